"""Local training as a piece of its own: one client's steps, and a stack of models trained on their own data.

:func:`run_steps` is one client's local training from a start model — the local steps in ``lax.scan``
(:mod:`fedpartial._src.engine.client`'s ``init`` / ``step`` / ``final``); the round trains its clients with
it.  :func:`train_models` trains ``[C]`` models at once, each on its own data ``[C, S, B, ...]``, vmapped
over the models, with a *recipe* of the caller's: a :class:`~fedpartial._src.core.types.Method` whose
``objective``, ``step_plan`` and ``transform_grads`` make the local step (every other hook is unused).
Pure and jittable; a method may call it from its ``update`` (Ditto's personal models, trained beside the
uploaded ones) and the driver to fine-tune every client's copy of the global model before evaluating it
(FedBABU; :mod:`fedpartial._src.experiment.finetune`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedpartial._src.core.types import Batch, ClientOptimizer, ClientPlan, Method, MethodContext
from fedpartial._src.engine.client import ClientFns, make_client_fns


def run_steps(fns: ClientFns, start: dict, data: Batch, plan: ClientPlan, global_vars: dict, client_state: Any,
              key: jax.Array, server_state: Any = (), *, unroll: int = 1) -> tuple[dict, jax.Array, jax.Array]:
    """One client's local training from ``start`` on its data ``[S, B, ...]`` (padded steps are no-ops):
    ``(trained variables, mean loss, real steps)``.  ``key``: the client's key (step ``s`` folds in ``s``)."""
    inputs = fns.prepare(start, data, global_vars)

    def body(local, xs):
        batch, index = xs
        return fns.step(local, batch, plan, global_vars, client_state, key, index, server_state), None

    num_steps = data.step_mask.shape[0]
    local = jax.lax.scan(body, fns.init(start, window=plan.window), (inputs, jnp.arange(num_steps)),
                         unroll=unroll)[0]
    return fns.final(local, start)


def train_models(ctx: MethodContext, recipe: Method, optimizer: ClientOptimizer | optax.GradientTransformation,
                 starts: dict, data: Batch, keys: jax.Array, *, global_vars: dict, plans: ClientPlan | None = None,
                 client_state: Any = (), track_batch_stats: bool = True) -> tuple[dict, jax.Array, jax.Array]:
    """``[C]`` models ``starts`` each trained on its own data ``data`` (``[C, S, B, ...]``) by ``optimizer`` with
    ``recipe``'s local step, vmapped over the models: ``(trained [C, ...], mean loss [C], real steps [C])``.

    Args:
      keys: ``[C]`` each model's key.
      global_vars: what every step sees as ``LocalStep.global_vars`` (unstacked: the same for every model),
        e.g. the model a proximal term pulls towards.
      plans: ``[C]`` each model's plan (masks, ``lr_scale``), or None to train everything at the optimizer's rate.
      client_state: ``[C]`` rows each step sees as ``LocalStep.client_state`` (``()``: none).
      track_batch_stats: False for the 'static' BatchNorm policy (running statistics not tracked).
    """
    fns = make_client_fns(ctx, recipe, optimizer, track_batch_stats=track_batch_stats)
    plans = ClientPlan() if plans is None else plans

    def one(start, data_k, plan_k, state_k, key_k):
        return run_steps(fns, start, data_k, plan_k, global_vars, state_k, key_k)

    return jax.vmap(one)(starts, data, plans, client_state, keys)
