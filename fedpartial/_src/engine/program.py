"""The round program: the pure pieces of one federated round, which a runner (:mod:`fedpartial._src.engine.runners`)
computes a round from.

:class:`~fedpartial._src.engine.round.FederatedRound` builds one :class:`RoundProgram` (its method bound to a
model, optimizers and a strategy, its client groups and their compiled local training) and hands it to its
runner; the runners read the program, never the round.  The pieces, in the order a round calls them:
the view (:meth:`RoundProgram.view`), the plan, every client's key and start model, one client's local
training (:meth:`RoundProgram.train_one`), fault cleaning, the per-client summary, selection, the upload's
encoding, aggregation (:meth:`RoundProgram.aggregate_and_update`) and the rest of the round from the
aggregate: ``server_correct``, the server optimizer, ``update`` and the metrics (:meth:`RoundProgram.conclude`).
:meth:`RoundProgram.pure_round` is all of them as one pure function (the fused strategy's body).  What the
pieces compute (client groups, keys, faults, per-client state): :mod:`fedpartial._src.engine.round`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedpartial._src.core import aggregation
from fedpartial._src.core.population import gather_clients
from fedpartial._src.core.types import Carry, ClientGroup, ClientOptimizer, ClientPlan, Method, MethodContext, RoundView
from fedpartial._src.engine import sharding as sharding_lib
from fedpartial._src.engine._rows import all_finite, clean_faults, concat, row_slice, rows_padded
from fedpartial._src.engine.client import ClientFns, update_scale, without_frozen
from fedpartial._src.engine.local_training import run_steps
from fedpartial._src.engine.metrics import round_metrics
from fedpartial._src.engine.strategy import Strategy
from fedpartial._src.engine.types import Cohort, HookKeys, ServerState, hook_keys


def carry(hook: str, out: Any, view: RoundView) -> tuple[Any, RoundView]:
    """``hook``'s result, and the view with what it handed on (a :class:`Carry`) in ``carried``."""
    if not isinstance(out, Carry):
        return out, view
    return out.result, view._replace(carried={**(view.carried or {}), hook: out.value})


def map_clients(train_one, args, chunk_size: int | None):
    """``train_one`` over the client rows of ``args``: all vmapped at once (``chunk_size`` None), vmapped chunks of
    ``chunk_size`` in a ``lax.map``, or with a chunk of one a plain ``lax.map`` of un-vmapped clients: XLA:CPU ran
    a vmap of one client's matrix products as batched products (mlp:50's local training 0.30 s a round un-vmapped
    against 0.38 s, docs/decisions.md)."""
    if chunk_size is None:
        return jax.vmap(train_one)(args)
    if chunk_size == 1:
        return jax.lax.map(train_one, args)
    return jax.lax.map(train_one, args, batch_size=chunk_size)


