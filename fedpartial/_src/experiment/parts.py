"""The parts of a run that a :class:`~fedpartial._src.experiment.config.RunConfig` names and that are built, not
set: the method (with the wrappers its options add), the model (shaped for the dataset) and the client and server
optimizers.

:class:`~fedpartial._src.experiment.simulation.Simulation` builds these unless the caller brings its own.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
import numpy as np
import optax

from fedpartial._src.core.types import ClientOptimizer, Method, client_sgd
from fedpartial._src.data import sources
from fedpartial._src.engine import conv_choice
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import Strategy
from fedpartial._src.experiment import compile_cache, core_split, pretrained, privacy
from fedpartial._src.experiment.config import DEFAULT_TRAIN_FRACTION, ConfigError, RunConfig
from fedpartial._src.experiment.lora import with_lora, with_rank_tiers
from fedpartial._src.experiment.setting_checks import DEFAULT_MODELS
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.codecs import upload_codec
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.models import registry, zoo
from fedpartial._src.models.adapter import Model, from_linen
from fedpartial._src.models.conv import check_conv_impl
from fedpartial._src.models.precision import with_compute_dtype


def usual_model(dataset: sources.ArrayDataset) -> str:
    """The model ``--model auto`` takes for ``dataset``: its own usual one, else the one for datasets of its name."""
    return dataset.usual_model or DEFAULT_MODELS.get(dataset.name.split("/")[0], "mlp")


def build_model(name: str, dataset: sources.ArrayDataset, *, conv_impl: str = "lax",
                compute_dtype: str = "float32", size: str = "tiny") -> Model:
    """A zoo model adapted for the engine, shaped for ``dataset``, its convolutions lowered by ``conv_impl``
    and trained in ``compute_dtype`` (the defaults: the plain model)."""
    if name == "auto":
        name = usual_model(dataset)
    return shaped_model(name, tuple(dataset.x_train.shape[1:]), dataset.num_classes, conv_impl=conv_impl,
                        compute_dtype=compute_dtype, size=size)


def shaped_model(name: str, input_shape: tuple[int, ...] | list[int], num_classes: int, *, conv_impl: str = "lax",
                 compute_dtype: str = "float32", size: str = "tiny") -> Model:
    """:func:`build_model` from the data's shape alone (``name`` a registry model, not ``auto``)."""
    input_shape = tuple(input_shape)
    spec = registry.find_model(name)
    module = registry.build_model(name, num_classes, input_shape, conv_impl=conv_impl, size=size)
    plain = conv_impl == "lax" and compute_dtype == "float32"
    # a width-reduced copy keeps the lowering (the registry's own model of this name would not)
    width = None if plain or not hasattr(module, "_width_fields") else \
        (lambda ratio, scaler: zoo.narrowed(module, ratio, scaler=scaler))
    model = from_linen(module, input_shape=input_shape, num_classes=num_classes,
                       sequential=spec.sequential, name=name, width=width)
    return with_compute_dtype(model, compute_dtype)


def timing_round(model: Model, strategy: Strategy, clients: int, devices: int | None = None, *, lr: float = 0.05,
                 momentum: float = 0.9, weight_decay: float = 0.0) -> FederatedRound:
    """What ``auto`` times a layout by (:data:`~fedpartial._src.engine.conv_choice.RoundFor`): FedAvg's round of
    ``clients`` clients training ``model`` with SGD at these settings, in ``strategy``, on one device or split
    over ``devices``."""
    return FederatedRound(model, fedavg(), num_clients=clients, cohort_size=clients, strategy=strategy,
                          client_optimizer=client_sgd(lr, momentum=momentum, weight_decay=weight_decay),
                          devices=devices)


def timing_spec(config: RunConfig) -> tuple[str, dict]:
    """``(builder, kwargs)`` of the round ``auto`` times the config's layouts by (:func:`timing_round` with the
    run's client optimizer), as a process of its own rebuilds it."""
    return f"{__name__}:timing_round", {"lr": config.client_lr, "momentum": config.momentum,
                                        "weight_decay": config.weight_decay}


