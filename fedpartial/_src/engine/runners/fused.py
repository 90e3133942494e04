"""The fused strategy's runner: the whole round (``RoundProgram.pure_round``) as one jitted function.

The server state is donated.  Over a device mesh the cohort is split over the devices (``pure_round``
trains each device's rows with ``shard_map``) and the state, metrics and new state are replicated, so
every process can read the metrics and feed the state back (:mod:`fedpartial._src.engine.sharding`).
"""

from __future__ import annotations

import jax

from fedpartial._src.engine import sharding as sharding_lib
from fedpartial._src.engine.runners.base import Runner, jit


class Fused(Runner):
    """``round``: the jitted round ``(state, cohort, key data) -> (state, metrics)``."""

    def __init__(self, program):
        super().__init__(program)
        if program.mesh is None:
            self.round = jit(lambda s, c, k: program.pure_round(s, c, self.wrap_key(k)), donate_argnums=(0,))
        else:  # the outputs replicated too: every process can read the metrics and feed the state back
            everywhere = sharding_lib.replicated(program.mesh)
            self.round = jit(
                lambda s, c, k: jax.lax.with_sharding_constraint(program.pure_round(s, c, self.wrap_key(k)), everywhere),
                in_shardings=(everywhere, sharding_lib.cohort_sharding(program.mesh), everywhere), donate_argnums=(0,))

    def __call__(self, state, cohort, key):
        return self.round(state, self.whole(cohort), self._key_data(key))

    def jitted(self) -> tuple:
        return (self.round,)
