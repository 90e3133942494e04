"""FedDyn (Acar et al. 2021): federated learning with dynamic regularisation.

Every client ``i`` keeps ``λ_i`` — its estimate of its own loss gradient at its last
local solution (``[N]``-stacked parameters, initially 0) — and the server keeps
``h`` (parameter-shaped, initially 0).  In a round each sampled client starts from
``θ_g`` and minimises::

    L_i(θ) − <λ_i, θ> + (α_i / 2) ||θ − θ_g||²

then updates ``λ_i ← λ_i − α_i (θ_i − θ_g)``.  The server::

    h     ← h − α · (1/N) Σ_{i ∈ cohort} (θ_i − θ_g)
    θ_new = (1/|cohort|) Σ_{i ∈ cohort} θ_i − h / α

(``N``: the whole population; the correction ``−h/α`` is the mean, over all
clients, of their accumulated drift.)

Decisions:

* **α per client.**  The official code (alpemreacar/FedDyn, ``train_FedDyn``) scales
  α by the client's size: ``α_i = α / (n_i / n̄)``, ``n̄`` the mean size over all N
  clients.  We do the same when the engine knows every client's size
  (``InitView.label_counts``, which :class:`~fedpartial._src.experiment.simulation.Simulation`
  gives); an engine built without them uses the mean size of the cohort's real
  clients as ``n̄`` (the same when the cohort is the population or sizes are equal).
  The server's ``h`` uses the unscaled α, as the reference's
  ``cld = mean(cohort) + mean_all(Σ (θ_i − θ_g))`` does.
* **Mean.**  The cohort's models are averaged uniformly, as in the paper and the
  reference (its FedAvg weighs by size, its FedDyn does not: the per-client α_i
  accounts for size); BatchNorm statistics get the same uniform weights.
* **α = 0** is defined as *no dynamic regulariser*: no linear or proximal term and no
  server correction (the paper's ``h/α`` would be ``0/0``; ``λ`` and ``h`` stay 0).
  FedDyn(α = 0) is FedAvg with uniform weights — FedAvg itself when every client
  has the same number of examples.
* **Not built in:** the reference's gradient clipping (norm 10); its weight decay is
  the run's ``--weight-decay`` as for every method.
* The default ``α = 0.01`` is the official code's CIFAR-10 example and the middle of
  the paper's grid {0.1, 0.01, 0.001}.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.methods.base import (
    Capabilities,
    ClientPlan,
    InitView,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    broadcast_clients,
    cohort_rows,
    make_method,
    scatter_clients,
    upload_trained,
    with_penalty,
)
from fedpartial._src.methods.registry import MethodSpec, Option, at_least, check_values


class DynServer(NamedTuple):
    """FedDyn's server state."""

    h: Any  # parameter-shaped
    mean_size: jax.Array  # n̄, the mean client size over the population; 0: unknown (the cohort's is used)


def _sum(tree) -> jax.Array:
    return sum(jax.tree.leaves(tree))


def _per_client(a: jax.Array, leaf: jax.Array) -> jax.Array:
    """A ``[K]`` vector shaped to broadcast against a ``[K, ...]`` leaf."""
    return a.reshape((-1,) + (1,) * (leaf.ndim - 1)).astype(leaf.dtype)


def feddyn(alpha: float = 0.01) -> Method:
    """FedDyn with regularisation strength ``alpha`` (α = 0: FedAvg with uniform weights).

    Args:
      alpha: the regularisation strength α (``--alpha``; 0: FedAvg with uniform weights).

    Returns:
      The :class:`~fedpartial.Method` (``--method feddyn``).
    """
    check_values("feddyn", SPEC.options, alpha=alpha)

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        params = view.global_vars["params"]
        mean_size = 0.0 if view.label_counts is None else jnp.mean(jnp.sum(view.label_counts, axis=-1))
        return MethodState(server=DynServer(h=jax.tree.map(jnp.zeros_like, params),
                                            mean_size=jnp.asarray(mean_size, jnp.float32)),
                           clients=broadcast_clients(jax.tree.map(jnp.zeros_like, params), ctx.num_clients))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        """Every client's ``α_i = α · n̄ / n_i`` (``ClientPlan.extra``; 0 for padding clients)."""
        n, valid = view.cohort.num_samples, view.cohort.valid
        cohort_mean = jnp.sum(jnp.where(valid, n, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
        known = view.method_state.server.mean_size
        mean_size = jnp.where(known > 0, known, cohort_mean)
        return ClientPlan(extra=jnp.where(valid & (n > 0), alpha * mean_size / jnp.where(n > 0, n, 1.0), 0.0))

    def dynamic_term(ctx: MethodContext, params, step) -> jax.Array:
        """``−<λ_i, θ> + α_i/2 ||θ − θ_g||²``."""
        linear = _sum(jax.tree.map(lambda lam, p: jnp.vdot(lam, p), step.client_state, params))
        prox = _sum(jax.tree.map(lambda p, g: jnp.sum(jnp.square(p - g)), params, step.global_vars["params"]))
        return -linear + 0.5 * step.plan.extra * prox

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        return upload_trained(ctx, view)._replace(weights=jnp.ones_like(view.cohort.num_samples))  # uniform

    def drift(view: RoundView):
        """``Σ_{i ∈ cohort} (θ_i − θ_g)`` over the real clients."""
        valid = view.cohort.valid.astype(jnp.float32)
        return jax.tree.map(lambda t, g: jnp.tensordot(valid.astype(t.dtype), t - g[None], axes=(0, 0)),
                            view.trained_vars["params"], view.global_vars["params"])

    def new_h(ctx: MethodContext, view: RoundView):
        return jax.tree.map(lambda h, d: h - alpha / ctx.num_clients * d, view.method_state.server.h, drift(view))

    def server_correct(ctx: MethodContext, view: RoundView):
        """The cohort's uniform mean (the engine's aggregate) minus ``h / α``."""
        return jax.tree.map(lambda m, h: m - h / alpha, view.aggregated["params"], new_h(ctx, view))

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        alphas = view.plan.extra
        rows = jax.tree.map(lambda lam, t, g: lam - _per_client(alphas, t) * (t - g[None]),
                            view.client_state, view.trained_vars["params"], view.global_vars["params"])
        state = view.method_state
        return MethodState(server=state.server._replace(h=new_h(ctx, view)),
                           clients=scatter_clients(state.clients, cohort_rows(view), rows, view.cohort.valid))

    return make_method("feddyn", init=init, plan=plan, objective=with_penalty(dynamic_term), select=select,
                       update=update, server_correct=server_correct if alpha > 0 else None,
                       capabilities=Capabilities(host_client_state=True))


SPEC = MethodSpec("feddyn", feddyn, "Dynamic regularisation: per-client linear term λ_i and the server's h correction.",
                  options=(Option("alpha", float, 0.01, "FedDyn: regularisation strength α (0: FedAvg, uniform)",
                                  at_least(0.0), flag="--dyn-alpha"),))
