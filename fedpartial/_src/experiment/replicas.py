"""Many seeds (and learning rates) in one run: independent replicas of one experiment as one simulation.

``fedpartial run --seeds 0,1,2,3`` builds one :class:`~fedpartial._src.experiment.simulation.Simulation` per seed
(``--lrs 0.01,0.1`` too: one per seed and client learning rate)
(host work stays per replica: data, partition, device profiles, sampling, packing) and runs their rounds in the
layout a single run of them takes: stacked, the server states on a leading replica axis and every round ONE
jitted function over the stacked states, cohorts and keys (``jax.vmap`` of the round over the replica axis on an
accelerator, a ``lax.scan`` on CPU: one replica after another inside the jit, each new state written over its
old one; :mod:`~fedpartial._src.experiment.replica_axis`), or, where the single run does not run the vmapped
fused round, one replica's round after another from the host, every replica calling the same compiled round
(:mod:`~fedpartial._src.experiment.replica_loop`).  Each replica's record is then
built by the same host code as a single run (:meth:`Simulation.finish_round`) and written by the same
writer (:class:`~fedpartial._src.experiment.run_directory.RunWriter`), so every seed gets an ordinary run directory.

Decisions:

* **Strategy and layout.**  ``--strategy auto`` follows the layout a single run decides: for a model under
  ``--conv-impl auto``, the lowering and cohort layout measured once for all replicas
  (:func:`~fedpartial._src.experiment.replica_axis.decided_layout`).  Where the single run's strategy is the
  vmapped fused round (``vmap``), the replicas are stacked and run it over the replica axis; where it is not
  (``loop``: ``stepwise:1``, a host loop of jitted client steps; ``map``: ``fused:1``), each replica runs that
  same strategy, the replicas one after another from the host (replica axis ``loop``,
  :func:`~fedpartial._src.experiment.replica_axis.runs_looped`): stacked onto a loop inside one program,
  XLA:CPU ran the 28x28 CNN's convolution gradients 19x slower than two separate runs
  (``benchmarks/results/replica-layout-cpu-2026-12-03.json``).  A named ``replica_axis`` (``vmap``, ``map``)
  keeps the replicas stacked, in the fused family (``loop`` and ``map`` then run ``fused:1``).  Nothing
  measured (a named lowering, ``FEDPARTIAL_CONV_IMPL``): the stacked fused round.  ``fused:N`` and
  ``fused-unrolled[:N]`` keep their meaning for the client axis inside each replica; a named ``stepwise`` or
  ``debug`` is refused.  Each replica equals a separate ``fedpartial run --seed S --strategy STRATEGY
  --conv-impl LOWERING`` of its seed, with the strategy and lowering its ``config.json`` names.
* **Learning rates.**  A replica's client learning rate is data, not a constant of the round: every
  replica's simulation is built with the client optimizer at rate 1 and its cohort carries its rate
  (``CohortInfo.lr_scale``), which multiplies each update.  ``sgd(1)`` then ``× lr`` is ``sgd(lr)``
  bit for bit (negation and the product are exact and commute), so seeds-only replicas are unchanged
  and each rate's replica equals its own separate run.  ``--server-lrs`` likewise: the server optimizer
  (sgd, adam, yogi, adagrad: each ends in its stateless ``× -lr``) is built at rate 1 and each replica's
  server state carries its rate (``ServerState.server_lr_scale``); the replicas' own states, written to
  their run folders, leave it out, so each folder is the state of a separate run at its rate and
  resumes on its own.  Every server rate runs with every client rate and seed.  Other settings stay
  one per run.  In the host loop the rates travel the same way: one compiled round serves every rate.
* **Shapes.**  Every replica's cohort is packed to the largest number of local steps over the
  replicas' populations (``num_steps``): padded steps are exact no-ops (``client.py`` keeps the
  state with ``where``; the packing draws do not depend on ``num_steps``).  Held-out splits are
  padded to the longest one (masked examples).  Server states whose shapes still differ across
  seeds are refused with one sentence.
* **Early stopping and divergence** are per replica: a replica whose clients have all stopped, or
  that diverged, is finished (its state frozen, its directory's status written) while the others go
  on; its row of the stacked round keeps running on its last cohort and is ignored.
* **Data on the device** (``data_placement="device"``) works as on the host: each replica's gather is
  padded to the common ``num_steps`` and its placed holdout to the longest one
  (:meth:`~fedpartial._src.experiment.simulation.Simulation.pad_shapes`), drawing the batches its own run draws.
  ``auto`` is decided once for all replicas, from their data together (a quarter of the free memory,
  as for one run), so every replica has the same placement (``data_placement`` in the summaries) and
  equals its separate run with that placement named.  (Decided one replica after another, a later one
  could find less room and draw other batches than its separate run.)
* **Memory.** The replica round holds every replica's state twice (stacked for the round, and each
  replica's own for evaluation, checkpoints and summaries) and its cohort, and the clients of the replicas
  that train together (all for ``vmap``, ``B`` for ``map:B``): :func:`memory.for_replicas`. When that
  exceeds what is available, data that ``auto`` would put on the device stays on the host first (the
  data is copied only once the checks pass); then ``replica_axis="auto"`` trains the most replicas at a
  time that fit (``map:B``), and a named axis, or replicas that do not fit even one at a time, are
  refused in one sentence with the estimate and what fits (:func:`~fedpartial._src.experiment.replica_axis.fit_replica_axis`). Why the layout
  changed: :attr:`Replicas.note`, ``layout_note`` in ``seeds_summary.json``.
* **Time.**  A replica's ``round_time_s`` is its own host work plus its share (1/active replicas)
  of the stacked replica round, or its own round in the host loop; ``rounds_per_s`` in each summary follows from
  that.
* **Output.**  ``<out>/<name or METHOD-DATASET-seedsA-B>/`` holds one run directory per seed
  (``METHOD-DATASET-seedS``, what ``fedpartial run --seed S`` writes; with ``--lrs``
  ``METHOD-DATASET-seedS-lrX`` in ``METHOD-DATASET-seedsA-B-lrsX_Y``) and ``seeds_summary.json`` /
  ``seeds_summary.md``: mean ± std (population std, as ``fedpartial compare``) of final and best
  accuracy, upload bytes, simulated time, rounds and rounds/s, from :mod:`fedpartial._src.analysis.compare`'s table;
  with ``--lrs`` one row per learning rate (``rows`` in the JSON).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import memory
from fedpartial._src.data import ondevice
from fedpartial._src.engine.runners.base import jit
from fedpartial._src.experiment import driver, jobs, population, replica_loop, signals
from fedpartial._src.experiment import replica_axis as replica_axis_lib
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.config_checks import with_validation
from fedpartial._src.experiment.parts import make_client_optimizer, make_server_optimizer
from fedpartial._src.experiment.replica_loop import with_lr
from fedpartial._src.experiment.replica_settings import (
    Setting,
    default_name,
    parse_lrs,
    replica_configs,
    replica_run_name,
    replica_settings,
)
from fedpartial._src.experiment.run_directory import RunWriter, unique_run_dir
from fedpartial._src.experiment.simulation import Simulation

# (the settings' names are read from here too: the command line and the tests take them with the runner)
__all__ = ["Replicas", "Setting", "default_name", "parse_lrs", "replica_configs", "replica_run_name",
           "replica_settings", "run_seeds", "stack", "with_lr"]


def _shapes(tree) -> list:
    return [(tuple(np.shape(a)), np.dtype(a.dtype).name) for a in jax.tree.leaves(tree)]


def stack(trees: Sequence) -> object:
    """The trees stacked leaf by leaf on a new leading replica axis."""
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


class Replicas:
    """One :class:`Simulation` per replica (seed, or seed and learning rates), advanced together by one
    jitted round over the replica axis per round, or by a host loop over the replicas' rounds
    (:attr:`loop`, replica axis ``loop``).

    ``sims[i]`` is replica ``i``'s simulation (seed ``seeds[i]``, client rate ``sims[i].config.client_lr``,
    server rate ``sims[i].config.server_lr``); its ``state`` is kept up to date (its row of the stacked
    state, without the server rate) so evaluation, early stopping, checkpoints and summaries work as for one
    run.  Its ``round`` has the client optimizer at rate 1 (and, with ``server_lrs``, the server optimizer
    too: the replica round's); to train a replica on its own, build ``Simulation(sims[i].config)``.
    """

    def __init__(self, config: RunConfig, seeds: Sequence[int], *, out_dir: str | None = None,
                 dataset_for: Callable[[RunConfig], object] | None = None, replica_axis: str = "auto",
                 lrs: Sequence[float] | None = None, server_lrs: Sequence[float] | None = None):
        configs = replica_configs(config, seeds, out_dir, lrs, server_lrs)
        # decided before anything is built: the layout a single run of the first replica would take
        first = dataset_for(configs[0]) if dataset_for else population.load_dataset(configs[0])
        # the options as given: --strategy auto.  With the replica axis left to auto, the replicas take the single
        # run's own strategy, and run in a host loop unless it is the vmapped fused round (replica_axis.runs_looped)
        decided = replica_axis_lib.decided_layout(config, first, stacked=replica_axis != "auto")
        looped = replica_axis == "auto" and replica_axis_lib.runs_looped(decided)
        if decided is not None:
            # what a single run of the replica decides: valid wherever the replica's configuration is
            configs = [with_validation(dataclasses.replace(c, strategy=decided[0], conv_impl=decided[1]), c)
                       for c in configs]
        datasets = [first] + [dataset_for(c) if dataset_for else None for c in configs[1:]]
        self.seeds = [c.seed for c in configs]
        # rate 1 in the optimizers, each replica's rates in its cohorts (with_lr) and server state: one round
        # for all rates.  --data-placement auto is decided once for all replicas, from their data together
        # (below), so that every replica draws its batches the same way
        auto_data = config.data_placement == "auto"
        self.sims = [Simulation(c, data,
                                client_optimizer=make_client_optimizer(dataclasses.replace(c, client_lr=1.0)),
                                server_optimizer=None if server_lrs is None else
                                make_server_optimizer(dataclasses.replace(c, server_lr=1.0)),
                                data_placement="host" if auto_data else None)
                     for c, data in zip(configs, datasets)]
        for sim, c in zip(self.sims, configs):  # fine-tuning (FedBABU's evaluation) trains at the replica's own rate
            sim.finetune_optimizer = make_client_optimizer(c)
        self._server_lrs = server_lrs is not None
        num_steps = max(sim.num_steps for sim in self.sims)
        holdouts = [sim.holdout for sim in self.sims if sim.holdout is not None]
        longest = max((h[0].shape[1] for h in holdouts), default=0)
        for sim in self.sims:
            # padded steps and examples are no-ops: the same training, one shape for all (the device
            # gather's bounds and the placed holdout follow, so data_placement="device" works too)
            sim.pad_shapes(num_steps, longest or None)
        platform = replica_axis_lib.platform()
        count, notes = len(self.sims), []
        together = sum(sim.data_bytes for sim in self.sims)
        available, where = memory.available_bytes()  # one reading for the placement and the axis below
        place = auto_data and ondevice.resolve_placement("auto", together, available, platform) == "device"
        #: ``(kind, batch)`` how the replica axis runs (:func:`~fedpartial._src.experiment.replica_axis.parse_replica_axis`, then what fits in memory)
        self.replica_axis = replica_axis_lib.LOOP if looped else replica_axis_lib.parse_replica_axis(replica_axis,
                                                                                                    platform)
        est = max((sim.memory for sim in self.sims), key=lambda e: e.total)
        if place and available is not None:  # the checks count the data as on the device; it is copied after
            need = memory.for_replicas(est, count, replica_axis_lib.at_once(self.replica_axis, count))
            if memory.fits(need, available - together):
                available -= together
            else:  # the data gives way first (as for one run: Simulation's own check), then the parallelism
                place = False
                notes.append(memory.data_stays_on_host(f"the {count} replicas'", together, "they", need.total,
                                                       available - together, where))
        self.replica_axis, fitted = replica_axis_lib.fit_replica_axis(est, count, self.replica_axis, available, where,
                                                     auto=replica_axis == "auto")
        #: why the replicas' layout (data placement, replica axis) is not what the options resolve to alone
        self.note = "; ".join(notes + ([fitted] if fitted else [])) or None
        for sim in self.sims if place else []:
            sim.place_data_on_device()
        first = self.sims[0]
        for seed, sim in zip(self.seeds[1:], self.sims[1:]):
            if jax.tree.structure(sim.state) != jax.tree.structure(first.state) or \
                    _shapes(sim.state) != _shapes(first.state):
                raise ConfigError(f"--seeds: seed {seed}'s server state differs in shape from seed {self.seeds[0]}'s "
                                  f"(e.g. a data-dependent model or method state), so they cannot run as one "
                                  f"simulation; run the seeds separately (fedpartial compare).")
        for sim in self.sims[1:]:  # the same model, method and shapes: the device model's counts are shared
            sim.costs.share_counts(first.costs)
        self.round = first.round  # its trace_count counts the replica round's traces
        #: the host loop over the replicas' rounds (replica axis ``loop``), else None: the stacked round below
        self.loop = replica_loop.ReplicaLoop(self.sims, self._server_lrs) if looped else None
        #: the replicas' states stacked on the replica axis (None in the host loop: each replica holds its own)
        self.state = None
        if looped:
            return
        round_fn = first.round.functions.round
        impl = jax.random.key_impl(first.rounds_key)

        def one(state, cohort, key_data):
            return round_fn(state, cohort, jax.random.wrap_key_data(key_data, impl=impl))

        self._round = jit(replica_axis_lib.over_replicas(one, *self.replica_axis), donate_argnums=(0,))
        # one replica's row, taken as its old state is let go: with every row taken at once, the old states,
        # the new rows and the stacked state were held together (FedSPU, 4 replicas, vmap: 11.8 GiB, 9.0 row by row)
        self._row = jax.jit(lambda s, i: jax.tree.map(lambda a: a[i], s))
        self.state = stack([sim.state._replace(server_lr_scale=np.float32(sim.config.server_lr))
                            if self._server_lrs else sim.state for sim in self.sims])

    def run_round(self, t: int, active: list[bool], last: list) -> list:
        """Round ``t`` of every active replica: host preparation, one replica round, then each active
        replica's record (a :class:`~fedpartial._src.core.errors.DivergedError` object where it diverged, None
        where it has stopped).  ``last`` holds each replica's latest prepared round (the stand-in cohort
        of a finished replica's row); both lists are updated in place."""
        host = [0.0] * len(self.sims)
        for i, sim in enumerate(self.sims):
            if active[i]:
                start = time.perf_counter()
                prepared = sim.prepare_round(t)
                host[i] = time.perf_counter() - start
                if prepared is None:  # early stopping stopped every client of this replica
                    active[i] = False
                else:
                    last[i] = prepared
        if not any(active):
            return [None] * len(self.sims)
        rounds = self.loop.run(last, active) if self.loop is not None else self._stacked_round(last, active)
        records = []
        for i, sim in enumerate(self.sims):
            if not active[i]:
                records.append(None)
                continue
            metrics, seconds = rounds[i]
            try:
                records.append(sim.finish_round(last[i], metrics, round_time=host[i] + seconds))
            except Exception as e:  # DivergedError (or a host error): this replica ends, the others go on
                active[i] = False
                records.append(e)
        return records

    def _stacked_round(self, last: list, active: list[bool]) -> list:
        """The stacked replica round: each active replica's ``(metrics, its share of the round's seconds)``, None
        for the others; each active replica's ``state`` is its row of the new stacked state."""
        start = time.perf_counter()
        # (cohorts gathered on the device are stacked there; packed ones on the host)
        cohorts = jax.tree.map(lambda *a: (jnp.stack if isinstance(a[0], jax.Array) else np.stack)(a),
                               *[with_lr(p.cohort, sim.config.client_lr) for p, sim in zip(last, self.sims)])
        keys = np.stack([jax.random.key_data(p.key) for p in last])
        self.state, metrics = self._round(self.state, cohorts, keys)
        metrics = jax.device_get(metrics)
        share = (time.perf_counter() - start) / sum(active)
        rounds: list = [None] * len(self.sims)
        for i, sim in enumerate(self.sims):
            if active[i]:
                sim.state = None  # let go before its new row exists
                sim.state = self._row(self.state, i)._replace(server_lr_scale=None)  # what a separate run's holds
                rounds[i] = (jax.tree.map(lambda a: a[i], metrics), share)  # noqa: B023
        return rounds


