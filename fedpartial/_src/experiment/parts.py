"""The parts of a run that a :class:`~fedpartial._src.experiment.config.RunConfig` names and that are built, not
set: the model (shaped for the dataset) and the client and server optimizers.

:class:`~fedpartial._src.experiment.simulation.Simulation` builds these unless the caller brings its own.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import optax

from fedpartial._src.data import sources
from fedpartial._src.core.types import ClientOptimizer, client_sgd
from fedpartial._src.engine import conv_choice
from fedpartial._src.experiment import compile_cache
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.config_checks import DEFAULT_MODELS
from fedpartial._src.models import registry, zoo
from fedpartial._src.models.adapter import Model, from_linen
from fedpartial._src.models.conv import check_conv_impl
from fedpartial._src.models.precision import with_compute_dtype


def build_model(name: str, dataset: sources.ArrayDataset, *, conv_impl: str = "lax",
                compute_dtype: str = "float32") -> Model:
    """A zoo model adapted for the engine, shaped for ``dataset``, its convolutions lowered by ``conv_impl``
    and trained in ``compute_dtype`` (the defaults: the plain model)."""
    if name == "auto":
        name = DEFAULT_MODELS.get(dataset.name.split("/")[0], "mlp")
    input_shape = tuple(dataset.x_train.shape[1:])
    spec = registry.MODELS[name]
    module = registry.build_model(name, dataset.num_classes, input_shape, conv_impl=conv_impl)
    plain = conv_impl == "lax" and compute_dtype == "float32"
    # a width-reduced copy keeps the lowering (the registry's own model of this name would not)
    width = None if plain or not hasattr(module, "_width_fields") else \
        (lambda ratio, scaler: zoo.narrowed(module, ratio, scaler=scaler))
    model = from_linen(module, input_shape=input_shape, num_classes=dataset.num_classes,
                       sequential=spec.sequential, name=name, width=width)
    return with_compute_dtype(model, compute_dtype)


def choose_conv(config: RunConfig, dataset: sources.ArrayDataset) -> conv_choice.ConvChoice:
    """``--conv-impl``: the lowering it names, or for ``auto`` the fastest (lowering, cohort layout) for the
    config's model, measured once per setting (:mod:`fedpartial._src.engine.conv_choice`).
    ``FEDPARTIAL_CONV_IMPL`` in the environment names what ``auto`` gives without measuring (the test suite
    sets ``lax``, so its numbers stay those of the plain convolution and no test spends seconds timing)."""
    if config.conv_impl != "auto":
        return conv_choice.ConvChoice(config.conv_impl, None, {}, "--conv-impl")
    forced = os.environ.get("FEDPARTIAL_CONV_IMPL")
    if forced:
        return conv_choice.ConvChoice(check_conv_impl(forced), None, {}, "FEDPARTIAL_CONV_IMPL")
    return conv_choice.choose(
        lambda impl: build_model(config.model, dataset, conv_impl=impl, compute_dtype=config.compute_dtype),
        batch_size=config.batch_size, cohort_size=config.cohort_size, dtype=config.compute_dtype,
        cache_dir=compile_cache.cache_folder())


def run_models(config: RunConfig, dataset: sources.ArrayDataset, model: Model | None, adapt=None
               ) -> tuple[Model, Model | None, conv_choice.ConvChoice]:
    """A run's model (the caller's ``model``, else the config's adapted by ``adapt``, the method's
    ``adapt_model``) lowered and in the dtype the config says; the same model plain (lax, float32) when the run's
    is not, else None; and the lowering's :class:`~fedpartial._src.engine.conv_choice.ConvChoice`."""
    dtype = config.compute_dtype
    if model is not None:
        choice = conv_choice.ConvChoice("lax", None, {}, "the caller's model")
        return with_compute_dtype(model, dtype), None if dtype == "float32" else model, choice
    choice = choose_conv(config, dataset)
    model = build_model(config.model, dataset, conv_impl=choice.impl, compute_dtype=dtype)
    plain = None if (choice.impl, dtype) == ("lax", "float32") else build_model(config.model, dataset)
    if adapt is not None:  # e.g. MOON's projection head
        model, plain = adapt(model), plain and adapt(plain)
    return model, plain, choice


def model_outputs(model: Model, dtype=np.float32) -> int:
    """How many logits ``model`` gives per example of ``dtype`` (from shapes alone: nothing is computed)."""
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, *model.input_shape), dtype)
    logits = jax.eval_shape(lambda v, x: model.apply(v, x, False)[0], variables, x)
    return int(logits.shape[-1])


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
