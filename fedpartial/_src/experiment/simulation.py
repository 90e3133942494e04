"""Host driver: data, partition, cohort sampling and packing, logging — around the pure round.

Everything here is host work (numpy, files, progress); the round itself is
:class:`fedpartial._src.engine.round.FederatedRound`.  :func:`run` is what ``fedpartial run``
calls; notebooks can call it too, or drive :class:`Simulation` round by round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from typing import Callable, Iterator, NamedTuple

import jax
import numpy as np
import optax

from fedpartial._src.experiment import checkpoint
from fedpartial._src.costs import devices
from fedpartial._src.engine import round as engine
from fedpartial._src.core import memory
from fedpartial._src.engine import sharding
from fedpartial._src.experiment import client_state as client_state_lib
from fedpartial._src.core.types import ClientOptimizer, CohortInfo, Holdout, Method, ServerData, client_sgd
from fedpartial._src.data import ondevice, packing, sources
from fedpartial._src.data.partition import partition as split_population
from fedpartial._src.data.partition import train_holdout_split
from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment.evaluation import evaluate, evaluate_clients, pad_holdouts
from fedpartial._src.core.masks import Mask
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import Model, from_linen
from fedpartial._src.experiment.config import (
    CLIENT_STATE_CHUNK_BYTES,
    DEFAULT_MODELS,
    DEFAULT_TRAIN_FRACTION,
    ConfigError,
    RunConfig,
)

def _client_mesh(num_devices: int):
    """The client mesh: this process's first ``num_devices`` devices, or every process's devices when the run
    spans several processes (``jax.distributed``); None for one device."""
    if jax.process_count() > 1:
        return sharding.client_mesh(None)
    return sharding.client_mesh(num_devices) if num_devices > 1 else None


def _draw(key: jax.Array, members: np.ndarray, active: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``k`` of ``members`` uniformly among the active ones (sorted ids, and which are real)."""
    if active.all():
        picked = _distinct_uniform(key, len(members), k)
        return np.sort(members[picked]), np.ones(k, bool)
    pool = members[active]
    if len(pool) >= k:
        # Gumbel top-k over the active members: the shapes never change, so nothing
        # recompiles as the pool shrinks.
        scores = np.where(active, np.asarray(jax.random.gumbel(key, (len(members),))), -np.inf)
        return np.sort(members[np.argsort(-scores, kind="stable")[:k]]), np.ones(k, bool)
    filler = members[~active][: k - len(pool)]
    return np.concatenate([pool, filler]), np.arange(k) < len(pool)


# Up to this many members a draw permutes them all (as every run before the O(k) draw did, so their cohorts
# are unchanged); above it, Floyd's algorithm draws k of n in O(k) (a 1M-client permutation took 0.7 s a round).
_PERMUTATION_MAX = 1 << 16


def _distinct_uniform(key: jax.Array, n: int, k: int) -> np.ndarray:
    """``k`` distinct positions of ``range(n)``, every k-subset equally likely (order not meaningful)."""
    if n <= _PERMUTATION_MAX:
        return np.asarray(jax.random.choice(key, n, (k,), replace=False))
    # Floyd: for j = n-k .. n-1 draw t uniform in [0, j]; take t, or j itself when t is already taken.  Every
    # k-subset comes out with probability 1 / C(n, k); the work and memory are O(k), whatever n is.
    tops = np.arange(n - k, n, dtype=np.int64)
    draws = np.asarray(jax.random.randint(key, (k,), 0, tops + 1))  # int32: client ids are int32 everywhere
    taken: set[int] = set()
    for top, t in zip(tops.tolist(), draws.tolist()):
        taken.add(top if t in taken else t)
    return np.fromiter(taken, np.int64, count=k)


def make_client_optimizer(config: RunConfig) -> ClientOptimizer:
    """SGD with momentum and (decoupled from the loss) L2 weight decay at the run's client rate."""
    return client_sgd(config.client_lr, momentum=config.momentum, weight_decay=config.weight_decay)


def make_server_optimizer(config: RunConfig) -> optax.GradientTransformation:
    return {
        "sgd": lambda lr: optax.sgd(lr),
        "adam": lambda lr: optax.adam(lr, b1=0.9, b2=0.99, eps=1e-3),
        "yogi": lambda lr: optax.yogi(lr, eps=1e-3),
        "adagrad": lambda lr: optax.adagrad(lr),
    }[config.server_optimizer](config.server_lr)


def build_model(name: str, dataset: sources.ArrayDataset) -> Model:
    """A zoo model adapted for the engine, shaped for ``dataset``."""
    if name == "auto":
        name = DEFAULT_MODELS.get(dataset.name.split("/")[0], "mlp")
    input_shape = tuple(dataset.x_train.shape[1:])
    spec = registry.MODELS[name]
    module = registry.build_model(name, dataset.num_classes, input_shape)
    return from_linen(module, input_shape=input_shape, num_classes=dataset.num_classes,
                      sequential=spec.sequential, name=name)


def partition_clients(config: RunConfig, dataset: sources.ArrayDataset, train_fraction: float = 1.0,
                      pool: np.ndarray | None = None) -> list[np.ndarray]:
    """Every client's training indices.  ``pool`` limits the examples clients may get
    (the rest is the server's); a natural partition is taken as it is."""
    if config.partition == "natural" or dataset.natural_partition is not None:
        if dataset.natural_partition is None:
            raise ConfigError(f"dataset {dataset.name!r} has no natural partition; use iid, dirichlet or shards.")
        parts = list(dataset.natural_partition)
        if len(parts) != config.num_clients:
            raise ConfigError(
                f"dataset {dataset.name!r} is partitioned into {len(parts)} clients by nature, "
                f"but {config.num_clients} clients were asked for."
            )
        return parts
    options = {"dirichlet": {"alpha": config.alpha}, "shards": {"classes_per_client": config.classes_per_client}}
    # A held-out split needs two examples per client: one to train on, one to hold out.
    pool = np.arange(len(dataset.y_train)) if pool is None else pool
    min_size = 2 if train_fraction < 1 and 2 * config.num_clients <= len(pool) else 1
    parts = split_population(dataset.y_train[pool], config.num_clients, config.partition, seed=config.seed,
                             min_size=min_size, **options.get(config.partition, {}))
    return [pool[p] for p in parts]


