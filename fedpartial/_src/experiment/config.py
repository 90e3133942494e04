"""A run's settings: :class:`RunConfig`, pure data, checked field by field with one sentence per bad value.

Only settings live here: no data is loaded, nothing is built, the machine is not asked and JAX is not imported
(a test keeps it so), so the command line, config files, ``fedpartial compare`` and many-seed runs can read and
check a run before anything costly starts.  The checks are :mod:`~fedpartial._src.experiment.config_checks`'
(:meth:`RunConfig.validate`, run once per entry path: its ``validate_once``); what the settings become on this
machine (its devices, the round's strategy, the method) is :func:`fedpartial._src.experiment.plan.resolve`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from fedpartial._src.core.errors import UserError
from fedpartial._src.costs.profile_defaults import DEFAULT_COMPUTE, DEFAULT_DOWNLOAD, DEFAULT_UPLOAD
from fedpartial._src.data.names import NATURAL_DATASETS
from fedpartial._src.experiment.settings import (
    COUNT,
    IN_OPEN_UNIT,
    NON_NEGATIVE,
    POSITIVE,
    ConfigError,  # noqa: F401 -- where callers take it, with RunConfig
    attributes_doc,
    finite,
    is_finite,
    reference_markdown,
    setting,
)

if TYPE_CHECKING:
    from fedpartial._src.core.types import Method
    from fedpartial._src.costs.devices import DeviceProfiles
    from fedpartial._src.engine.strategy import Strategy

#: the population of a dataset that does not bring its own
DEFAULT_CLIENTS = 20
DEFAULT_LOCAL_EPOCHS = 2.0
#: each client's training share when the method needs held-out data and none is given
DEFAULT_TRAIN_FRACTION = 0.7
#: the flags (by destination) that make a run a set of replicas, run as one simulation (not RunConfig fields)
REPLICA_FLAGS = ("seeds", "lrs", "server_lrs")


@dataclasses.dataclass
class RunConfig:
    """One simulation run; the defaults are the offline digits job of the quick start.

    ``RunConfig(**settings)``: each field below is a keyword argument with a default; give only the ones you
    change.  Every field is a setting described once: its section, its meaning, unit and default, and its flag
    of ``fedpartial run`` (the flags and their ``--help`` are generated from these descriptions, as is the
    [configuration reference](../configuration.md), which lists them by section in one table, and the
    Attributes below).  :meth:`validate` judges the settings alone, naming each bad value by its flag.

    Example:
      >>> import fedpartial as fp
      >>> config = fp.RunConfig(method="fedldf", options={"n": 2}, rounds=5, out_dir=None)
      >>> config.validate()
      >>> config.num_clients, config.cohort_size
      (20, 10)
    """

    # --- data and population ---
    dataset: str = setting("digits", section="data", help="the dataset (fedpartial list datasets); digits, "
                           "mnist5k, synthetic and synthetic_text are offline; leaf and hf read files you have "
                           "(the Data page)")
    data_dir: str | None = setting(None, section="data", help="the data folder: tensorflow-datasets' data "
                                   "directory, or the folder of a leaf or hf dataset",
                                   default_text="tensorflow-datasets' own")
    leaf_task: str | None = setting(None, section="data", help="leaf only: the task of the files, femnist, "
                                    "shakespeare or sent140", default_text="read from the files")
    client_column: str | None = setting(None, section="data", help="hf only: the column whose values are the "
                                        "clients (e.g. writer_id)", metavar="COLUMN")
    feature: str | None = setting(None, section="data", help="hf only: the column of the examples",
                                  metavar="COLUMN", default_text="the first of image, img, x, text, tweet, "
                                  "sentence that exists")
    label: str | None = setting(None, section="data", help="hf only: the column of the labels", metavar="COLUMN",
                                default_text="the first of label, labels, y, character, target, sentiment that "
                                "exists")
    max_clients: int | None = setting(None, section="data", help="leaf and hf: take at most N of the users, "
                                      "drawn with --seed", unit="clients", metavar="N", default_text="all")
    min_examples: int | None = setting(None, section="data", help="leaf and hf: leave out users with fewer than "
                                       "N training examples", unit="examples", metavar="N",
                                       default_text="none left out")
    partition: str | None = setting(None, section="data", help="how the data is split over the clients: iid, "
                                    "dirichlet (label skew), shards (a few classes each) or natural (the dataset's "
                                    "own writers/users)", default_text="natural for leaf and hf, else dirichlet")
    alpha: float = setting(0.5, section="data", help="the Dirichlet α of the dirichlet partition (smaller: more "
                           "skewed); for synthetic also its α and β",
                           allowed=finite(lambda v: v >= 0, "≥ 0 (> 0 for the dirichlet partition)"))
    classes_per_client: int = setting(2, section="data", help="classes per client of the shards partition")
    num_clients: int | None = setting(None, section="data", help="the population N", flag="--clients",
                                      unit="clients", default_text="20; for leaf and hf every user of the files",
                                      allowed=COUNT)
    cohort_size: int = setting(10, section="data", help="clients sampled per round K", flag="--cohort",
                               unit="clients")
    train_fraction: float | None = setting(None, section="data", help="each client's share of its data to train "
                                           "on, the rest held out (personalised evaluation, --es)",
                                           default_text="0.7 when the method or --es needs held-out data, else 1",
                                           allowed=finite(lambda v: 0 < v <= 1,
                                                          "in (0, 1] (each client's train fraction; the rest of its data is held out)"))
    max_samples: int | None = setting(None, section="data", help="synthetic only: cap each client's examples at "
                                      "N (its minimum min(50, N)), so that a million clients fit in memory",
                                      unit="examples", metavar="N",
                                      default_text="none: the generator's lognormal sizes, a mean of about 450",
                                      allowed=COUNT)
    seed: int = setting(0, section="data", help="the seed of every random choice: the partition and held-out "
                        "split, cohorts, initial model, drawn device profiles")

    # --- model ---
    model: str = setting("auto", section="model", help="a zoo model (fedpartial list models), "
                         "package.module:factory for your own Flax module, or auto: the dataset's usual model "
                         "(cnn2c1f for digits, mlp for synthetic, shakespeare_lstm for LEAF's Shakespeare, ...)")
    model_size: str = setting("tiny", section="model", help="the named size of a transformer model "
                              "(transformer_lm, transformer_cls, vit): tiny, small, base or gpt2 (GPT-2 small's "
                              "shape); other models take only tiny")
    init_from: str | None = setting(None, section="model", metavar="PATH",
                                    help="start from these parameters instead of a random initial model: a "
                                         "fedpartial run folder (its final model) or a saved parameter file "
                                         "(.npz, fedpartial.models.save_params)",
                                    default_text="none: a random initial model")
    bn_policy: str = setting("global", section="model", help="BatchNorm statistics: global (aggregated like "
                             "weights) or static (not tracked; batch statistics at test time)")
    lora: int | None = setting(None, section="model", metavar="RANK", help="LoRA adapters of this rank on the "
                               "model's Dense layers over a frozen base held once (the LoRA fine-tuning page)", default_text="off")
    lora_alpha: float | None = setting(None, section="model", metavar="ALPHA", help="the LoRA scaling numerator: an "
                                       "adapter adds (alpha/rank)·x·A·B", default_text="the rank (scale 1)")
    lora_targets: str | None = setting(None, section="model", metavar="NAME,...", help="the layers LoRA wraps: "
                                       "layer names or globs, comma-separated", default_text="every block's attention "
                                       "projections and MLP, else every Dense layer but the output layer")
    lora_ranks: str | None = setting(None, section="model", metavar="R,R,...", help="heterogeneous LoRA ranks: "
                                     "clients in equal groups by id train the first r of the --lora adapters' "
                                     "components", default_text="every client the full rank")

    # --- local training ---
    local_steps: int | None = setting(None, section="training", help="local SGD steps per round",
                                      unit="steps", exclusive="local", default_text="none: --local-epochs",
                                      allowed=COUNT)
    local_epochs: float | None = setting(None, section="training", help="local epochs per round",
                                         unit="epochs", exclusive="local",
                                         default_text=f"{DEFAULT_LOCAL_EPOCHS:g} when --local-steps is not given",
                                         allowed=POSITIVE)
    batch_size: int = setting(16, section="training", help="the client batch size", unit="examples", allowed=COUNT)
    client_lr: float = setting(0.05, section="training", help="the client learning rate", flag="--lr", allowed=POSITIVE)
    momentum: float = setting(0.9, section="training", help="the client SGD momentum, in [0, 1)",
                              allowed=finite(lambda v: 0 <= v < 1, "in [0, 1)"))
    weight_decay: float = setting(0.0, section="training", help="the client L2 weight decay (never reaches frozen "
                                  "elements)", allowed=NON_NEGATIVE)

    # --- method ---
    method: str = setting("fedavg", section="method", help="the method (fedpartial list methods), or "
                          "package.module:factory for your own")
    options: dict = setting(section="method", factory=dict, flag="",
                            help="the method's options by name, e.g. {'n': 4}; on the command line each option "
                                 "is a flag of its own (fedpartial run --method NAME --help)")
    early_stopping: bool = setting(False, section="method", flag="--es",
                                   help="early stopping: a client leaves for good when its λ-mixed train/held-out "
                                        "loss rises")
    upload_codec: str | None = setting(None, section="method", metavar="CODEC",
                                       help="compress what each client uploads: topk:F (the largest fraction F of "
                                            "its update, with error feedback), qsgd:B (B-bit QSGD, unbiased) or "
                                            "sign (scaled sign, error feedback); traffic is counted in bits")

    # --- server ---
    rounds: int = setting(40, section="server", help="communication rounds (with --resume: extend the run to this "
                          "many)", unit="rounds", allowed=COUNT)
    server_optimizer: str = setting("sgd", section="server", flag="--server-opt",
                                    help="the server optimizer applied to the round's aggregate: sgd, adam, yogi "
                                         "or adagrad")
    server_lr: float = setting(1.0, section="server", help="the server learning rate", allowed=POSITIVE)

    # --- differential privacy ---
    dp_clip: float | None = setting(None, section="privacy", metavar="C", unit="L2 norm",
                                    help="C: clip each client's update (on what it uploads) to this norm; turns DP "
                                         "on", allowed=POSITIVE)
    dp_noise_multiplier: float | None = setting(None, section="privacy", metavar="Z",
                                                help="z: Gaussian noise of std z·C on the sum of clipped updates "
                                                     "(0: clipping only, no privacy)", allowed=NON_NEGATIVE)
    dp_clip_per_layer: bool = setting(False, section="privacy", help="clip each layer to C/√L (L layers) instead "
                                      "of the whole upload to C")
    dp_delta: float | None = setting(None, section="privacy", help="the δ at which ε is reported",
                                     default_text="1/N, N the population", allowed=IN_OPEN_UNIT)
    dp_target_quantile: float | None = setting(None, section="privacy", metavar="Q",
                                               help="adaptive clipping (Andrew et al. 2021): C follows this "
                                                    "quantile of the clients' update norms, starting from --dp-clip",
                                                    allowed=IN_OPEN_UNIT)

    # --- simulated time: devices, deadlines and availability ---
    device_profiles: str | None = setting(None, section="time", metavar="CSV",
                                          help="device profiles with columns compute_flops_per_s, "
                                               "download_bytes_per_s, upload_bytes_per_s; client i gets row i mod "
                                               "rows (replaces the three distributions)")
    compute_speed: str = setting(DEFAULT_COMPUTE, section="time", metavar="DIST", unit="FLOP/s",
                                 help="each client's compute speed: a number, lognormal:MEDIAN:SIGMA or "
                                      "uniform:LOW:HIGH, drawn with the seed")
    download_bandwidth: str = setting(DEFAULT_DOWNLOAD, section="time", metavar="DIST", unit="bytes/s",
                                      help="each client's download bandwidth (a distribution, as --compute-speed)")
    upload_bandwidth: str = setting(DEFAULT_UPLOAD, section="time", metavar="DIST", unit="bytes/s",
                                    help="each client's upload bandwidth (a distribution, as --compute-speed)")
    sparse_flops: bool = setting(False, section="time",
                                 help="count the FLOPs of a client that trains an element mask (feddst, fiarse) as "
                                      "if it computed only the weights it trains (the engine itself computes "
                                      "densely)", default_text="off: dense")
    round_deadline: float | None = setting(None, section="time", metavar="SECONDS", unit="seconds",
                                           exclusive="deadline",
                                           help="a round waits this long (simulated time) for its clients")
    deadline_quantile: float | None = setting(None, section="time", metavar="Q", exclusive="deadline",
                                              help="the deadline is this quantile of the cohort's predicted times, "
                                                   "each round")
    straggler_policy: str = setting("drop", section="time", help="a client past the deadline: drop (its work is "
                                    "lost) or partial (it trains the steps that fit and uploads them)")
    over_select: float = setting(1.0, section="time", metavar="F", help="sample ceil(F·K) clients and keep the "
                                 "first K to report")
    availability: str = setting("always", section="time", help="who may be sampled: always, a probability (e.g. "
                                "0.7), diurnal[:LOW:HIGH[:PERIOD_S]] or a CSV trace with columns "
                                "client_id,start_s,end_s")

    # --- execution ---
    strategy: str = setting("auto", section="execution", help="how the cohort's clients run: auto, "
                            "fused[:chunk], stepwise[:chunk], stream:chunk, stream-stepwise:chunk or debug "
                            "(the Scale and memory page)")
    data_placement: str = setting("auto", section="execution", help="where the training data lives: device "
                                  "(placed once, batches gathered on the device), host (packed every round) or "
                                  "auto (device on a GPU/TPU when it takes at most a quarter of its free memory, "
                                  "else host)")
    client_state: str = setting("auto", section="execution", help="where the method's per-client state (e.g. "
                                "FedSPU's N personal models) lives: device, host (RAM; only the cohort's rows travel "
                                "each round), disk (memory-mapped files in $TMPDIR) or auto (device while it takes "
                                "at most half the device's free memory, then host, then disk)")
    conv_impl: str = setting("auto", section="execution",
                             help="how convolutions are lowered: auto (the fastest lowering and cohort layout, timed "
                                  "once per model, batch and cohort on this machine and kept in the cache folder), "
                                  "lax, im2col, hybrid or mapped (the Models page)")
    compute_dtype: str = setting("float32", section="execution",
                                 help="dtype of training's forward/backward pass: float32 or bfloat16 (parameters, "
                                      "optimizer state, aggregation and evaluation stay float32)")
    compile_cache: bool = setting(True, section="execution",
                                  help="keep compiled programs in the cache folder ($XDG_CACHE_HOME/fedpartial/jax, "
                                       "else ~/.cache/fedpartial/jax), so a second identical run does not compile "
                                       "again; --no-compile-cache: do not")
    devices: int | None = setting(None, section="execution", metavar="N", unit="devices",
                                  help="split each round's cohort over N local devices (fused strategy: the cohort "
                                       "is padded to a multiple of N with clients that weigh nothing; stepwise:1: "
                                       "N clients trained side by side, one per device)",
                                  default_text="every local device for the fused strategy on a GPU/TPU; on a "
                                               "CPU of several cores, --strategy auto measures the split over "
                                               "them and the command starts again on them unless one "
                                               "device measures faster; "
                                               "else 1")

    # --- asynchronous aggregation (docs/async.md); off by default ---
    mode: str = setting("sync", section="async", help="sync: rounds of a cohort; async: buffered asynchronous "
                        "aggregation (FedBuff; --buffer 1 is FedAsync)")
    concurrency: int | None = setting(None, section="async", metavar="C", unit="clients",
                                      help="async: clients in flight at once", default_text="the buffer")
    buffer: int | None = setting(None, section="async", metavar="M", unit="updates",
                                 help="async: the server steps when M updates have arrived", default_text="--cohort")
    staleness: str = setting("poly:0.5", section="async",
                             help="async: the weight of an update τ server steps old: constant, poly[:A] ((1+τ)^-A, "
                                  "A 0.5) or hinge:A:B (1 up to B, then 1/(A(τ-B)+1))")

    # --- evaluation and output ---
    eval_every: int = setting(1, section="output", help="test the global model every this many rounds",
                              unit="rounds", allowed=COUNT)
    target_accuracy: float | None = setting(None, section="output", help="report the simulated time (and round) "
                                            "at which test accuracy first reaches this",
                                            allowed=finite(lambda v: 0 < v <= 1, "in (0, 1]"))
    out_dir: str | None = setting("runs", section="output", flag="--out", help="the directory run folders are "
                                  "made in (None in Python: write nothing)")
    run_name: str | None = setting(None, section="output", flag="--name", help="the run folder's name, made "
                                   "unique", default_text="METHOD-DATASET-seedSEED")
    record_decisions: bool = setting(False, section="output", help="save every round's plan and selection masks "
                                     "to RUN_DIR/decisions/round-NNNNN.npz")

    def __post_init__(self):
        natural = self.dataset in NATURAL_DATASETS
        if self.num_clients is None and not natural:  # leaf and hf: every user, known once the files are read
            self.num_clients = DEFAULT_CLIENTS
        if self.partition is None:
            self.partition = "natural" if natural else "dirichlet"

    def validate(self, *, custom_method: bool = False, check_model: bool = False) -> None:
        """Raises :class:`ConfigError` naming the first bad value by its command-line flag and what is allowed.

        Each number is checked against the values its setting declares (``allowed``; NaN and ±inf never pass),
        then names, output paths and combinations.  Nothing is created or loaded and the machine is not asked (the run
        asks when it starts).  The configuration remembers that it passed, so its run does not check it again
        unless a setting changed.

        ``custom_method``: the method is a given :class:`Method`, so ``method`` and ``options`` are not looked
        up.  ``check_model``: also refuse, from the names alone, a model the run cannot use (a neuron-level
        method on a residual model, or a model that cannot take the dataset's known example shape); leave it
        off when the caller brings its own dataset or model.
        """
        # the checks read the method and model registries and the engine's names: loaded when a run is checked
        from fedpartial._src.experiment import config_checks

        config_checks.validate(self, custom_method=custom_method, check_model=check_model)

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
        over = self.over_select if is_finite(self.over_select) else 1.0
        return math.ceil(round(over * self.cohort_size, 9))

    @property
    def private(self) -> bool:
        """Whether the run is DP-FedAvg (``--dp-clip`` given)."""
        return self.dp_clip is not None

    @property
    def privacy_delta(self) -> float:
        """The δ at which ε is reported: ``--dp-delta``, else ``1/N``."""
        return self.dp_delta if self.dp_delta is not None else 1.0 / self.num_clients

    @property
    def num_devices(self) -> int:
        """Devices the client axis is split over: ``--devices``, else every local device when the strategy is
        fused on an accelerator, or a CPU's cores in a process started again for them (``auto``), else 1 (it asks
        JAX for the local devices)."""
        return _plan().num_devices(self)

    def run_strategy(self, num_devices: int | None = None, model=None, layout: str | None = None) -> Strategy:
        """The strategy the round runs: ``--strategy`` ('auto' is fused when the cohort is split over devices:
        ``num_devices``, default :attr:`num_devices`; otherwise the platform's rule for ``model``)."""
        return _plan().run_strategy(self, num_devices, model, layout)

    def device_model(self) -> DeviceProfiles:
        """Every client's device ``[N]``: the profiles CSV when given, else drawn with the seed."""
        return _plan().device_model(self)

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
        from fedpartial._src.methods.catalog import find_method  # an import string names a module to import

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
        return _plan().build_method(self)


def _plan():
    """:mod:`~fedpartial._src.experiment.plan`, imported when first asked: it imports JAX, which a config never does."""
    from fedpartial._src.experiment import plan

    return plan


RunConfig.__doc__ += "\n" + "\n".join("    " + line if line else line
                                       for line in attributes_doc(RunConfig).splitlines())


def reference_page() -> str:
    """``docs/configuration.md``: every RunConfig setting by section, and the built-in methods' options."""
    from fedpartial._src.methods.catalog import METHODS

    return reference_markdown(RunConfig, METHODS.values())


if __name__ == "__main__":  # python -m fedpartial._src.experiment.config > docs/configuration.md
    print(reference_page(), end="")
