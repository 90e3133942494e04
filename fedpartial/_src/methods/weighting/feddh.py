"""FedDH, FedJS and FedDHE (docs/decisions.md#feddhad): weightings that compose with any method (:func:`reweight`).

**FedDH** (dynamic heterogeneous aggregation, the paper's Algorithm 1).  Each
client's label distribution ``P_k`` is known to the server; ``P_m`` is the
``n_k``-weighted mean of all ``N`` of them (the population's label distribution)
and ``JS_k = JS(P_k || P_m)`` (Formula 5, natural logarithm).  The non-IID degree
is ``D_k = υ_k·JS_k + b_k`` (Formula 4, ``υ_k = 1``, ``b_k = 0`` initially) and the
cohort aggregates with ``q_k = (n_k / D_k) / Σ_j (n_j / D_j)`` (Formula 11; ``n_k``
is the wrapped method's own weight, ``n_k`` for every built-in method).  After the
aggregation, the cohort's ``(υ, b)`` take one gradient step (Formula 10)::

    υ ← υ − λ_Υ·decay_Υ^t · ∇_υ F(w(q(υ, b))),     b ← b − λ_B·decay_B^t · ∇_b F(w(q(υ, b)))

``w(q)`` is the engine's own aggregation (:func:`fedpartial._src.core.aggregation.aggregate`
with the round's upload masks), so the gradient is exact for any masks a wrapped
method uploads; ``F`` is the ``n_k``-weighted mean loss of ``w(q)`` on the first
local batch of every cohort client (its real examples only), and ``jax.grad``
differentiates through the aggregation.  ``t`` is the round index (0 first).

**FedJS** is the paper's ablation: ``q_k ∝ n_k / JS_k``, never learned.

**FedDHE** estimates ``P_k`` on the server instead of receiving it (Formula 8):
on a small class-balanced server set, ``s_i = ||∇L_i(θ_k)||²`` is the squared norm
of the gradient of the mean loss over the server's class-``i`` examples at client
``k``'s trained model, and ``P̂_k(i) ∝ exp(β·s_i)``.

The label distributions, JS divergences, degrees, weights and the gradient of ``F``
are in :mod:`fedpartial._src.methods.weighting.degrees`, FedDHE's estimate in
:mod:`fedpartial._src.methods.weighting.estimate`; each keeps its own decisions.

Decisions (where the paper is vague, or where we depart from the authors' code):

* **The gradient.**  Plain gradient steps with the paper's learning rates and
  multiplicative decays (Table 5; defaults are its LeNet/CIFAR-10 column:
  ``λ_Υ = 1e-4``, ``decay_Υ = 0.999``, ``λ_B = 1e-4``, ``decay_B = 0.99``).  The
  authors' public code min-max normalises the gradients and takes their
  ``abs()``; we follow the paper's Formula 10 and do neither.
* **No test data, no rollbacks.**  The authors' code hard-codes 10 clients per
  round and drops clients and rolls rounds back by looking at the test loss.
  Here the cohort size is the run's, every sampled client is aggregated, and
  nothing ever reads test data.

**Composing**: :func:`~fedpartial._src.methods.weighting.compose.reweight` aggregates
any method with a :class:`~fedpartial._src.methods.weighting.compose.Weighting`'s weights
(``reweight(fedldf(n=4), feddh_weighting())``: FedLDF's top-n layers, FedDH's weights).
The command line has ``feddh``, ``fedjs`` and ``feddhe`` (over FedAvg); a
``--weighting`` flag for any method is not offered: registry options belong to one
method each, and a wrapper would need the wrapped method's options too.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.base import Carry, InitView, Method, MethodContext, MethodState, RoundView, scatter_clients
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.registry import MethodSpec, Option, at_least, check_values, positive_int
from fedpartial._src.methods.weighting.compose import Weighting, reweight
from fedpartial._src.methods.weighting.degrees import (
    MIN_DEGREE,
    DegreeState,
    label_distributions,
    control_gradients,
    degree_weights,
    js_divergence,
    non_iid_degree,
    population_distribution,
)
from fedpartial._src.methods.weighting.estimate import estimated_distributions, group_by_class

# ---- the FedDH weighting ---------------------------------------------------------------------


def feddh_weighting(lr_upsilon: float = 1e-4, decay_upsilon: float = 0.999, lr_b: float = 1e-4,
                    decay_b: float = 0.99, *, estimate_beta: float | None = None, server_examples: int = 10,
                    min_degree: float = MIN_DEGREE, name: str = "feddh") -> Weighting:
    """FedDH's weights ``q_k ∝ n_k / D_k`` with ``D_k = υ_k·JS_k + b_k`` learned after every aggregation.

    Args:
      lr_upsilon, decay_upsilon, lr_b, decay_b: Formula 10's learning rates and their
        multiplicative per-round decays (both rates 0: nothing is learned — FedJS).
      estimate_beta: None: ``P_k`` from the label counts given to ``init`` (FedDH).  A
        negative number: ``P_k`` estimated on the server with this β (FedDHE).
      server_examples: FedDHE's server set, examples per class.
      min_degree: the floor that keeps ``D_k`` positive.
    """
    # the options describe the arguments: called directly, the factory checks them there (one sentence each)
    check_values(name, (*RATE_OPTIONS, *ESTIMATE_OPTIONS), lr_upsilon=lr_upsilon, decay_upsilon=decay_upsilon,
                 lr_b=lr_b, decay_b=decay_b,
                 **({} if estimate_beta is None else {"beta": estimate_beta, "server_examples": server_examples}))
    if not min_degree > 0:
        raise UserError(f"{name}: min_degree = {min_degree!r} must be > 0 (it keeps D_k positive).")
    learns = lr_upsilon > 0 or lr_b > 0
    if estimate_beta is None:
        init, fill, per_class = label_distributions(name), None, 0
    else:
        init, fill = estimated_distributions(name, float(estimate_beta))
        per_class = int(server_examples)

    def init_state(ctx: MethodContext, view: InitView) -> MethodState:
        state = init(ctx, view)
        # FedDHE keeps the server set it estimates on; FedDH needs nothing server-side.
        server = () if fill is None else group_by_class(view.server_data, ctx.model.num_classes, name)
        return MethodState(server=server, clients=state)

    def cohort_js(ctx: MethodContext, view: RoundView) -> tuple[jax.Array, DegreeState]:
        """``JS_k`` ``[K]`` of the cohort against ``P_m``, and the population state it used."""
        population = view.method_state.clients if fill is None else fill(ctx, view, view.method_state.server)
        p_m = population_distribution(population.distribution, population.num_samples, population.known)
        rows = jax.tree.map(lambda a: a[view.cohort.client_ids], population)
        return js_divergence(rows.distribution, p_m[None, :]), population

    def weights(ctx: MethodContext, view: RoundView) -> Carry:
        """The weights, handing the cohort's JS divergences and the population state on (FedDHE's estimate is
        made once a round)."""
        js, population = cohort_js(ctx, view)
        rows: DegreeState = view.client_state
        degree = non_iid_degree(js, rows.upsilon, rows.b, min_degree)
        return Carry(degree_weights(view.selection.weights, degree, view.cohort.valid), (js, population))

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        js, population = view.carried["select"]
        if not learns:
            return view.method_state._replace(clients=population)
        rows: DegreeState = view.client_state
        degree = non_iid_degree(js, rows.upsilon, rows.b, min_degree)
        # The wrapped method's weights, up to a common factor: q_k·D_k (the engine zeroed padding clients).
        base = jax.lax.stop_gradient(view.selection.weights * degree)
        g_upsilon, g_b = control_gradients(ctx, view, js, base, min_degree)
        t = view.round.astype(jnp.float32)
        stepped = DegreeState(
            upsilon=rows.upsilon - lr_upsilon * decay_upsilon ** t * g_upsilon,
            b=rows.b - lr_b * decay_b ** t * g_b,
            distribution=population.distribution[view.cohort.client_ids],
            num_samples=population.num_samples[view.cohort.client_ids],
            known=population.known[view.cohort.client_ids])
        clients = scatter_clients(population, view.cohort.client_ids, stepped, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        js, _ = view.carried["select"]
        rows: DegreeState = view.client_state
        return {"aggregation_weights": view.selection.weights,
                "non_iid_degree": non_iid_degree(js, rows.upsilon, rows.b, min_degree)}

    return Weighting(name=name, init=init_state, weights=weights, update=update, metrics=metrics,
                     server_examples_per_class=per_class)


def fedjs_weighting(min_degree: float = MIN_DEGREE) -> Weighting:
    """FedJS: static ``q_k ∝ n_k / JS_k`` (``υ = 1``, ``b = 0`` never learned)."""
    return feddh_weighting(0.0, 1.0, 0.0, 1.0, min_degree=min_degree, name="fedjs")


def feddhe_weighting(beta: float = -0.03, server_examples: int = 10, lr_upsilon: float = 1e-4,
                     decay_upsilon: float = 0.999, lr_b: float = 1e-4, decay_b: float = 0.99) -> Weighting:
    """FedDHE: FedDH with ``P_k`` estimated on the server from each client's trained model."""
    return feddh_weighting(lr_upsilon, decay_upsilon, lr_b, decay_b, estimate_beta=beta,
                           server_examples=server_examples, name="feddhe")