def timing_steps(config: RunConfig, dataset: sources.ArrayDataset) -> int:
    """The local steps a timed round takes: ``--local-steps``, else the steps of the run's epochs for a client
    of average size."""
    if config.local_steps is not None:
        return config.local_steps
    average = len(dataset.x_train) / max(config.num_clients or 1, 1)
    return max(1, math.ceil(config.epochs * average / config.batch_size))


def timing(config: RunConfig, dataset: sources.ArrayDataset) -> dict:
    """What :func:`~fedpartial._src.engine.conv_choice.choose` times the config's rounds with."""
    builder, kwargs = timing_spec(config)
    return {"round_for": lambda model, strategy, clients, devices: timing_round(model, strategy, clients, devices,
                                                                                **kwargs),
            "local_steps": timing_steps(config, dataset),
            "optimizer": f"momentum={config.momentum},weight_decay={config.weight_decay}"}


def choose_conv(config: RunConfig, dataset: sources.ArrayDataset, second_order: bool = False
                ) -> conv_choice.ConvChoice:
    """``--conv-impl``: the lowering it names, or for ``auto`` the fastest (lowering, cohort layout) for the
    config's model, measured once per setting by timing its rounds (:mod:`fedpartial._src.engine.conv_choice`).
    ``FEDPARTIAL_CONV_IMPL`` in the environment names what ``auto`` gives without measuring (the test suite
    sets ``lax``, so its numbers stay those of the plain convolution and no test spends seconds timing).
    ``second_order``: the run's method differentiates twice, which ``auto`` never gives a lowering that cannot
    (:data:`~fedpartial._src.engine.conv_choice.REVERSE_ONLY`; a named one is refused when the round is built)."""
    split = core_split.for_config(config)
    if split is not None:  # restarted for the split over the cores: its lowering, one client at a time or mapped
        return conv_choice.ConvChoice(split.impl, split.layout, split.seconds, f"split over {split.devices} cores")
    if config.conv_impl != "auto":
        return conv_choice.ConvChoice(config.conv_impl, None, {}, "--conv-impl")
    forced = os.environ.get("FEDPARTIAL_CONV_IMPL")
    if forced:
        return conv_choice.ConvChoice(check_conv_impl(forced), None, {}, "FEDPARTIAL_CONV_IMPL")
    return conv_choice.choose(
        lambda impl: build_model(config.model, dataset, conv_impl=impl, compute_dtype=config.compute_dtype,
                                 size=config.model_size),
        **timing(config, dataset), batch_size=config.batch_size, cohort_size=config.cohort_size,
        dtype=config.compute_dtype, cache_dir=compile_cache.cache_folder(), second_order=second_order,
        time_dense=getattr(config, "lora", None) is None)  # a LoRA model's base is shared: the strategy fuses it


def choose_core_split(config: RunConfig, dataset: sources.ArrayDataset, second_order: bool = False
                      ) -> core_split.CoreSplit | None:
    """``--strategy auto`` on a CPU of several cores: the split over them
    (:mod:`~fedpartial._src.experiment.core_split`) unless one device measures faster than it by more than
    :data:`~fedpartial._src.engine.conv_choice.MARGIN` (:func:`~fedpartial._src.experiment.core_split.decide`),
    else None (``config``: validated, its population known).  Measured once per setting, kept in
    ``core-split.json``."""
    model = build_model(config.model, dataset, compute_dtype=config.compute_dtype, size=config.model_size)
    if not conv_choice.timeable(model):
        return None
    one = choose_conv(config, dataset, second_order)
    # what auto runs on one device: the measured choice, or with a named lowering one client at a time
    one_pair = (one.impl, one.layout or "loop")
    devices = min(core_split.cores(), config.cohort_size)
    pairs = core_split.candidates(config.conv_impl, "conv" in model.structure.kinds, second_order)
    timed = timing(config, dataset)
    key = "|".join([conv_choice.cache_key(model, config.batch_size, config.cohort_size, timed["local_steps"],
                                          config.compute_dtype, second_order, timed["optimizer"]),
                    "/".join(one_pair), ",".join("/".join(p) for p in pairs), f"cores={devices}"])
    known = conv_choice.read_table(os.path.join(compile_cache.cache_folder(), core_split.CACHE_FILE)).get(key)
    if known is None:
        shape = {"name": model.name, "input_shape": list(model.input_shape), "num_classes": model.num_classes,
                 "compute_dtype": config.compute_dtype, "size": config.model_size}
        known = core_split.measure((f"{__name__}:shaped_model", shape), timing_spec(config), one_pair, pairs,
                                   devices=devices, batch_size=config.batch_size, cohort_size=config.cohort_size,
                                   local_steps=timed["local_steps"])
        if known["split"]:  # a probe that failed is tried again next time
            conv_choice.write_entry(compile_cache.cache_folder(), core_split.CACHE_FILE, key, known)
    return core_split.decide(known["one_device"], known["split"], devices)