class RoundProgram:
    """The pure pieces of a round of ``method`` (each a pure function of arrays; a runner jits them its own way).

    Attributes (fixed when the round is built):
      ctx: the method's static context.
      method: the method.
      groups: the client groups, laid out one after another along the client axis; ``offsets`` their first rows.
      clients: per group, its clients' compiled local training (:class:`~fedpartial._src.engine.client.ClientFns`).
      strategy: how the round runs (:class:`~fedpartial._src.engine.strategy.Strategy`).
      mesh: the device mesh the client axis is split over (fused strategy), or None.
      step_devices: the devices the stepwise strategy trains clients on side by side, or None.
      client_state: where the method's per-client state lives, ``"device"`` or ``"host"``.
      communicated: the collections clients upload and the server aggregates.
      client_optimizer: the client optimizer (its rate, if known, is ``RoundView.client_lr``).
      server_optimizer: the server optimizer.
      record_decisions: add the plan and selection to the metrics.
    """

    def __init__(self, *, ctx: MethodContext, method: Method, groups: tuple[ClientGroup, ...],
                 offsets: tuple[int, ...], clients: tuple[ClientFns, ...], strategy: Strategy,
                 mesh: jax.sharding.Mesh | None, client_state: str, communicated: tuple[str, ...],
                 client_optimizer: ClientOptimizer, server_optimizer: optax.GradientTransformation,
                 record_decisions: bool, step_devices: tuple[jax.Device, ...] | None = None):
        self.ctx, self.method, self.groups, self.offsets, self.clients = ctx, method, groups, offsets, clients
        self.strategy, self.mesh, self.client_state, self.communicated = strategy, mesh, client_state, communicated
        self.step_devices = step_devices
        self.client_optimizer, self.server_optimizer = client_optimizer, server_optimizer
        self.record_decisions = record_decisions

    # ---- before local training -----------------------------------------------------------

    def view(self, state: ServerState, cohort: Cohort, key: jax.Array) -> RoundView:
        """What the method's hooks read this round, the cohort's per-client state rows gathered."""
        ids = jnp.asarray(cohort.info.client_ids)
        rows = jnp.arange(ids.shape[0], dtype=ids.dtype) if self.client_state == "host" else ids
        return RoundView(
            key=key, round=state.round, global_vars=state.variables, method_state=state.method_state,
            client_state=gather_clients(state.method_state.clients, rows),
            cohort=cohort.info, data=cohort.data, holdout=cohort.holdout, client_rows=rows,
        )

    def plan(self, view: RoundView, keys: HookKeys) -> ClientPlan:
        """The method's plan, the cohort's own learning-rate scales composed with the method's."""
        plan = self.method.plan(self.ctx, view._replace(key=keys.plan))
        if view.cohort.lr_scale is None:
            return plan
        scale = jnp.asarray(view.cohort.lr_scale, jnp.float32)  # a method's own per-client rates compose with it
        return plan._replace(lr_scale=scale if plan.lr_scale is None else plan.lr_scale * scale)

    def client_lr(self, plan: ClientPlan) -> jax.Array | None:
        """``[K]`` the rate each client trains with (``RoundView.client_lr``), or None when the client optimizer
        is a plain optax transformation whose rate is unknown."""
        if self.client_optimizer.lr is None:
            return None
        scale = update_scale(self.client_optimizer.lr, plan.lr_scale)
        return jnp.broadcast_to(scale, (self.ctx.cohort_size,)) if plan.lr_scale is None else scale

    def client_keys(self, keys: HookKeys, cohort: Cohort) -> jax.Array:
        """``[K]`` each client's training key, ``fold_in(train_key, id_k)``."""
        return jax.vmap(lambda i: jax.random.fold_in(keys.train, i))(jnp.asarray(cohort.info.client_ids))

    def client_start(self, global_vars: dict, client_state: Any, plan: ClientPlan) -> dict:
        """One client's start model (the method's ``client_start``) without the frozen base, which the round
        holds once and hands to every client's forward pass unstacked (:func:`~fedpartial._src.engine.client.with_frozen`)."""
        return without_frozen(self.method.client_start(self.ctx, global_vars, client_state, plan))

    def starts(self, view: RoundView, plan: ClientPlan) -> dict:
        """``[K, ...]`` every client's start model (the method's ``client_start``), without the frozen base."""
        start = lambda cstate, plan_k: self.client_start(view.global_vars, cstate, plan_k)  # noqa: E731
        return jax.vmap(start, axis_size=self.ctx.cohort_size)(view.client_state, plan)

    def group_slices(self, *trees):
        """Per group, the static rows of each tree (the trees themselves for one group)."""
        if len(self.groups) == 1:
            return [trees]
        return [tuple(row_slice(t, start, g.size) for t in trees) for g, start in zip(self.groups, self.offsets)]

    # ---- local training -------------------------------------------------------------------

    def train_one(self, shared, fns: ClientFns, args):
        """One client's local training from ``shared`` (the global variables and the method's server state),
        steps in ``lax.scan``: ``(trained, loss, steps)``."""
        global_vars, server_state = shared
        data_k, plan_k, cstate_k, key_k = args
        start = self.client_start(global_vars, cstate_k, plan_k)
        return run_steps(fns, start, data_k, plan_k, global_vars, cstate_k, key_k, server_state,
                         unroll=self.strategy.unroll)

    def final_results(self, starts: dict, locals_) -> tuple:
        """Every group's clients' local states ``locals_`` → ``(trained, losses, steps)`` ``[K, ...]``."""
        parts = [jax.vmap(fns.final)(local, start)
                 for fns, local, (start,) in zip(self.clients, locals_, self.group_slices(starts))]
        return tuple(concat([p[i] for p in parts]) for i in range(3))

    # ---- after local training ---------------------------------------------------------------

    def finish(self, state: ServerState, cohort: Cohort, key: jax.Array, plan: ClientPlan, locals_):
        """Final client results of every group, then selection, aggregation, server optimizer, update."""
        view = self.view(state, cohort, key)
        starts = self.starts(view, plan)
        trained, losses, steps = self.final_results(starts, locals_)
        return self.aggregate_and_update(state, view, hook_keys(key), plan, starts, trained, losses, steps)

    def aggregate_and_update(self, state, view: RoundView, keys: HookKeys, plan, starts, trained, losses, steps):
        """From the cohort's trained variables: faults cleaned, summary, selection, encoding, aggregation, then
        :meth:`conclude`."""
        # Faults: a client whose result is not finite is from here on a padding client (valid False) that
        # trained nothing (its start model, loss 0), so select, aggregation, server_correct, update and
        # metrics all see one consistent cohort and no NaN reaches a sum (0 · NaN is NaN).
        sent = view.cohort.valid
        raw_losses = losses
        finite, trained, losses = clean_faults(trained, losses, starts)
        view = view._replace(cohort=view.cohort._replace(valid=sent & finite))
        view = view._replace(plan=plan, trained_vars=trained, client_loss=losses, start_vars=starts,
                             client_steps=steps, client_lr=self.client_lr(plan))
        view = self.summarize(view)
        selection, carried = self.select(view, keys)
        view = view._replace(carried=carried)
        uploaded = trained["params"]
        if self.method.encode is not None:  # e.g. an upload codec: what the server receives is not what was trained
            uploaded, view = carry("encode", self.method.encode(
                self.ctx, view._replace(selection=selection, key=jax.random.fold_in(keys.update, 3))), view)
        view = view._replace(uploaded=uploaded)
        own = self.method.aggregate is not None  # the method replaces the formula for params (e.g. DP's noise)
        aggregated, received = aggregation.aggregate(
            self.ctx.structure, state.variables, {**trained, "params": uploaded}, selection.upload, selection.weights,
            tuple(c for c in self.communicated if c != "params") if own else self.communicated)
        if own:
            (params, received), view = carry("aggregate", self.method.aggregate(
                self.ctx, view._replace(selection=selection, key=jax.random.fold_in(keys.update, 2))), view)
            aggregated = {**aggregated, "params": params}
        return self.conclude(state, view, keys, selection, aggregated, received, raw_losses, sent)

    def summarize(self, view: RoundView) -> RoundView:
        """The view with the method's per-client ``summary`` of the trained cohort (if it has one)."""
        if self.method.summarize is None:
            return view
        return view._replace(summary=self.method.summarize(self.ctx, view))

    def select(self, view: RoundView, keys: HookKeys):
        """The method's selection, with padding and failed clients' weights zeroed, and what ``select`` carried
        (``RoundView.carried``: ``{}`` or ``{"select": value}``)."""
        selection, view = carry("select", self.method.select(self.ctx, view._replace(key=keys.select)),
                                view._replace(carried={}))
        return selection._replace(weights=jnp.where(view.cohort.valid, selection.weights, 0.0)), view.carried

    def conclude(self, state, view: RoundView, keys: HookKeys, selection, aggregated, received, raw_losses, sent):
        """From the aggregate: server_correct, server optimizer, rewrite_global, update, metrics."""
        valid = view.cohort.valid
        losses, steps = view.client_loss, view.client_steps
        view = view._replace(selection=selection, aggregated=aggregated)
        target = aggregated["params"]
        if self.method.server_correct is not None:  # e.g. FedNova, FedDyn: not the plain aggregate
            proposed, view = carry("server_correct", self.method.server_correct(
                self.ctx, view._replace(key=jax.random.fold_in(keys.update, 1))), view)
            target = jax.tree.map(jnp.where, received, proposed, target)  # nobody uploaded: the global value
        params, opt_state = aggregation.server_update(
            self.server_optimizer, state.opt_state, state.variables["params"], target, received,
            lr_scale=state.server_lr_scale)
        new_vars = {**aggregated, "params": params}
        view = view._replace(new_global_vars=new_vars)
        if self.method.rewrite_global is not None:  # e.g. FLoRA: the adapters folded into the frozen base
            new_vars = self.method.rewrite_global(self.ctx, view._replace(key=jax.random.fold_in(keys.update, 4)))
            view = view._replace(new_global_vars=new_vars)
        # The round is flagged (not undone) when every real client failed or the new global model is not
        # finite: keeping the input state would need a lax.cond or a select over the whole state, which
        # copies a method's [N, ...] rows every round (measured: FedSPU, N = 1000, 12 ms -> 245 ms a round).
        diverged = (jnp.any(sent) & ~jnp.any(valid)) | ~all_finite(new_vars)
        method_state = self.method.update(self.ctx, view._replace(key=keys.update))
        new_state = ServerState(round=state.round + 1, variables=new_vars, opt_state=opt_state,
                                method_state=method_state, server_lr_scale=state.server_lr_scale)
        metrics = round_metrics(self.ctx, self.method, self.communicated, self.record_decisions,
                                view._replace(key=keys.metrics), selection, losses, steps, sent)
        metrics["client_loss"] = raw_losses  # NaN shows which client failed
        metrics["nonfinite_clients"] = jnp.sum(sent & ~valid).astype(jnp.int32)
        metrics["diverged"] = diverged
        return new_state, metrics

    # ---- the whole round, pure ------------------------------------------------------------

    def pure_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """One whole round as a pure function of arrays (the fused strategy's body)."""
        keys = hook_keys(key)
        view = self.view(state, cohort, key)
        plan = self.plan(view, keys)
        client_keys = self.client_keys(keys, cohort)
        outs = []
        for fns, (data, plan_g, cstate, ckeys) in zip(
                self.clients, self.group_slices(cohort.data, plan, view.client_state, client_keys)):

            def train_group(shared, args, fns=fns):
                return map_clients(functools.partial(self.train_one, shared, fns), args, self.strategy.chunk_size)

            args = (data, plan_g, cstate, ckeys)
            if self.mesh is not None:
                # Each device trains its own rows (chunks are per device).  No collectives inside, so the
                # replication check (which would ask every method to mark its scan carries) is off.
                clients = jax.sharding.PartitionSpec(sharding_lib.CLIENT_AXIS)
                train_group = rows_padded(jax.shard_map(
                    train_group, mesh=self.mesh, in_specs=(jax.sharding.PartitionSpec(), clients),
                    out_specs=clients, check_vma=False), self.mesh.size)
            outs.append(train_group((state.variables, state.method_state.server), args))
        trained, losses, steps = (concat([o[i] for o in outs]) for i in range(3))
        starts = self.starts(view, plan)  # recomputed, not carried: XLA fuses it into the fault check's select
        return self.aggregate_and_update(state, view, keys, plan, starts, trained, losses, steps)
