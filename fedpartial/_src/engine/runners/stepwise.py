"""The stepwise strategy's runner: a host loop over local steps of a step jitted over a chunk of clients.

The plan (with every client's start model) and the aggregation are jitted separately; in between, each
chunk of ``chunk_size`` clients is taken out of the cohort's local states, trained by one jitted call per
step and written back in place.  :class:`Steps` (the jitted steps and their host loop) also trains the
streamed strategy's stepwise chunks.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.engine.runners.base import Runner, jit
from fedpartial._src.engine.types import Cohort, ServerState, hook_keys


class Steps:
    """A round's jitted local steps, by ``(group, chunk, full)``, and the host loop over them; keys are
    wrapped as ``runner``'s."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.fns: dict[tuple[int, int | None, bool], Any] = {}

    def fn(self, group: int, chunk: int | None, full: bool = False):
        """A jitted step over ``chunk`` clients of ``group`` (None: one client, un-vmapped).

        Signature ``(local, data, s, plan, global_vars, client_state, client_key, server_state) -> local``.
        ``full``: the host knows step ``s`` and every example of its batches are real for every client of
        the chunk, so the step and example masks become constant True.  XLA then drops the select that
        keeps padded steps no-ops (one more read and write of the whole local state) and the masked
        BatchNorm statistics and loss become the plain ones: measured 4–13% of a VGG-9 step on CPU, where
        the full step runs as fast as a plain jitted step.  The same arithmetic up to float reassociation
        (BatchNorm statistics ~1e-6 apart).  Each variant compiles when first needed:
        a later round whose chunk first holds padding compiles the masked variant then (once, not per round).
        """
        if (group, chunk, full) not in self.fns:
            step = self.runner.program.clients[group].step
            wrap = self.runner.wrap_key

            def one_step(local, data, s, plan, global_vars, cstate, ckey_data, server_state):
                batch = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, s, axis=0, keepdims=False), data)
                if full:
                    batch = batch._replace(step_mask=jnp.ones((), bool),
                                           example_mask=jnp.ones(batch.example_mask.shape, bool))
                return step(local, batch, plan, global_vars, cstate, wrap(ckey_data), s, server_state)

            fn = one_step if chunk is None else jax.vmap(one_step, in_axes=(0, 0, None, 0, None, 0, 0, None))
            self.fns[group, chunk, full] = jit(fn, donate_argnums=(0,))
        return self.fns[group, chunk, full]

    def run(self, group: int, chunk: int | None, step_mask: np.ndarray, full_step: np.ndarray, local, args):
        """The host loop of one chunk's jitted steps (``args``: the step's data, plan, global variables,
        client state and keys).  ``step_mask``, ``full_step``: the chunk's ``[C, S]`` host masks.  Steps
        after the chunk's last real step are padding: skipped.  A step without any padding in the chunk
        (every step of one client's packed data but a partial last batch) runs without masks."""
        data, *rest = args
        active = np.flatnonzero(step_mask.any(axis=0))
        for s in range(int(active[-1]) + 1 if active.size else 0):
            local = self.fn(group, chunk, bool(full_step[:, s].all()))(local, data, s, *rest)
        return local


