"""What :meth:`RunConfig.validate <fedpartial._src.experiment.config.RunConfig.validate>` does (:func:`validate`):
the checks of :mod:`~fedpartial._src.experiment.setting_checks` in order, the first bad value refused in one
sentence naming its flag; and the record that a configuration passed them (:func:`validate_once`,
:func:`with_validation`), so that each entry path validates once.

The configuration is pure data; the registries of methods and models and the engine's names it is checked against
are loaded here, when a run is checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fedpartial._src.core.errors import UserError
from fedpartial._src.costs import devices
from fedpartial._src.data import ondevice
from fedpartial._src.data.names import DATASETS, NATURAL_DATASETS
from fedpartial._src.engine import strategy as engine_strategy
from fedpartial._src.engine.round import BN_POLICIES
from fedpartial._src.experiment import client_state as client_state_lib
from fedpartial._src.experiment import settings
from fedpartial._src.experiment.setting_checks import (
    PARTITIONS,
    SERVER_OPTIMIZERS,
    build_method,
    check_allowed,
    check_async,
    check_cohort,
    check_devices,
    check_int,
    check_model_size,
    check_natural_data,
    check_output,
    check_privacy,
    check_rounds_in_time,
    check_seed,
    check_usable_model,
    flag,
    refuse,
)
from fedpartial._src.experiment.settings import ConfigError
from fedpartial._src.methods.catalog import find_method
from fedpartial._src.methods.codecs import parse_codec
from fedpartial._src.models import registry
from fedpartial._src.models.conv import CONV_IMPLS
from fedpartial._src.models.precision import COMPUTE_DTYPES


def validate(config, *, custom_method: bool = False, check_model: bool = False) -> None:
    """Raises :class:`ConfigError` naming the first bad value of ``config`` by its command-line flag and what is
    allowed: :meth:`RunConfig.validate <fedpartial._src.experiment.config.RunConfig.validate>` (which documents
    ``custom_method`` and ``check_model``)."""

    def bad(msg):
        raise ConfigError(msg)

    # Types first: a string where a mapping belongs (options='n=4') must not reach the checks below.
    for field in ("method", "dataset", "model", "partition"):
        if not isinstance(getattr(config, field), str):
            bad(f"{flag(config, field)} {getattr(config, field)!r} is not allowed: it must be a name (a string).")
    if not isinstance(config.options, Mapping) or not all(isinstance(k, str) for k in config.options):
        bad(f"options {config.options!r} is not allowed: it must be a mapping of option names to values, e.g. "
            f"{{'n': 4}} (the method's own flags on the command line).")

    for field in settings.fields(type(config)):  # each setting's values, declared with it (Setting.allowed)
        check_allowed(config, field)
    if config.upload_codec is not None:
        parse_codec(config.upload_codec)  # a bad codec is one sentence
    if not isinstance(config.sparse_flops, bool):
        refuse(config, "sparse_flops", config.sparse_flops, "true or false")
    if config.num_clients is None and config.dataset not in NATURAL_DATASETS:  # the files' users count only there
        refuse(config, "num_clients", None, "a whole number ≥ 1")
    if config.local_steps is not None and config.local_epochs is not None:
        bad("give only one of --local-steps or --local-epochs.")
    check_cohort(config)
    check_seed(config)
    if not custom_method:
        try:
            spec = find_method(config.method)  # built in, installed (entry point) or package.module:factory
        except UserError as e:
            bad(f"--{e}")
        try:  # the options' own checks (Option.problem), said as the command line says them
            spec.check(dict(config.options), typed=True)
        except UserError as e:
            bad(str(e))
        tiers = dict(config.options).get("tiers")
        # equal clusters by client id
        if isinstance(tiers, (tuple, list)) and config.num_clients is not None and len(tiers) > config.num_clients:
            bad(f"--tiers gives {len(tiers)} keep ratios but the population has {config.num_clients} clients "
                f"(--clients), so some tiers would have nobody; give at most {config.num_clients}.")
    if config.dataset not in DATASETS:
        bad(f"--dataset {config.dataset!r} is unknown; choose one of {', '.join(DATASETS)}.")
    if config.model != "auto" and config.model not in registry.MODELS:
        if not isinstance(config.model, str) or ":" not in config.model:
            bad(f"--model {config.model!r} is unknown; choose 'auto', one of {', '.join(sorted(registry.MODELS))} "
                "or package.module:factory for your own.")
        try:
            registry.find_model(config.model)  # your own: importable, naming a module class or factory
        except UserError as e:
            bad(f"--{e}")
    if config.model_size != "tiny":
        check_model_size(config)
    if config.max_samples is not None and config.dataset != "synthetic":
        bad(f"--max-samples applies to --dataset synthetic only, not {config.dataset!r}.")
    if config.partition not in PARTITIONS:
        bad(f"--partition {config.partition!r} is unknown; choose one of {', '.join(PARTITIONS)}.")
    check_natural_data(config)
    if config.partition == "dirichlet" and not config.alpha > 0:
        refuse(config, "alpha", config.alpha, "> 0 for the dirichlet partition (the Dirichlet α)")
    if config.partition == "shards":
        check_int(config, "classes_per_client", 1)
    if config.server_optimizer not in SERVER_OPTIMIZERS:
        bad(f"--server-opt {config.server_optimizer!r} is unknown; choose one of {', '.join(SERVER_OPTIMIZERS)}.")
    if config.early_stopping and config.train_fraction is not None and config.train_fraction >= 1:
        bad("--es needs each client's held-out split; use a --train-fraction below 1 (e.g. 0.7).")
    check_privacy(config, custom_method)
    check_rounds_in_time(config)
    check_async(config, custom_method)
    if config.bn_policy not in BN_POLICIES:
        bad(f"--bn-policy {config.bn_policy!r} is unknown; choose one of {', '.join(BN_POLICIES)} "
            "(the BatchNorm policy).")
    if config.data_placement not in ondevice.PLACEMENTS:
        bad(f"--data-placement {config.data_placement!r} is unknown; choose one of "
            f"{', '.join(ondevice.PLACEMENTS)}.")
    if config.conv_impl not in ("auto", *CONV_IMPLS):
        bad(f"--conv-impl {config.conv_impl!r} is unknown; choose one of auto, {', '.join(CONV_IMPLS)}.")
    if config.compute_dtype not in COMPUTE_DTYPES:
        bad(f"--compute-dtype {config.compute_dtype!r} is unknown; choose one of {', '.join(COMPUTE_DTYPES)}.")
    try:
        strategy = engine_strategy.parse_strategy(config.strategy)
    except ValueError as e:
        bad(f"--{e}")
    if strategy.kind == "stream" and not custom_method:
        problem = ("early stopping (--es) keeps per-client state, so the run cannot be streamed"
                   if config.early_stopping else
                   "a deadline or over-selection predicts every client's time from the whole cohort's data "
                   "before the round, so the run cannot be streamed" if config.deadlines else
                   "differential privacy (--dp-clip) adds its noise to the whole cohort's sum, so the run cannot "
                   "be streamed" if config.private else engine_strategy.stream_refusal(build_method(config)))
        if problem:
            bad(f"--strategy {config.strategy} is not allowed: {problem}; use --strategy auto, fused, fused:N "
                "or stepwise:N.")
    if config.client_state not in client_state_lib.PLACES:
        bad(f"--client-state {config.client_state!r} is unknown; choose one of "
            f"{', '.join(client_state_lib.PLACES)}.")
    if config.client_state in client_state_lib.OFF_DEVICE and config.devices is not None and config.devices > 1:
        bad(f"--client-state {config.client_state} is not allowed with --devices {config.devices}: per-client "
            "state kept off the device runs on one device; use --devices 1.")
    if strategy.kind == "stream" and config.data_placement == "device":
        bad(f"--data-placement device is not allowed with --strategy {config.strategy}: a streamed cohort is "
            "packed on the host a chunk at a time; use --data-placement host or auto.")
    if config.devices is not None:
        check_devices(config)
    try:  # nothing the population's size is drawn: a huge --clients is the preflight's to refuse
        if config.device_profiles is None:
            for field in ("compute_speed", "download_bandwidth", "upload_bandwidth"):
                devices.parse_distribution(getattr(config, field), flag(config, field))
        else:
            devices.load_profiles(config.device_profiles, 1)
    except UserError as e:
        bad(str(e))
    check_output(config)
    if check_model:
        check_usable_model(config, custom_method)
    config.__dict__[_VALIDATED] = (custom_method, check_model, _settings(config))


#: the instance attribute (not a field: never compared, shown or saved) recording a passed :func:`validate`: its
#: ``custom_method`` and ``check_model``, and the settings it judged
_VALIDATED = "_validated"


def _settings(config) -> tuple | None:
    """A copy of every setting of ``config``, to tell later whether one changed (None: a value that cannot be
    copied, so nothing is remembered)."""
    try:
        return dataclasses.astuple(config)
    except Exception:  # noqa: BLE001 -- any value a deep copy refuses (a lock among the options): judge again
        return None


def validated(config, *, custom_method: bool = False, check_model: bool = False) -> bool:
    """Whether ``config`` passed :func:`validate` with checks at least these (the registry's method checks cover a
    custom method's, ``check_model`` covers none) and no setting has changed since."""
    record = config.__dict__.get(_VALIDATED)
    if record is None or record[2] is None:
        return False
    was_custom, was_model, settings = record
    if (was_custom and not custom_method) or (check_model and not was_model):
        return False
    try:
        return bool(settings == _settings(config))
    except (TypeError, ValueError):  # values without a plain equality (an array among the options): judge again
        return False


def validate_once(config, *, custom_method: bool = False, check_model: bool = False) -> None:
    """``config.validate``, unless ``config`` already passed it as it is (:func:`validated`): each entry path (the
    command line, :func:`fedpartial.run`, a :class:`~fedpartial.Simulation`, replicas, a comparison) checks a
    configuration once, however many layers it passes through."""
    if not validated(config, custom_method=custom_method, check_model=check_model):
        config.validate(custom_method=custom_method, check_model=check_model)


def with_validation(config, like):
    """``config``, a copy of the validated ``like`` with some settings changed, marked as validated as ``like``
    was: for the caller whose own checks covered every change (the population's size once the files are read:
    :func:`check_population`; a replica's seed and rates: :func:`check_replica`; an asynchronous run's buffer as
    its cohort).  Unchanged when ``like`` is not validated."""
    record = like.__dict__.get(_VALIDATED)
    if record is not None and validated(like, custom_method=record[0], check_model=record[1]):
        config.__dict__[_VALIDATED] = (*record[:2], _settings(config))
    return config
