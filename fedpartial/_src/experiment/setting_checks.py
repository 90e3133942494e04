"""The checks of a run's settings, each a function of the configuration: one sentence per bad value, naming it by
its flag (:func:`~fedpartial._src.experiment.config_checks.validate` runs them in order), and the names and ranges
they judge against (partitions, server optimizers, the usual model of each dataset, the example shapes).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import Method
from fedpartial._src.data.names import NATURAL_DATASETS
from fedpartial._src.engine import asynchronous as engine_async
from fedpartial._src.engine import strategy as engine_strategy
from fedpartial._src.experiment import availability
from fedpartial._src.experiment import client_state as client_state_lib
from fedpartial._src.experiment.deadlines import POLICIES as STRAGGLER_POLICIES
from fedpartial._src.experiment.settings import ConfigError, described, flag_of, is_finite, is_int, optional
from fedpartial._src.methods.catalog import find_method
from fedpartial._src.methods.registry import shown
from fedpartial._src.models import registry

PARTITIONS = ("iid", "dirichlet", "shards", "natural")
SERVER_OPTIMIZERS = ("sgd", "adam", "yogi", "adagrad")
#: the largest seed (numpy's seeds are 32-bit)
MAX_SEED = 2**32 - 1
#: Model used when ``model='auto'``.
DEFAULT_MODELS = {
    "digits": "cnn2c1f", "synthetic": "mlp", "mnist": "cnn2c1f", "fashion_mnist": "cnn2c1f",
    "emnist": "femnist_cnn", "cifar10": "vgg9", "cifar100": "resnet20", "svhn_cropped": "vgg9",
    "mnist5k": "cnn2c1f", "synthetic_text": "bilstm", "imdb_reviews": "bilstm", "synthetic_lm": "transformer_lm",
}
#: one example's shape for each dataset whose shape is fixed, so a model that cannot take it is refused
#: before data is loaded (imdb_reviews' default sequence length; synthetic_text's default is 64)
DATASET_SHAPES = {
    "digits": (8, 8, 1), "mnist5k": (28, 28, 1), "synthetic": (60,), "mnist": (28, 28, 1),
    "fashion_mnist": (28, 28, 1), "emnist": (28, 28, 1), "cifar10": (32, 32, 3), "cifar100": (32, 32, 3),
    "svhn_cropped": (32, 32, 3), "synthetic_text": (64,), "imdb_reviews": (256,), "synthetic_lm": (32,),
}
#: a run folder's name: file systems allow 255 bytes; a taken name gets a suffix such as "-1"
MAX_RUN_NAME_BYTES = 240


def build_method(config) -> Method:
    """The registered method with ``config``'s options (before early stopping), and this run's values of the
    settings it reads (``MethodSpec.run_settings``, e.g. FedNova's client ``momentum``): what the checks judge,
    and the run's method (:func:`fedpartial._src.experiment.plan.resolve`)."""
    spec = find_method(config.method)  # an unknown name: one sentence naming the known methods
    settings = {name: getattr(config, name) for name in spec.run_settings}
    return spec.factory(**spec.check(dict(config.options)), **settings)


def model_name(config) -> str:
    """The zoo model (or import string) the run names: ``--model``, or for ``auto`` the dataset's usual one."""
    return DEFAULT_MODELS.get(config.dataset, "mlp") if config.model == "auto" else config.model


def flag(config, field: str) -> str:
    """The flag of ``config``'s field named ``field``: what messages name."""
    return flag_of(field, type(config))


def refuse(config, field: str, value, allowed: str):
    """Raises the one sentence refusing ``value`` of ``config``'s ``field``, naming its flag."""
    raise ConfigError(f"{flag(config, field)} {shown(value)} is not allowed: it must be {allowed}.")


def check_int(config, field: str, low: int, allowed: str | None = None) -> None:
    value = getattr(config, field)
    if not is_int(value) or value < low:
        refuse(config, field, value, allowed or f"a whole number ≥ {low}")


def check_finite(config, field: str, ok: Callable[[float], bool], allowed: str) -> None:
    """NaN and ±inf are refused first: every comparison with NaN is False, so range checks alone miss it."""
    value = getattr(config, field)
    if value is not None and not (is_finite(value) and ok(value)):
        refuse(config, field, value, f"a finite number {allowed}")


def check_allowed(config, field: dataclasses.Field | str) -> None:
    """A setting's value against the values its declaration allows (``setting(..., allowed=...)``:
    :class:`~fedpartial._src.experiment.settings.Allowed`), refused in one sentence naming its flag."""
    if isinstance(field, str):
        field = next(f for f in dataclasses.fields(config) if f.name == field)
    allowed = described(field).allowed
    value = getattr(config, field.name)
    problem = allowed.refusal(value, optional(field)) if allowed is not None else None
    if problem:
        refuse(config, field.name, value, problem)


def check_seed(config) -> None:
    """``--seed``: a whole number numpy takes."""
    check_int(config, "seed", 0, f"a whole number from 0 to {MAX_SEED}")
    if config.seed > MAX_SEED:
        refuse(config, "seed", config.seed, f"a whole number from 0 to {MAX_SEED}")


def check_replica(config) -> None:
    """What one replica of a set (``--seeds``, ``--lrs``, ``--server-lrs``) sets on its own: its seed, learning
    rates and run folder; the settings the replicas share are judged once, on the configuration they come from."""
    check_allowed(config, "client_lr")  # in validate's order
    check_allowed(config, "server_lr")
    check_seed(config)
    check_output(config)


def check_output(config) -> None:
    """``out_dir`` and ``run_name`` name a folder (whether it can be made is the preflight's question)."""
    out_dir, run_name = config.out_dir, config.run_name
    if out_dir is None:
        return
    if not isinstance(out_dir, (str, os.PathLike)) or not os.fspath(out_dir):
        refuse(config, "out_dir", out_dir, "a directory to write run folders in (e.g. runs)")
    if run_name is not None and (
            not isinstance(run_name, str) or not run_name or run_name in (".", "..") or os.path.isabs(run_name)
            or "/" in run_name or (os.sep in run_name) or (os.altsep and os.altsep in run_name)):
        refuse(config, "run_name", run_name, "a plain folder name without '/' (the folder is made inside --out)")
    if run_name is not None and len(run_name.encode()) > MAX_RUN_NAME_BYTES:
        refuse(config, "run_name", run_name, f"a folder name of at most {MAX_RUN_NAME_BYTES} bytes (file systems allow "
                                      f"255, and a taken name gets a suffix)")



def check_privacy(config, custom_method: bool) -> None:
    """The DP flags: both ``--dp-clip`` and ``--dp-noise-multiplier`` or neither, the others only with them, and a
    method whose server step does not read the updates outside the noised sum."""
    if config.dp_clip is None and config.dp_noise_multiplier is not None:
        raise ConfigError("--dp-noise-multiplier needs --dp-clip (the norm each client's update is clipped to, "
                          "which the noise is scaled by).")
    if config.dp_clip is not None and config.dp_noise_multiplier is None:
        raise ConfigError("--dp-clip needs --dp-noise-multiplier (0 clips without noise, which gives no privacy).")
    if not isinstance(config.dp_clip_per_layer, bool):
        refuse(config, "dp_clip_per_layer", config.dp_clip_per_layer, "true or false")
    for field in ("dp_delta", "dp_target_quantile", "dp_clip_per_layer"):
        if not config.private and getattr(config, field) not in (None, False):
            raise ConfigError(f"{flag(config, field)} needs --dp-clip and --dp-noise-multiplier (differential privacy "
                              "is off without them).")
    if config.private and not custom_method:
        try:
            method = build_method(config)
        except UserError:
            return  # the method's own sentence comes from the method checks
        if method.server_correct is not None or method.rewrite_global is not None:
            raise ConfigError(f"--method {config.method} cannot run with differential privacy: its server step "
                              "reads every client's update outside the clipped, noised sum.")

def check_rounds_in_time(config) -> None:
    """The deadline flags (one of ``--round-deadline`` and ``--deadline-quantile``; ``partial`` only with one),
    ``--over-select`` (its ⌈F·K⌉ clients within the population) and ``--availability``."""
    check_finite(config, "round_deadline", lambda v: v > 0, "> 0 (seconds of simulated time)")
    check_finite(config, "deadline_quantile", lambda v: 0 < v <= 1, "in (0, 1]")
    if config.round_deadline is not None and config.deadline_quantile is not None:
        raise ConfigError("give only one of --round-deadline or --deadline-quantile.")
    if config.straggler_policy not in STRAGGLER_POLICIES:
        refuse(config, "straggler_policy", config.straggler_policy, " or ".join(STRAGGLER_POLICIES))
    if config.straggler_policy == "partial" and config.round_deadline is None and config.deadline_quantile is None:
        raise ConfigError("--straggler-policy partial needs a deadline (--round-deadline or --deadline-quantile).")
    check_finite(config, "over_select", lambda v: v >= 1, "≥ 1 (⌈F·K⌉ clients are sampled for a cohort of K)")
    check_sampled_fits(config)
    try:
        kind, params = availability.parse(config.availability)
        if kind == "trace":  # bad rows are refused before any data is loaded
            availability.load_trace(*params)
    except UserError as e:
        raise ConfigError(str(e)) from None

def check_async(config, custom_method: bool) -> None:
    """``--mode`` and the asynchronous flags (only with ``--mode async``; ``M ≤ C ≤ N``), and what an asynchronous
    run cannot combine with (:mod:`fedpartial._src.engine.asynchronous`)."""
    if config.mode not in ("sync", "async"):
        refuse(config, "mode", config.mode, "sync or async")
    if config.mode == "sync":
        for field in ("concurrency", "buffer"):
            if getattr(config, field) is not None:
                raise ConfigError(f"{flag(config, field)} needs --mode async.")
        if config.staleness != type(config).staleness:
            raise ConfigError("--staleness needs --mode async.")
        return
    try:
        engine_async.parse_staleness(config.staleness)
    except UserError as e:
        raise ConfigError(str(e)) from None
    for field in ("concurrency", "buffer"):
        if getattr(config, field) is not None:
            check_int(config, field, 1)
    check_concurrency_fits(config)
    if config.async_buffer > config.async_concurrency:
        raise ConfigError(f"--buffer {config.async_buffer} is larger than --concurrency {config.async_concurrency}: "
                          "the server would wait for more updates than are ever in flight.")
    clash = ("a deadline or over-selection (a synchronous round's)" if config.deadlines else
             "early stopping (--es)" if config.early_stopping else "--upload-codec" if config.upload_codec else
             "the streamed strategy" if config.strategy.startswith("stream") else
             "--devices above 1" if config.devices is not None and config.devices > 1 else
             f"--client-state {config.client_state}" if config.client_state in client_state_lib.OFF_DEVICE else None)
    if clash:
        raise ConfigError(f"--mode async cannot run with {clash}; leave it out.")
    if not custom_method:
        problem = engine_async.async_refusal(build_method(config))
        if problem:
            raise ConfigError(f"--mode async is not allowed: {problem}.")


def check_devices(config) -> None:
    """``--devices``: a whole number ≥ 1 (at most the local device count: the preflight's), with a strategy
    that splits."""
    check_int(config, "devices", 1)
    strategy = engine_strategy.parse_strategy(config.strategy)
    side_by_side = strategy.kind == "stepwise" and strategy.chunk_size == 1  # one client per device at a time
    if config.devices > 1 and config.strategy != "auto" and strategy.kind != "fused" and not side_by_side:
        raise ConfigError(f"--devices {config.devices} needs the fused strategy (--strategy fused or fused:N) or "
                          f"stepwise:1; --strategy {config.strategy} runs on one device.")


def check_natural_data(config) -> None:
    """The settings of naturally federated files (``--dataset leaf`` and ``hf``: docs/data.md) go with those
    datasets only, and those datasets' clients are their users (``--partition natural``)."""
    from fedpartial._src.data import leaf

    dataset = config.dataset
    for field, datasets in (("leaf_task", ("leaf",)), ("client_column", ("hf",)), ("feature", ("hf",)),
                            ("label", ("hf",)), ("max_clients", NATURAL_DATASETS),
                            ("min_examples", NATURAL_DATASETS)):
        if getattr(config, field) is not None and dataset not in datasets:
            raise ConfigError(f"{flag(config, field)} applies to --dataset {' and '.join(datasets)} only, not "
                              f"{dataset!r}.")
    for field in ("max_clients", "min_examples"):
        if getattr(config, field) is not None:
            check_int(config, field, 1)
    if dataset not in NATURAL_DATASETS:
        return
    if config.partition != "natural":
        raise ConfigError(f"--partition {config.partition} is not allowed with --dataset {dataset}: its clients are "
                          "the users of its files; leave --partition out (natural).")
    if not config.data_dir:
        where = "the folder holding LEAF's train/ and test/" if dataset == "leaf" else \
            "a dataset saved with save_to_disk or a folder of parquet files"
        raise ConfigError(f"--dataset {dataset} needs --data-dir: {where}.")
    if dataset == "leaf" and config.leaf_task is not None and config.leaf_task not in leaf.LEAF_TASKS:
        refuse(config, "leaf_task", config.leaf_task, f"one of {', '.join(leaf.LEAF_TASKS)}")
    if dataset == "hf" and not config.client_column:
        raise ConfigError("--dataset hf needs --client-column, the column whose values are the clients (e.g. "
                          "writer_id).")
    check_within_max_clients(config)


def check_model_size(config) -> None:
    """``--model-size``: a named size, for a model that comes in sizes."""
    from fedpartial._src.models import transformer

    name = model_name(config)
    if config.model_size not in transformer.SIZES:
        refuse(config, "model_size", config.model_size, f"one of {', '.join(transformer.SIZES)}")
    if name in registry.MODELS and not registry.MODELS[name].sized:
        raise ConfigError(f"--model-size {config.model_size} applies to {', '.join(registry.sized_models())}, not "
                          f"to --model {name}; leave it at tiny or choose one of those models.")


def check_usable_model(config, custom_method: bool) -> None:
    """Refuses a model the run cannot use, from the registry alone (building a model takes seconds)."""
    name = model_name(config)
    spec = registry.find_model(name)
    if not custom_method and not spec.sequential and build_method(config).capabilities.neuron_masks:
        chains = ", ".join(n for n, s in registry.MODELS.items() if s.sequential)
        raise ConfigError(f"--method {config.method} drops single neurons, which needs a sequential model "
                          f"(a chain of layers), but --model {name} has residual connections; choose one "
                          f"of {chains}.")
    shape = DATASET_SHAPES.get(config.dataset)
    if shape is None:
        return
    module = spec.factory(10, shape)  # a flax module is a dataclass: no parameters are made
    validate = getattr(module, "validate_input_shape", None)
    if validate is not None:
        try:
            validate(shape)
        except UserError as e:
            raise ConfigError(f"--model {name} cannot take --dataset {config.dataset} "
                              f"({'x'.join(map(str, shape))} examples): {str(e).rstrip('.')}.") from None


def check_cohort(config) -> None:
    """``--cohort``: a whole number from 1 to the population (any, while the population is not known)."""
    if not is_int(config.cohort_size) or not 1 <= config.cohort_size <= (config.num_clients or config.cohort_size):
        refuse(config, "cohort_size", config.cohort_size, f"between 1 and --clients ({config.num_clients})")


def check_within_max_clients(config) -> None:
    """``--clients`` of naturally federated files: at most ``--max-clients``."""
    if config.num_clients is not None and config.max_clients is not None and config.num_clients > config.max_clients:
        raise ConfigError(f"--clients {config.num_clients} asks for more clients than --max-clients "
                          f"{config.max_clients}; leave --clients out or raise --max-clients.")


def check_sampled_fits(config) -> None:
    """``--over-select``: its ⌈F·K⌉ clients within the population."""
    if config.num_clients is not None and config.sampled_size > config.num_clients:
        refuse(config, "over_select", config.over_select, f"at most {config.num_clients / config.cohort_size:g}: "
                                                 f"⌈F·K⌉ clients are sampled from --clients {config.num_clients}")


def check_concurrency_fits(config) -> None:
    """``--concurrency``: at most the population (each client in flight is a different one)."""
    if config.num_clients is not None and config.async_concurrency > config.num_clients:
        refuse(config, "concurrency", config.async_concurrency,
               f"at most --clients ({config.num_clients}): each client in flight is a different one")


def check_population(config) -> None:
    """What depends on the population's size, for a configuration :func:`validate` judged while the size was open
    (``--dataset leaf`` and ``hf``: every user of the files, counted once they are read): ``--clients`` itself,
    ``--cohort``, ``--max-clients``, ``--over-select`` and, asynchronously, ``--concurrency``, in
    :func:`validate`'s order."""
    check_int(config, "num_clients", 1)
    check_cohort(config)
    check_within_max_clients(config)
    check_sampled_fits(config)
    if config.mode == "async":
        check_concurrency_fits(config)