# ---- the registered methods ------------------------------------------------------------------


def feddh(lr_upsilon: float = 1e-4, decay_upsilon: float = 0.999, lr_b: float = 1e-4,
          decay_b: float = 0.99) -> Method:
    """FedDH: FedAvg aggregated with learned non-IID-degree weights.

    Args:
      lr_upsilon: the learning rate of the non-IID degrees υ.
      decay_upsilon: the decay of υ's learning rate per round.
      lr_b: the learning rate of the bias b.
      decay_b: the decay of b's learning rate per round.

    Returns:
      The :class:`~fedpartial.Method` (``--method feddh``).
    """
    return reweight(fedavg(), feddh_weighting(lr_upsilon, decay_upsilon, lr_b, decay_b), name="feddh")


def fedjs() -> Method:
    """FedJS: FedAvg aggregated with static ``n_k / JS_k`` weights."""
    return reweight(fedavg(), fedjs_weighting(), name="fedjs")


def feddhe(beta: float = -0.03, server_examples: int = 10, lr_upsilon: float = 1e-4, decay_upsilon: float = 0.999,
           lr_b: float = 1e-4, decay_b: float = 0.99) -> Method:
    """FedDHE: FedDH with label distributions estimated on the server.

    Args:
      beta: the server-side estimate's exponent β.
      server_examples: the server's examples per class.
      lr_upsilon: the learning rate of the non-IID degrees υ.
      decay_upsilon: the decay of υ's learning rate per round.
      lr_b: the learning rate of the bias b.
      decay_b: the decay of b's learning rate per round.

    Returns:
      The :class:`~fedpartial.Method` (``--method feddhe``).
    """
    return reweight(fedavg(), feddhe_weighting(beta, server_examples, lr_upsilon, decay_upsilon, lr_b, decay_b),
                    name="feddhe")


