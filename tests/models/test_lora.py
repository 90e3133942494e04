"""LoRA as a model transform: the adapters' layers and masks, the frozen base held once, merging, refusals."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks as masks_lib
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import FROZEN
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise, streamed
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora, merge_adapters, merge_into_base
from tests.conftest import make_cohort


@pytest.fixture(scope="module")
def lora_mlp(mlp):
    return lora(mlp, 2, alpha=4.0)


@pytest.fixture(scope="module")
def trained(lora_mlp):
    """Two fused FedAvg rounds of the LoRA MLP, and its initial state."""
    r = FederatedRound(lora_mlp, fedavg(), num_clients=4, cohort_size=4, client_optimizer=optax.sgd(0.5))
    state = r.init(jax.random.key(0))
    first = jax.device_get(state)
    metrics = []
    for t in range(2):
        state, m = r(state, make_cohort((4,), k=4, seed=t), jax.random.key(t))
        metrics.append(jax.device_get(m))
    return first, jax.device_get(state), metrics


def test_adapters_are_layers_and_the_base_is_frozen(lora_mlp):
    s = lora_mlp.structure
    assert s.layer_names == ("fc1/lora_a", "fc1/lora_b", "fc2/lora_a", "fc2/lora_b", "head")
    assert s.units == (2, 6, 2, 5, 3)
    assert [layer.feeds_from for layer in s.layers] == [None, 0, None, 2, None]
    v = lora_mlp.init_variables(jax.random.key(0))
    assert sorted(v[FROZEN]) == ["bn1", "fc1", "fc2"]  # kernels, biases and the BatchNorm's scale and bias
    assert v["params"]["fc1"]["lora_a"]["kernel"].shape == (4, 2)
    np.testing.assert_array_equal(v["params"]["fc2"]["lora_b"]["kernel"], np.zeros((2, 5)))
    assert lora_mlp.lora.scale == 2.0


def test_a_new_adapter_computes_the_base_model(mlp, lora_mlp):
    v = lora_mlp.init_variables(jax.random.key(0))
    base = mlp.init_variables(jax.random.key(0))
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    np.testing.assert_array_equal(lora_mlp.apply(v, x, False)[0], mlp.apply(base, x, False)[0])


def test_only_adapters_train_and_the_base_is_held_once(lora_mlp, trained):
    first, state, metrics = trained
    for a, b in zip(jax.tree.leaves(first.variables[FROZEN]), jax.tree.leaves(state.variables[FROZEN])):
        np.testing.assert_array_equal(a, b)
    assert np.abs(state.variables["params"]["fc1"]["lora_b"]["kernel"]).sum() > 0
    # traffic counts the adapters, the head and the BatchNorm's statistics (mean and variance, under fc1's B):
    # A 4·2, B 2·6 + 6 + 6, A 6·2, B 2·5, head 5·3 + 3, float32
    np.testing.assert_array_equal(metrics[0]["upload_bytes_per_layer"][0], 4 * np.array([8, 24, 12, 10, 18]))
    # no optimizer state and no copy of the base anywhere in the server state but its variables
    assert FROZEN not in jax.tree.structure(state.opt_state).__repr__()


def test_merged_weights_evaluate_as_the_adapted_model(mlp, lora_mlp, trained):
    _, state, _ = trained
    x = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
    ours = lora_mlp.apply(state.variables, x, False)[0]
    np.testing.assert_allclose(mlp.apply(merge_adapters(lora_mlp, state.variables), x, False)[0], ours, rtol=1e-5, atol=1e-6)
    folded = merge_into_base(lora_mlp, state.variables)
    assert not np.any(folded["params"]["fc1"]["lora_b"]["kernel"])
    np.testing.assert_allclose(lora_mlp.apply(folded, x, False)[0], ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", [stepwise(1), streamed(2)], ids=str)
def test_every_strategy_trains_the_same_adapters(lora_mlp, trained, strategy):
    first, state, _ = trained
    r = FederatedRound(lora_mlp, fedavg(), num_clients=4, cohort_size=4, client_optimizer=optax.sgd(0.5),
                       strategy=strategy)
    s = r.init(jax.random.key(0))
    for t in range(2):
        s, _ = r(s, make_cohort((4,), k=4, seed=t), jax.random.key(t))
    for a, b in zip(jax.tree.leaves(state.variables), jax.tree.leaves(jax.device_get(s.variables))):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_a_rank_mask_keeps_leading_components(lora_mlp):
    spec = lora_mlp.lora
    mask = spec.rank_mask(lora_mlp.structure, jnp.array([1, 2]))
    v = lora_mlp.init_variables(jax.random.key(0))
    one = masks_lib.expand(lora_mlp.structure, jax.tree.map(lambda a: a[0], mask), v["params"])
    np.testing.assert_array_equal(one["fc1"]["lora_a"]["kernel"], np.tile([True, False], (4, 1)))
    np.testing.assert_array_equal(one["fc1"]["lora_b"]["kernel"], np.repeat([[True], [False]], 6, axis=1))
    counts = masks_lib.count_elements(lora_mlp.structure, mask, v["params"])
    np.testing.assert_array_equal(counts, [4 + 6 + 6 + 5 + 18, 8 + 12 + 12 + 10 + 18])


def test_stages_survive_the_transform(staged_mlp):
    m = lora(staged_mlp, 2, targets=["b2/fc", "b3/fc"])
    assert m.stage_of_layer == (1, 1, 2, 2, 3)
    v = m.init_variables(jax.random.key(0))
    x = jnp.ones((2, 4))
    h, _ = m.apply_stages(v, x, stop=2)
    np.testing.assert_allclose(m.apply_stages(v, h, start=2)[0], m.apply(v, x, False)[0], rtol=1e-6)


def test_bad_lora_arguments_are_refused_in_one_sentence(mlp, lora_mlp, cnn):
    with pytest.raises(UserError, match="matches no layer"):
        lora(mlp, 2, targets=["attn*"])
    with pytest.raises(UserError, match="at most 4"):
        lora(mlp, 5, targets=["fc1"])
    with pytest.raises(UserError, match="at least 1"):
        lora(mlp, 0)
    with pytest.raises(UserError, match="already has LoRA"):
        lora(lora_mlp, 2)
    with pytest.raises(UserError, match="is a Conv, not a flax.linen Dense"):
        lora(cnn, 1, targets=["conv*"])


class InnerLoRA(nn.Module):
    """A LoRA written inside one module: ``kernel [64, 128]``, ``lora_a [64, 4]``, ``lora_b [4, 128]``."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape((x.shape[0], -1))
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (64, 128))
        a = self.param("lora_a", nn.initializers.normal(0.02), (64, 4))
        b = self.param("lora_b", nn.initializers.zeros, (4, 128))
        return nn.Dense(3, name="head")(nn.relu(x @ kernel + x @ a @ b))


def test_leaves_without_units_on_the_last_axis_are_whole_layer_leaves():
    model = from_linen(InnerLoRA(), input_shape=(64,), num_classes=3)
    role = model.structure.role("params", ("lora_a",))
    assert not role.units_axis and not role.has_input_axis
    assert model.structure.role("params", ("lora_b",)).units_axis
    r = FederatedRound(model, fedavg(), num_clients=2, cohort_size=2, client_optimizer=optax.sgd(0.1),
                       strategy=fused())
    state = r.init(jax.random.key(0))
    state, metrics = r(state, make_cohort((64,), k=2, steps=1, batch=2), jax.random.key(1))
    per_client = np.asarray(metrics["upload_bytes_per_layer"])[0]
    np.testing.assert_array_equal(per_client, 4 * np.array([64 * 128 + 64 * 4 + 4 * 128, 128 * 3 + 3]))
    half = masks_lib.Mask(layers=jnp.array([True, True]), neurons=(jnp.arange(128) < 64, jnp.ones(3, bool)))
    on = masks_lib.expand(model.structure, half, state.variables["params"])
    assert bool(on["lora_a"].all()) and int(on["lora_b"].sum()) == 4 * 64
