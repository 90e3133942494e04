"""The parts of a run that a :class:`~fedpartial._src.experiment.config.RunConfig` names and that are built, not
set: the model (shaped for the dataset) and the client and server optimizers.

:class:`~fedpartial._src.experiment.simulation.Simulation` builds these unless the caller brings its own.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from fedpartial._src.data import sources
from fedpartial._src.core.types import ClientOptimizer, client_sgd
from fedpartial._src.experiment.config import DEFAULT_MODELS, RunConfig
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import Model, from_linen


def build_model(name: str, dataset: sources.ArrayDataset) -> Model:
    """A zoo model adapted for the engine, shaped for ``dataset``."""
    if name == "auto":
        name = DEFAULT_MODELS.get(dataset.name.split("/")[0], "mlp")
    input_shape = tuple(dataset.x_train.shape[1:])
    spec = registry.MODELS[name]
    module = registry.build_model(name, dataset.num_classes, input_shape)
    return from_linen(module, input_shape=input_shape, num_classes=dataset.num_classes,
                      sequential=spec.sequential, name=name)


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