def _decay(v: Any) -> str | None:
    return None if isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v <= 1 \
        else "must be a multiplicative decay in (0, 1]"


def _negative(v: Any) -> str | None:
    return None if isinstance(v, numbers.Real) and not isinstance(v, bool) and v < 0 else "must be a number < 0"


RATE_OPTIONS = (
    Option("lr_upsilon", float, 1e-4, "FedDH: learning rate λ_Υ of the control parameters υ", at_least(0.0),
           flag="--dh-lr-upsilon"),
    Option("decay_upsilon", float, 0.999, "FedDH: per-round multiplicative decay of λ_Υ", _decay,
           flag="--dh-decay-upsilon"),
    Option("lr_b", float, 1e-4, "FedDH: learning rate λ_B of the control parameters b", at_least(0.0),
           flag="--dh-lr-b"),
    Option("decay_b", float, 0.99, "FedDH: per-round multiplicative decay of λ_B", _decay, flag="--dh-decay-b"),
)
#: FedDHE's options (the factory's ``beta`` is the weighting's ``estimate_beta``)
ESTIMATE_OPTIONS = (
    Option("beta", float, -0.03, "FedDHE: β of P_k(i) ∝ exp(β·||∇L_i||²)", _negative, flag="--dhe-beta"),
    Option("server_examples", int, 10, "FedDHE: server examples per class", positive_int,
           flag="--dhe-server-examples"),
)
SPECS = (
    MethodSpec("feddh", feddh, "FedAvg weighted by n_k / D_k, D_k = υ_k·JS_k + b_k learned through the aggregation.",
               RATE_OPTIONS),
    MethodSpec("fedjs", fedjs, "FedAvg weighted by n_k / JS_k (static JS divergence of each client's labels)."),
    MethodSpec("feddhe", feddhe, "FedDH with label distributions estimated on the server from client models.",
               (*ESTIMATE_OPTIONS, *RATE_OPTIONS)),
)