def server_examples(y: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """``per_class`` training indices of every class, drawn with ``seed`` (a class-balanced server set)."""
    rng = np.random.default_rng([seed, 0x5E7])
    picked = []
    for c in np.unique(y):
        of_class = np.flatnonzero(y == c)
        if len(of_class) <= per_class:
            raise ConfigError(f"the server set needs {per_class} examples of class {int(c)} and more left for "
                              f"clients, but the training data has only {len(of_class)}.")
        picked.append(rng.choice(of_class, per_class, replace=False))
    return np.sort(np.concatenate(picked))


class Simulation:
    """A run's data, model and round, advanced one round at a time by :meth:`rounds`.

    ``method``, ``model`` and the optimizers default to what ``config`` names; pass
    your own (e.g. a method built with :func:`fedpartial.methods.make_method`) and it
    gets the same sampling, early stopping, personalised evaluation and logging.

    ``check_memory``: before any array is built, refuse (:class:`ConfigError`) a run whose
    estimated peak memory (:mod:`fedpartial._src.core.memory`) exceeds what is available.
    ``data_placement``: where the training data goes, ``host`` or ``device``, decided by the caller instead of
    ``config.data_placement`` (:mod:`fedpartial._src.experiment.replicas` decides ``auto`` for all its replicas together).
    """

    def __init__(self, config: RunConfig, dataset: sources.ArrayDataset | None = None, *,
                 method: Method | None = None, model: Model | None = None,
                 client_optimizer: ClientOptimizer | optax.GradientTransformation | None = None,
                 server_optimizer: optax.GradientTransformation | None = None, check_memory: bool = True,
                 data_placement: str | None = None):
        if method is not None:
            config = dataclasses.replace(config, method=method.name, options={})
        config.validate(custom_method=method is not None)
        if data_placement not in (None, "host", "device"):
            raise ConfigError(f"data_placement {data_placement!r} is not allowed: choose host or device (or None for "
                              f"--data-placement {config.data_placement}).")
        self.config = config
        if dataset is None:
            options = {}
            if config.dataset == "synthetic":
                options = dict(alpha=config.alpha, beta=config.alpha, num_clients=config.num_clients)
                if config.max_samples is not None:
                    options.update(max_samples=config.max_samples, min_samples=min(50, config.max_samples))
            dataset = sources.load_dataset(config.dataset, data_dir=config.data_dir, seed=config.seed, **options)
        self.dataset = dataset
        base = method if method is not None else config.build_method()
        self.train_fraction = config.train_fraction
        if self.train_fraction is None:
            wants_holdout = base.capabilities.personalised or base.capabilities.needs_holdout or config.early_stopping
            self.train_fraction = DEFAULT_TRAIN_FRACTION if wants_holdout else 1.0
        self.method = early_stopping(base, lam=self.train_fraction) if config.early_stopping else base
        self.server_data, pool = None, None
        if self.method.capabilities.server_examples_per_class:
            if dataset.natural_partition is not None:
                raise ConfigError(f"method {self.method.name} needs a server set, which a naturally "
                                  f"partitioned dataset ({dataset.name}) cannot spare.")
            server = server_examples(dataset.y_train, self.method.capabilities.server_examples_per_class, config.seed)
            self.server_data = ServerData(dataset.x_train[server], dataset.y_train[server])
            pool = np.setdiff1d(np.arange(len(dataset.y_train)), server)
        self.clients = partition_clients(config, dataset, self.train_fraction, pool)
        self.holdout = None
        if self.train_fraction < 1:
            self.clients, held = train_holdout_split(self.clients, self.train_fraction, seed=config.seed)
            self.holdout = pad_holdouts([(dataset.x_train[h], dataset.y_train[h]) for h in held])
        self.sizes = np.array([len(c) for c in self.clients])
        # [N, C] every client's training examples per class (FedDH's label distributions).
        # (one bincount over (client, label) pairs and steps of the distinct sizes: no per-client Python work)
        owner = np.repeat(np.arange(len(self.clients)), self.sizes)
        labels = dataset.y_train[np.concatenate(self.clients)] if self.sizes.sum() else np.zeros(0, np.int64)
        self.label_counts = np.bincount(owner * dataset.num_classes + labels, minlength=len(self.clients) *
                                        dataset.num_classes).reshape(len(self.clients), -1).astype(np.float32)
        self.num_steps = packing.max_steps(np.unique(self.sizes), config.batch_size, local_steps=config.local_steps,
                                           local_epochs=config.epochs)
        self._place_data(data_placement)
        if model is None:
            model = build_model(config.model, dataset)
            if self.method.adapt_model is not None:  # e.g. MOON's projection head
                model = self.method.adapt_model(model)
        self.model = model
        if self.method.capabilities.neuron_masks and not self.model.structure.sequential:  # from the record
            raise ConfigError(f"method {self.method.name} drops single neurons, which needs a sequential model (a "
                              f"chain of layers), but model {self.model.name} is not declared sequential; choose "
                              "a sequential model or a layer-level method.")
        if self.model.input_shape != tuple(dataset.x_train.shape[1:]):
            raise ConfigError(f"model {self.model.name} takes examples of shape {self.model.input_shape}, but "
                              f"{dataset.name} has {tuple(dataset.x_train.shape[1:])}.")
        # The cohort split over devices is padded to a multiple of their number with padding clients.
        if jax.process_count() > 1 and config.devices is not None:
            raise ConfigError(f"--devices {config.devices} is not used by a run over {jax.process_count()} "
                              f"processes, which splits the cohort over all their {jax.device_count()} devices; "
                              "leave it out.")
        self.mesh = _client_mesh(config.num_devices)
        num_devices = 1 if self.mesh is None else self.mesh.size
        client_optimizer = client_optimizer or make_client_optimizer(config)
        server_optimizer = server_optimizer or make_server_optimizer(config)

        padded_size = sharding.padded_size(config.cohort_size, num_devices)

        def build_round(client_state: str, strategy: engine.Strategy | None = None) -> engine.FederatedRound:
            return engine.FederatedRound(
                self.model, self.method,
                num_clients=config.num_clients, cohort_size=padded_size,
                padding=padded_size - config.cohort_size,
                client_optimizer=client_optimizer, server_optimizer=server_optimizer,
                bn_policy=config.bn_policy, strategy=strategy or config.run_strategy(num_devices, self.model),
                rounds=config.rounds,
                record_decisions=config.record_decisions, server_data=self.server_data,
                label_counts=self.label_counts, devices=self.mesh, client_state=client_state,
            )

        self.round = build_round("device")
        self.client_state = self._resolve_client_state(self.round.client_state_shapes())
        if self.client_state != "device":  # the same round, its per-client state handed in a cohort at a time
            self.round = build_round("host")
        self.memory = self._estimate()
        #: why the round's layout (strategy, data placement) is not what ``--strategy`` and ``--data-placement``
        #: resolve to by themselves (None: it is)
        self.strategy_note = None
        if check_memory:
            notes = [self._yield_device_data()]
            bounded = self._bounded_strategy()
            if bounded is not None:  # 'auto' streams a cohort that does not fit at once
                bounded, streamed = bounded
                notes.append(streamed)
                self.round = build_round(self.client_state, bounded)
                self.memory = self._estimate()
                self.drop_device_data()  # a streamed cohort is packed on the host a chunk at a time
            self.strategy_note = "; ".join(n for n in notes if n) or None
            self._check_memory()
        if self.data_placement == "device":
            self.place_data_on_device()
        init_key, self.rounds_key = jax.random.split(jax.random.key(config.seed))
        self.devices = config.device_model()  # [N] compute speeds and bandwidths (simulated time)
        self.costs = devices.CostModel(self.round)  # FLOPs of local work, compiled once per shape
        if self.method.capabilities.needs_execution_times:  # e.g. FedAD's per-device dropout targets, read by init
            self.round.execution_times = self.full_model_times()
        self.state = self.round.init(init_key)
        #: the per-client state kept off the device (``client_state`` host or disk), else None
        self.client_store = None
        if self.client_state != "device":
            shapes = self.round.client_state_shapes()
            self.client_store = client_state_lib.HostClientState(shapes, disk=self.client_state == "disk")
            per_client = max(1, client_state_lib.tree_bytes(shapes) // config.num_clients)
            self.client_store.fill(lambda start, size: self.round.init_client_rows(init_key, start, size),
                                   chunk=max(1, CLIENT_STATE_CHUNK_BYTES // per_client))
        self.last_decisions = None
        #: host-side totals :meth:`rounds` carries between rounds (rounds done, traffic, simulated time);
        #: with ``state`` it is everything a checkpoint restores (:mod:`fedpartial._src.experiment.checkpoint`)
        self.progress = {"round": 0, "cumulative_upload_bytes": 0, "cumulative_download_bytes": 0,
                         "cumulative_simulated_time_s": 0.0}

    def _resolve_client_state(self, shapes) -> str:
        """``config.client_state`` resolved to ``device``, ``host`` or ``disk`` (refusing a method that cannot
        keep its per-client state off the device); ``device`` when the method keeps none."""
        cfg = self.config
        state_bytes = client_state_lib.tree_bytes(shapes)
        if cfg.client_state in ("host", "disk") and state_bytes and not self.method.capabilities.host_client_state:
            raise ConfigError(f"--client-state {cfg.client_state} is not allowed for --method {self.method.name}: "
                              "it reads every client's state in its hooks; use --client-state device or auto.")
        if state_bytes == 0:
            return "device"
        device_free, where = self._device_room()
        host_free = device_free if where == "RAM" else memory.available_bytes(jax.devices("cpu")[0])[0]
        # (split over several devices the state stays there: the host store feeds one device)
        return client_state_lib.resolve(cfg.client_state, state_bytes,
                                        can_leave_device=self.method.capabilities.host_client_state and self.mesh is None,
                                        device_free=device_free, host_free=host_free,
                                        platform=jax.devices()[0].platform)

    def method_state(self):
        """The method's whole state, per-client rows included (numpy arrays when they are kept off the device)."""
        if self.client_store is None:
            return self.state.method_state
        return self.state.method_state._replace(clients=self.client_store.tree())

    def checkpoint_state(self) -> engine.ServerState:
        """What a checkpoint saves: the server state with every client's rows."""
        return engine.with_clients(self.state, self.method_state().clients)

    def load_state(self, state: engine.ServerState) -> None:
        """Sets the state from a restored checkpoint (host arrays): per-client rows into their store."""
        if self.client_store is not None:
            self.client_store.load(state.method_state.clients)
            state = engine.without_clients(state)
        # replicated on the devices the cohort is split over, as the round keeps it (with several processes the
        # arrays must be global: every process restored the same values from its own copy)
        self.state = jax.device_put(state, None if self.mesh is None else sharding.replicated(self.mesh))

    def run_round(self, prepared: PreparedRound):
        """Runs the prepared round on the state (per-client rows off the device travel in and back); returns
        its metrics."""
        state = self.state
        if self.client_store is not None:
            # one copy to the device: the stepwise strategy hands the state to several jitted pieces
            state = engine.with_clients(state, jax.device_put(self.client_store.rows(prepared.ids)))
        state, metrics = self.round(state, self.placed(prepared.cohort), prepared.key)
        if self.client_store is not None:
            self.client_store.write(prepared.ids, prepared.valid, state.method_state.clients)
            state = engine.without_clients(state)
        self.state = state
        return metrics

    def _estimate(self) -> memory.MemoryEstimate:
        """The current round's peak-memory estimate (:func:`memory.estimate`), the host store of per-client
        state included where it shares the RAM."""
        est = memory.estimate(self.round, num_steps=self.num_steps, batch_size=self.config.batch_size,
                              example_shape=self.model.input_shape,
                              x_itemsize=np.dtype(self.dataset.x_train.dtype).itemsize)
        if self.client_state == "host" and jax.devices()[0].platform == "cpu":  # the store shares the RAM
            est = est._replace(server=est.server + client_state_lib.tree_bytes(self.round.client_state_shapes()))
        return est

    def streamed_option(self, clients_that_fit: int) -> engine.Strategy:
        """The streamed strategy for this platform and model with at most ``clients_that_fit`` in flight."""
        return engine.bounded_strategy(clients_that_fit, jax.devices()[0].platform, self.model)

    def drop_device_data(self) -> None:
        """Training data on the host from now on: the device's copy (if any) is let go."""
        self.data_placement = "host"
        self._population = self._device_holdout = self._gather_spec = None

    def _device_room(self) -> tuple[int | None, str]:
        """:func:`memory.available_bytes`, less the data that is to go on the device and is not copied yet."""
        available, where = memory.available_bytes()
        if available is not None and self.data_placement == "device" and self._population is None:
            available -= self.data_bytes
        return available, where

    def _yield_device_data(self) -> str | None:
        """When ``--data-placement auto`` chose the device and the round's estimate does not fit in what the data
        would leave, the data stays on the host instead (the round keeps its strategy, where streaming would
        split the cohort into chunks and a refusal would stop the run): returns why, for people, else None."""
        if self.data_placement != "device" or self.config.data_placement != "auto":
            return None
        available, where = self._device_room()
        if available is None or memory.fits(self.memory, available):
            return None
        self.drop_device_data()
        return memory.data_stays_on_host("its", self.data_bytes, str(self.round.strategy), self.memory.total,
                                         available, where)

    def _bounded_strategy(self) -> tuple[engine.Strategy, str] | None:
        """For ``--strategy auto`` on one device, when the estimate exceeds the available memory and the method
        streams: the streamed strategy (:func:`engine.bounded_strategy`) with a chunk that fits, and why, for
        people; else None (a run that fits, a named strategy, or one :meth:`_check_memory` refuses)."""
        cfg = self.config
        if cfg.strategy != "auto" or self.mesh is not None or cfg.data_placement == "device" \
                or engine.stream_refusal(self.method) is not None:
            return None
        available, where = self._device_room()
        if available is None or memory.fits(self.memory, available):
            return None
        fit = memory.clients_that_fit(self.memory, available)
        if fit < 1:
            return None
        return (self.streamed_option(memory.round_down(min(fit, cfg.cohort_size))),
                f"auto streams the cohort: {self.round.strategy} would need about {memory.gib(self.memory.total)} "
                f"but {memory.gib(available)} of {where} is available")

    def _check_memory(self) -> None:
        """Refuses the run in one sentence when its estimate exceeds the available memory (see
        :mod:`fedpartial._src.core.memory`); on an accelerator the packed data's host copy is checked against RAM."""
        est = self.memory
        available, where = self._device_room()
        if available is None:
            return
        if where != "RAM":  # the device holds all but the host copy of the data
            host, _ = memory.available_bytes(jax.devices("cpu")[0])
            if host is not None and est.data / 2 > memory.HEADROOM * host:
                raise ConfigError(f"the run's packed data needs about {memory.gib(est.data / 2)} but "
                                  f"{memory.gib(host)} of RAM is available; use --strategy stream:"
                                  f"{max(1, int(memory.HEADROOM * host // max(est.data / 2 / est.in_flight, 1)))}.")
        movable = 0
        if self.client_state == "device" and self.method.capabilities.host_client_state:
            movable = client_state_lib.tree_bytes(self.round.client_state_shapes())
        host, _ = memory.available_bytes(jax.devices("cpu")[0])
        move = "--client-state host" if where != "RAM" and host and movable <= memory.HEADROOM * host \
            else "--client-state disk"
        problem = memory.refusal(est, available, where, strategy=str(self.round.strategy),
                                 cohort_size=self.config.cohort_size,
                                 stream=self.streamed_option if engine.stream_refusal(self.method) is None
                                 else None,
                                 movable_bytes=movable, move=move)
        if problem:
            raise ConfigError(problem[0].upper() + problem[1:])

    def _place_data(self, decided: str | None = None) -> None:
        """Resolves ``config.data_placement`` (or takes the caller's ``decided`` placement) into
        :attr:`data_placement`; for ``device`` :meth:`place_data_on_device` copies the data once the memory
        checks have passed (they count it as already there), so that data which gives way is never copied.

        ``auto`` is ``device`` on an accelerator when the placed data - every client's training examples,
        labels and index tables, plus the holdout - takes at most :data:`ondevice.DEVICE_MEMORY_FRACTION`
        (a quarter) of its free memory (``bytes_limit`` less what is in use), else ``host``; on CPU it is
        ``host`` (:func:`ondevice.resolve_placement` says why).
        """
        cfg = self.config
        #: bytes the data takes on the device (:func:`ondevice.population_bytes` plus the holdout)
        self.data_bytes = ondevice.population_bytes(self.dataset.x_train, self.clients) + (
            0 if self.holdout is None else sum(int(a.nbytes) for a in self.holdout))
        #: ``host`` or ``device``: where this run's training data lives (``config.data_placement`` resolved)
        self.data_placement = "host" if engine.parse_strategy(cfg.strategy).kind == "stream" else decided or \
            ondevice.resolve_placement(cfg.data_placement, self.data_bytes, ondevice.available_memory(),
                                       jax.devices()[0].platform)  # a streamed cohort is packed a chunk at a time
        # (copied by __init__ once the round is known to fit beside it: :meth:`_device_room`)
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
        per client (:mod:`fedpartial._src.experiment.replicas` gives its seeds one shape).  Padded steps and examples are
        masked no-ops, so training and evaluation are unchanged; on the device the gather's bounds follow
        (its stream length depends on the population only, so the batches drawn stay the same)."""
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
        """``[N]`` each device's simulated time for one round of *full-model* local work on its
        own data (its real steps × the step's FLOPs at its speed, plus the whole model down
        and up): ``ET°_k`` of :func:`fedpartial._src.costs.devices.expected_execution_time`."""
        cfg = self.config
        k = self.round.ctx.cohort_size
        # same shapes as every round's (ids cycled: a cohort padded for several devices may exceed N)
        group_costs = self.costs.group_costs(self.cohort(np.arange(k) % cfg.num_clients, 0))
        per_step = max(c.step_flops + c.prepare_flops for c in group_costs)  # a sub-model's count is full-width
        steps = np.array([packing.steps_for_client(int(n), cfg.batch_size, local_steps=cfg.local_steps,
                                                   local_epochs=cfg.epochs) if n else 0 for n in self.sizes])
        shapes = jax.eval_shape(self.round.pure_init, jax.random.key(0)).variables
        model_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                          for c in self.round.communicated for a in jax.tree.leaves(shapes.get(c, {})))
        return devices.expected_execution_time(self.devices, steps * per_step, model_bytes, model_bytes)

    @property
    def num_params(self) -> int:
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

    def sample_cohort(self, t: int) -> tuple[np.ndarray, np.ndarray, jax.Array, int]:
        """Round ``t``'s client ids, which are real, the round key and packing seed — all from the run's key.

        The cohort is laid out group by group (one group of ``K`` unless the method
        has client groups); each group draws its fixed number of clients from its
        active members (stratified).  When fewer are active, all of them take part
        and the group's slots are filled with inactive members marked not valid
        (they train on nothing and weigh nothing).  A cohort split over devices ends
        with padding clients up to the round's size (ids outside the cohort, not valid);
        the draw is the same as on one device.
        """
        sample_key, round_key, pack_key = jax.random.split(jax.random.fold_in(self.rounds_key, t), 3)
        active = self.active_clients()
        ids, valid = [], []
        extra = self.round.ctx.cohort_size - self.config.cohort_size  # padding slots, at the end
        groups = self.round.groups
        for g, group in enumerate(groups):
            members = np.arange(len(active)) if group.members is None else np.asarray(group.members)
            key = sample_key if len(groups) == 1 else jax.random.fold_in(sample_key, g)
            chosen, real = _draw(key, members, active[members], group.size - (extra if g == len(groups) - 1 else 0))
            ids.append(chosen)
            valid.append(real)
        pack_seed = int(jax.random.randint(pack_key, (), 0, np.iinfo(np.int32).max))
        ids, valid = np.concatenate(ids), np.concatenate(valid)
        if extra:
            ids = np.concatenate([ids, sharding.padding_ids(ids, self.config.num_clients, extra)])
            valid = np.concatenate([valid, np.zeros(extra, bool)])
        return ids, valid, round_key, pack_seed

    def cohort(self, ids: np.ndarray, pack_seed: int, valid: np.ndarray | None = None) -> engine.Cohort:
        """The clients ``ids``' local data for one round, shuffled with ``pack_seed``: packed on the host, or
        gathered on the device (:attr:`data_placement`; the two draw different, equally valid orders)."""
        cfg = self.config
        valid = np.ones(len(ids), bool) if valid is None else np.asarray(valid, bool)
        if self.round.strategy.kind == "stream":
            return self._streamed_cohort(ids, pack_seed, valid)
        if self.data_placement == "device":
            ids = np.asarray(ids, np.int32)
            batch, num_samples, holdout = ondevice.gather_round(
                self._population, self._device_holdout, ids, valid, np.uint32(pack_seed), spec=self._gather_spec)
            return engine.Cohort(data=batch, info=CohortInfo(client_ids=ids, num_samples=num_samples, valid=valid),
                                 holdout=holdout)
        empty = np.zeros(0, np.int64)
        packed = packing.pack_cohort(
            self.dataset.x_train, self.dataset.y_train, [self.clients[i] if v else empty for i, v in zip(ids, valid)],
            batch_size=cfg.batch_size, num_steps=self.num_steps, local_steps=cfg.local_steps,
            local_epochs=cfg.epochs, seed=pack_seed,
        )
        holdout = None
        if self.holdout is not None:
            x, y, mask = self.holdout
            holdout = Holdout(x[ids], y[ids], mask[ids] & valid[:, None])
        return engine.cohort_from_packed(packed, ids, valid, holdout)

    def _streamed_cohort(self, ids: np.ndarray, pack_seed: int, valid: np.ndarray) -> engine.Cohort:
        """The cohort with its data packed a chunk at a time (:class:`engine.ClientData`): each client's
        batches come from its own seed ``(pack_seed, id)``, so they do not depend on its chunk."""
        cfg = self.config
        empty = np.zeros(0, np.int64)
        x, y = self.dataset.x_train, self.dataset.y_train

        def take(rows):
            packed = packing.pack_cohort(
                x, y, [self.clients[i] if v else empty for i, v in zip(ids[rows], valid[rows])],
                batch_size=cfg.batch_size, num_steps=self.num_steps, local_steps=cfg.local_steps,
                local_epochs=cfg.epochs, seed=pack_seed, client_keys=ids[rows])
            return engine.cohort_from_packed(packed, ids[rows]).data

        k, s, b = len(ids), self.num_steps, cfg.batch_size
        x_dtype = x.dtype if np.issubdtype(x.dtype, np.integer) else np.dtype(np.float32)
        spec = engine.Batch(jax.ShapeDtypeStruct((k, s, b, *x.shape[1:]), x_dtype),
                            jax.ShapeDtypeStruct((k, s, b), np.int32), jax.ShapeDtypeStruct((k, s, b), bool),
                            jax.ShapeDtypeStruct((k, s), bool))
        sizes = np.where(valid, self.sizes[ids], 0).astype(np.float32)
        cohort = engine.Cohort(engine.ClientData(take, spec), engine.CohortInfo(np.asarray(ids, np.int32), sizes,
                                                                                np.asarray(valid, bool)))
        if self.holdout is not None:
            hx, hy, mask = self.holdout
            cohort = cohort._replace(holdout=Holdout(hx[ids], hy[ids], mask[ids] & valid[:, None]))
        return cohort

    def placed(self, cohort: engine.Cohort) -> engine.Cohort:
        """The cohort split over the devices (unchanged on one device).  With several processes each keeps only
        its own devices' rows and the global cohort is assembled from them (:func:`sharding.global_cohort`)."""
        if self.mesh is None:
            return cohort
        if jax.process_count() == 1:
            return sharding.shard_cohort(cohort, self.mesh)
        rows = sharding.process_rows(self.round.ctx.cohort_size, self.mesh)
        mine = jax.tree.map(lambda a: np.asarray(a)[rows], cohort)
        return sharding.global_cohort(mine, self.mesh, self.round.ctx.cohort_size)

    def evaluate_personal(self) -> dict:
        """Every client's own model on its held-out split, and the global model on the same splits."""
        x, y, mask = self.holdout
        static = self.config.bn_policy == "static"
        personal = self.method.personal(self.round.ctx, self.method_state(), self.state.variables)
        own = evaluate_clients(self.model, personal, x, y, mask, batch_statistics=static)
        shared = evaluate_clients(self.model, type(personal)(variables=self.state.variables, stacked=False),
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
        """Round ``t``'s cohort and key (the host work before the round); None when early stopping has
        stopped every client."""
        if not self.active_clients().any():
            return None
        start = time.perf_counter()
        ids, valid, round_key, pack_seed = self.sample_cohort(t)
        cohort = self.cohort(ids, pack_seed, valid)
        return PreparedRound(t, ids, valid, round_key, cohort, start, time.perf_counter() - start)

    def finish_round(self, prepared: PreparedRound, metrics: dict, round_time: float | None = None) -> dict:
        """Round ``prepared.round``'s record from the metrics of its round (the state already updated):
        divergence check, traffic, simulated time, running totals and evaluation.

        ``round_time``: the record's ``round_time_s`` (default: the time since :meth:`prepare_round`
        started, the round's host and device work); its ``wall_time_s`` adds the time taken here.
        """
        from fedpartial._src.core.errors import DivergedError  # here: only rounds() is this module's part for faults

        cfg = self.config
        t, ids, valid, cohort = prepared.round, prepared.ids, prepared.valid, prepared.cohort
        metrics = jax.device_get(metrics)
        failed = int(metrics["nonfinite_clients"])
        if bool(metrics["diverged"]):
            what = ("every client's update was non-finite (NaN/inf)" if failed == int(np.sum(valid))
                    else "the global model became non-finite (NaN/inf)")
            raise DivergedError(f"round {t + 1}: {what} — lower --lr or --server-lr, or check the data")
        metrics.update(engine.traffic_totals(metrics))
        finished = time.perf_counter()
        train_time = finished - prepared.start if round_time is None else round_time
        dropout = None  # a sub-model method's kept units, as the round's own plan chose them
        if KEEP_PROBABILITY in metrics:  # masks drawn per local step: each unit's keep probability
            neurons = tuple(np.asarray(n, np.float64) for n in metrics[KEEP_PROBABILITY])
        elif "dropout_neurons" in metrics:
            neurons = tuple(np.asarray(n) for n in metrics["dropout_neurons"])
        if KEEP_PROBABILITY in metrics or "dropout_neurons" in metrics:
            dropout = Mask(layers=np.ones((len(ids), len(neurons)), bool), neurons=neurons)
        self.progress["cumulative_upload_bytes"] += int(metrics["upload_bytes"])
        self.progress["cumulative_download_bytes"] += int(metrics["download_bytes"])
        flops = self.costs.client_flops(engine.data_spec(cohort), metrics["client_steps_per_client"], dropout)
        seconds = devices.client_times(self.devices, ids, flops, metrics["download_bytes_per_client"],
                                       metrics["upload_bytes_per_client"])
        simulated = devices.round_time(seconds, valid)
        self.progress["cumulative_simulated_time_s"] += simulated
        self.progress["round"] = t + 1
        record = {
            "round": t + 1,
            "train_loss": float(metrics["train_loss"]),
            "client_steps": int(metrics["client_steps"]),
            "upload_bytes": int(metrics["upload_bytes"]),
            "download_bytes": int(metrics["download_bytes"]),
            "cumulative_upload_bytes": self.progress["cumulative_upload_bytes"],
            "cumulative_download_bytes": self.progress["cumulative_download_bytes"],
            "round_time_s": train_time,
            "host_time_s": prepared.host_time,
            "clients": int(valid.sum()),
            "nonfinite_clients": failed,
            "client_flops": round(float(np.sum(flops[valid]))),
            "simulated_time_s": simulated,
            "cumulative_simulated_time_s": self.progress["cumulative_simulated_time_s"],
        }
        # The method's own per-round values (its ``metrics`` hook), as JSON numbers / lists.
        for name, value in metrics.items():
            if name not in engine.ENGINE_METRICS and name != KEEP_PROBABILITY and name not in record:
                record[name] = np.asarray(value).tolist()
        if "decisions" in metrics:
            self.last_decisions = {"client_ids": ids, **metrics["decisions"]}
        if self.method.active_clients is not None:
            record["active_clients"] = int(self.active_clients().sum())
        last = t + 1 == cfg.rounds or record.get("active_clients", 1) == 0
        if (t + 1) % cfg.eval_every == 0 or last:
            result = self.evaluate()
            record["test_accuracy"] = result["accuracy"]
            record["test_loss"] = result["loss"]
            if self.holdout is not None:
                record.update(self.evaluate_personal())
        record["wall_time_s"] = train_time + time.perf_counter() - finished
        return record


class PreparedRound(NamedTuple):
    """One round's host inputs (:meth:`Simulation.prepare_round`): who takes part and their data."""

    round: int  # t, counted from 0
    ids: np.ndarray  # [K] client ids
    valid: np.ndarray  # [K] which are real
    key: jax.Array  # the round key
    cohort: engine.Cohort
    start: float  # time.perf_counter() when preparation began
    host_time: float  # seconds of sampling and packing (device placement: the gather's dispatch)


#: a method metric (per layer ``[K, units]``) giving each unit's keep probability when masks are drawn
#: per local step (FedAD ``resample='step'``): the device model counts expected kept units from it
KEEP_PROBABILITY = "dropout_keep_probability"


def unique_run_dir(out_dir: str, name: str) -> str:
    """A fresh directory under ``out_dir``; an existing run is never overwritten."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    suffix = 1
    while os.path.exists(path):
        path = os.path.join(out_dir, f"{name}-{suffix}")
        suffix += 1
    os.makedirs(path)
    return path


def run(config: RunConfig, *, on_round: Callable[[dict], None] | None = None,
        sim: Simulation | None = None, checkpoint_every: int | None = None, resume: str | None = None,
        stop: checkpoint.StopFlag | None = None, **parts) -> dict:
    """Runs a whole simulation; writes ``config.json`` (every value resolved), ``config.toml`` (the same, for
    ``fedpartial run --config``), ``environment.json`` (versions, devices, command line, time),
    ``metrics.jsonl``, ``metrics.csv`` (scalar fields), ``summary.json``, ``status.json``
    and orbax checkpoints (every ``checkpoint_every`` rounds, and always at the end) to a fresh run directory.

    Pass ``sim`` to reuse an already-built :class:`Simulation` of ``config``, or any of
    :class:`Simulation`'s ``method``, ``model``, ``client_optimizer``,
    ``server_optimizer`` to use your own.  ``resume``: an existing run directory whose
    newest checkpoint is loaded into ``sim`` (build it from :func:`load_config`); the run
    continues there, ``metrics.jsonl`` truncated to the checkpoint's round.  Returns the
    summary dict (also holding ``run_dir`` and the per-round records).

    SIGINT/SIGTERM (through ``stop``, or a :class:`~fedpartial._src.experiment.checkpoint.StopFlag`
    installed here) stop the run after the current round: a checkpoint, ``status.json``
    (``interrupted``) and the summary are written, then
    :class:`~fedpartial._src.experiment.checkpoint.RunInterrupted` is raised.  A ``DivergedError`` from
    :meth:`Simulation.rounds` leaves status ``diverged`` and the last good checkpoint;
    any other error status ``failed``; both are raised again after the summary is written.
    Result files are strict JSON: a non-finite number is written as ``null``.
    """
    t0 = time.perf_counter()
    if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                         or checkpoint_every < 1):
        raise UserError(f"checkpoint interval {checkpoint_every!r} must be a whole number of rounds ≥ 1.")
    sim = sim or Simulation(config, **parts)
    writer = RunWriter(sim, checkpoint_every=checkpoint_every, resume=resume)
    error = None
    # A caller's flag (the command line's, installed before the simulation was built) is used as it is.
    with contextlib.nullcontext(stop) if stop is not None else checkpoint.StopFlag() as flag:
        try:
            rounds = iter(()) if flag.stopped else sim.rounds()  # a signal while the simulation was built
            for record in rounds:
                writer.write(record)
                if on_round:
                    on_round(record)
                if flag.stopped:
                    break
        except BaseException as e:  # written down as the run's status, then raised again below
            error = e
        finally:
            writer.close()
        return writer.finish(error, flag.signum, time.perf_counter() - t0)


class RunWriter:
    """A run directory written round by round: what :func:`run` writes, for one :class:`Simulation`.

    Made with the simulation (a fresh directory under ``config.out_dir`` named ``config.run_name`` or
    ``METHOD-DATASET-seedSEED``, or the ``resume`` directory); :meth:`write` takes each round's record,
    :meth:`close` closes the files, :meth:`finish` writes the summary and status.  With no ``out_dir``
    nothing is written and only the records are kept.  :mod:`fedpartial._src.experiment.replicas` keeps one per seed.
    """

    def __init__(self, sim: Simulation, *, checkpoint_every: int | None = None, resume: str | None = None):
        config = sim.config
        self.sim, self.checkpoint_every = sim, checkpoint_every
        self.run_dir = None
        self.records: list[dict] = []
        if resume is not None:
            self.run_dir = resume
            host = checkpoint.restore(resume, sim)
            if checkpoint_every is None:
                self.checkpoint_every = host.get("checkpoint_every")
            self.records = _truncate_metrics(os.path.join(resume, "metrics.jsonl"), sim.progress["round"])
        elif config.out_dir:
            from fedpartial._src.experiment import records as run_record

            name = config.run_name or f"{config.method_name}-{config.dataset}-seed{config.seed}"
            self.run_dir = unique_run_dir(config.out_dir, name)
            # Every value resolved (method options, local epochs, model, train fraction), so the run can be
            # repeated from config.json or config.toml alone; environment.json says what it ran on.
            full = run_record.resolved(config, sim)
            checkpoint.write_json(os.path.join(self.run_dir, "config.json"), dataclasses.asdict(full))
            with open(os.path.join(self.run_dir, "config.toml"), "w") as f:
                f.write(run_record.to_toml(full))
            checkpoint.write_json(os.path.join(self.run_dir, "environment.json"), run_record.environment(config))
        elif checkpoint_every is not None:
            raise UserError("checkpoints need a run directory; give an output directory (out_dir) or no interval.")
        self.resumed_from = sim.progress["round"] if resume is not None else None
        self.saved = checkpoint.latest_round(self.run_dir) if self.run_dir else None
        self.extra = {"checkpoint_every": self.checkpoint_every}
        self.status("running", "resumed from round %d" % self.resumed_from if resume is not None else "")
        self.log = self.table = None
        if self.run_dir:  # scalar fields only, written each round (see fedpartial._src.experiment.records.MetricsCSV)
            from fedpartial._src.experiment.records import MetricsCSV

            self.log = open(os.path.join(self.run_dir, "metrics.jsonl"), "a" if resume is not None else "w")
            self.table = MetricsCSV(os.path.join(self.run_dir, "metrics.csv"), self.records)

    def status(self, state: str, message: str = "") -> None:
        if self.run_dir:
            checkpoint.write_status(self.run_dir, state, round=self.sim.progress["round"], message=message,
                                    checkpoint_round=self.saved)

    def write(self, record: dict) -> None:
        """Keeps one round's record and writes it (metrics, decisions, a checkpoint when due, status)."""
        self.records.append(record)
        if not self.run_dir:
            return
        self.log.write(checkpoint.strict_json(record) + "\n")
        self.log.flush()
        self.table.write(record)
        if self.sim.last_decisions is not None:
            save_decisions(os.path.join(self.run_dir, "decisions", f"round-{record['round']:05d}.npz"),
                           self.sim.last_decisions)
        if self.checkpoint_every and record["round"] % self.checkpoint_every == 0:
            self.saved = checkpoint.save(self.run_dir, self.sim, extra=self.extra)
        self.status("running")

    def close(self) -> None:
        if self.log:
            self.log.close()
            self.table.close()
            self.log = None

    def finish(self, error: BaseException | None, signum: int | None, wall: float) -> dict:
        """Writes the final checkpoint, ``summary.json`` and ``status.json``; raises ``error`` again, or
        :class:`~fedpartial._src.experiment.checkpoint.RunInterrupted` when signal ``signum`` stopped the run early;
        returns the summary with ``run_dir`` and ``records``."""
        sim, run_dir, config = self.sim, self.run_dir, self.sim.config
        done = sim.progress["round"]
        where = f"after round {done} of {config.rounds}"
        if error is None and signum is not None and done < config.rounds:
            if run_dir:
                self.saved = checkpoint.save(run_dir, sim, extra=self.extra)
            name = signal.Signals(signum).name
            message = (f"stopped by {name} {where}; the checkpoint of round {self.saved}, metrics and summary are "
                       f"kept in {run_dir}; continue with: fedpartial run --resume {run_dir}" if run_dir else
                       f"stopped by {name} {where}; nothing was written (no output directory)")
            state = "interrupted"
        elif error is None:
            if run_dir:
                self.saved = checkpoint.save(run_dir, sim, extra=self.extra)
            state, message = "complete", f"{done} rounds"
        else:
            kept = (f"the checkpoint of round {self.saved} is kept" if self.saved is not None
                    else "no checkpoint was written")
            if checkpoint.is_diverged(error):
                state, message = "diverged", f"{str(error).strip().rstrip('.')}; {kept}."
            elif isinstance(error, KeyboardInterrupt):
                state, message = "interrupted", f"interrupted during round {done + 1}; {kept}"
            else:
                state, message = "failed", f"{type(error).__name__}: {str(error).strip().rstrip('.')}; {kept}."
        try:
            summary = summarize(config, sim, self.records, wall, status=state, resumed_from=self.resumed_from)
        except Exception:  # a failed run's summary must never hide its error
            if error is None:
                raise
            summary = {"status": state, "rounds": len(self.records)}
        if run_dir:
            checkpoint.write_json(os.path.join(run_dir, "summary.json"), summary)
            self.status(state, message)
        if error is not None:
            raise error
        result = {**summary, "run_dir": run_dir, "records": self.records}
        if state == "interrupted":
            raise checkpoint.RunInterrupted(signum, message, result)
        return result


def load_config(run_dir: str) -> RunConfig:
    """The :class:`RunConfig` a run directory was started with (its ``config.json``)."""
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"{run_dir!r} is not a run directory to resume (its config.json cannot be read).") from None
    known = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in fields.items() if k in known})


def _truncate_metrics(path: str, upto: int) -> list[dict]:
    """Rounds ``1..upto`` of ``metrics.jsonl`` (each once; a torn last line is dropped); rewrites the file
    with just those, atomically, and returns them (JSON ``null`` read back as NaN, as it was written)."""
    kept: dict[int, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # the line a kill cut short
                if isinstance(record, dict) and 1 <= record.get("round", 0) <= upto:
                    kept.setdefault(record["round"], record)
    records = [kept[r] for r in sorted(kept)]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for record in records:
            f.write(checkpoint.strict_json(record) + "\n")
    os.replace(tmp, path)
    return [{k: math.nan if v is None else v for k, v in r.items()} for r in records]


def save_decisions(path: str, decisions: dict) -> None:
    """Writes one round's plan and selection masks to ``path`` (``.npz``, one array per named field).

    Array names are the pytree paths, e.g. ``selection/upload/layers`` (``[K, L]``)
    or ``plan/train/neurons/0`` (``[K, units_0]``); ``client_ids`` says whose rows they are.
    """
    arrays = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(decisions)[0]:
        name = "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in keys)
        arrays[name] = np.asarray(leaf)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **arrays)


def summarize(config: RunConfig, sim: Simulation, records: list[dict], wall: float, *, status: str = "complete",
              resumed_from: int | None = None) -> dict:
    """The run's totals from its records.  Values that do not exist yet (no evaluated round) are NaN here
    and ``null`` in ``summary.json``; ``status`` is the run's (see :mod:`fedpartial._src.experiment.checkpoint`)."""
    evaluated = [r for r in records if "test_accuracy" in r]
    accs = [r["test_accuracy"] for r in evaluated]
    train_time = sum(r["round_time_s"] for r in records)
    personal = {}
    if sim.holdout is not None and evaluated:
        keys = ("personal_accuracy", "personal_accuracy_std", "personal_accuracy_min", "personal_accuracy_max",
                "global_client_accuracy")
        personal = {f"final_{k}": evaluated[-1][k] for k in keys}
        personal["best_personal_accuracy"] = max(r["personal_accuracy"] for r in evaluated)
    target = config.target_accuracy
    reached = next((r for r in evaluated if target is not None and r["test_accuracy"] >= target), None)
    stopping = {}
    if config.early_stopping:
        stopping = {"rounds_saved": config.rounds - len(records),
                    "stopped_clients": int(config.num_clients - sim.active_clients().sum())}
    return {
        "status": status,
        "method": config.method,
        "dataset": sim.dataset.name,
        "model": sim.model.name,
        "num_params": sim.num_params,
        "strategy": f"{sim.round.strategy.name}:{sim.round.strategy.chunk_size}",
        **({"strategy_note": sim.strategy_note} if sim.strategy_note else {}),
        "devices": 1 if sim.mesh is None else sim.mesh.size,
        "backend": jax.default_backend(),
        "data_placement": sim.data_placement,
        "client_state": sim.client_state,
        "rounds": len(records),
        "final_test_accuracy": accs[-1] if accs else math.nan,
        "best_test_accuracy": max(accs) if accs else math.nan,
        "final_test_loss": evaluated[-1]["test_loss"] if evaluated else math.nan,
        "final_train_loss": records[-1]["train_loss"] if records else math.nan,
        "total_upload_bytes": records[-1]["cumulative_upload_bytes"] if records else 0,
        "total_download_bytes": records[-1]["cumulative_download_bytes"] if records else 0,
        "total_client_steps": sum(r["client_steps"] for r in records),
        "total_client_flops": sum(r["client_flops"] for r in records),
        "total_simulated_time_s": records[-1]["cumulative_simulated_time_s"] if records else 0.0,
        "target_accuracy": target,
        "time_to_target_s": reached["cumulative_simulated_time_s"] if reached else None,
        "round_to_target": reached["round"] if reached else None,
        "train_time_s": train_time,
        "rounds_per_s": len(records) / train_time if train_time else math.nan,
        "wall_time_s": wall,
        "planned_rounds": config.rounds,
        "resumed_from_round": resumed_from,
        "client_train_fraction": sim.train_fraction,
        "personal_state_bytes": sim.personal_state_bytes,
        **personal,
        **stopping,
    }
