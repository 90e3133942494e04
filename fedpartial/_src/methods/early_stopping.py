"""Early stopping (FedSPU+ES, docs/decisions.md#fedspu / the paper's Algorithm 2) as a method combinator.

``early_stopping(method, lam)`` returns a :class:`Method` that behaves like
``method`` and, after each round's local training, lets every sampled client
compute

    L_t = λ · L_train + (1 − λ) · L_val

(``L_train``: its mean local training loss this round; ``L_val``: the loss of its
trained model — its sub-model, for dropout methods — on its own held-out split).
If ``L_t > L_{t−1}`` (its value from the last round it took part in) the client
stops for good: its update of this round is still aggregated, then it leaves the
pool.  :meth:`Method.active_clients` exposes who is left; the host driver samples
only from them, samples all of them when fewer than ``K`` remain (padding the
cohort with non-participating slots) and ends the run when none remain.

The first time a client takes part it has no ``L_{t−1}`` and never stops.  Like
optax's combinators, the result is again a :class:`Method`, so any method —
FedSPU and every baseline — can be wrapped for a fair comparison.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.losses import model_loss
from fedpartial._src.core.structure import with_frozen
from fedpartial._src.methods.base import (
    InitView,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    cohort_rows,
    scatter_clients,
)
from fedpartial._src.methods.wrappers import Wrapper, wrap


class StopState(NamedTuple):
    """Per client ``[N]``: last ``L_t``, whether it stopped, and the round it stopped in (−1)."""

    last_loss: jax.Array
    stopped: jax.Array
    stop_round: jax.Array


def holdout_losses(ctx: MethodContext, view: RoundView) -> jax.Array:
    """``[K]`` loss of every client's trained model (its sub-model) on its held-out split."""
    if view.holdout is None:
        raise UserError(
            "early stopping needs every client's held-out split; run with a per-client train fraction below 1."
        )

    def one(variables, plan, x, y, example_mask):
        variables = with_frozen(variables, view.global_vars)  # a LoRA model's base, held once
        return model_loss(ctx.model, variables, x, y, example_mask, train=ctx.batch_statistics,
                          submodel=plan.dropout, unit_scale=plan.dropout_scale)[0]

    h = view.holdout
    return jax.vmap(one)(view.trained_vars, view.plan, h.x, h.y, h.example_mask)


def early_stopping(method: Method, lam: float = 0.7) -> Method:
    """``method`` whose clients stop for good once their λ-mixed train/val loss rises.

    Args:
      method: any method.
      lam: λ, the weight of the training loss in ``λ·train + (1 − λ)·val``.

    Returns:
      The wrapped :class:`~fedpartial.Method` (it needs held-out data).
    """
    if not 0 <= lam <= 1:
        raise UserError(f"early stopping: λ = {lam!r} must be in [0, 1].")

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        n = ctx.num_clients
        return MethodState(clients=StopState(last_loss=jnp.full((n,), jnp.inf, jnp.float32),
                                             stopped=jnp.zeros((n,), bool), stop_round=jnp.full((n,), -1, jnp.int32)))

    def update(ctx: MethodContext, view: RoundView, inner_state: MethodState) -> MethodState:
        mixed = lam * view.client_loss + (1.0 - lam) * holdout_losses(ctx, view)
        before = view.client_state
        stops = mixed > before.last_loss
        rows = StopState(last_loss=mixed, stopped=before.stopped | stops,
                         stop_round=jnp.where(stops & ~before.stopped, view.round, before.stop_round))
        return view.method_state._replace(
            clients=scatter_clients(view.method_state.clients, cohort_rows(view), rows, view.cohort.valid))

    def active_clients(ctx: MethodContext, state: MethodState, inner_active) -> jax.Array:
        active = ~state.clients.stopped
        return active if inner_active is None else active & inner_active

    return wrap(method, Wrapper(
        lambda name: f"{name}+es", init=init, hooks={"update": update, "active_clients": active_clients},
        # per-client state: not streamed
        capabilities=lambda caps: caps._replace(needs_holdout=True, streamable=None, asynchronous=False),
        label="early stopping"))
