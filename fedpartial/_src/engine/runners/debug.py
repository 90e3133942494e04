"""The debug strategy's runner: the stepwise round with nothing jitted, one client and one step at a time,
so an error inside a method's hook points at the hook's own line and hooks can print concrete values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.engine.runners.base import Runner
from fedpartial._src.engine.types import hook_keys


class Debug(Runner):
    """Nothing jitted, so nothing is ever traced (``jitted()`` is empty)."""

    def __call__(self, state, cohort, key):
        prog, cohort = self.program, self.whole(cohort)
        with jax.disable_jit():
            keys = hook_keys(key)
            view = prog.view(state, cohort, key)
            plan = prog.plan(view, keys)
            client_keys = prog.client_keys(keys, cohort)
            locals_ = []
            for fns, group, offset in zip(prog.clients, prog.groups, prog.offsets):
                results = []
                for k in range(offset, offset + group.size):
                    one = lambda tree: jax.tree.map(lambda a: a[k], tree)  # noqa: B023,E731
                    plan_k, cstate_k = one(plan), one(view.client_state)
                    start = prog.client_start(state.variables, cstate_k, plan_k)
                    inputs = fns.prepare(start, one(cohort.data), state.variables)
                    local = fns.init(start, window=plan_k.window)
                    for s in range(int(np.shape(cohort.data.step_mask)[1])):
                        batch = jax.tree.map(lambda a: a[s], inputs)  # noqa: B023
                        local = fns.step(local, batch, plan_k, state.variables, cstate_k, client_keys[k],
                                         jnp.asarray(s), state.method_state.server)
                    results.append(local)
                locals_.append(jax.tree.map(lambda *a: jnp.stack(a), *results))
            return prog.finish(state, cohort, key, plan, tuple(locals_))
