"""FedDH's non-IID degree (docs/decisions.md#feddhad): label distributions, JS divergence, ``D_k``, ``q_k`` and ``∇F``.

``P_m`` is the ``n_k``-weighted mean of the known clients' label distributions ``P_k``
(:func:`population_distribution`), ``JS_k = JS(P_k || P_m)`` (Formula 5, natural
logarithm, :func:`js_divergence`), ``D_k = υ_k·JS_k + b_k`` (Formula 4,
:func:`non_iid_degree`) and ``q_k = (n_k / D_k) / Σ_j (n_j / D_j)`` (Formula 11,
:func:`degree_weights`).  :func:`control_gradients` is Formula 10's ``(∇_υ F, ∇_b F)``:
``F(w(q(υ, b)))`` where ``w(q)`` is the engine's own aggregation
(:func:`fedpartial._src.core.aggregation.aggregate` with the round's upload masks), so
the gradient is exact for any masks a wrapped method uploads, and ``jax.grad``
differentiates through the aggregation.  The weighting built from these pieces is
:func:`fedpartial._src.methods.weighting.feddh.feddh_weighting`.

Decisions:

* **D_k > 0.**  ``D_k = max(υ_k·JS_k + b_k, min_degree)`` (``min_degree = 1e-3``).
  The paper's linear form holds wherever it is positive; the floor only guards a
  client whose distribution equals the population's (``JS_k = 0`` at ``b_k = 0``)
  or whose ``(υ, b)`` would make ``D_k ≤ 0``.  At the floor ``D_k`` stops depending
  on ``(υ_k, b_k)`` (zero gradient): such a client already weighs the most a
  client can.  A softplus reparametrisation was not used because it changes
  Formula 4 everywhere, not only where it breaks.
* **What F is.**  Formula 3's ``F = Σ n_k F_k / Σ n_k`` over the cohort (the paper:
  "only based on the selected devices"), each ``F_k`` on the client's first local
  batch of the round, in evaluation mode (running statistics; batch statistics
  under the 'static' BatchNorm policy).  We differentiate the aggregate itself:
  before a wrapped method's ``server_correct`` (FedNova, FedDyn) and before the
  server optimizer (with FedAvg's SGD(1) the two are the same).
* **Label distributions** reach ``init`` as ``InitView.label_counts`` (``[N, C]``;
  :class:`~fedpartial._src.experiment.simulation.Simulation` counts each client's training
  split).  Reporting them once costs no per-round traffic and is not counted.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import aggregation
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.losses import model_loss
from fedpartial._src.methods.base import InitView, MethodContext, RoundView

#: smallest non-IID degree a client can have (see the module docstring)
MIN_DEGREE = 1e-3

# ---- label distributions and the non-IID degree ----------------------------------------------


def kl_divergence(p: jax.Array, q: jax.Array) -> jax.Array:
    """``Σ_y p(y)·log(p(y)/q(y))`` over the last axis (``0·log 0 = 0``; ``q > 0`` where ``p > 0``)."""
    safe_p = jnp.where(p > 0, p, 1.0)
    safe_q = jnp.where(p > 0, q, 1.0)
    return jnp.sum(jnp.where(p > 0, p * jnp.log(safe_p / safe_q), 0.0), axis=-1)


def js_divergence(p: jax.Array, q: jax.Array) -> jax.Array:
    """Jensen–Shannon divergence (Formula 5): ``½KL(p||m) + ½KL(q||m)``, ``m = ½(p + q)``; in ``[0, ln 2]``."""
    m = 0.5 * (p + q)
    return 0.5 * kl_divergence(p, m) + 0.5 * kl_divergence(q, m)


def population_distribution(distributions: jax.Array, num_samples: jax.Array, known: jax.Array) -> jax.Array:
    """``P_m``: the ``n_k``-weighted mean of the known clients' distributions ``[N, C] -> [C]``."""
    w = jnp.where(known, num_samples, 0.0)
    return jnp.tensordot(w, distributions, axes=(0, 0)) / jnp.maximum(jnp.sum(w), 1e-12)


