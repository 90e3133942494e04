"""A round on the simulated clock: who is available at its start, each sampled client's predicted time, the
deadline's decisions applied to the cohort, and the record's six fields (docs/deadlines.md).

:class:`~fedpartial._src.experiment.simulation.Simulation` calls :class:`RoundClock`: :meth:`~RoundClock.join`
before the draw, :meth:`~RoundClock.cut` on the packed cohort before the round, :meth:`~RoundClock.finish` on
the round's simulated time.  The decisions are values in the cohort the jitted round already takes — its
``valid`` mask and its data's ``step_mask`` — so the round compiles once per run.

**Prediction** (before training, from the round's own plan: :meth:`FederatedRound.preview`, jitted once):
each client downloads what its plan sends (the ``download`` mask's bytes, or the plan's own payload, plus its
extra bytes), trains its real local steps at the FLOPs of one step of its sub-model (:class:`CostModel`, kept
units from the plan's dropout mask) and uploads at most what it received and may train (``download ∧ train``;
the payload when it has its own).  The upload is an **upper bound**: a method that decides what to send after
training (FedLDF's top-n layers, FedADP's largest updates) sends less, and its extra upload bytes (feedback,
indices) are not known before — so such a client is predicted a little slower than it is.  For FedAvg-like
methods the prediction is the device model's time exactly (tested).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.costs import devices
from fedpartial._src.engine import metrics as engine_metrics
from fedpartial._src.engine import types as engine_types
from fedpartial._src.experiment import deadlines
from fedpartial._src.experiment.availability import Availability
from fedpartial._src.experiment.config import ConfigError, RunConfig

#: the record's fields (their names are an interface: docs/deadlines.md)
FIELDS = ("clients_sampled", "clients_finished", "clients_dropped", "wasted_flops", "wasted_bytes",
          "simulated_clock_s")


class Timing(NamedTuple):
    """What :meth:`RoundClock.join` and :meth:`RoundClock.cut` decided for one round."""

    wait_s: float = 0.0  # simulated seconds the server waited for anyone to be available
    outcome: deadlines.Outcome | None = None  # None: no deadline and no over-selection
    deadline_s: float = math.inf


def planned_traffic(round, state, cohort, key):
    """``[K, L]`` bytes each client downloads and at most uploads (:mod:`fedpartial._src.engine.metrics`'
    counts of the plan's masks), ``[K]`` its extra download bytes, the plan's dropout mask (None: none) and the
    ``[K, L]`` share of each layer its element train mask trains (None: no element level; ``--sparse-flops``)."""
    structure, communicated = round.model.structure, round.communicated
    plan = round.preview(state, cohort, key).plan
    k = cohort.info.valid.shape[0]
    received, down = engine_metrics.planned_download(structure, plan, state.variables, communicated, k)
    trained = received
    if plan.train is not None and jax.tree.structure(plan.train) == jax.tree.structure(received):
        trained = masks.intersect(plan.train, received)
    up = masks.count_bytes_per_layer(structure, trained, state.variables, communicated)
    if plan.download_bytes_per_layer is not None:  # a payload of its own: no more than it came in
        up = jnp.minimum(up, down)
    extra = jnp.zeros(k, jnp.int32) if plan.extra_download_bytes is None else plan.extra_download_bytes
    dropout = None if plan.dropout is None else plan.dropout._replace(inputs=None)
    densities = None if plan.train is None or plan.train.elements is None else \
        masks.layer_densities(structure, plan.train, state.variables["params"])
    return down, extra.astype(jnp.int32), up, dropout, densities


def truncated(cohort: engine_types.Cohort, kept: np.ndarray, steps: np.ndarray) -> engine_types.Cohort:
    """The cohort with only ``kept`` clients valid (their held-out examples too) and client ``k``'s data cut to
    its first ``steps[k]`` steps (``step_mask``; the round leaves the state unchanged on a masked step)."""
    data, holdout = cohort.data, cohort.holdout
    on_device = isinstance(data.step_mask, jax.Array)
    xp = jnp if on_device else np
    fits = xp.arange(data.step_mask.shape[1])[None, :] < xp.asarray(steps)[:, None]
    data = data._replace(step_mask=xp.logical_and(data.step_mask, fits))
    if holdout is not None:
        hxp = jnp if isinstance(holdout.example_mask, jax.Array) else np
        holdout = holdout._replace(example_mask=hxp.logical_and(holdout.example_mask, hxp.asarray(kept)[:, None]))
    info = cohort.info._replace(valid=np.asarray(kept, bool))
    return cohort._replace(data=data, info=info, holdout=holdout)


class RoundClock:
    """A run's availability model, deadline and over-selection, around its round (``round``), FLOP counts
    (``costs``) and devices (``profiles``)."""

    def __init__(self, config: RunConfig, round, costs: devices.CostModel, profiles: devices.DeviceProfiles):
        self.availability = Availability(config.availability, config.num_clients, config.seed)
        self.on = config.deadlines
        self.deadline_s = math.inf if config.round_deadline is None else float(config.round_deadline)
        self.quantile = config.deadline_quantile
        self.policy = config.straggler_policy
        self.keep = config.cohort_size if config.over_select > 1 else None
        self.round, self.costs, self.profiles = round, costs, profiles
        self.sparse_flops = config.sparse_flops  # predicted as the device model counts the round
        if self.on and round.strategy.kind == "stream":
            raise ConfigError(f"a deadline or over-selection cannot run with the streamed strategy "
                              f"({round.strategy}) that this round needs to fit in memory: each client's time is "
                              "predicted from the whole cohort's data; use a smaller cohort or model.")
        # (built always, compiled when first called: by a deadline's cut or an asynchronous run's dispatch)
        self._traffic = jax.jit(lambda state, cohort, key: planned_traffic(round, state, cohort, key))

    def join(self, t: int, active: np.ndarray, progress: dict) -> tuple[np.ndarray, float] | None:
        """Who of ``active`` may be sampled in round ``t`` at the clock ``progress["simulated_clock_s"]``, and the
        seconds the server waited for anyone; None when a trace has nobody left (the run ends)."""
        if self.availability.always:
            return active, 0.0
        return self.availability.wait(progress["simulated_clock_s"], t, active)

    def predict(self, state, cohort: engine_types.Cohort, key: jax.Array) -> deadlines.ClientTimes:
        """Every cohort client's predicted download, step and upload times (docstring of this module)."""
        down, extra, up, dropout, densities = jax.device_get(self._traffic(state, cohort, key))
        down = np.asarray(down, np.int64).sum(-1) + np.asarray(extra, np.int64)
        up = np.asarray(up, np.int64).sum(-1)
        steps = np.asarray(jax.device_get(cohort.data.step_mask)).sum(axis=1)
        k = len(steps)
        spec = engine_types.data_spec(cohort)
        step_flops = self.costs.client_flops(spec, np.ones(k), dropout, densities if self.sparse_flops else None)
        p, ids = self.profiles, np.asarray(cohort.info.client_ids) % self.profiles.num_clients
        return deadlines.ClientTimes(down / p.download_bytes_per_s[ids], step_flops / p.compute_flops_per_s[ids],
                                     up / p.upload_bytes_per_s[ids], steps, down, up, step_flops)

    def cut(self, state, cohort: engine_types.Cohort, key: jax.Array, wait_s: float
            ) -> tuple[engine_types.Cohort, Timing]:
        """The cohort as the deadline and over-selection leave it (:func:`deadlines.decide` on the predicted
        times; unchanged when neither is set), and the round's :class:`Timing`."""
        if not self.on:
            return cohort, Timing(wait_s)
        times = self.predict(state, cohort, key)
        valid = np.asarray(cohort.info.valid, bool)
        deadline = self.deadline_s if self.quantile is None else deadlines.quantile_deadline(times, valid,
                                                                                            self.quantile)
        outcome = deadlines.decide(times, valid, deadline=deadline, policy=self.policy, keep=self.keep)
        return truncated(cohort, outcome.kept, outcome.steps), Timing(wait_s, outcome, deadline)

    @staticmethod
    def finish(timing: Timing, progress: dict, valid: np.ndarray, simulated: float) -> tuple[float, dict]:
        """The round's simulated time (when it was cut, else ``simulated``: its slowest client's) and the record's
        :data:`FIELDS`; advances ``progress["simulated_clock_s"]`` by the wait and the round."""
        outcome = timing.outcome
        if outcome is not None and outcome.end_s is not None:
            simulated = outcome.end_s
        progress["simulated_clock_s"] += timing.wait_s + simulated
        sampled = int(np.sum(valid)) if outcome is None else outcome.sampled
        finished = sampled if outcome is None else outcome.finished
        wasted = (0.0, 0.0) if outcome is None else (outcome.wasted_flops, outcome.wasted_bytes)
        return simulated, {"clients_sampled": sampled, "clients_finished": finished,
                           "clients_dropped": sampled - finished, "wasted_flops": round(wasted[0]),
                           "wasted_bytes": round(wasted[1]), "simulated_clock_s": progress["simulated_clock_s"]}


class PreparedRound(NamedTuple):
    """One round's host inputs (:meth:`Simulation.prepare_round`): who takes part and their data."""

    round: int  # t, counted from 0
    ids: np.ndarray  # [K] client ids
    valid: np.ndarray  # [K] which are real
    key: jax.Array  # the round key
    cohort: engine_types.Cohort
    start: float  # time.perf_counter() when preparation began
    host_time: float  # seconds of sampling and packing (device placement: the gather's dispatch)
    draw: tuple[int, int] | None = None  # (N, K) of the draw, for a DP run's accountant (privacy.draw_share)
    timing: Timing | None = None  # the wait for availability and the deadline's decisions