def run_seeds(config: RunConfig, seeds: Sequence[int], *, on_round: Callable[[int, list], None] | None = None,
              stop: signals.StopFlag | None = None, checkpoint_every: int | None = None,
              dataset_for: Callable[[RunConfig], object] | None = None, replica_axis: str = "auto",
              lrs: Sequence[float] | None = None, server_lrs: Sequence[float] | None = None) -> dict:
    """Runs ``config`` once per seed (and, with ``lrs`` / ``server_lrs``, per client / server learning rate:
    every rate with every seed) as one simulation (one jitted round over the replicas, or a host loop over their
    rounds: :class:`Replicas`) and writes the run directories.

    Returns ``{"out_dir", "run_dirs", "results", "summary", "simulations", "replica_axis", "data_placement",
    "note"}``: the parent directory (None without ``config.out_dir``), and per replica (:func:`~fedpartial._src.experiment.replica_settings.replica_settings`
    order) its run directory, its :func:`~fedpartial._src.experiment.simulation.run`-style result (summary, ``run_dir`` and
    ``records``), the mean ± std summary (None without a directory), the seeds' :class:`Simulation` objects
    (their final states), and the layout: the replica axis that ran, where the data lived and why
    (:attr:`Replicas.note`, None when the options alone decided it).
    A replica that diverged or failed has status ``diverged``/``failed`` in its directory and ``error``
    in its result; the others complete.  ``checkpoint_every``: as :func:`~fedpartial._src.experiment.simulation.run`'s, per
    seed.  ``on_round(t, records)`` gets each round's records (None for a finished replica).  A stop signal
    ends every replica after the current round (status ``interrupted``).
    ``replica_axis``: how the replicas run inside the one jitted round (:func:`~fedpartial._src.experiment.replica_axis.parse_replica_axis`);
    ``auto`` runs them in a host loop (``loop`` in the result and the summary) where a single run's measured
    layout is not the vmapped fused round.
    """
    t0 = time.perf_counter()
    driver.check_checkpoint_every(checkpoint_every)
    replica_axis_lib.parse_replica_axis(replica_axis, "cpu")  # a bad value before a folder is made
    parent = None
    if config.out_dir:
        replica_configs(config, seeds, config.out_dir, lrs, server_lrs)  # every bad value before a folder is made
        parent = unique_run_dir(config.out_dir, config.run_name or default_name(config, seeds, lrs, server_lrs))
    replicas = Replicas(config, seeds, out_dir=parent, dataset_for=dataset_for, replica_axis=replica_axis,
                        lrs=lrs, server_lrs=server_lrs)
    writers = [RunWriter(sim, checkpoint_every=checkpoint_every) for sim in replicas.sims]
    if parent:  # what the job runs, so that an interrupted one can be continued (fedpartial run --resume PARENT)
        jobs.write_job(parent, "replicas", seeds=list(dict.fromkeys(replicas.seeds)), lrs=lrs, server_lrs=server_lrs,
                       run_dirs=[os.path.relpath(w.run_dir, parent) for w in writers],
                       replica_axis=replica_axis_lib.axis_name(replicas.replica_axis))
    count = len(writers)
    active, last = [True] * count, [None] * count

    def steps():  # each replica's record, the error that ended it, or None once it has stopped
        for t in range(config.rounds):
            yield replicas.run_round(t, active, last)

    def progress(records):
        if on_round:
            on_round(progress.t, [r if isinstance(r, dict) else None for r in records])
        progress.t += 1

    progress.t = 0
    results, flag = driver.drive(writers, steps(), stop=stop, on_step=progress, started=t0, each_alone=True)
    run_dirs = [w.run_dir for w in writers]
    summary = None
    if parent:
        summary = jobs.write_summary(parent, replicas.seeds, run_dirs, time.perf_counter() - t0,
                                [r["status"] for r in results],
                                replica_axis=replica_axis_lib.axis_name(replicas.replica_axis),
                                lrs=lrs, server_lrs=server_lrs, data_placement=replicas.sims[0].data_placement,
                                note=replicas.note)
    if flag.stopped:
        raise signals.RunInterrupted(flag.signum, f"stopped by signal after round "
                                        f"{max(s.progress['round'] for s in replicas.sims)}; the seeds' "
                                        f"checkpoints and summaries are kept in {parent}",
                                        {"out_dir": parent, "run_dirs": run_dirs, "results": results})
    return {"out_dir": parent, "run_dirs": run_dirs, "results": results, "summary": summary,
            "simulations": replicas.sims, "replica_axis": replica_axis_lib.axis_name(replicas.replica_axis),
            "data_placement": replicas.sims[0].data_placement, "note": replicas.note}