def non_iid_degree(js: jax.Array, upsilon: jax.Array, b: jax.Array, min_degree: float = MIN_DEGREE) -> jax.Array:
    """``D_k = max(υ_k·JS_k + b_k, min_degree)`` (Formula 4, kept strictly positive)."""
    return jnp.maximum(upsilon * js + b, min_degree)


def degree_weights(base: jax.Array, degree: jax.Array, valid: jax.Array) -> jax.Array:
    """``q_k = (base_k / D_k) / Σ_j (base_j / D_j)`` over the valid clients (Formula 11); 0 elsewhere."""
    raw = jnp.where(valid, base / degree, 0.0)
    return raw / jnp.maximum(jnp.sum(raw), 1e-30)


class DegreeState(NamedTuple):
    """Per client ``[N]``: control parameters ``υ``, ``b``; label distribution ``[N, C]``, ``n_k``, and
    whether the distribution is known yet (always, for FedDH; after its first round, for FedDHE)."""

    upsilon: jax.Array
    b: jax.Array
    distribution: jax.Array
    num_samples: jax.Array
    known: jax.Array


def label_distributions(name: str):
    """``init`` of the distribution state from ``InitView.label_counts`` (FedDH, FedJS)."""

    def init(ctx: MethodContext, view: InitView) -> DegreeState:
        counts = view.label_counts
        if counts is None:
            raise UserError(f"{name} needs every client's label counts ([N, C]: FederatedRound(label_counts=...), "
                            "which Simulation passes), but none were given.")
        expected = (ctx.num_clients, ctx.model.num_classes)
        if tuple(np.shape(counts)) != expected:
            raise UserError(f"{name}: label counts have shape {tuple(np.shape(counts))}, but the run needs "
                            f"{expected} (clients × classes).")
        if isinstance(counts, np.ndarray) and (counts < 0).any():
            raise UserError(f"{name}: label counts must be ≥ 0, got a smallest count of {counts.min()}.")
        counts = jnp.asarray(counts, jnp.float32)
        n = jnp.sum(counts, axis=1)
        return DegreeState(upsilon=jnp.ones_like(n), b=jnp.zeros_like(n),
                           distribution=counts / jnp.maximum(n, 1.0)[:, None], num_samples=n,
                           known=jnp.ones(n.shape, bool))

    return init


# ---- F and its gradient ------------------------------------------------------------------


def global_loss(ctx: MethodContext, view: RoundView, weights: jax.Array) -> jax.Array:
    """``F(w(q))``: the ``n_k``-weighted mean loss of the model aggregated with ``weights`` ``[K]`` under the
    round's upload masks, on every valid cohort client's first local batch (its real examples)."""
    collections = ("params",) if ctx.batch_statistics else ("params", "batch_stats")
    aggregated, _ = aggregation.aggregate(ctx.structure, view.global_vars, view.trained_vars,
                                          view.selection.upload, weights, collections)
    data = view.data

    def client_loss(x, y, example_mask):
        return model_loss(ctx.model, aggregated, x, y, example_mask, train=ctx.batch_statistics)[0]

    losses = jax.vmap(client_loss)(data.x[:, 0], data.y[:, 0], data.example_mask[:, 0])
    n = jnp.where(view.cohort.valid, view.cohort.num_samples, 0.0)
    return jnp.sum(n * losses) / jnp.maximum(jnp.sum(n), 1e-12)


def control_gradients(ctx: MethodContext, view: RoundView, js: jax.Array, base: jax.Array,
                      min_degree: float = MIN_DEGREE) -> tuple[jax.Array, jax.Array]:
    """``(∇_υ F, ∇_b F)`` ``[K]`` at the cohort's current ``(υ, b)`` (``view.client_state``), through the
    aggregation: ``F(w(q(υ, b)))`` with ``q = degree_weights(base, D(υ, b))``."""
    rows: DegreeState = view.client_state

    def loss(upsilon, b):
        return global_loss(ctx, view, degree_weights(base, non_iid_degree(js, upsilon, b, min_degree),
                                                     view.cohort.valid))

    return jax.grad(loss, argnums=(0, 1))(rows.upsilon, rows.b)

