"""Default method pieces and :func:`make_method`: a method states only what differs from FedAvg.

The types a method works with (:class:`~fedpartial._src.core.types.Method`,
:class:`~fedpartial._src.core.types.RoundView`, :class:`~fedpartial._src.core.types.ClientPlan`, …) live
in :mod:`fedpartial._src.core.types` and are re-exported here.  See that module for the order
in which a round calls the pieces.

Example — FedProx is FedAvg whose local objective adds a proximal term::

    import jax, jax.numpy as jnp
    from fedpartial._src.methods import base

    def proximal(mu):
        def term(ctx, params, step):
            sq = jax.tree.map(lambda p, g: jnp.sum((p - g) ** 2), params, step.global_vars["params"])
            return 0.5 * mu * sum(jax.tree.leaves(sq))
        return term

    fedprox = base.make_method("fedprox", objective=base.with_penalty(proximal(0.01)))

Per-client state for the whole population (SCAFFOLD's control variates, FedSPU's
personal models) lives in ``MethodState.clients`` with a leading ``[N]`` axis:
the engine gathers the cohort's rows into ``RoundView.client_state`` and the
method's ``update`` writes them back (:func:`scatter_clients`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedpartial._src.core import masks as masks_lib
from fedpartial._src.core.types import (  # noqa: F401  (re-exported: the vocabulary of every method)
    Batch,
    Capabilities,
    Carry,
    ClientGroup,
    ClientPlan,
    CohortInfo,
    Holdout,
    InitView,
    LocalGraph,
    LocalStep,
    LossAux,
    Method,
    MethodContext,
    MethodState,
    Objective,
    PersonalModels,
    RoundView,
    Selection,
    ServerData,
)
from fedpartial._src.core.losses import masked_cross_entropy
from fedpartial._src.core.population import (  # noqa: F401  (re-exported: methods write rows with these)
    broadcast_clients,
    cohort_rows,
    gather_clients,
    scatter_clients,
)
from fedpartial._src.core.masks import Mask

# ---- default pieces -------------------------------------------------------------


def no_state(ctx: MethodContext, view: InitView) -> MethodState:
    del ctx, view
    return MethodState()


def train_everything(ctx: MethodContext, view: RoundView) -> ClientPlan:
    del ctx, view
    return ClientPlan()


def start_from_global(ctx: MethodContext, global_vars: dict, client_state: Any, plan: ClientPlan) -> dict:
    del ctx, client_state, plan
    return global_vars


def cross_entropy(ctx: MethodContext, params: Any, step: LocalStep) -> tuple[jax.Array, LossAux]:
    """The default local objective: mean cross-entropy over the step's real examples.

    Args:
      ctx: the method's context.
      params: the client's trainable parameters.
      step: the step's :class:`~fedpartial.LocalStep` (its ``forward`` runs the client's graph).

    Returns:
      ``(loss, LossAux)``.
    """
    del ctx
    logits, stats = step.forward(params, step.batch.x)
    loss = masked_cross_entropy(logits, step.batch.y, step.batch.example_mask)
    return loss, LossAux(loss=loss, batch_stats=stats)


def with_penalty(term: Callable[[MethodContext, Any, LocalStep], jax.Array],
                 objective: Objective = cross_entropy) -> Objective:
    """``objective`` plus ``term(ctx, params, step)`` (e.g. FedProx's proximal term).

    The reported training loss stays the data loss of ``objective``.

    Args:
      term: ``term(ctx, params, step) -> scalar`` added to the objective.
      objective: the objective to add it to.

    Returns:
      The new objective.
    """

    def penalised(ctx, params, step):
        value, aux = objective(ctx, params, step)
        return value + term(ctx, params, step), aux

    return penalised


def trained_part(ctx: MethodContext, plan: ClientPlan, cohort_size: int) -> Mask:
    """The elements a client changed: its train mask within its sub-model."""
    mask = masks_lib.full(ctx.structure, (cohort_size,)) if plan.train is None else plan.train
    if plan.dropout is not None:
        mask = masks_lib.within(mask, plan.dropout)
    return mask


def upload_trained(ctx: MethodContext, view: RoundView) -> Selection:
    """Each client uploads what it trained, weighted by ``n_k``.

    Args:
      ctx: the method's context.
      view: the round's :class:`~fedpartial.RoundView`.

    Returns:
      The :class:`~fedpartial.Selection`: upload masks from ``view.plan.train``.
    """
    k = view.cohort.num_samples.shape[0]
    return Selection(
        upload=trained_part(ctx, view.plan, k),
        weights=view.cohort.num_samples,
        extra_upload_bytes=jnp.zeros((k,), jnp.int32),
    )


def keep_state(ctx: MethodContext, view: RoundView) -> MethodState:
    del ctx
    return view.method_state


def global_is_personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
    """A non-personalised method: every client's model is the global model."""
    del ctx, state
    return PersonalModels(variables=global_vars, stacked=False)


def make_method(
    name: str,
    *,
    init=no_state,
    plan=train_everything,
    client_start=start_from_global,
    step_plan=None,
    objective: Objective = cross_entropy,
    transform_grads=None,
    select=upload_trained,
    update=keep_state,
    metrics=None,
    groups=None,
    personal=global_is_personal,
    active_clients=None,
    server_correct=None,
    adapt_model=None,
    summarize=None,
    capabilities: Capabilities = Capabilities(),
    aggregate=None,
    encode=None,
    rewrite_global=None,
) -> Method:
    """Builds a :class:`Method`; every hook not given is FedAvg's.

    ``step_plan`` None: the plan holds for every local step.  ``transform_grads`` None: the
    objective's gradient is used as it is.  ``metrics`` None: no per-round values of the method's
    own.  ``groups`` None: the cohort is one group training the whole model.  ``active_clients``
    None: every client may always be sampled.  ``server_correct`` None: the server steps to the
    aggregate.  ``encode`` None: the server receives the trained ``params``.  ``adapt_model`` None: the method
    trains the model it is given.  ``summarize`` None:
    no per-client statistic.  ``aggregate`` None: the one formula of docs/decisions.md#engine.  ``capabilities``: what
    the method needs from a run and which executions it allows (:class:`Capabilities`; by default none
    of either, except that a method with no state of its own (``init`` left out) has ``host_client_state``,
    so that a wrapper's per-client state may leave the device around it).

    Args:
      name: the method's name (run folders, tables).
      init: the ``init`` hook (:class:`~fedpartial.Method`).
      plan: the ``plan`` hook (:class:`~fedpartial.Method`).
      client_start: the ``client_start`` hook (:class:`~fedpartial.Method`).
      step_plan: the ``step_plan`` hook (:class:`~fedpartial.Method`).
      objective: the ``objective`` hook (:class:`~fedpartial.Method`).
      transform_grads: the ``transform_grads`` hook (:class:`~fedpartial.Method`).
      select: the ``select`` hook (:class:`~fedpartial.Method`).
      update: the ``update`` hook (:class:`~fedpartial.Method`).
      metrics: the ``metrics`` hook (:class:`~fedpartial.Method`).
      groups: the ``groups`` hook (:class:`~fedpartial.Method`).
      personal: the ``personal`` hook (:class:`~fedpartial.Method`).
      active_clients: the ``active_clients`` hook (:class:`~fedpartial.Method`).
      server_correct: the ``server_correct`` hook (:class:`~fedpartial.Method`).
      adapt_model: the ``adapt_model`` hook (:class:`~fedpartial.Method`).
      summarize: the ``summarize`` hook (:class:`~fedpartial.Method`).
      capabilities: what the method needs from a run (:class:`~fedpartial.Capabilities`).
      aggregate: the ``aggregate`` hook.
      encode: the ``encode`` hook.
      rewrite_global: the ``rewrite_global`` hook.

    Returns:
      The :class:`~fedpartial.Method`.

    Examples:
      >>> import fedpartial as fp
      >>> def select(ctx, view):  # FedAvg's selection with uniform weights
      ...     return fp.upload_trained(ctx, view)._replace(weights=view.cohort.valid.astype("float32"))
      >>> fp.make_method("uniform", select=select).name
      'uniform'
    """
    if init is no_state:  # no per-client state: nothing is read from the population, so it may live anywhere
        capabilities = capabilities._replace(host_client_state=True)
    return Method(name=name, init=init, plan=plan, client_start=client_start, step_plan=step_plan,
                  objective=objective, select=select, update=update, metrics=metrics, groups=groups,
                  personal=personal, active_clients=active_clients, server_correct=server_correct,
                  adapt_model=adapt_model, summarize=summarize, transform_grads=transform_grads,
                  capabilities=capabilities, aggregate=aggregate, encode=encode,
                  rewrite_global=rewrite_global)
