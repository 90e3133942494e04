"""Composing an aggregation weighting with any method: :class:`Weighting` and :func:`reweight`.

**Composing** (:func:`reweight`).  A :class:`Weighting` is three pure functions
(``init``, ``weights``, ``update``), like an optax transformation: it states
nothing about local training or masks.  ``reweight(method, weighting)`` is
``method`` — its plan, local training, upload masks — aggregated with the
weighting's weights; the two states sit side by side in ``MethodState`` and
neither knows of the other::

    from fedpartial._src.methods.basic.fedavg import fedavg
    from fedpartial._src.methods.layerwise.fedldf import fedldf
    from fedpartial._src.methods.submodel.fedspu import fedspu
    from fedpartial._src.methods.weighting.compose import reweight
    from fedpartial._src.methods.weighting.feddh import feddh_weighting, fedjs_weighting

    feddh = reweight(fedavg(), feddh_weighting())                # FedDH itself
    ldf_dh = reweight(fedldf(n=4), feddh_weighting())            # FedLDF's top-n layers, FedDH's weights
    spu_js = reweight(fedspu(), fedjs_weighting())               # FedSPU's active neurons, static JS weights

With every ``D_k`` equal the weights are ``n_k`` (up to a common factor) and
``reweight(method, …)`` aggregates exactly as ``method``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax

from fedpartial._src.methods.base import Carry, InitView, Method, MethodContext, MethodState, RoundView, Selection
from fedpartial._src.methods.wrappers import Wrapper, wrap


class Weighting(NamedTuple):
    """Aggregation weights as a piece that composes with any method (see :func:`reweight`).

    Attributes:
      name: appended to the wrapped method's name.
      init: ``(ctx, InitView) -> MethodState``: the weighting's own state (per-client
        rows ``[N]`` in ``clients``).
      weights: ``(ctx, RoundView) -> [K]`` weights, called in ``select``;
        ``view.selection`` is the wrapped method's selection, ``view.method_state``
        and ``view.client_state`` are the weighting's own.  It may return
        ``Carry(weights, value)``: its ``update`` and ``metrics`` read ``view.carried["select"]``.
      update: ``(ctx, RoundView) -> MethodState``, called after aggregation;
        ``view.selection`` is the final selection (upload masks, these weights).
      metrics: ``(ctx, RoundView) -> dict`` of per-round values, or None.
      server_examples_per_class: the server set the weighting needs (0: none).
    """

    name: str
    init: Callable[[MethodContext, InitView], MethodState]
    weights: Callable[[MethodContext, RoundView], jax.Array]
    update: Callable[[MethodContext, RoundView], MethodState]
    metrics: Callable[[MethodContext, RoundView], dict] | None = None
    server_examples_per_class: int = 0


def reweight(method: Method, weighting: Weighting, name: str | None = None) -> Method:
    """``method`` aggregated with ``weighting``'s weights instead of its own.

    Everything else is ``method``'s: plan, local training, upload masks, its server
    steps (``aggregate`` and ``server_correct``, which see the new weights), personal models, who
    may be sampled.  A :class:`~fedpartial.Wrapper` adding to ``select``, ``update``
    and ``metrics``: the state is ``MethodState(server=(method's, weighting's), clients=(method's,
    weighting's))``; each piece sees only its own.

    Args:
      method: any method.
      weighting: the weighting: its ``init``, ``weights``, ``update`` and ``metrics`` (FedDH's learned
        non-IID degrees are one; the built-in ``feddh`` is FedAvg reweighted by it).
      name: the new method's name (default ``method``'s and the weighting's, e.g. ``fedldf+feddh``).

    Returns:
      The reweighted :class:`~fedpartial.Method`.
    """

    def select(ctx: MethodContext, view: RoundView, own: Selection) -> Selection | Carry:
        weights = weighting.weights(ctx, view._replace(selection=own))
        if isinstance(weights, Carry):  # handed on to the weighting's update and metrics
            return Carry(own._replace(weights=weights.result), weights.value)
        return own._replace(weights=weights)

    def update(ctx: MethodContext, view: RoundView, inner_state: MethodState) -> MethodState:
        return weighting.update(ctx, view)

    def metrics(ctx: MethodContext, view: RoundView, inner: dict | None) -> dict:
        return {**(inner or {}), **weighting.metrics(ctx, view)}

    hooks = {"select": select, "update": update, **({"metrics": metrics} if weighting.metrics else {})}
    return wrap(method, Wrapper(
        lambda inner: name or f"{inner}+{weighting.name}", init=weighting.init, hooks=hooks, label=weighting.name,
        # the weighting reads every client's trained model and, in its update, every client's label distribution
        capabilities=lambda caps: caps._replace(
            server_examples_per_class=max(caps.server_examples_per_class, weighting.server_examples_per_class),
            streamable=None, host_client_state=False, asynchronous=False)))