def run_models(config: RunConfig, dataset: sources.ArrayDataset, model: Model | None, adapt=None,
               second_order: bool = False) -> tuple[Model, Model | None, conv_choice.ConvChoice]:
    """A run's model (the caller's ``model``, else the config's adapted by ``adapt``, the method's
    ``adapt_model``) lowered and in the dtype the config says (``second_order``: the method differentiates twice);
    the same model plain (lax, float32) when the run's is not, else None; and the lowering's
    :class:`~fedpartial._src.engine.conv_choice.ConvChoice`."""
    dtype = config.compute_dtype
    if model is not None:
        choice = conv_choice.ConvChoice("lax", None, {}, "the caller's model")
        model = with_lora(config, model)
        return with_compute_dtype(model, dtype), None if dtype == "float32" else model, choice
    choice = choose_conv(config, dataset, second_order)
    model = build_model(config.model, dataset, conv_impl=choice.impl, compute_dtype=dtype, size=config.model_size)
    plain = None if (choice.impl, dtype) == ("lax", "float32") else \
        build_model(config.model, dataset, size=config.model_size)
    if adapt is not None:  # e.g. MOON's projection head
        model, plain = adapt(model), plain and adapt(plain)
    return with_lora(config, model), plain and with_lora(config, plain), choice


def model_outputs(model: Model, dtype=np.float32) -> int:
    """How many logits ``model`` gives per example of ``dtype`` (from shapes alone: nothing is computed)."""
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, *model.input_shape), dtype)
    logits = jax.eval_shape(lambda v, x: model.apply(v, x, False)[0], variables, x)
    return int(logits.shape[-1])


def labels_per_example(model: Model, dtype) -> tuple[int, ...]:
    """The shape of the labels ``model`` predicts for one example of ``dtype``: ``()`` a class, ``(T,)`` one per
    position (a language model); from shapes alone."""
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, *model.input_shape), dtype)
    return tuple(jax.eval_shape(lambda v, x: model.apply(v, x, False)[0], variables, x).shape[1:-1])


def check_outputs_fit_labels(model: Model, dataset: sources.ArrayDataset) -> None:
    """Refuses, in one sentence, a model whose logits do not have one row per label of an example: a language
    model (logits per position) on one label per example, or a classifier on labels per position."""
    per_example = labels_per_example(model, dataset.x_train.dtype)
    labels = tuple(np.shape(dataset.y_train)[1:])
    if per_example != labels:
        def said(shape):
            return "one label per example" if not shape else f"labels of shape {shape} per example (one per position)"
        raise ConfigError(f"model {model.name} predicts {said(per_example)}, but {dataset.name} has {said(labels)}; "
                          f"choose a model that predicts {said(labels)} (transformer_lm for next-token labels, a "
                          "classifier for one label per example).")


