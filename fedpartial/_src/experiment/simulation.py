"""Host driver: data, partition, cohort sampling and packing, logging — around the pure round.

Everything here is host work (numpy, files, progress); the round itself is
:class:`fedpartial._src.engine.round.FederatedRound`.  :func:`run` is what ``fedpartial run``
calls; notebooks can call it too, or drive :class:`Simulation` round by round.  The clients and their
cohorts are :mod:`~fedpartial._src.experiment.population`'s, where things live and whether they fit
:mod:`~fedpartial._src.experiment.layout`'s, the run directory :mod:`~fedpartial._src.experiment.run_directory`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
import optax

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import ClientOptimizer, Method
from fedpartial._src.costs import devices
from fedpartial._src.data import sources
from fedpartial._src.engine import sharding
from fedpartial._src.engine import strategy as engine_strategy
from fedpartial._src.engine import types as engine_types
from fedpartial._src.experiment import client_state as client_state_lib
from fedpartial._src.experiment import (
    compile_cache,
    driver,
    finetune,
    layout,
    parts,
    population,
    preflight,
    privacy,
    round_record,
    signals,
    simulated_time,
    timing,
)
from fedpartial._src.experiment import plan as plan_lib
from fedpartial._src.experiment.client_data import ClientData
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.evaluation import evaluate
from fedpartial._src.experiment.run_directory import RunWriter
from fedpartial._src.experiment.timing import PreparedRound
from fedpartial._src.models.adapter import Model


def _held(part: str, name: str, doc: str, settable: bool = False) -> property:
    """An attribute of the simulation that one of its parts holds (``settable``: written there too)."""
    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value):  # the parts are named tuples: replaced, not changed in place
        setattr(self, part, getattr(self, part)._replace(**{name: value}))
    return property(get, put if settable else None, doc=doc)


class Simulation:
    """A run's data, model and round, advanced one round at a time by :meth:`rounds`.

    ``method``, ``model`` and the optimizers default to what ``config`` names; your own (e.g. from
    :func:`fedpartial.make_method`) gets the same sampling, early stopping, personalised evaluation and logging.

    Args:
      config: the run's settings (:class:`~fedpartial.RunConfig`).
      dataset: an :class:`~fedpartial.data.ArrayDataset` instead of ``config.dataset``, or None.
      method: a :class:`~fedpartial.Method` instead of ``config.method``'s, or None.
      model: a :class:`~fedpartial.models.Model` instead of ``config.model``, or None.
      client_optimizer: :func:`~fedpartial.client_sgd` or any optax transformation instead of ``config``'s.
      server_optimizer: an optax optimizer instead of ``config.server_opt``'s, or None.
      check_memory: refuse, before building anything, a run whose estimated peak memory does not fit.
      data_placement: ``host`` or ``device`` instead of ``config.data_placement`` (None: the config's).

    Raises:
      UserError: a setting that cannot run, in one sentence naming it.

    Examples:
      >>> import fedpartial as fp
      >>> config = fp.RunConfig(dataset="digits", num_clients=6, cohort_size=3, rounds=2,
      ...                       local_steps=1, out_dir=None)
      >>> [r["round"] for r in fp.Simulation(config).rounds()]
      [1, 2]
    """

    dataset = _held("data", "dataset", "the training and test data")
    clients = _held("data", "clients", "every client's training example indices")
    holdout = _held("data", "holdout", "every client's held-out examples ``(x, y, mask)``, else None")
    sizes = _held("data", "sizes", "``[N]`` every client's training examples")
    label_counts = _held("data", "label_counts", "``[N, C]`` every client's training examples per class")
    server_data = _held("data", "server_data", "the examples the server holds, else None")
    num_steps = _held("data", "num_steps", "the local steps every cohort is packed to")
    train_fraction = _held("data", "train_fraction", "the share of each client's examples it trains on")
    holdout_note = _held("data", "holdout_note", "why each client holds data out when the run did not say, else None")
    data_bytes = _held("data", "data_bytes", "bytes the training data takes on the device")
    data_placement = _held("data", "placement", "``host`` or ``device``: where the training data lives")
    mesh = _held("layout", "mesh", "the client mesh the cohort is split over (None: one device)")
    conv_choice = _held("layout", "conv_choice", "how the model's convolutions are lowered, and why")
    client_state = _held("layout", "client_state", "where the method's per-client state lives: device, host or disk")
    memory = _held("layout", "memory", "the round's peak-memory estimate", settable=True)
    strategy_note = _held("layout", "note", "why the round's layout is not what --strategy and --data-placement "
                          "give by themselves (None: it is)", settable=True)
    costs = _held("clock", "costs", "the FLOPs of local work, counted on the plain model")
    devices = _held("clock", "profiles", "``[N]`` the simulated devices' compute speeds and bandwidths")

    def __init__(self, config: RunConfig, dataset: sources.ArrayDataset | None = None, *,
                 method: Method | None = None, model: Model | None = None,
                 client_optimizer: ClientOptimizer | optax.GradientTransformation | None = None,
                 server_optimizer: optax.GradientTransformation | None = None, check_memory: bool = True,
                 data_placement: str | None = None):
        # Cheap checks first: a bad setting is refused before data is loaded or anything is built.  ``plan``: what
        # the settings resolve to on this machine, its devices and the method (:func:`.plan.resolve`)
        self.config, self.plan = preflight.for_simulation(config, method, data_placement)
        compile_cache.enable(self.config.compile_cache)
        self.config, dataset = population.run_dataset(self.config, dataset, model)
        self.method, self.accountant, fraction, note = parts.run_method(self.config, self.plan.method)
        #: the clients' data and where it lives (on the device or the host)
        self.data = ClientData(self.config, dataset, self.method, fraction, note, data_placement)
        self.model, plain_model, conv_choice = parts.checked_model(self.config, dataset, self.method, model)
        mesh = layout.run_mesh(self.config, self.plan.num_devices)
        #: how the round runs (strategy, where data and per-client state live, the memory estimate), decided before
        #: the round was built
        self.layout, self.round, counted = layout.build_round(
            self.config, self.method, self.model, plain_model, conv_choice=conv_choice, mesh=mesh,
            strategy=self.plan.strategy(self.model, conv_choice.layout, split_over=1 if mesh is None else mesh.size),
            client_optimizer=client_optimizer or parts.make_client_optimizer(self.config),
            server_optimizer=server_optimizer or parts.make_server_optimizer(self.config),
            server_data=self.data.server_data, label_counts=self.data.label_counts,
            data_placement=self.data.placement, data_bytes=self.data.data_bytes, num_steps=self.data.num_steps,
            x_dtype=dataset.x_train.dtype, check_memory=check_memory)
        if self.plan.core_split is not None and not self.strategy_note:  # auto chose it: said, with its numbers
            self.strategy_note = self.plan.core_split.describe()
        if self.layout.data_placement == "host":
            self.data.keep_on_host()
        else:
            self.data.place_on_device()
        #: who is available and who reports in time, with the simulated devices and the FLOPs of their local work
        #: (counted on the plain model)
        self.clock = timing.RoundClock(self.config, self.round, devices.CostModel(counted),
                                       plan_lib.device_model(self.config))
        # the run's two keys: the initial state's, and the one every round's draws come from (:attr:`rounds_key`)
        init_key = jax.random.split(jax.random.key(self.config.seed))[0]
        times = self.full_model_times() if self.method.capabilities.needs_execution_times else None  # e.g. FedAD's
        #: the server state, and the per-client state kept off the device (``client_state`` host or disk) or None
        self.state, self.client_store = client_state_lib.initial_state(
            self.round, init_key, self.client_state, self.config.num_clients, execution_times=times)
        #: the last round's plan and selection (client ids and structured masks) when the run records decisions,
        #: else None
        self.last_decisions = None
        #: the optimizer per-client fine-tuning trains with; None: the round's client optimizer
        #: (replicas, whose round runs at rate 1 with each replica's rate in its cohort, set their own rate here)
        self.finetune_optimizer = None
        #: host-side totals :meth:`rounds` carries between rounds (rounds done, traffic, simulated time and the
        #: clock availability reads); with ``state`` everything a checkpoint restores
        self.progress = {"round": 0, "cumulative_upload_bytes": 0, "cumulative_download_bytes": 0,
                         "cumulative_simulated_time_s": 0.0, "simulated_clock_s": 0.0}
        #: whether a round of this run trained nothing (its warning is said once a run)
        self.trained_nothing_said = False

    @property
    def rounds_key(self) -> jax.Array:
        """The key every round's draws come from: the second of the run seed's two keys."""
        return jax.random.split(jax.random.key(self.config.seed))[1]

    @property
    def compile_cache_dir(self) -> str | None:
        """The persistent compilation cache's folder (None: off)."""
        return jax.config.jax_compilation_cache_dir or None

    def method_state(self):
        """The method's whole state, per-client rows included (numpy arrays when they are kept off the device)."""
        return client_state_lib.whole(self.state, self.client_store).method_state

    def checkpoint_state(self) -> engine_types.ServerState:
        """What a checkpoint saves: the server state with every client's rows."""
        return client_state_lib.whole(self.state, self.client_store)

    def load_state(self, state: engine_types.ServerState) -> None:
        """Sets the state from a restored checkpoint (host arrays): per-client rows into their store."""
        if self.client_store is not None:
            self.client_store.load(state.method_state.clients)
            state = engine_types.without_clients(state)
        # replicated on the devices the cohort is split over, as the round keeps it (with several processes the
        # arrays must be global: every process restored the same values from its own copy)
        self.state = jax.device_put(state, None if self.mesh is None else sharding.replicated(self.mesh))

    def run_round(self, prepared: PreparedRound):
        """Runs the prepared round on the state (per-client rows off the device travel in and back); returns
        its metrics."""
        state, metrics = self.round(client_state_lib.with_rows(self.state, self.client_store, prepared.ids),
                                    layout.placed(prepared.cohort, self.mesh, self.round.ctx.cohort_size), prepared.key)
        self.state = client_state_lib.rows_written(state, self.client_store, prepared.ids, prepared.valid)
        return metrics

    def streamed_option(self, clients_that_fit: int) -> engine_strategy.Strategy:
        """The streamed strategy for this platform and model with at most ``clients_that_fit`` in flight."""
        return layout.streamed_strategy(clients_that_fit, self.model)

    def place_data_on_device(self) -> None:
        """Copies the clients' training data to the device, once; later cohorts are gathered there."""
        self.data.place_on_device()

    def pad_shapes(self, num_steps: int, holdout_length: int | None = None) -> None:
        """Pads every later cohort to ``num_steps`` local steps and the holdout to ``holdout_length`` examples
        per client (the seeds of a many-seed run share one shape)."""
        self.data.pad(num_steps, holdout_length)
        self.memory = layout.estimate(self.round, self.client_state, num_steps=num_steps,  # padded steps are packed
                                      batch_size=self.config.batch_size, example_shape=self.model.input_shape,
                                      x_dtype=self.dataset.x_train.dtype)

    def full_model_times(self) -> np.ndarray:
        """``[N]`` each device's simulated time for one round of *full-model* local work on its own data
        (what FedAD's dropout targets start from)."""
        # same shapes as every round's (ids cycled: a cohort padded for several devices may exceed N)
        cohort = self.cohort(np.arange(self.round.ctx.cohort_size) % self.config.num_clients, 0)
        return simulated_time.full_model_times(self.round, self.costs, self.devices, cohort, self.sizes,
                                               batch_size=self.config.batch_size, local_steps=self.config.local_steps,
                                               local_epochs=self.config.epochs)

    @property
    def num_params(self) -> int:
        """The number of trainable parameters of the global model."""
        return sum(int(np.size(p)) for p in jax.tree.leaves(self.state.variables["params"]))

    @property
    def personal_state_bytes(self) -> int:
        """Device memory of the method's per-client state (e.g. N personal models)."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.method_state().clients))

    def active_clients(self) -> np.ndarray:
        """``[N]`` bool: who may be sampled (all, unless early stopping removed some)."""
        if self.method.active_clients is None:
            return np.ones(self.config.num_clients, bool)
        return np.asarray(self.method.active_clients(self.round.ctx, self.method_state()))

    def sample_cohort(self, t: int, may: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, jax.Array, int]:
        """Round ``t``'s client ids, which are real, the round key and packing seed — all from the run's key
        (:func:`~fedpartial._src.experiment.population.sample_cohort`: stratified by the method's client groups,
        members that ``may`` not join (default: the inactive ones) filling a group's slots as not valid,
        padding clients last)."""
        may = self.active_clients() if may is None else may
        return population.sample_cohort(self.rounds_key, t, may, self.round.groups,
                                        num_clients=self.config.num_clients, cohort_size=self.config.sampled_size,
                                        padded_size=self.round.ctx.cohort_size)

    def cohort(self, ids: np.ndarray, pack_seed: int, valid: np.ndarray | None = None) -> engine_types.Cohort:
        """The clients ``ids``' local data for one round, shuffled with ``pack_seed``: packed on the host, or
        gathered on the device (:attr:`data_placement`; the two draw different, equally valid orders)."""
        valid = np.ones(len(ids), bool) if valid is None else np.asarray(valid, bool)
        return self.data.cohort(ids, pack_seed, valid, streamed=self.round.strategy.kind == "stream")

    def evaluate_personal(self) -> dict:
        """Every client's own model (fine-tuned first where the method asks) on its held-out split, and the global
        model on the same splits: the ``personal_accuracy*`` and ``global_client_accuracy`` fields."""
        return finetune.evaluate_personal(self)

    def evaluate(self) -> dict:
        return evaluate(self.model, self.state.variables, self.dataset.x_test, self.dataset.y_test,
                        batch_statistics=self.config.bn_policy == "static")

    def rounds(self) -> Iterator[dict]:
        """Runs the configured rounds, yielding one metrics record per round: :meth:`prepare_round` (host), the
        round itself (:meth:`run_round`), :meth:`finish_round` (host).

        A round in which every real client's update, or the new global model, is not finite raises
        :class:`~fedpartial.DivergedError` before its record is yielded (``self.state`` is then
        the diverged round's; :func:`run` keeps the last good checkpoint); ``nonfinite_clients`` counts the
        updates left out of aggregation.
        """
        # Running totals live on the instance (``self.progress``) so a checkpoint can restore them.
        for t in range(self.progress["round"], self.config.rounds):
            prepared = self.prepare_round(t)
            if prepared is None:
                return  # early stopping: every client has stopped
            yield self.finish_round(prepared, self.run_round(prepared))

    def prepare_round(self, t: int) -> PreparedRound | None:
        """Round ``t``'s cohort and key (the host work before the round), drawn from the clients available at the
        clock and cut by the deadline; None when early stopping has stopped every client or an availability
        trace has nobody left."""
        active = self.active_clients()
        joined = self.clock.join(t, active, self.progress) if active.any() else None
        if joined is None:
            return None
        may, wait = joined
        start = time.perf_counter()
        draw = self.accountant and privacy.draw_share(  # (N, K) for DP's accountant: who may be drawn, how many
            may, self.round.groups, self.config.sampled_size, self.round.ctx.cohort_size)
        ids, valid, key, pack_seed = self.sample_cohort(t, may)
        rows = client_state_lib.with_rows(self.state, self.client_store, ids) if self.clock.on else None
        cohort, timed = self.clock.cut(rows, self.cohort(ids, pack_seed, valid), key, wait)
        return PreparedRound(t, ids, np.asarray(cohort.info.valid), key, cohort, start, time.perf_counter() - start,
                             draw, timed)

    def finish_round(self, prepared: PreparedRound, metrics: dict, round_time: float | None = None) -> dict:
        """Round ``prepared.round``'s record from the metrics of its round (the state already updated):
        divergence check, traffic, simulated time, running totals and evaluation.

        ``round_time``: the record's ``round_time_s`` (default: the time since :meth:`prepare_round`
        started, the round's host and device work); its ``wall_time_s`` adds the time taken here.
        """
        return round_record.synchronous(self, prepared, metrics, round_time)


def run(config: RunConfig, *, on_round: Callable[[dict], None] | None = None,
        sim: Simulation | None = None, checkpoint_every: int | None = None, resume: str | None = None,
        stop: signals.StopFlag | None = None, **parts) -> dict:
    """Runs the simulation ``sim`` (or a new :class:`Simulation` of ``config`` and ``parts``) to its end, writing
    its run folder through the run loop (:func:`~fedpartial._src.experiment.driver.drive`): what
    :func:`fedpartial.run` does (documented there)."""
    started = time.perf_counter()
    driver.check_checkpoint_every(checkpoint_every)
    if sim is None and config.mode != "sync":
        raise UserError("an asynchronous configuration (--mode async) runs with fedpartial.run, which builds its "
                        "AsyncSimulation, or pass sim=AsyncSimulation(config).")
    sim = sim or Simulation(config, **parts)
    writer = RunWriter(sim, checkpoint_every=checkpoint_every, resume=resume)
    steps = ([record] for record in sim.rounds())
    results, _ = driver.drive([writer], steps, stop=stop, started=started,
                              on_step=None if on_round is None else lambda records: on_round(records[0]))
    return results[0]
