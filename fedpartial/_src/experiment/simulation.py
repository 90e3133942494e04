"""Host driver: data, partition, cohort sampling and packing, logging — around the pure round.

Everything here is host work (numpy, files, progress); the round itself is
:class:`fedpartial._src.engine.round.FederatedRound`.  :func:`run` is what ``fedpartial run``
calls; notebooks can call it too, or drive :class:`Simulation` round by round.  The clients and their
cohorts are :mod:`~fedpartial._src.experiment.population`'s, where things live and whether they fit
:mod:`~fedpartial._src.experiment.layout`'s, the run directory :mod:`~fedpartial._src.experiment.run_directory`'s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
import optax

from fedpartial._src.core import memory
from fedpartial._src.core.errors import UserError, warn_nothing_trained
from fedpartial._src.core.types import ClientOptimizer, CohortInfo, Holdout, Method, PersonalModels, ServerData
from fedpartial._src.costs import devices
from fedpartial._src.data import ondevice, packing, sources
from fedpartial._src.data.partition import train_holdout_split
from fedpartial._src.engine import round as engine
from fedpartial._src.engine import sharding
from fedpartial._src.engine import strategy as engine_strategy
from fedpartial._src.engine import types as engine_types
from fedpartial._src.experiment import client_state as client_state_lib
from fedpartial._src.experiment import (
    compile_cache,
    driver,
    finetune,
    layout,
    population,
    pretrained,
    privacy,
    round_record,
    signals,
    simulated_time,
    timing,
)
from fedpartial._src.experiment import plan as plan_lib
from fedpartial._src.experiment.config import CLIENT_STATE_CHUNK_BYTES, DEFAULT_TRAIN_FRACTION, ConfigError, RunConfig
from fedpartial._src.experiment.config_checks import validate_once
from fedpartial._src.experiment.evaluation import evaluate, evaluate_clients, pad_holdouts
from fedpartial._src.experiment.lora import with_rank_tiers
from fedpartial._src.experiment.parts import (
    check_outputs_fit_labels,
    make_client_optimizer,
    make_server_optimizer,
    model_outputs,
    run_models,
)
from fedpartial._src.experiment.preflight import preflight
from fedpartial._src.experiment.run_directory import RunWriter
from fedpartial._src.experiment.timing import PreparedRound
from fedpartial._src.methods.codecs import upload_codec
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.models.adapter import Model


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
      >>> config = fp.RunConfig(dataset="digits", num_clients=6, cohort_size=3, rounds=2, local_steps=1, out_dir=None)
      >>> [r["round"] for r in fp.Simulation(config).rounds()]
      [1, 2]
    """

    def __init__(self, config: RunConfig, dataset: sources.ArrayDataset | None = None, *,
                 method: Method | None = None, model: Model | None = None,
                 client_optimizer: ClientOptimizer | optax.GradientTransformation | None = None,
                 server_optimizer: optax.GradientTransformation | None = None, check_memory: bool = True,
                 data_placement: str | None = None):
        # Cheap checks first: a bad setting is refused before data is loaded or anything is built.
        self.config = self._checked_config(config, method, data_placement)
        #: what the settings resolve to on this machine: its devices and the method (:func:`.plan.resolve`)
        self.plan = plan_lib.resolve(self.config, method)
        #: the persistent compilation cache's folder (None: off)
        self.compile_cache_dir = compile_cache.enable(self.config.compile_cache)
        self._load_dataset(dataset, model)
        self._choose_method(method)
        self._split_population()
        self._place_data(data_placement)
        self._build_model(model)
        self._split_over_devices()
        self._build_round(client_optimizer, server_optimizer, check_memory)
        if self.data_placement == "device":
            self.place_data_on_device()
        self._model_devices()
        self._init_method_state()
        #: the last round's plan and selection (client ids and structured masks) when the run records decisions,
        #: else None
        self.last_decisions = None
        #: the optimizer per-client fine-tuning trains with (:mod:`.finetune`); None: the round's client optimizer
        #: (replicas, whose round runs at rate 1 with each replica's rate in its cohort, set their own rate here)
        self.finetune_optimizer = None
        #: host-side totals :meth:`rounds` carries between rounds (rounds done, traffic, simulated time and the
        #: clock availability reads); with ``state`` everything a checkpoint restores (:mod:`.checkpoint`)
        self.progress = {"round": 0, "cumulative_upload_bytes": 0, "cumulative_download_bytes": 0,
                         "cumulative_simulated_time_s": 0.0, "simulated_clock_s": 0.0}

    @staticmethod
    def _checked_config(config: RunConfig, method: Method | None, data_placement: str | None) -> RunConfig:
        """``config`` validated unless its caller did (named after a custom ``method``), and the caller's
        ``data_placement`` checked."""
        if method is not None and (config.method, config.options) != (method.name, {}):
            config = dataclasses.replace(config, method=method.name, options={})
        validate_once(config, custom_method=method is not None)
        preflight(config)  # then whether this machine can hold it
        if data_placement not in (None, "host", "device"):
            raise ConfigError(f"data_placement {data_placement!r} is not allowed: choose host or device (or None for "
                              f"--data-placement {config.data_placement}).")
        return config

    def _load_dataset(self, dataset: sources.ArrayDataset | None, model: Model | None) -> None:
        """The training and test data: the caller's ``dataset``, else the one the config names; in the view the
        run's model (the caller's ``model``, else the config's) reads (a language model: labels per position)."""
        if dataset is None and model is None:
            self.dataset = population.load_dataset(self.config)
        else:
            loaded = dataset if dataset is not None else population.load_dataset(self.config, viewed=False)
            self.dataset = population.for_model(self.config, loaded, model)
        self.config = population.with_population(self.config, self.dataset)  # leaf, hf: --clients from the files
        population.check_labels(self.dataset)  # before the partition counts them

    def _choose_method(self, method: Method | None) -> None:
        """The method (the caller's or the config's, early stopping around it) and each client's train fraction."""
        config = self.config
        base = method if method is not None else config.build_method()
        self.train_fraction = config.train_fraction
        #: why each client holds data out when the run did not say (None: it said, or nothing is held out)
        self.holdout_note = None
        if self.train_fraction is None:
            caps = base.capabilities
            why = (f"method {base.name} is personalised: each client's own model is evaluated on its held-out data"
                   if caps.personalised else f"method {base.name} reads held-out data" if caps.needs_holdout
                   else "early stopping (--es) reads held-out data" if config.early_stopping else None)
            self.train_fraction = DEFAULT_TRAIN_FRACTION if why else 1.0
            if why:
                self.holdout_note = (f"each client trains on {DEFAULT_TRAIN_FRACTION:.0%} of its data and holds the "
                                     f"rest out, because {why} (--train-fraction changes it)")
        inner = early_stopping(base, lam=self.train_fraction) if config.early_stopping else base
        inner = with_rank_tiers(config, inner)  # --lora-ranks: each client's rank components, as masks
        inner = upload_codec(inner, config.upload_codec) if config.upload_codec else inner
        # with --dp-clip the method is wrapped in DP-FedAvg (around the codec: it clips what the server receives)
        # and ``accountant`` gives ε each round (else None)
        self.method, self.accountant = privacy.private(config, inner)

    def _split_population(self) -> None:
        """The server's set, every client's training and held-out examples, its label counts and local steps."""
        config, dataset = self.config, self.dataset
        self.server_data, pool = None, None
        if self.method.capabilities.server_examples_per_class:
            if dataset.natural_partition is not None:
                raise ConfigError(f"method {self.method.name} needs a server set, which a naturally "
                                  f"partitioned dataset ({dataset.name}) cannot spare.")
            server = population.server_examples(dataset.groups, self.method.capabilities.server_examples_per_class,
                                                config.seed)
            self.server_data = ServerData(dataset.x_train[server], dataset.y_train[server])
            pool = np.setdiff1d(np.arange(len(dataset.y_train)), server)
        self.clients = population.partition_clients(config, dataset, self.train_fraction, pool)
        self.holdout = None
        if self.train_fraction < 1:
            self.clients, held = train_holdout_split(self.clients, self.train_fraction, seed=config.seed)
            self.holdout = pad_holdouts([(dataset.x_train[h], dataset.y_train[h]) for h in held])
        self.sizes = np.array([len(c) for c in self.clients])
        #: [N, C] every client's training examples per class (FedDH's label distributions)
        self.label_counts = population.label_counts(dataset.y_train, self.clients, dataset.num_classes)
        self.num_steps = packing.max_steps(np.unique(self.sizes), config.batch_size, local_steps=config.local_steps,
                                           local_epochs=config.epochs)

    def _build_model(self, model: Model | None) -> None:
        """The model (the caller's, else the config's adapted by the method), refused if it cannot take the data."""
        dataset = self.dataset
        #: the model, and the same model lowered by lax in float32 when the run's is not (the device model counts its
        #: FLOPs; None: it is), and how its convolutions are lowered
        model, self.plain_model, self.conv_choice = run_models(self.config, dataset, model, self.method.adapt_model,
                                                               self.method.capabilities.second_order)
        self.model = pretrained.initial_model(model, self.config.init_from)  # --init-from: checked against it
        if self.method.capabilities.neuron_masks and not self.model.structure.sequential:  # from the record
            raise ConfigError(f"method {self.method.name} drops single neurons, which needs a sequential model (a "
                              f"chain of layers), but model {self.model.name} is not declared sequential; choose "
                              "a sequential model or a layer-level method.")
        if self.model.input_shape != tuple(dataset.x_train.shape[1:]):
            raise ConfigError(f"model {self.model.name} takes examples of shape {self.model.input_shape}, but "
                              f"{dataset.name} has {tuple(dataset.x_train.shape[1:])}.")
        check_outputs_fit_labels(self.model, dataset)
        outputs = model_outputs(self.model, dataset.x_train.dtype)
        if outputs != dataset.num_classes:  # fewer would fail later as something else, more would pass silently
            raise ConfigError(f"model {self.model.name} gives {outputs} outputs per example, but {dataset.name} has "
                              f"{dataset.num_classes} classes; build the model with num_classes="
                              f"{dataset.num_classes}.")

    def _split_over_devices(self) -> None:
        """The mesh the cohort is split over (None on one device); a run over several processes uses them all."""
        config = self.config
        if jax.process_count() > 1 and config.devices is not None:
            raise ConfigError(f"--devices {config.devices} is not used by a run over {jax.process_count()} "
                              f"processes, which splits the cohort over all their {jax.device_count()} devices; "
                              "leave it out.")
        self.mesh = layout.client_mesh(config.num_devices)

    def _build_round(self, client_optimizer: ClientOptimizer | optax.GradientTransformation | None,
                     server_optimizer: optax.GradientTransformation | None, check_memory: bool) -> None:
        """Decides the round's layout from estimates (:func:`layout.decide`: strategy, where the per-client state
        and the data live, with ``check_memory`` a refusal of a run that does not fit), then builds the round,
        once, in that layout."""
        config = self.config
        client_optimizer = client_optimizer or make_client_optimizer(config)
        server_optimizer = server_optimizer or make_server_optimizer(config)
        num_devices = 1 if self.mesh is None else self.mesh.size
        # The cohort (⌈F·K⌉ with over-selection) split over devices is padded to a multiple of their number.
        padded_size = sharding.padded_size(config.sampled_size, num_devices)
        sizes = {"num_clients": config.num_clients, "cohort_size": padded_size, "padding": padded_size - config.sampled_size,
                     "bn_policy": config.bn_policy, "rounds": config.rounds}
        known = {"server_data": self.server_data, "label_counts": self.label_counts}
        ctx = engine.method_context(self.model, client_optimizer=client_optimizer, **sizes)
        shapes = jax.eval_shape(lambda key: engine.initial_state(self.method, ctx, server_optimizer, key, **known),
                                jax.random.key(0))
        decided = layout.decide(config, self.method, ctx, shapes, client_optimizer,
                                strategy=config.run_strategy(num_devices, self.model, self.conv_choice.layout),
                                mesh=self.mesh, data_placement=self.data_placement, data_bytes=self.data_bytes,
                                num_steps=self.num_steps, x_dtype=self.dataset.x_train.dtype, check_memory=check_memory)
        #: where the method's per-client state lives: ``device``, ``host`` or ``disk``
        self.client_state = decided.client_state
        #: the round's peak-memory estimate (:mod:`fedpartial._src.core.memory`)
        self.memory = decided.memory
        #: why the round's layout (strategy, data placement) is not what ``--strategy`` and ``--data-placement``
        #: resolve to by themselves (None: it is)
        self.strategy_note = decided.note
        if decided.data_placement != self.data_placement:
            self.drop_device_data()

        def build(model: Model) -> engine.FederatedRound:
            return engine.FederatedRound(
                model, self.method, client_optimizer=client_optimizer, server_optimizer=server_optimizer,
                strategy=decided.strategy, record_decisions=config.record_decisions, devices=self.mesh,
                client_state="device" if decided.client_state == "device" else "host", **sizes, **known)

        self.round = build(self.model)
        # FLOPs of local work, compiled once per shape; counted on the plain model (a device's simulated time does
        # not depend on how the simulator lowers or rounds its arithmetic): a second round, for counting only
        self._counted = self.round if self.plain_model is None else build(self.plain_model)

    def _model_devices(self) -> None:
        """The simulated devices (compute speeds and bandwidths), the FLOPs of their local work, and the clock that
        decides who is available and who reports in time (:mod:`fedpartial._src.experiment.timing`)."""
        self.devices = self.config.device_model()  # [N] compute speeds and bandwidths (simulated time)
        self.costs = devices.CostModel(self._counted)
        self.clock = timing.RoundClock(self.config, self.round, self.costs, self.devices)

    def _init_method_state(self) -> None:
        """The run's keys and the method's initial state; per-client rows off the device are filled in chunks."""
        init_key, self.rounds_key = jax.random.split(jax.random.key(self.config.seed))
        # e.g. FedAD's per-device dropout targets, read by init
        times = self.full_model_times() if self.method.capabilities.needs_execution_times else None
        self.state = self.round.init(init_key, execution_times=times)
        #: the per-client state kept off the device (``client_state`` host or disk), else None
        self.client_store = None
        if self.client_state != "device":
            shapes = self.round.client_state_shapes()
            self.client_store = client_state_lib.HostClientState(shapes, disk=self.client_state == "disk")
            per_client = max(1, client_state_lib.tree_bytes(shapes) // self.config.num_clients)
            variables = self.state.variables
            self.client_store.fill(lambda start, size: self.round.init_client_rows(
                init_key, start, size, variables, execution_times=times),
                chunk=max(1, CLIENT_STATE_CHUNK_BYTES // per_client))

    def method_state(self):
        """The method's whole state, per-client rows included (numpy arrays when they are kept off the device)."""
        if self.client_store is None:
            return self.state.method_state
        return self.state.method_state._replace(clients=self.client_store.tree())

    def checkpoint_state(self) -> engine_types.ServerState:
        """What a checkpoint saves: the server state with every client's rows."""
        return engine_types.with_clients(self.state, self.method_state().clients)

    def load_state(self, state: engine_types.ServerState) -> None:
        """Sets the state from a restored checkpoint (host arrays): per-client rows into their store."""
        if self.client_store is not None:
            self.client_store.load(state.method_state.clients)
            state = engine_types.without_clients(state)
        # replicated on the devices the cohort is split over, as the round keeps it (with several processes the
        # arrays must be global: every process restored the same values from its own copy)
        self.state = jax.device_put(state, None if self.mesh is None else sharding.replicated(self.mesh))

    def _with_rows(self, ids: np.ndarray) -> engine_types.ServerState:
        """The state the round takes for the cohort ``ids`` (per-client rows off the device brought in)."""
        if self.client_store is None:
            return self.state
        # one copy to the device: the stepwise strategy hands the state to several jitted pieces
        return engine_types.with_clients(self.state, jax.device_put(self.client_store.rows(ids)))

    def run_round(self, prepared: PreparedRound):
        """Runs the prepared round on the state (per-client rows off the device travel in and back); returns
        its metrics."""
        state = self._with_rows(prepared.ids)
        state, metrics = self.round(state, layout.placed(prepared.cohort, self.mesh, self.round.ctx.cohort_size),
                                    prepared.key)
        if self.client_store is not None:
            self.client_store.write(prepared.ids, prepared.valid, state.method_state.clients)
            state = engine_types.without_clients(state)
        self.state = state
        return metrics

    def _estimate(self) -> memory.MemoryEstimate:
        """The current round's peak-memory estimate (:func:`layout.estimate`)."""
        return layout.estimate(self.round, self.client_state, num_steps=self.num_steps,
                               batch_size=self.config.batch_size, example_shape=self.model.input_shape,
                               x_dtype=self.dataset.x_train.dtype)

    def streamed_option(self, clients_that_fit: int) -> engine_strategy.Strategy:
        """The streamed strategy for this platform and model with at most ``clients_that_fit`` in flight."""
        return layout.streamed_strategy(clients_that_fit, self.model)

    def drop_device_data(self) -> None:
        """Training data on the host from now on: the device's copy (if any) is let go."""
        self.data_placement = "host"
        self._population = self._device_holdout = self._gather_spec = None

    def _place_data(self, decided: str | None = None) -> None:
        """Resolves ``config.data_placement`` (or takes the caller's ``decided`` placement) into
        :attr:`data_placement` (:func:`layout.data_placement`); for ``device`` :meth:`place_data_on_device`
        copies the data once the memory checks have passed (they count it as already there), so that data
        which gives way is never copied."""
        #: bytes the data takes on the device (:func:`ondevice.population_bytes` plus the holdout)
        self.data_bytes = layout.data_bytes(self.dataset.x_train, self.clients, self.holdout)
        #: ``host`` or ``device``: where this run's training data lives (``config.data_placement`` resolved)
        self.data_placement = layout.data_placement(self.config, self.data_bytes, decided)
        # (copied by __init__ once the round is known to fit beside it: :func:`layout.decide`)
        self._population = self._device_holdout = self._gather_spec = None

    def place_data_on_device(self) -> None:
        """Copies the clients' training data (and the padded holdout) to the device, once; later cohorts are
        gathered there (:mod:`fedpartial._src.data.ondevice`)."""
        cfg = self.config
        self.data_placement = "device"
        self._gather_spec = ondevice.gather_spec(batch_size=cfg.batch_size, num_steps=self.num_steps,
                                                 local_steps=cfg.local_steps, local_epochs=cfg.epochs)
        self._population = ondevice.place(self.dataset.x_train, self.dataset.y_train, self.clients,
                                          self._gather_spec)
        if self.holdout is not None:
            self._device_holdout = jax.device_put(Holdout(*self.holdout))

    def pad_shapes(self, num_steps: int, holdout_length: int | None = None) -> None:
        """Pads every later cohort to ``num_steps`` local steps and the holdout to ``holdout_length`` examples
        per client (:mod:`fedpartial._src.experiment.replicas` gives its seeds one shape).  Padded steps and
        examples are masked no-ops, so training and evaluation are unchanged; on the device the gather's bounds
        follow (its stream length depends on the population only, so the batches drawn stay the same)."""
        if num_steps < self.num_steps:
            raise ValueError(f"num_steps {num_steps} is below this run's {self.num_steps}; padding only grows it.")
        self.num_steps = num_steps
        if self._gather_spec is not None:
            self._gather_spec = self._gather_spec._replace(num_steps=num_steps)
        if self.holdout is not None and holdout_length is not None and holdout_length != self.holdout[0].shape[1]:
            extra = holdout_length - self.holdout[0].shape[1]
            if extra < 0:
                raise ValueError(f"holdout_length {holdout_length} is below this run's {self.holdout[0].shape[1]}.")
            before = sum(int(a.nbytes) for a in self.holdout)
            self.holdout = tuple(np.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2)) for a in self.holdout)
            self.data_bytes += sum(int(a.nbytes) for a in self.holdout) - before
            if self._device_holdout is not None:
                self._device_holdout = jax.device_put(Holdout(*self.holdout))
        self.memory = self._estimate()  # the padded steps are packed too

    def full_model_times(self) -> np.ndarray:
        """``[N]`` each device's simulated time for one round of *full-model* local work on its own data
        (:func:`~fedpartial._src.experiment.simulated_time.full_model_times`)."""
        cfg = self.config
        k = self.round.ctx.cohort_size
        # same shapes as every round's (ids cycled: a cohort padded for several devices may exceed N)
        cohort = self.cohort(np.arange(k) % cfg.num_clients, 0)
        return simulated_time.full_model_times(self.round, self.costs, self.devices, cohort, self.sizes,
                                               batch_size=cfg.batch_size, local_steps=cfg.local_steps,
                                               local_epochs=cfg.epochs)

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
        cfg = self.config
        valid = np.ones(len(ids), bool) if valid is None else np.asarray(valid, bool)
        packing_settings = {"batch_size": cfg.batch_size, "num_steps": self.num_steps,
                            "local_steps": cfg.local_steps, "local_epochs": cfg.epochs}
        if self.round.strategy.kind == "stream":
            return population.streamed_cohort(self.dataset, self.clients, self.sizes, self.holdout, ids, valid,
                                              pack_seed, **packing_settings)
        if self.data_placement == "device":
            ids = np.asarray(ids, np.int32)
            batch, num_samples, holdout = ondevice.gather_round(
                self._population, self._device_holdout, ids, valid, np.uint32(pack_seed), spec=self._gather_spec)
            return engine_types.Cohort(data=batch, info=CohortInfo(client_ids=ids, num_samples=num_samples, valid=valid),
                                 holdout=holdout)
        return population.packed_cohort(self.dataset, self.clients, self.holdout, ids, valid, pack_seed,
                                        **packing_settings)

    def evaluate_personal(self) -> dict:
        """Every client's own model (fine-tuned first where the method asks: :mod:`.finetune`) on its held-out
        split, and the global model on the same splits."""
        x, y, mask = self.holdout
        static = self.config.bn_policy == "static"
        own = finetune.evaluate_own_models(self, static)
        shared = evaluate_clients(self.model, PersonalModels(variables=self.state.variables, stacked=False),
                                  x, y, mask, batch_statistics=static)
        return {"personal_accuracy": own["mean"], "personal_accuracy_std": own["std"],
                "personal_accuracy_min": own["min"], "personal_accuracy_max": own["max"],
                "global_client_accuracy": shared["mean"]}

    def evaluate(self) -> dict:
        return evaluate(self.model, self.state.variables, self.dataset.x_test, self.dataset.y_test,
                        batch_statistics=self.config.bn_policy == "static")

    def rounds(self) -> Iterator[dict]:
        """Runs the configured rounds, yielding one metrics record per round.

        Each record holds ``nonfinite_clients``: real clients whose update was not finite
        (NaN/inf) and was left out of aggregation.  When every real client of a round
        failed, or the new global model is not finite, the round raises
        :class:`fedpartial._src.core.errors.DivergedError` before its record is yielded (the command
        line exits with status 1; :func:`run` keeps the last good checkpoint and writes
        nothing of the diverged state).  ``self.state`` is then the diverged round's.

        A round is :meth:`prepare_round` (host), the round itself, :meth:`finish_round` (host);
        :mod:`fedpartial._src.experiment.replicas` runs the same two host halves around one vmapped round.
        """
        # Running totals live on the instance (``self.progress``) so a checkpoint can restore them.
        for t in range(self.progress["round"], self.config.rounds):
            prepared = self.prepare_round(t)
            if prepared is None:
                return  # early stopping: every client has stopped
            yield self.finish_round(prepared, self.run_round(prepared))

    def prepare_round(self, t: int) -> PreparedRound | None:
        """Round ``t``'s cohort and key (the host work before the round), drawn from the clients available at the
        clock and cut by the deadline (:mod:`fedpartial._src.experiment.timing`); None when early stopping has
        stopped every client or an availability trace has nobody left."""
        active = self.active_clients()
        joined = self.clock.join(t, active, self.progress) if active.any() else None
        if joined is None:
            return None
        may, wait = joined
        start = time.perf_counter()
        draw = self.accountant and privacy.draw_share(  # (N, K) for DP's accountant: who may be drawn, how many
            may, self.round.groups, self.config.sampled_size, self.round.ctx.cohort_size)
        ids, valid, key, pack_seed = self.sample_cohort(t, may)
        cohort, timed = self.clock.cut(self._with_rows(ids) if self.clock.on else None,
                                       self.cohort(ids, pack_seed, valid), key, wait)
        return PreparedRound(t, ids, np.asarray(cohort.info.valid), key, cohort, start, time.perf_counter() - start,
                             draw, timed)

    def finish_round(self, prepared: PreparedRound, metrics: dict, round_time: float | None = None) -> dict:
        """Round ``prepared.round``'s record from the metrics of its round (the state already updated):
        divergence check, traffic, simulated time, running totals and evaluation.

        ``round_time``: the record's ``round_time_s`` (default: the time since :meth:`prepare_round`
        started, the round's host and device work); its ``wall_time_s`` adds the time taken here.
        """
        cfg = self.config
        t, ids, valid, cohort = prepared.round, prepared.ids, prepared.valid, prepared.cohort

        def diverged(metrics):
            what = ("every client's update was non-finite (NaN/inf)" if int(metrics["nonfinite_clients"]) ==
                    int(np.sum(valid)) else "the global model became non-finite (NaN/inf)")
            return f"round {t + 1}: {what} — lower --lr or --server-lr, or check the data"

        metrics = round_record.checked(metrics, diverged)
        trained_nothing = bool(metrics.get("trained_nothing", False))
        if trained_nothing and not getattr(self, "_said_trained_nothing", False):  # once a run
            self._said_trained_nothing = warn_nothing_trained(t + 1)
        finished = time.perf_counter()
        train_time = finished - prepared.start if round_time is None else round_time
        flops, simulated = simulated_time.client_work(self.costs, self.devices, cohort, ids, valid, metrics,
                                                      sparse_flops=self.config.sparse_flops)
        simulated, clock = self.clock.finish(prepared.timing or timing.Timing(), self.progress, valid, simulated)
        self.progress["cumulative_simulated_time_s"] += simulated
        self.progress["round"] = t + 1
        record = round_record.record(
            self, t, metrics, round_time_s=train_time, host_time_s=prepared.host_time, clients=int(valid.sum()),
            client_flops=np.sum(flops[valid]), simulated_time_s=simulated,
            inserted={"simulated_time_s": {"cumulative_simulated_time_s": self.progress["cumulative_simulated_time_s"],
                                           **clock}})  # clients sampled, finished and dropped, wasted work, the clock
        round_record.method_values(self, record, metrics, ids)
        if trained_nothing:
            record["trained_nothing"] = True
        if self.method.active_clients is not None:
            record["active_clients"] = int(self.active_clients().sum())
        round_record.privacy_spent(self, record, prepared.draw)
        round_record.evaluate_into(self, record, t, t + 1 == cfg.rounds or record.get("active_clients", 1) == 0)
        record["wall_time_s"] = train_time + time.perf_counter() - finished
        return record


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