def make_client_optimizer(config: RunConfig) -> ClientOptimizer:
    """SGD with momentum and (decoupled from the loss) L2 weight decay at the run's client rate (the rate is
    applied once, by the engine, so methods can read it: ``LocalStep.lr``)."""
    return client_sgd(config.client_lr, momentum=config.momentum, weight_decay=config.weight_decay)


def make_server_optimizer(config: RunConfig) -> optax.GradientTransformation:
    return {
        "sgd": lambda lr: optax.sgd(lr),
        "adam": lambda lr: optax.adam(lr, b1=0.9, b2=0.99, eps=1e-3),
        "yogi": lambda lr: optax.yogi(lr, eps=1e-3),
        "adagrad": lambda lr: optax.adagrad(lr),
    }[config.server_optimizer](config.server_lr)


class RunMethod(NamedTuple):
    """The method a run trains with, and what it decides about the clients' data."""

    method: Method  # the caller's or the config's, wrapped as the options say (early stopping, codec, DP…)
    accountant: object  # gives ε each round under --dp-clip (:mod:`.privacy`), else None
    train_fraction: float  # the share of each client's examples it trains on
    holdout_note: str | None  # why each client holds data out when the run did not say, else None


def run_method(config: RunConfig, method: Method | None) -> RunMethod:
    """The run's method (the caller's ``method`` or the config's) wrapped in early stopping, rank tiers, the
    upload codec and DP-FedAvg as the config says, and each client's train fraction (a method that evaluates
    personal models or reads held-out data holds some out unless ``--train-fraction`` says)."""
    base = method if method is not None else config.build_method()
    fraction, note = config.train_fraction, None
    if fraction is None:
        caps = base.capabilities
        why = (f"method {base.name} is personalised: each client's own model is evaluated on its held-out data"
               if caps.personalised else f"method {base.name} reads held-out data" if caps.needs_holdout
               else "early stopping (--es) reads held-out data" if config.early_stopping else None)
        fraction = DEFAULT_TRAIN_FRACTION if why else 1.0
        if why:
            note = (f"each client trains on {DEFAULT_TRAIN_FRACTION:.0%} of its data and holds the rest out, "
                    f"because {why} (--train-fraction changes it)")
    inner = early_stopping(base, lam=fraction) if config.early_stopping else base
    inner = with_rank_tiers(config, inner)  # --lora-ranks: each client's rank components, as masks
    inner = upload_codec(inner, config.upload_codec) if config.upload_codec else inner
    # DP-FedAvg around the codec: it clips what the server receives
    return RunMethod(*privacy.private(config, inner), fraction, note)


def checked_model(config: RunConfig, dataset: sources.ArrayDataset, method: Method, model: Model | None
                  ) -> tuple[Model, Model | None, conv_choice.ConvChoice]:
    """:func:`run_models` for ``method`` (the model initialised from ``--init-from``), refused in one sentence if
    it cannot take the data or the method."""
    model, plain, choice = run_models(config, dataset, model, method.adapt_model, method.capabilities.second_order)
    model = pretrained.initial_model(model, config.init_from)  # --init-from: checked against it
    if method.capabilities.neuron_masks and not model.structure.sequential:  # from the record
        raise ConfigError(f"method {method.name} drops single neurons, which needs a sequential model (a chain of "
                          f"layers), but model {model.name} is not declared sequential; choose a sequential model "
                          "or a layer-level method.")
    if model.input_shape != tuple(dataset.x_train.shape[1:]):
        raise ConfigError(f"model {model.name} takes examples of shape {model.input_shape}, but {dataset.name} has "
                          f"{tuple(dataset.x_train.shape[1:])}.")
    check_outputs_fit_labels(model, dataset)
    outputs = model_outputs(model, dataset.x_train.dtype)
    if outputs != dataset.num_classes:  # fewer would fail later as something else, more would pass silently
        raise ConfigError(f"model {model.name} gives {outputs} outputs per example, but {dataset.name} has "
                          f"{dataset.num_classes} classes; build the model with num_classes={dataset.num_classes}.")
    return model, plain, choice
