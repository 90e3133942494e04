"""Local training of one client, as FedJAX-style ``client_init`` / ``client_step`` / ``client_final``.

Written for a single client of one client group; the engine vmaps, ``lax.map``s
or loops it over the group.  Masks arrive structured and are expanded here, per
step, to parameter shape in the full model's coordinates and then cut to the
group's graph (:class:`fedpartial._src.core.types.LocalGraph`); they are never stored expanded.

**Frozen means frozen.**  An element a client does not train in a step (train mask
off, or a dropped neuron's parameters) gets a zero gradient before the optimizer and
keeps its old value *and its optimizer state* after it: its momentum buffer, Adam
moments or any other per-element optax state are those of the step before, so weight
decay never reaches a frozen element's momentum and a mask that changes between steps
(FedRep's head phase, then its body phase) resumes each element's state where it was
left, as PyTorch's SGD skips parameters that have no gradient.  State shared by all
elements (Adam's step count) counts the client's steps.  An optimizer whose state
cannot be frozen element by element (factored statistics) is refused in one sentence.  Elements outside the
group's graph are not in the local state at all and come back from the start
model.  A padded step (``step_mask`` False) returns the state unchanged; padded
examples carry no loss, no gradient and no BatchNorm statistics.

**A frozen base is held once.**  A LoRA model's base (the ``frozen`` variables collection) is in no client's
start model, local state or result: every forward pass reads the one copy in ``global_vars``
(:func:`~fedpartial._src.core.structure.with_frozen`), which the cohort's vmap broadcasts instead of stacking.

Every step has its own key, ``fold_in(client_key, step)``, split in two: one
for ``Method.step_plan`` and one for the objective (``LocalStep.key``).

**Learning rate.**  This module is the one place a client's rate is applied: the
optimizer's updates (at rate 1) are multiplied by ``ClientOptimizer.lr`` ×
``ClientPlan.lr_scale`` (the round has already folded the cohort's ``lr_scale`` into
the plan).  The same product is the step's ``LocalStep.lr``, so a method that reads
the rate (SCAFFOLD's control variates) sees exactly the rate that trained the
client, in a separate run and in a replica of ``--lrs`` alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedpartial._src.engine import graphs
from fedpartial._src.core import masks as masks_lib
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import with_frozen, without_frozen  # noqa: F401  (without_frozen: here too)
from fedpartial._src.core.types import (
    Batch,
    ClientOptimizer,
    ClientPlan,
    LocalGraph,
    LocalStep,
    Method,
    MethodContext,
)


class LocalState(NamedTuple):
    """One client's training state (variables in its group's coordinates)."""

    variables: dict  # {'params', 'batch_stats'} of the group's graph
    opt_state: Any
    loss_sum: jax.Array  # sum of step losses (real steps only)
    steps: jax.Array  # real steps taken
    window: Any = None  # where the client's width window starts (ClientPlan.window), None: the leading units


class ClientFns(NamedTuple):
    init: Any  # (start_vars, optimizer_state=True, window=None) -> LocalState (False: opt_state is ())
    prepare: Any  # (start_vars, data [S, B, ...], global_vars=None) -> inputs [S, B, ...]
    step: Any  # (local, batch, plan, global_vars, client_state, client_key, index, server_state=()) -> LocalState
    final: Any  # (local, start_vars) -> (trained full variables, mean loss, steps)
    init_optimizer: Any  # (local without optimizer state) -> local with its fresh optimizer state


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


def as_client_optimizer(optimizer: ClientOptimizer | optax.GradientTransformation) -> ClientOptimizer:
    """A :class:`ClientOptimizer`; a plain optax transformation applies its own rate (``lr`` None: unknown)."""
    if isinstance(optimizer, ClientOptimizer):
        return optimizer
    return ClientOptimizer(direction=optimizer, lr=None)


def update_scale(base_lr: float | None, lr_scale: jax.Array | None) -> jax.Array | None:
    """What multiplies a client's (or ``[K]`` clients') optimizer updates: ``base_lr`` × ``lr_scale``, either
    left out when unknown or None; None when both are (a plain optax transformation applies its own rate)."""
    if base_lr is None:
        return None if lr_scale is None else jnp.asarray(lr_scale, jnp.float32)
    lr = jnp.asarray(base_lr, jnp.float32)
    return lr if lr_scale is None else lr * jnp.asarray(lr_scale, jnp.float32)


def keep_frozen_state(new: Any, old: Any, trained: Any) -> Any:
    """``new`` optimizer state with ``old``'s values where ``trained`` (a params-shaped boolean tree) is False.

    Every part of the state laid out like the parameters (SGD's trace, Adam's ``mu`` and ``nu``, any optax
    state of that shape) is masked element-wise; scalars and other state (step counts) are ``new``'s.
    """
    layout = jax.tree.structure(trained)

    def like_params(node) -> bool:
        return node is not None and jax.tree.structure(node) == layout

    def keep(n, o):
        if not like_params(n):
            return n
        for a, m in zip(jax.tree.leaves(n), jax.tree.leaves(trained)):
            if jnp.shape(a) != jnp.shape(m):
                raise UserError("the client optimizer keeps state that is not laid out like the parameters "
                                f"(a leaf of shape {jnp.shape(a)} for parameters of shape {jnp.shape(m)}), so a "
                                "frozen element's state cannot be kept; use an optimizer with per-element state "
                                "(SGD, momentum, Adam).")
        return jax.tree.map(jnp.where, trained, n, o)

    return jax.tree.map(keep, new, old, is_leaf=like_params)


def make_client_fns(
    ctx: MethodContext,
    method: Method,
    optimizer: ClientOptimizer | optax.GradientTransformation,
    *,
    track_batch_stats: bool = True,
    graph: LocalGraph | None = None,
) -> ClientFns:
    """Builds the per-client functions for a method, a local optimizer and a group's graph.

    Args:
      ctx: static model/population facts.
      method: supplies ``step_plan``, ``objective`` and ``transform_grads``.
      optimizer: a :class:`ClientOptimizer` (:func:`~fedpartial._src.core.types.client_sgd`), or any
        optax transformation, which then applies its own rate (``LocalStep.lr`` is None).
      track_batch_stats: False for the 'static' BatchNorm policy (statistics not
        tracked; batch statistics are used in training).
      graph: the group's local graph (None: the whole model).
    """
    graph = graph or graphs.whole(ctx.model)
    client_optimizer = as_client_optimizer(optimizer)
    direction, base_lr = client_optimizer.direction, client_optimizer.lr

    def extract(tree, window):
        return graph.extract(tree) if window is None or not graph.windowed else graph.extract(tree, window)

    def insert(full, part, window):
        return graph.insert(full, part) if window is None or not graph.windowed else graph.insert(full, part, window)

    def extract_params(tree, window):
        return extract({"params": tree}, window)["params"]

    def client_init(start_vars: dict, optimizer_state: bool = True, window: jax.Array | None = None) -> LocalState:
        local = LocalState(variables=extract(start_vars, window), opt_state=(), loss_sum=jnp.zeros((), jnp.float32),
                           steps=jnp.zeros((), jnp.int32), window=window)
        return init_optimizer(local) if optimizer_state else local

    def init_optimizer(local: LocalState) -> LocalState:
        return local._replace(opt_state=direction.init(local.variables["params"]))

    def client_prepare(start_vars: dict, data: Batch, global_vars: dict | None = None) -> Batch:
        if graph.prepare is None:
            return data
        return graph.prepare(with_frozen(start_vars, global_vars), data, not track_batch_stats)

    def client_step(local: LocalState, batch: Batch, plan: ClientPlan, global_vars: dict, client_state: Any,
                    client_key: jax.Array, index: jax.Array, server_state: Any = ()) -> LocalState:
        plan_key, loss_key = jax.random.split(jax.random.fold_in(client_key, index))
        if method.step_plan is not None:
            plan = method.step_plan(ctx, plan, plan_key, index)
        params = local.variables["params"]
        stats = local.variables["batch_stats"]
        template = global_vars["params"]  # full-model shapes: masks are expanded there, then cut
        train_mask = trainable_mask(ctx, plan)
        scale = forward_scale(ctx, plan, template)
        scale = None if scale is None else extract_params(scale, local.window)

        def forward(p, x):
            p_fwd = p if scale is None else jax.tree.map(jnp.multiply, p, scale)
            return graph.apply(with_frozen({"params": p_fwd, "batch_stats": stats}, global_vars), x, True,
                               batch.example_mask)

        rate = update_scale(base_lr, plan.lr_scale)
        step = LocalStep(batch=batch, key=loss_key, index=index, plan=plan, global_vars=global_vars,
                         client_state=client_state, forward=forward, server_state=server_state,
                         lr=None if base_lr is None else rate)
        (_, aux), grads = jax.value_and_grad(lambda p: method.objective(ctx, p, step), has_aux=True)(params)
        if method.transform_grads is not None:  # before the frozen elements are zeroed: they stay frozen
            grads = method.transform_grads(ctx, grads, step)
        if train_mask is not None:
            elem = extract_params(masks_lib.expand(ctx.structure, train_mask, template), local.window)
            grads = jax.tree.map(lambda g, m: jnp.where(m, g, jnp.zeros_like(g)), grads, elem)
        updates, opt_state = direction.update(grads, local.opt_state, params)
        if train_mask is not None:
            opt_state = keep_frozen_state(opt_state, local.opt_state, elem)
        if rate is not None:  # the one place a client's rate multiplies its updates
            updates = jax.tree.map(lambda u: u * rate.astype(u.dtype), updates)
        new_params = optax.apply_updates(params, updates)
        if train_mask is not None:
            new_params = jax.tree.map(jnp.where, elem, new_params, params)
        new = LocalState(
            variables={"params": new_params, "batch_stats": aux.batch_stats if track_batch_stats else stats},
            opt_state=opt_state,
            loss_sum=local.loss_sum + aux.loss,
            steps=local.steps + 1,
            window=local.window,
        )
        # A padded step leaves every part of the client state unchanged.
        return jax.tree.map(lambda a, b: jnp.where(batch.step_mask, a, b), new, local)

    def client_final(local: LocalState, start_vars: dict) -> tuple[dict, jax.Array, jax.Array]:
        mean_loss = local.loss_sum / jnp.maximum(local.steps, 1).astype(jnp.float32)
        return insert(start_vars, local.variables, local.window), mean_loss, local.steps

    return ClientFns(client_init, client_prepare, client_step, client_final, init_optimizer)
