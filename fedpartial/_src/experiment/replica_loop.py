"""Replicas in a host loop: each replica's round is the single run's round, called with that replica's state,
cohort and key, one replica after another (the replica axis ``loop``).

:class:`~fedpartial._src.experiment.replicas.Replicas` runs this layout when a single run of the replicas' setting
runs anything but the vmapped fused round (:func:`~fedpartial._src.experiment.replica_axis.runs_looped`): a
host loop of jitted client steps (``stepwise:1``) or the clients one at a time inside the program (``fused:1``).
Stacking such replicas on a replica axis would put the clients' convolution gradients inside a loop of the
program, which XLA:CPU runs several times slower than the top-level calls a single run makes.

Every replica calls the first replica's :class:`~fedpartial._src.engine.round.FederatedRound` (the same model,
method, optimizers at rate 1 and shapes: the other replicas' rounds differ only in what their ``init`` read), so
its programs compile once for all replicas.  Each replica's client rate rides in its cohort (:func:`with_lr`)
and its server rate, with ``--server-lrs``, in the state handed to the round (``server_lr_scale``), as in the
stacked round; each replica keeps its own state, without the rate, as a separate run holds it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np

from fedpartial._src.engine import types as engine_types


def with_lr(cohort: engine_types.Cohort, lr: float) -> engine_types.Cohort:
    """``cohort`` whose clients train at ``lr`` times the client optimizer's rate."""
    size = np.shape(cohort.info.client_ids)[0]
    return cohort._replace(info=cohort.info._replace(lr_scale=np.full(size, lr, np.float32)))


class ReplicaLoop:
    """Runs a round of every active replica of ``sims`` one after another with ``sims[0]``'s round.

    ``server_lrs``: each replica's server state carries its server rate during its round (the replicas'
    server optimizer is built at rate 1)."""

    def __init__(self, sims: Sequence, server_lrs: bool):
        self.sims = sims
        self.round = sims[0].round
        self.server_lrs = server_lrs

    def run(self, last: list, active: list[bool]) -> list:
        """Each replica's ``(metrics on the host, seconds its round took)`` for its prepared round ``last[i]``,
        None where it is not ``active``; each active replica's ``state`` is its new one."""
        out: list = [None] * len(self.sims)
        for i, sim in enumerate(self.sims):
            if not active[i]:
                continue
            start = time.perf_counter()
            state = sim.state
            if self.server_lrs:
                state = state._replace(server_lr_scale=np.float32(sim.config.server_lr))
            # (a fused round donates the state it is given: the replica's own is replaced before anything reads it)
            new, metrics = self.round(state, with_lr(last[i].cohort, sim.config.client_lr), last[i].key)
            sim.state = new._replace(server_lr_scale=None)  # what a separate run's holds
            out[i] = (jax.device_get(metrics), time.perf_counter() - start)
        return out
