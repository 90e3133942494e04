"""Buffered asynchronous runs on the simulated clock (``--mode async``; docs/async.md): the host loop.

:class:`AsyncSimulation` holds a :class:`~fedpartial._src.experiment.simulation.Simulation` whose round has the
buffer ``M`` as its cohort (its data, model, method, clock and evaluation), and adds the pool of in-flight updates;
its :meth:`~AsyncSimulation.rounds` yields one record per *server step*.  The pure pieces (dispatch, the pool, the
server step) are :mod:`fedpartial._src.engine.asynchronous`'s.

**The loop.**  ``C`` slots (``--concurrency``).  While a slot is free, ``M`` clients are drawn (the synchronous
draw of "round" ``d``, ``d`` counting dispatches, from the clients that are active, available at the clock and
not in flight; a slot beyond the free ones or the clients that may be drawn is a padding row), trained on the
current model and put in the pool, each arriving at the clock plus its predicted device time (the device model's
download, local steps and upload: :meth:`~fedpartial._src.experiment.timing.RoundClock.predict`, the deadline
predictor, which for FedAvg-like methods is the device model's time exactly and for a method that decides its
upload after training an upper bound).  A server step takes the next ``M`` arrivals (fewer when fewer are in
flight), moves the clock to the last of them, aggregates them with their staleness ``τ`` (server steps since
each was dispatched), and the free slots are dispatched again on the new model.  When nobody is in flight and
nobody may be drawn, the server waits for availability as a synchronous round does; when nobody is left (a
trace that ended) the run ends.

**Keys.**  Dispatch ``d`` uses the synchronous round ``d``'s draw, key and packing seed, and server step ``t``
the round ``t`` key for its hooks after training, so with ``M = C = K`` (dispatch ``t`` is aggregated by server
step ``t``) the run is the synchronous run, bit for bit (tested).  Everything else is a function of the seed and
these counters, so a checkpoint holds the server state, the pool's rows (trained and start models, plans,
losses, steps, ids, sizes) and, in its host item, each slot's arrival time, dispatch version and dispatch
number (which names its keys): a resumed run is the uninterrupted one, bit for bit (tested).

**Not here** (refused by :meth:`RunConfig.validate <fedpartial._src.experiment.config.RunConfig.validate>`):
deadlines and over-selection (a synchronous round's; an update's staleness is the asynchronous answer to a
straggler), early stopping, upload codecs, the streamed strategy, several devices and per-client state off the
device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import memory
from fedpartial._src.engine import asynchronous as engine_async
from fedpartial._src.experiment import population, round_record, simulated_time
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.config_checks import validate_once, with_validation
from fedpartial._src.experiment.disk import human_bytes
from fedpartial._src.experiment.simulation import Simulation

#: the host item's per-slot lists (``progress``): arrival time (None: empty), dispatch version, client, dispatch
SLOT_FIELDS = ("slot_arrival_s", "slot_version", "slot_client", "slot_dispatch")


class HostPool:
    """The pool of in-flight updates kept in host memory (numpy), for a pool that does not fit beside the round on
    the device: rows are copied in when dispatched and out when a server step takes them, with the values the
    device pool holds (the same writes and reads), so the run is the same bit for bit."""

    def __init__(self, like):
        self.rows = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), like)

    def put(self, rows, slots: np.ndarray) -> None:
        keep = slots < len(self.rows.valid)  # a slot >= C drops its row (padding)
        rows = jax.device_get(rows)
        for mine, theirs in zip(jax.tree.leaves(self.rows), jax.tree.leaves(rows)):
            mine[slots[keep]] = np.asarray(theirs)[keep].astype(mine.dtype)

    def take(self, slots: np.ndarray):
        return jax.device_put(jax.tree.map(lambda a: a[slots], self.rows))


def pool_place(pool_bytes: int, estimate_total: int, available: int | None, where: str) -> str:
    """``device``, or ``host`` when the pool does not fit beside the round on an accelerator but fits in RAM (on a
    CPU the host is the device: nothing to move to)."""
    if available is None or estimate_total <= memory.HEADROOM * available or where == "RAM":
        return "device"
    host, _ = memory.available_bytes(jax.devices("cpu")[0])
    return "host" if host is not None and pool_bytes <= memory.HEADROOM * host else "device"


class AsyncSimulation:
    """A buffered asynchronous run of ``config`` (``mode='async'``, docs/async.md): C clients in flight, the
    server stepping on every M arrivals, on the simulated clock.

    It holds ``simulation``, the :class:`~fedpartial.Simulation` of the buffer (``M`` clients a round), and
    reads through to it what it does not hold itself (the data, model, method, state, clock, evaluation).

    Args:
      config: the run's settings (:class:`~fedpartial.RunConfig` with ``mode="async"``).
      dataset: an :class:`~fedpartial.data.ArrayDataset` instead of ``config.dataset``, or None.
      **parts: as :class:`~fedpartial.Simulation`'s (``method``, ``model``, the optimizers, ``check_memory``,
        ``data_placement``).

    Raises:
      UserError: a setting that cannot run asynchronously, in one sentence naming it.
    """

    def __init__(self, config: RunConfig, dataset=None, **parts):
        if config.mode != "async":
            raise ConfigError(f"an asynchronous simulation needs --mode async, not {config.mode!r}.")
        method = parts.get("method")
        if method is not None:  # named after the caller's method, as the Simulation names it
            config = dataclasses.replace(config, method=method.name, options={})
        validate_once(config, custom_method=method is not None)  # before the buffer replaces the cohort
        # M ≤ C ≤ N was judged just now, and a cohort of M with per-client state on the device is what async allows:
        # the buffer's configuration is valid as it is
        buffered = with_validation(dataclasses.replace(config, cohort_size=config.async_buffer,
                                                       buffer=config.async_buffer, client_state="device"), config)
        #: the simulation of the buffer: its round is built for M clients; per-client state stays on the device
        self.simulation = Simulation(buffered, dataset, **parts)
        self._check_pool_fits(parts.get("check_memory", True))
        sim, cfg = self.simulation, self.simulation.config
        #: the asynchronous round: dispatch, arrival and the server step on every M arrivals
        self.engine = engine_async.AsyncRound(sim.round, cfg.async_concurrency,
                                              engine_async.parse_staleness(cfg.staleness))
        c = cfg.async_concurrency
        sim.progress.update({"dispatches": 0, "cumulative_client_flops": 0.0, "slot_arrival_s": [None] * c,
                             "slot_version": [0] * c, "slot_client": [-1] * c, "slot_dispatch": [-1] * c})
        ids, valid, key, pack_seed = sim.sample_cohort(0)
        self._shapes = sim.cohort(ids, pack_seed, valid)  # any cohort of the run's shapes (FLOP counts)
        if self.pool_place == "device":
            #: the C clients in flight: their models, start versions and simulated arrival times
            self.pool = self.engine.empty_pool(sim.state, self._shapes, key)
        else:  # shaped on the host: the device never holds the whole pool
            self._host_pool = HostPool(jax.eval_shape(self.engine.empty_pool, sim.state, self._shapes, key))

    def __getattr__(self, name: str):
        if name == "simulation":  # not set yet (an error in __init__): no recursion
            raise AttributeError(name)
        return getattr(self.simulation, name)

    # what a caller (or a checkpoint) sets is the simulation's
    config = property(lambda self: self.simulation.config, lambda self, v: setattr(self.simulation, "config", v))
    state = property(lambda self: self.simulation.state, lambda self, v: setattr(self.simulation, "state", v))
    progress = property(lambda self: self.simulation.progress,
                        lambda self, v: setattr(self.simulation, "progress", v))

    # ---- memory: the pool beside the round ----------------------------------------------------

    def _check_pool_fits(self, check_memory: bool) -> None:
        """Adds the pool of C in-flight updates to the round's estimate: on the device when it fits there, else in
        host memory (:class:`HostPool`, :attr:`pool_place`); refuses a run that fits neither way."""
        sim = self.simulation
        variables = jax.eval_shape(sim.round.pure_init, jax.random.key(0)).variables
        #: bytes of the pool of C in-flight updates (in :attr:`memory`'s ``server`` when it is on the device)
        self.pool_bytes = engine_async.pool_bytes(variables, sim.config.async_concurrency)
        available, where = memory.available_bytes()
        with_pool = sim.memory._replace(server=sim.memory.server + self.pool_bytes)
        #: ``device`` or ``host``: where the pool lives (:func:`pool_place`)
        self.pool_place = pool_place(self.pool_bytes, with_pool.total, available, where) if check_memory \
            else "device"
        self._host_pool = None
        if self.pool_place == "host":  # said where the run's layout is said (summary.json's strategy_note)
            why = (f"the pool of in-flight updates ({human_bytes(self.pool_bytes)}) is kept in host memory: with the "
                   f"round it needs about {human_bytes(with_pool.total)}"
                   + ("" if available is None else f" but {human_bytes(available)} of {where} is available"))
            sim.strategy_note = "; ".join(n for n in (sim.strategy_note, why) if n)
            return
        sim.memory = with_pool
        if check_memory and available is not None and sim.memory.total > memory.HEADROOM * available:
            raise ConfigError(
                f"--concurrency {sim.config.async_concurrency} keeps {human_bytes(self.pool_bytes)} of "
                f"in-flight updates, and with the round the run needs about {human_bytes(sim.memory.total)}"
                f", more than the {human_bytes(available)} available ({where}); lower --concurrency.")

    # ---- checkpoints: the pool with the state ---------------------------------------------------

    @property
    def pool(self):
        """The pool of in-flight updates (host arrays when :attr:`pool_place` is ``host``)."""
        return self._pool if self._host_pool is None else self._host_pool.rows

    @pool.setter
    def pool(self, value) -> None:
        if self._host_pool is None:
            self._pool = jax.device_put(value)
        else:
            self._host_pool.rows = jax.tree.map(np.array, jax.device_get(value))

    def checkpoint_state(self):
        return (self.simulation.checkpoint_state(), self.pool)

    def load_state(self, state) -> None:
        server, pool = state
        self.simulation.load_state(server)
        self.pool = pool

    def _put(self, rows, slots: np.ndarray) -> None:
        if self._host_pool is None:
            self._pool = self.engine.put(self._pool, rows, slots)
        else:
            self._host_pool.put(rows, slots)

    def _take(self, slots: np.ndarray):
        return self.engine.take(self._pool, slots) if self._host_pool is None else self._host_pool.take(slots)

    # ---- the host's view of the slots (in ``progress``, so a checkpoint has them) --------------------

    def _slots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[C]`` arrival times (inf: empty), dispatch versions and whether each slot is in flight."""
        arrival = np.array([math.inf if a is None else a for a in self.progress["slot_arrival_s"]], np.float64)
        return arrival, np.asarray(self.progress["slot_version"], np.int64), np.isfinite(arrival)

    def in_flight(self) -> int:
        return int(self._slots()[2].sum())

    # ---- the loop -------------------------------------------------------------------------------

    def rounds(self) -> Iterator[dict]:
        """Runs the configured server steps (``--rounds``), yielding one record per server step."""
        if self.progress["dispatches"] == 0:
            self._fill()
        for t in range(self.progress["round"], self.config.rounds):
            record = self._server_step(t)
            if record is None:
                return  # nobody in flight and nobody left to dispatch
            yield record

    def _fill(self) -> None:
        """Dispatches ``M`` clients at a time onto the free slots while anyone may be drawn."""
        p = self.progress
        while True:
            _, _, busy = self._slots()
            free = np.flatnonzero(~busy)
            if free.size == 0:
                return
            idle = self.active_clients().copy()
            taken = np.asarray(p["slot_client"])[busy]
            idle[taken] = False
            d = p["dispatches"]
            may = self.clock.availability.available(p["simulated_clock_s"], d) & idle
            if not may.any():
                if busy.any():
                    return  # the next arrivals move the clock on
                waited = self.clock.availability.wait(p["simulated_clock_s"], d, idle) if idle.any() else None
                if waited is None:
                    return
                may, wait = waited
                p["simulated_clock_s"] += wait
            if not self._dispatch(d, may, free):
                return  # nobody drawn (every slot of the draw a padding row): try again after the next step

    def _dispatch(self, d: int, may: np.ndarray, free: np.ndarray) -> int:
        """Dispatch ``d``: ``M`` clients drawn from ``may`` trained on the current model, their rows put on ``free``
        slots (rows beyond the free slots are padding)."""
        p = self.progress
        ids, valid, key, pack_seed = self.sample_cohort(d, may)
        valid = valid & (np.cumsum(valid) <= free.size)
        cohort = self.cohort(ids, pack_seed, valid)
        seconds = self.clock.predict(self.state, cohort, key).finish()
        rows = self.engine.dispatch(self.state, cohort, key)
        real = np.flatnonzero(valid)
        slots = np.full(len(ids), self.engine.concurrency, np.int64)  # out of range: dropped
        slots[real] = free[:real.size]
        self._put(rows, slots)
        for row in real:
            s = int(slots[row])
            p["slot_arrival_s"][s] = p["simulated_clock_s"] + float(seconds[row])
            p["slot_version"][s], p["slot_client"][s], p["slot_dispatch"][s] = p["round"], int(ids[row]), d
        p["dispatches"] = d + 1
        return real.size

    def _server_step(self, t: int) -> dict | None:
        """Server step ``t`` on the next ``M`` arrivals, then dispatches on the new model; its record."""
        start = time.perf_counter()
        p, m = self.progress, self.round.ctx.cohort_size
        arrival, version, busy = self._slots()
        # aggregated in the pool's order, not the arrivals' (with M = C = K: the cohort's, so the float sums are the
        # synchronous round's whatever the devices' speeds)
        arrived = np.sort(engine_async.next_arrivals(arrival, busy, m))
        if arrived.size == 0:
            return None
        p["simulated_clock_s"] = max(p["simulated_clock_s"], float(arrival[arrived].max()))
        slots = np.concatenate([arrived, np.repeat(arrived[:1], m - arrived.size)])
        rows = self._take(slots)
        rows = rows._replace(valid=rows.valid & jnp.asarray(np.arange(m) < arrived.size))
        tau = np.where(np.arange(m) < arrived.size, p["round"] - version[slots], 0)
        key = population.round_keys(self.rounds_key, t)[1]  # the synchronous round t's key
        self.state, metrics = self.engine.server_step(self.state, rows, tau, key)
        ids = np.asarray(p["slot_client"])[slots]
        for s in arrived:
            p["slot_arrival_s"][s], p["slot_client"][s] = None, -1
        record, evaluation_s = self._record(t, metrics, ids, tau[:arrived.size])
        self._fill()  # the next dispatch's training is this step's work too
        record["clients_in_flight"] = self.in_flight()
        record["wall_time_s"] = time.perf_counter() - start
        record["round_time_s"] = record["wall_time_s"] - evaluation_s
        return record

    def _record(self, t: int, metrics: dict, ids: np.ndarray, tau: np.ndarray) -> dict:
        """Server step ``t``'s record (the synchronous round's fields where they mean the same)."""
        sim, cfg, p = self.simulation, self.config, self.progress
        metrics = round_record.checked(metrics, lambda _: f"server step {t + 1}: the update was non-finite (NaN/inf) "
                                                          "— lower --lr or --server-lr, or check the data")
        valid = np.arange(len(metrics["client_steps_per_client"])) < len(tau)
        flops, _ = simulated_time.client_work(self.costs, self.devices, self._shapes, ids, valid, metrics,
                                              sparse_flops=cfg.sparse_flops)
        p["cumulative_client_flops"] += float(np.sum(flops[valid]))
        p["round"] = t + 1
        p["cumulative_simulated_time_s"] = p["simulated_clock_s"]
        record = round_record.record(sim, t, metrics, round_time_s=0.0, host_time_s=0.0, clients=len(tau),
                                     client_flops=np.sum(flops[valid]), simulated_time_s=0.0, inserted={
            "round": {"server_step": t + 1},
            "clients": {"clients_arrived": len(tau)},
            "client_flops": {"staleness_mean": float(np.mean(tau)) if len(tau) else 0.0,
                             "staleness_max": int(np.max(tau)) if len(tau) else 0,
                             "arrived_client_ids": [int(i) for i in ids[:len(tau)]],
                             "arrived_staleness": [int(x) for x in tau]},
            "simulated_time_s": {"cumulative_simulated_time_s": p["simulated_clock_s"],
                                 "simulated_clock_s": p["simulated_clock_s"]}})
        # --record-decisions: the arrived updates' plans and the step's selection
        round_record.method_values(sim, record, metrics, ids, skip=("staleness_weight",))
        round_record.privacy_spent(sim, record, (cfg.num_clients, len(tau)))  # a server step: a round of the buffer
        evaluated = time.perf_counter()
        round_record.evaluate_into(sim, record, t, t + 1 == cfg.rounds)
        return record, time.perf_counter() - evaluated
