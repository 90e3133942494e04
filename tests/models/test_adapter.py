"""Adapters: zoo models' derived layer structure, and user linen / NNX modules in the engine."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.models.registry import MODELS, build_model
from fedpartial._src.models.adapter import from_linen, from_nnx
from tests.conftest import make_cohort


def adapt(name, shape, classes=10):
    return from_linen(build_model(name, classes, shape), input_shape=shape, num_classes=classes,
                      sequential=MODELS[name].sequential)


def test_cnn2c1f_structure_wires_conv_into_dense():
    s = adapt("cnn2c1f", (28, 28, 1)).structure
    assert s.units == (32, 64, 10)
    head = s.layers[-1]
    # two SAME 2x2 pools: 28 → 7; 7*7*64 inputs, 49 per channel
    assert head.fan_in == 7 * 7 * 64 and head.feeds_from == 1 and head.input_tile == 49


def test_vgg9_structure_has_batchnorm_with_each_conv():
    s = adapt("vgg9", (32, 32, 3)).structure
    assert s.num_layers == 9
    assert all(len(layer.norm_paths) == 1 for layer in s.layers[:8]) and s.layers[8].norm_paths == ()
    assert s.layers[8].input_tile == 4  # 2x2 spatial map after four pools


def test_resnet20_is_non_sequential_with_all_layers():
    s = adapt("resnet20", (8, 8, 3)).structure
    # 19 3x3 convs + 2 projection shortcuts + the classifier
    assert s.num_layers == 22 and not s.sequential
    assert all(layer.feeds_from is None for layer in s.layers)
    assert s.layer_names[-1].endswith("head")


# the token-id models: tests/models/test_bilstm.py, test_transformer.py, test_recurrent.py
@pytest.mark.parametrize("name", sorted(set(MODELS) - {"bilstm", "transformer_lm", "transformer_cls",
                                                       "shakespeare_lstm", "sent140_lstm"}))
def test_every_zoo_model_has_one_role_per_leaf(name):
    shape = (32, 32, 3) if name in ("vgg9", "cnn2c3f", "lenet5", "resnet20") else \
        (16,) if name in ("transformer_lm", "transformer_cls") else (28, 28, 1)
    model = adapt(name, shape)
    variables = jax.eval_shape(lambda: model.init_variables(jax.random.key(0)))
    for collection, tree in variables.items():
        assert len(model.structure.roles[collection]) == len(jax.tree.leaves(tree))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        # Defined out of call order on purpose: the adapter must follow the calls.
        self.head = nnx.Linear(5, 3, rngs=rngs)
        self.fc1 = nnx.Linear(4, 5, rngs=rngs)
        self.bn = nnx.BatchNorm(5, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.bn(self.fc1(x))))


def test_nnx_module_runs_in_the_engine():
    model = from_nnx(NnxMLP(nnx.Rngs(0)), input_shape=(4,), num_classes=3, sequential=True)
    assert model.structure.layer_names == ("fc1", "head")
    assert model.structure.layers[0].norm_paths == (("bn",),)
    r = FederatedRound(model, fedavg(), num_clients=4, cohort_size=4, client_optimizer=optax.sgd(0.1))
    state = jax.device_get(r.init(jax.random.key(0)))  # host copy: the fused round (GPU default) donates
    new, metrics = r(state, make_cohort((4,), k=4, steps=2), jax.random.key(1))
    assert np.isfinite(float(metrics["train_loss"]))
    assert not np.allclose(new.variables["params"]["fc1"]["kernel"], state.variables["params"]["fc1"]["kernel"])
    assert not np.allclose(new.variables["batch_stats"]["bn"]["mean"], 0.0)


def test_readme_user_linen_module():
    class Tiny(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
            return nn.Dense(10)(x)

    model = from_linen(Tiny(), input_shape=(8, 8, 1), num_classes=10, sequential=True)
    assert "Dense_0" in model.structure.describe()
    logits, _ = model.apply(model.init_variables(jax.random.key(0)), jnp.ones((2, 8, 8, 1)), False)
    assert logits.shape == (2, 10)


def test_module_with_parameters_never_called_is_reported():
    class Unused(nnx.Module):
        def __init__(self, rngs):
            self.used = nnx.Linear(4, 3, rngs=rngs)
            self.spare = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.used(x)

    with pytest.raises(ValueError, match="spare"):
        from_nnx(Unused(nnx.Rngs(0)), input_shape=(4,), num_classes=3)
