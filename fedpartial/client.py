"""Local training of one client, as FedJAX-style ``client_init`` / ``client_step`` / ``client_final``.

Written for a single client; the engine vmaps, ``lax.map``s or loops it over the
cohort.  Masks arrive structured and are expanded here, per step, to parameter
shape (they are never stored expanded).

Frozen elements (train mask off, or a dropped neuron's parameters) get a zero
gradient before the optimizer *and* keep their old value after it, so they stay
bit-identical even under momentum and weight decay.  A padded step
(``step_mask`` False) returns the state unchanged; padded examples carry no
loss, no gradient and no BatchNorm statistics.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedpartial import masks as masks_lib
from fedpartial.losses import masked_cross_entropy
from fedpartial.methods.base import Batch, ClientPlan, Method, MethodContext


class LocalState(NamedTuple):
    """One client's training state."""

    variables: dict  # {'params', 'batch_stats'}
    opt_state: Any
    loss_sum: jax.Array  # sum of step losses (real steps only)
    steps: jax.Array  # real steps taken


class ClientFns(NamedTuple):
    init: Any
    step: Any
    final: Any


def trainable_mask(ctx: MethodContext, plan: ClientPlan) -> masks_lib.Mask | None:
    """One client's effective train mask (train ∧ sub-model), or None when all is trainable."""
    if plan.train is None and plan.dropout is None:
        return None
    mask = masks_lib.full(ctx.structure) if plan.train is None else plan.train
    if plan.dropout is not None:
        mask = masks_lib.within(mask, plan.dropout)
    return masks_lib.protect_output(mask)


def forward_scale(ctx: MethodContext, plan: ClientPlan, params: Any) -> Any | None:
    """Multipliers that remove dropped units from the forward pass (None without dropout)."""
    if plan.dropout is None:
        return None
    return masks_lib.submodel_scale(ctx.structure, plan.dropout, params, plan.dropout_scale)


def make_client_fns(
    ctx: MethodContext,
    method: Method,
    optimizer: optax.GradientTransformation,
    *,
    track_batch_stats: bool = True,
) -> ClientFns:
    """Builds the per-client functions for a method and a local optimizer.

    Args:
      ctx: static model/population facts.
      method: supplies ``client_start`` and ``regularizer``.
      optimizer: any optax transformation (e.g. SGD with momentum and weight decay).
      track_batch_stats: False for the 'static' BatchNorm policy (statistics not
        tracked; batch statistics are used in training).
    """
    model = ctx.model

    def client_init(global_vars: dict, client_state: Any, plan: ClientPlan) -> LocalState:
        start = method.client_start(ctx, global_vars, client_state, plan)
        return LocalState(
            variables=start,
            opt_state=optimizer.init(start["params"]),
            loss_sum=jnp.zeros((), jnp.float32),
            steps=jnp.zeros((), jnp.int32),
        )

    def client_step(local: LocalState, batch: Batch, plan: ClientPlan, global_vars: dict, client_state: Any) -> LocalState:
        params = local.variables["params"]
        stats = local.variables["batch_stats"]
        train_mask = trainable_mask(ctx, plan)
        scale = forward_scale(ctx, plan, params)

        def objective(p):
            p_fwd = p if scale is None else jax.tree.map(jnp.multiply, p, scale)
            logits, new_stats = model.apply({"params": p_fwd, "batch_stats": stats}, batch.x, True,
                                            batch.example_mask)
            loss = masked_cross_entropy(logits, batch.y, batch.example_mask)
            total = loss
            if method.regularizer is not None:
                total = total + method.regularizer(ctx, p, batch, global_vars, client_state)
            return total, (loss, new_stats)

        (_, (loss, new_stats)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        if train_mask is not None:
            elem = masks_lib.expand(ctx.structure, train_mask, params)
            grads = jax.tree.map(lambda g, m: jnp.where(m, g, jnp.zeros_like(g)), grads, elem)
        updates, opt_state = optimizer.update(grads, local.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if train_mask is not None:
            new_params = jax.tree.map(jnp.where, elem, new_params, params)
        new = LocalState(
            variables={"params": new_params, "batch_stats": new_stats if track_batch_stats else stats},
            opt_state=opt_state,
            loss_sum=local.loss_sum + loss,
            steps=local.steps + 1,
        )
        # A padded step leaves every part of the client state unchanged.
        return jax.tree.map(lambda a, b: jnp.where(batch.step_mask, a, b), new, local)

    def client_final(local: LocalState) -> tuple[dict, jax.Array, jax.Array]:
        mean_loss = local.loss_sum / jnp.maximum(local.steps, 1).astype(jnp.float32)
        return local.variables, mean_loss, local.steps

    return ClientFns(client_init, client_step, client_final)