class Stepwise(Runner):
    """``_begin`` (plan and local states), :attr:`steps`, ``_finish`` (the round's end,
    ``RoundProgram.finish``): each jitted on its own."""

    def __init__(self, program):
        super().__init__(program)
        self._begin = jit(lambda s, c, k: self._begin_round(s, c, self.wrap_key(k)))
        self._finish = jit(lambda s, c, k, p, locals_: program.finish(s, c, self.wrap_key(k), p, locals_))
        self.steps = Steps(self)

    def __call__(self, state, cohort, key):
        key_data = self._key_data(key)
        if self.program.step_devices is not None:
            # Committed to the first device from the first round on, as the round's own outputs are: an
            # uncommitted input would compile the round's programs once more in the second round.
            state, key_data = jax.device_put((state, key_data), self.program.step_devices[0])
        cohort, plan, trained = self.train(state, self.whole(cohort), key_data)
        return self._finish(state, cohort, key_data, plan, trained)

    def jitted(self) -> tuple:
        return (self._begin, self._finish, *self.steps.fns.values())

    def _begin_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """Plans the round; per group, every client's local state (without optimizer state: each chunk
        gets its own when it starts, so ``[K]`` optimizer states never exist), inputs, plan, state and
        key rows.

        A group's inputs are its prepared inputs, its rows of the cohort data when
        there are several groups, or None (one group without preparation: the
        cohort data itself is used, never copied).
        """
        prog = self.program
        keys = hook_keys(key)
        view = prog.view(state, cohort, key)
        plan = prog.plan(view, keys)
        client_keys = prog.client_keys(keys, cohort)
        starts = prog.starts(view, plan)
        groups = []
        for fns, group, (start, data, plan_g, cstate, ckeys) in zip(
                prog.clients, prog.groups,
                prog.group_slices(starts, cohort.data, plan, view.client_state, client_keys)):
            if group.graph is not None and group.graph.prepare is not None:
                inputs = jax.vmap(fns.prepare, (0, 0, None))(start, data, state.variables)
            else:
                inputs = data if len(prog.groups) > 1 else None
            local = jax.vmap(lambda s, w: fns.init(s, optimizer_state=False, window=w))(start, plan_g.window)
            groups.append((local, inputs, plan_g, cstate, jax.random.key_data(ckeys)))
        return plan, tuple(groups)

    def train(self, state: ServerState, cohort: Cohort, key_data: jax.Array):
        """The stepwise strategy's local training: ``(cohort on the device, plan, per group every client's
        local state)`` (the benchmark times this phase on its own)."""
        prog = self.program
        step_mask = np.asarray(cohort.data.step_mask)
        # [K, S]: no padding at all (reduced where the mask lives, so device data sends K × S, not K × S × B)
        full_step = step_mask & np.asarray(cohort.data.example_mask.all(axis=-1))
        # once; chunks below are sliced on the device (split over devices: committed to the first, see __call__)
        cohort = jax.device_put(cohort, None if prog.step_devices is None else prog.step_devices[0])
        plan, groups = self._begin(state, cohort, key_data)
        trained = []
        for g, (group, offset, (local, inputs, plan_g, cstate, ckeys)) in enumerate(
                zip(prog.groups, prog.offsets, groups)):
            data = cohort.data if inputs is None else inputs
            chunk = min(prog.strategy.chunk_size or 1, group.size)
            if prog.step_devices is not None:
                rows = slice(offset, offset + group.size)
                trained.append(self._side_by_side(g, state, step_mask[rows], full_step[rows],
                                                  (local, data, plan_g, cstate, ckeys)))
                continue
            for start in range(0, group.size, chunk):
                size = min(chunk, group.size - start)
                # chunk 1 runs the un-vmapped step on one client's slice.
                batched = None if chunk == 1 else size
                # One jitted call takes the chunk out (and gives it fresh optimizer states), one writes
                # it back in place: slicing leaf by leaf on the host costs a dispatch per leaf and client.
                rows_in = (local, data, plan_g, cstate, ckeys)
                init_opt = prog.clients[g].init_optimizer
                local_c, data_c, plan_c, cstate_c, key_c = _take(batched, start, rows_in, init_opt)
                chunk_rows = slice(offset + start, offset + start + size)
                local_c = self.steps.run(g, batched, step_mask[chunk_rows], full_step[chunk_rows], local_c,
                                         (data_c, plan_c, state.variables, cstate_c, key_c,
                                          state.method_state.server))
                local = _put(batched, start, local, local_c._replace(opt_state=()))
            trained.append(local)
        return cohort, plan, tuple(trained)


    def _side_by_side(self, g: int, state: ServerState, step_mask: np.ndarray, full_step: np.ndarray, rows):
        """One group's clients trained one per device at a time (``rows``: their local states, data, plan,
        client state and keys), their steps interleaved so that each device runs its client's step while
        the others run theirs (dispatch is asynchronous).  Each client runs the same un-vmapped jitted step as
        on one device, so the results are the same bit for bit.  The next clients are taken out before this
        wave's are written back, so that no device waits for another's last step."""
        devices, size = self.program.step_devices, step_mask.shape[0]
        init_opt = self.program.clients[g].init_optimizer
        home = next(iter(jax.tree.leaves(rows[0])[0].devices()))
        shared = [jax.device_put((state.variables, state.method_state.server), d) for d in devices]

        def take(first):
            return [jax.device_put(_take(None, i, rows, init_opt), d)
                    for i, d in zip(range(first, min(first + len(devices), size)), devices)]

        lanes = take(0)
        for first in range(0, size, len(devices)):
            last = [int(a[-1]) + 1 if a.size else 0 for a in map(np.flatnonzero, step_mask[first:first + len(lanes)])]
            for s in range(max(last)):
                for j, (local_c, *args) in enumerate(lanes):
                    if s < last[j]:  # steps after a client's last real step are padding: skipped
                        step = self.steps.fn(g, None, bool(full_step[first + j, s]))
                        data_c, plan_c, cstate_c, key_c = args
                        local_c = step(local_c, data_c, s, plan_c, *shared[j][:1], cstate_c, key_c, shared[j][1])
                        lanes[j] = (local_c, *args)
            done, lanes = lanes, take(first + len(devices)) if first + len(devices) < size else []
            local = rows[0]
            for j, (local_c, *_) in enumerate(done):
                local = _put(None, first + j, local, jax.device_put(local_c._replace(opt_state=()), home))
            rows = (local, *rows[1:])
        return rows[0]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _take(size: int | None, start, tree, init_optimizer=None):
    """Rows ``start:start+size`` of every leaf (``size`` None: row ``start`` without its axis);
    ``init_optimizer``: gives the first element, the chunk's local states, their optimizer states."""
    if size is None:
        rows = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, start, 0, keepdims=False), tree)
    else:
        rows = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, 0), tree)
    if init_optimizer is not None:
        first = init_optimizer(rows[0]) if size is None else jax.vmap(init_optimizer)(rows[0])
        rows = (first, *rows[1:])
    return rows


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _put(size: int | None, start, tree, rows):
    """Writes ``rows`` back at ``start`` (in place: ``tree`` is donated)."""
    def leaf(a, r):
        r = r[None] if size is None else r
        return jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), start, 0)
    return jax.tree.map(leaf, tree, rows)
