"""A run's settings: :class:`RunConfig`, checked field by field with one sentence per bad value.

Only settings live here — no data is loaded and nothing is built — so the command line, config
files, ``fedpartial compare`` and many-seed runs can check a run before anything costly starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
import math
import os
from collections.abc import Callable

import jax
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import Method
from fedpartial._src.costs import devices
from fedpartial._src.data import ondevice, sources
from fedpartial._src.engine import asynchronous as engine_async
from fedpartial._src.engine import round as engine
from fedpartial._src.engine import strategy as engine_strategy
from fedpartial._src.experiment import availability
from fedpartial._src.experiment import client_state as client_state_lib
from fedpartial._src.methods.catalog import find_method
from fedpartial._src.methods.codecs import parse_codec
from fedpartial._src.methods.registry import shown
from fedpartial._src.models import registry

#: Model used when ``model='auto'``.
DEFAULT_MODELS = {
    "digits": "cnn2c1f", "synthetic": "mlp", "mnist": "cnn2c1f", "fashion_mnist": "cnn2c1f",
    "emnist": "femnist_cnn", "cifar10": "vgg9", "cifar100": "resnet20", "svhn_cropped": "vgg9",
    "mnist5k": "cnn2c1f", "synthetic_text": "bilstm", "imdb_reviews": "bilstm",
}
PARTITIONS = ("iid", "dirichlet", "shards", "natural")
DEFAULT_LOCAL_EPOCHS = 2.0
#: a run folder's name: file systems allow 255 bytes; a taken name gets a suffix such as "-1"
MAX_RUN_NAME_BYTES = 240
#: each client's training share when the method needs held-out data and none is given
DEFAULT_TRAIN_FRACTION = 0.7
SERVER_OPTIMIZERS = ("sgd", "adam", "yogi", "adagrad")
#: per-client state kept off the device is initialised about this many bytes at a time
CLIENT_STATE_CHUNK_BYTES = 64 * 2**20


class ConfigError(UserError):
    """An invalid run configuration; the message is one sentence for a person."""


#: command-line flag of each RunConfig field whose flag is not ``--field-name``: messages name what people type
_FLAGS = {
    "num_clients": "--clients", "cohort_size": "--cohort", "client_lr": "--lr", "server_lr": "--server-lr",
    "server_optimizer": "--server-opt", "early_stopping": "--es", "out_dir": "--out", "run_name": "--name",
}
#: one example's shape for each dataset whose shape is fixed, so a model that cannot take it is refused
#: before data is loaded (imdb_reviews' default sequence length; synthetic_text's default is 64)
DATASET_SHAPES = {
    "digits": (8, 8, 1), "mnist5k": (28, 28, 1), "synthetic": (60,), "mnist": (28, 28, 1),
    "fashion_mnist": (28, 28, 1), "emnist": (28, 28, 1), "cifar10": (32, 32, 3), "cifar100": (32, 32, 3),
    "svhn_cropped": (32, 32, 3), "synthetic_text": (64,), "imdb_reviews": (256,),
}
_MAX_SEED = 2**32 - 1


def _flag(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


_shown = shown  # a value as people type it


def _refuse(field: str, value, allowed: str):
    raise ConfigError(f"{_flag(field)} {_shown(value)} is not allowed: it must be {allowed}.")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _check_int(config, field: str, low: int, allowed: str | None = None) -> None:
    value = getattr(config, field)
    if not _is_int(value) or value < low:
        _refuse(field, value, allowed or f"a whole number ≥ {low}")


def _check_finite(config, field: str, ok: Callable[[float], bool], allowed: str) -> None:
    """NaN and ±inf are refused first: every comparison with NaN is False, so range checks alone miss it."""
    value = getattr(config, field)
    if value is not None and not (_is_finite(value) and ok(value)):
        _refuse(field, value, f"a finite number {allowed}")


def _check_output(out_dir: str | None, run_name: str | None) -> None:
    """``out_dir`` and ``run_name`` name a folder (whether it can be made is the preflight's question)."""
    if out_dir is None:
        return
    if not isinstance(out_dir, (str, os.PathLike)) or not os.fspath(out_dir):
        _refuse("out_dir", out_dir, "a directory to write run folders in (e.g. runs)")
    if run_name is not None and (
            not isinstance(run_name, str) or not run_name or run_name in (".", "..") or os.path.isabs(run_name)
            or "/" in run_name or (os.sep in run_name) or (os.altsep and os.altsep in run_name)):
        _refuse("run_name", run_name, "a plain folder name without '/' (the folder is made inside --out)")
    if run_name is not None and len(run_name.encode()) > MAX_RUN_NAME_BYTES:
        _refuse("run_name", run_name, f"a folder name of at most {MAX_RUN_NAME_BYTES} bytes (file systems allow "
                                      f"255, and a taken name gets a suffix)")


@dataclasses.dataclass
class RunConfig:
    """One simulation run. Defaults: the offline digits job of the quick start."""

    # --- method and model ---
    method: str = "fedavg"
    options: dict = dataclasses.field(default_factory=dict)  # the method's options, by name (see METHODS)
    early_stopping: bool = False  # a client leaves for good when its train/held-out loss rises (--es)
    model: str = "auto"  # 'auto': the dataset's model in DEFAULT_MODELS

    # --- data and population ---
    dataset: str = "digits"
    data_dir: str | None = None
    partition: str = "dirichlet"
    alpha: float = 0.5
    classes_per_client: int = 2
    num_clients: int = 20
    cohort_size: int = 10
    # each client's share of its data to train on, the rest held out (None: DEFAULT_TRAIN_FRACTION when the method
    # or early stopping needs held-out data, else 1)
    train_fraction: float | None = None
    # synthetic only: each client's examples capped at this (its minimum min(50, cap)), so that a population of
    # a million clients fits in memory (None: the generator's lognormal sizes, a mean of about 450)
    max_samples: int | None = None
    seed: int = 0  # the partition and held-out split, cohorts, initial model, drawn device profiles

    # --- local training ---
    local_steps: int | None = None
    local_epochs: float | None = None  # None with no local_steps: DEFAULT_LOCAL_EPOCHS
    batch_size: int = 16
    client_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    bn_policy: str = "global"

    # --- server ---
    rounds: int = 40
    server_optimizer: str = "sgd"
    server_lr: float = 1.0

    # --- what a client sends: an upload codec around the method (docs/methods.md); off unless given ---
    upload_codec: str | None = None  # 'topk:F' (top-k with error feedback), 'qsgd:B' (B-bit QSGD) or 'sign'
    # the device model credits a client that trains an element mask (FedDST, FIARSE) with computing sparsely: its
    # layers' FLOPs scale with the share it trains (the engine itself computes densely); default dense
    sparse_flops: bool = False

    # --- differential privacy: DP-FedAvg around the method (docs/privacy.md); off unless dp_clip is given ---
    dp_clip: float | None = None  # C: each client's update (on what it uploads) clipped to this L2 norm
    dp_noise_multiplier: float | None = None  # z: Gaussian noise of std z·C on the sum of clipped updates
    dp_clip_per_layer: bool = False  # clip each layer to C/√L instead of the whole upload to C
    dp_delta: float | None = None  # the δ at which ε is reported (None: 1/N)
    dp_target_quantile: float | None = None  # adaptive clipping: C follows this quantile of the update norms

    # --- deadlines, stragglers and availability (docs/deadlines.md); off by default ---
    round_deadline: float | None = None  # seconds of simulated time a round waits for its clients
    deadline_quantile: float | None = None  # or: the deadline is this quantile of the cohort's predicted times
    straggler_policy: str = "drop"  # a client past the deadline: 'drop' (lost) or 'partial' (the steps that fit)
    over_select: float = 1.0  # sample ceil(F·K) clients, keep the first K to report
    availability: str = "always"  # 'always', a probability, 'diurnal[:LOW:HIGH[:PERIOD_S]]' or a CSV trace

    # --- asynchronous aggregation (docs/async.md); off by default ---
    mode: str = "sync"  # 'sync' (rounds of a cohort) or 'async' (buffered asynchronous: FedBuff, FedAsync)
    concurrency: int | None = None  # async: clients in flight at once, C (None: the buffer)
    buffer: int | None = None  # async: updates the server waits for before it steps, M (None: cohort_size)
    staleness: str = "poly:0.5"  # async: an update's weight by its staleness τ: constant, poly[:A], hinge:A:B

    # --- evaluation and output ---
    eval_every: int = 1
    target_accuracy: float | None = None  # the summary reports the simulated time at which it is reached
    out_dir: str | None = "runs"
    run_name: str | None = None
    record_decisions: bool = False  # save every round's plan and selection masks (decisions/*.npz)

    # --- devices and simulated time ---
    # Device model (simulated time, fedpartial._src.costs.devices): a CSV of device profiles (rows cycled by client
    # id) or, without one, distributions drawn with the seed: a number, 'lognormal:MEDIAN:SIGMA' or
    # 'uniform:LOW:HIGH' in FLOP/s (compute) and bytes/s (bandwidths).
    device_profiles: str | None = None
    compute_speed: str = devices.DEFAULT_COMPUTE
    download_bandwidth: str = devices.DEFAULT_DOWNLOAD
    upload_bandwidth: str = devices.DEFAULT_UPLOAD

    # --- execution: the round's strategy, where data and per-client state live, devices ---
    strategy: str = "auto"
    # Where the clients' training data lives: 'device' (placed once, each round's batches gathered in jit),
    # 'host' (packed with numpy every round) or 'auto' (device on an accelerator when it fits in a quarter of
    # its free memory, host on CPU: Simulation.data_placement).
    data_placement: str = "auto"
    # Where the method's per-client state (e.g. FedSPU's N personal models) lives: 'device', 'host' (RAM),
    # 'disk' (memory-mapped files) or 'auto' (Simulation.client_state; fedpartial._src.experiment.client_state.resolve).
    client_state: str = "auto"
    # Devices the client axis is split over (None: see num_devices).  Last: the name hides the devices module
    # from the class body.
    devices: int | None = None

    def validate(self, *, custom_method: bool = False, check_model: bool = False) -> None:
        """Raises :class:`ConfigError` naming the first bad value by its command-line flag and what is allowed.

        Numbers are checked finite first (NaN and ±inf never pass), then their ranges, then names, output
        paths and combinations.  Nothing is created or loaded, and the machine is not asked: whether the run
        fits its memory, devices and disk is :func:`fedpartial._src.experiment.preflight.preflight`'s question.

        ``custom_method``: the run's method is a given :class:`Method` object, so ``method`` and ``options``
        are not looked up in the registry.  ``check_model``: also refuse, from the names alone, a model the
        run cannot use — a neuron-level method (``Capabilities.neuron_masks``) on a residual model, or a model
        that cannot take the dataset's known example shape (:data:`DATASET_SHAPES`).  Leave it off when
        the caller brings its own dataset or model, whose shape the names do not tell.
        """
        def bad(msg):
            raise ConfigError(msg)

        # Types first: a string where a mapping belongs (options='n=4') must not reach the checks below.
        for field in ("method", "dataset", "model", "partition"):
            if not isinstance(getattr(self, field), str):
                bad(f"{_flag(field)} {getattr(self, field)!r} is not allowed: it must be a name (a string).")
        if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
            bad(f"options {self.options!r} is not allowed: it must be a mapping of option names to values, e.g. "
                f"{{'n': 4}} (the method's own flags on the command line).")

        _check_finite(self, "alpha", lambda v: v >= 0, "≥ 0 (> 0 for the dirichlet partition)")
        _check_finite(self, "local_epochs", lambda v: v > 0, "> 0")
        _check_finite(self, "client_lr", lambda v: v > 0, "> 0")
        _check_finite(self, "momentum", lambda v: 0 <= v < 1, "in [0, 1)")
        _check_finite(self, "weight_decay", lambda v: v >= 0, "≥ 0")
        _check_finite(self, "server_lr", lambda v: v > 0, "> 0")
        _check_finite(self, "train_fraction", lambda v: 0 < v <= 1,
                      "in (0, 1] (each client's train fraction; the rest of its data is held out)")
        _check_finite(self, "target_accuracy", lambda v: 0 < v <= 1, "in (0, 1]")
        _check_finite(self, "dp_clip", lambda v: v > 0, "> 0")
        _check_finite(self, "dp_noise_multiplier", lambda v: v >= 0, "≥ 0")
        _check_finite(self, "dp_delta", lambda v: 0 < v < 1, "in (0, 1)")
        _check_finite(self, "dp_target_quantile", lambda v: 0 < v < 1, "in (0, 1)")
        if self.upload_codec is not None:
            parse_codec(self.upload_codec)  # a bad codec is one sentence
        if not isinstance(self.sparse_flops, bool):
            _refuse("sparse_flops", self.sparse_flops, "true or false")
        for field in ("num_clients", "rounds", "batch_size", "eval_every"):
            _check_int(self, field, 1)
        if self.local_steps is not None:
            _check_int(self, "local_steps", 1)
        if self.max_samples is not None:
            _check_int(self, "max_samples", 1)
        if self.local_steps is not None and self.local_epochs is not None:
            bad("give only one of --local-steps or --local-epochs.")
        if not _is_int(self.cohort_size) or not 1 <= self.cohort_size <= self.num_clients:
            _refuse("cohort_size", self.cohort_size, f"between 1 and --clients ({self.num_clients})")
        _check_int(self, "seed", 0, f"a whole number from 0 to {_MAX_SEED}")
        if self.seed > _MAX_SEED:
            _refuse("seed", self.seed, f"a whole number from 0 to {_MAX_SEED}")
        if not custom_method:
            try:
                spec = find_method(self.method)  # built in, installed (entry point) or package.module:factory
            except UserError as e:
                bad(f"--{e}")
            try:  # the options' own checks (Option.problem), said as the command line says them
                spec.check(dict(self.options), typed=True)
            except UserError as e:
                bad(str(e))
            tiers = dict(self.options).get("tiers")
            if isinstance(tiers, (tuple, list)) and len(tiers) > self.num_clients:  # equal clusters by client id
                bad(f"--tiers gives {len(tiers)} keep ratios but the population has {self.num_clients} clients "
                    f"(--clients), so some tiers would have nobody; give at most {self.num_clients}.")
        if self.dataset not in sources.DATASETS:
            bad(f"--dataset {self.dataset!r} is unknown; choose one of {', '.join(sources.DATASETS)}.")
        if self.model != "auto" and self.model not in registry.MODELS:
            bad(f"--model {self.model!r} is unknown; choose 'auto' or one of {', '.join(sorted(registry.MODELS))}.")
        if self.max_samples is not None and self.dataset != "synthetic":
            bad(f"--max-samples applies to --dataset synthetic only, not {self.dataset!r}.")
        if self.partition not in PARTITIONS:
            bad(f"--partition {self.partition!r} is unknown; choose one of {', '.join(PARTITIONS)}.")
        if self.partition == "dirichlet" and not self.alpha > 0:
            _refuse("alpha", self.alpha, "> 0 for the dirichlet partition (the Dirichlet α)")
        if self.partition == "shards":
            _check_int(self, "classes_per_client", 1)
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            bad(f"--server-opt {self.server_optimizer!r} is unknown; choose one of {', '.join(SERVER_OPTIMIZERS)}.")
        if self.early_stopping and self.train_fraction is not None and self.train_fraction >= 1:
            bad("--es needs each client's held-out split; use a --train-fraction below 1 (e.g. 0.7).")
        self._check_privacy(custom_method)
        self._check_rounds_in_time()
        self._check_async(custom_method)
        if self.bn_policy not in engine.BN_POLICIES:
            bad(f"--bn-policy {self.bn_policy!r} is unknown; choose one of {', '.join(engine.BN_POLICIES)} "
                "(the BatchNorm policy).")
        if self.data_placement not in ondevice.PLACEMENTS:
            bad(f"--data-placement {self.data_placement!r} is unknown; choose one of "
                f"{', '.join(ondevice.PLACEMENTS)}.")
        try:
            strategy = engine_strategy.parse_strategy(self.strategy)
        except ValueError as e:
            bad(f"--{e}")
        if strategy.kind == "stream" and not custom_method:
            problem = ("early stopping (--es) keeps per-client state, so the run cannot be streamed"
                       if self.early_stopping else
                       "a deadline or over-selection predicts every client's time from the whole cohort's data "
                       "before the round, so the run cannot be streamed" if self.deadlines else
                       "differential privacy (--dp-clip) adds its noise to the whole cohort's sum, so the run cannot "
                       "be streamed" if self.private else engine_strategy.stream_refusal(self.build_method()))
            if problem:
                bad(f"--strategy {self.strategy} is not allowed: {problem}; use --strategy auto, fused, fused:N "
                    "or stepwise:N.")
        if self.client_state not in client_state_lib.PLACES:
            bad(f"--client-state {self.client_state!r} is unknown; choose one of "
                f"{', '.join(client_state_lib.PLACES)}.")
        if self.client_state in ("host", "disk") and self.devices is not None and self.devices > 1:
            bad(f"--client-state {self.client_state} is not allowed with --devices {self.devices}: per-client "
                "state kept off the device runs on one device; use --devices 1.")
        if strategy.kind == "stream" and self.data_placement == "device":
            bad(f"--data-placement device is not allowed with --strategy {self.strategy}: a streamed cohort is "
                "packed on the host a chunk at a time; use --data-placement host or auto.")
        if self.devices is not None:
            self._check_devices()
        try:  # nothing the population's size is drawn: a huge --clients is the preflight's to refuse
            if self.device_profiles is None:
                for field in ("compute_speed", "download_bandwidth", "upload_bandwidth"):
                    devices.parse_distribution(getattr(self, field), _flag(field))
            else:
                devices.load_profiles(self.device_profiles, 1)
        except UserError as e:
            bad(str(e))
        _check_output(self.out_dir, self.run_name)
        if check_model:
            self._check_model(custom_method)

    def _check_privacy(self, custom_method: bool) -> None:
        """The DP flags: both ``--dp-clip`` and ``--dp-noise-multiplier`` or neither, the others only with them, and a
        method whose server step does not read the updates outside the noised sum."""
        if self.dp_clip is None and self.dp_noise_multiplier is not None:
            raise ConfigError("--dp-noise-multiplier needs --dp-clip (the norm each client's update is clipped to, "
                              "which the noise is scaled by).")
        if self.dp_clip is not None and self.dp_noise_multiplier is None:
            raise ConfigError("--dp-clip needs --dp-noise-multiplier (0 clips without noise, which gives no privacy).")
        if not isinstance(self.dp_clip_per_layer, bool):
            _refuse("dp_clip_per_layer", self.dp_clip_per_layer, "true or false")
        for field in ("dp_delta", "dp_target_quantile", "dp_clip_per_layer"):
            if not self.private and getattr(self, field) not in (None, False):
                raise ConfigError(f"{_flag(field)} needs --dp-clip and --dp-noise-multiplier (differential privacy "
                                  "is off without them).")
        if self.private and not custom_method:
            try:
                method = self.build_method()
            except UserError:
                return  # the method's own sentence comes from the method checks
            if method.server_correct is not None:
                raise ConfigError(f"--method {self.method} cannot run with differential privacy: its server step "
                                  "reads every client's update outside the clipped, noised sum.")

    def _check_rounds_in_time(self) -> None:
        """The deadline flags (one of ``--round-deadline`` and ``--deadline-quantile``; ``partial`` only with one),
        ``--over-select`` (its ⌈F·K⌉ clients within the population) and ``--availability``."""
        _check_finite(self, "round_deadline", lambda v: v > 0, "> 0 (seconds of simulated time)")
        _check_finite(self, "deadline_quantile", lambda v: 0 < v <= 1, "in (0, 1]")
        if self.round_deadline is not None and self.deadline_quantile is not None:
            raise ConfigError("give only one of --round-deadline or --deadline-quantile.")
        if self.straggler_policy not in ("drop", "partial"):
            _refuse("straggler_policy", self.straggler_policy, "drop or partial")
        if self.straggler_policy == "partial" and self.round_deadline is None and self.deadline_quantile is None:
            raise ConfigError("--straggler-policy partial needs a deadline (--round-deadline or --deadline-quantile).")
        _check_finite(self, "over_select", lambda v: v >= 1, "≥ 1 (⌈F·K⌉ clients are sampled for a cohort of K)")
        if self.sampled_size > self.num_clients:
            _refuse("over_select", self.over_select, f"at most {self.num_clients / self.cohort_size:g}: "
                                                     f"⌈F·K⌉ clients are sampled from --clients {self.num_clients}")
        try:
            kind, params = availability.parse(self.availability)
            if kind == "trace":  # bad rows are refused before any data is loaded
                availability.load_trace(*params)
        except UserError as e:
            raise ConfigError(str(e)) from None

    def _check_async(self, custom_method: bool) -> None:
        """``--mode`` and the asynchronous flags (only with ``--mode async``; ``M ≤ C ≤ N``), and what an asynchronous
        run cannot combine with (:mod:`fedpartial._src.engine.asynchronous`)."""
        if self.mode not in ("sync", "async"):
            _refuse("mode", self.mode, "sync or async")
        if self.mode == "sync":
            for field in ("concurrency", "buffer"):
                if getattr(self, field) is not None:
                    raise ConfigError(f"{_flag(field)} needs --mode async.")
            if self.staleness != RunConfig.staleness:
                raise ConfigError("--staleness needs --mode async.")
            return
        try:
            engine_async.parse_staleness(self.staleness)
        except UserError as e:
            raise ConfigError(str(e)) from None
        for field in ("concurrency", "buffer"):
            if getattr(self, field) is not None:
                _check_int(self, field, 1)
        if self.async_concurrency > self.num_clients:
            _refuse("concurrency", self.async_concurrency, f"at most --clients ({self.num_clients}): each client in "
                                                           "flight is a different one")
        if self.async_buffer > self.async_concurrency:
            raise ConfigError(f"--buffer {self.async_buffer} is larger than --concurrency {self.async_concurrency}: "
                              "the server would wait for more updates than are ever in flight.")
        clash = ("a deadline or over-selection (a synchronous round's)" if self.deadlines else
                 "early stopping (--es)" if self.early_stopping else "--upload-codec" if self.upload_codec else
                 "the streamed strategy" if self.strategy.startswith("stream") else
                 "--devices above 1" if self.devices is not None and self.devices > 1 else
                 f"--client-state {self.client_state}" if self.client_state in ("host", "disk") else None)
        if clash:
            raise ConfigError(f"--mode async cannot run with {clash}; leave it out.")
        if not custom_method:
            problem = engine_async.async_refusal(self.build_method())
            if problem:
                raise ConfigError(f"--mode async is not allowed: {problem}.")

    @property
    def async_buffer(self) -> int:
        """``M``: ``--buffer``, else ``--cohort``."""
        return self.buffer if self.buffer is not None else self.cohort_size

    @property
    def async_concurrency(self) -> int:
        """``C``: ``--concurrency``, else the buffer."""
        return self.concurrency if self.concurrency is not None else self.async_buffer

    @property
    def deadlines(self) -> bool:
        """Whether clients' times are predicted before each round (a deadline or over-selection is set)."""
        return self.round_deadline is not None or self.deadline_quantile is not None or self.over_select > 1

    @property
    def sampled_size(self) -> int:
        """Clients sampled a round: ``⌈F·K⌉`` with ``--over-select F`` (``K`` without)."""
        over = self.over_select if _is_finite(self.over_select) else 1.0
        return math.ceil(round(over * self.cohort_size, 9))

    @property
    def private(self) -> bool:
        """Whether the run is DP-FedAvg (``--dp-clip`` given)."""
        return self.dp_clip is not None

    @property
    def privacy_delta(self) -> float:
        """The δ at which ε is reported: ``--dp-delta``, else ``1/N``."""
        return self.dp_delta if self.dp_delta is not None else 1.0 / self.num_clients

    def _check_devices(self) -> None:
        """``--devices``: a whole number ≥ 1 (at most the local device count: the preflight's), with a strategy
        that splits."""
        _check_int(self, "devices", 1)
        kind = engine_strategy.parse_strategy(self.strategy).kind
        if self.devices > 1 and self.strategy != "auto" and kind != "fused":
            raise ConfigError(f"--devices {self.devices} needs the fused strategy (--strategy fused or fused:N); "
                              f"--strategy {self.strategy} runs on one device.")

    @property
    def num_devices(self) -> int:
        """Devices the client axis is split over: ``--devices``, else every local device when the strategy is
        fused on an accelerator, else 1 (fake CPU devices share the same cores: splitting gains nothing)."""
        if self.devices is not None:
            return self.devices
        fused = engine_strategy.parse_strategy(self.strategy).kind == "fused"
        return jax.local_device_count() if fused and jax.default_backend() != "cpu" else 1

    def run_strategy(self, num_devices: int | None = None, model=None) -> engine_strategy.Strategy:
        """The strategy the round runs: ``--strategy`` ('auto' is fused when the cohort is split over devices:
        ``num_devices``, default :attr:`num_devices`; otherwise the platform's rule for ``model``)."""
        if self.strategy == "auto" and (num_devices or self.num_devices) > 1:
            return engine_strategy.fused()
        return engine_strategy.parse_strategy(self.strategy, model)

    def _check_model(self, custom_method: bool) -> None:
        """Refuses a model the run cannot use, from the registry alone (building a model takes seconds)."""
        name = DEFAULT_MODELS.get(self.dataset, "mlp") if self.model == "auto" else self.model
        spec = registry.MODELS[name]
        if not custom_method and not spec.sequential and self.build_method().capabilities.neuron_masks:
            chains = ", ".join(n for n, s in registry.MODELS.items() if s.sequential)
            raise ConfigError(f"--method {self.method} drops single neurons, which needs a sequential model "
                              f"(a chain of layers), but --model {name} has residual connections; choose one "
                              f"of {chains}.")
        shape = DATASET_SHAPES.get(self.dataset)
        if shape is None:
            return
        module = spec.factory(10, shape)  # a flax module is a dataclass: no parameters are made
        validate = getattr(module, "validate_input_shape", None)
        if validate is not None:
            try:
                validate(shape)
            except UserError as e:
                raise ConfigError(f"--model {name} cannot take --dataset {self.dataset} "
                                  f"({'x'.join(map(str, shape))} examples): {str(e).rstrip('.')}.") from None

    def device_model(self) -> devices.DeviceProfiles:
        """Every client's device ``[N]``: the profiles CSV when given, else drawn with the seed."""
        if self.device_profiles is not None:
            return devices.load_profiles(self.device_profiles, self.num_clients)
        return devices.sample_profiles(self.num_clients, self.seed, compute=self.compute_speed,
                                       download=self.download_bandwidth, upload=self.upload_bandwidth)

    @property
    def epochs(self) -> float | None:
        """Local epochs in effect: the given ones, or the default when no local steps are given."""
        if self.local_epochs is None and self.local_steps is None:
            return DEFAULT_LOCAL_EPOCHS
        return self.local_epochs

    @property
    def method_name(self) -> str:
        """The method's own name, for run folders and summaries: ``package.module:SPEC`` gives the name its spec
        declares, ``package.module:factory`` the name of the Method it builds; never the import string (a colon
        has no place in a folder name)."""
        if ":" not in self.method:
            return self.method
        try:
            name = find_method(self.method).name
            if ":" in name:  # a plain factory is named by its import string until it is built
                name = self.build_method().name
        except (UserError, TypeError):
            name = self.method
        # the attribute's name when the Method's is unusable as a folder name
        return name if name and ":" not in name and "/" not in name else self.method.rpartition(":")[2]

    def build_method(self) -> Method:
        """The registered method with this configuration's options (before early stopping), and this run's
        values of the settings it reads (``MethodSpec.run_settings``, e.g. FedNova's client ``momentum``)."""
        spec = find_method(self.method)  # an unknown name: one sentence naming the known methods
        settings = {name: getattr(self, name) for name in spec.run_settings}
        return spec.factory(**spec.check(dict(self.options)), **settings)
