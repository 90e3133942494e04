"""The zoo's transformers: shapes, module names, stages, sizes, causality, and the pre-norm layer structure."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import build_structure, leaf_paths
from fedpartial._src.models import registry, transformer
from fedpartial._src.models.adapter import from_linen


def adapted(name, num_classes, shape, size="tiny"):
    return from_linen(registry.build_model(name, num_classes, shape, size=size), input_shape=shape,
                      num_classes=num_classes, sequential=registry.MODELS[name].sequential)


@pytest.fixture(scope="module")
def lm():
    return adapted("transformer_lm", 30, (12,))


def test_lm_shapes_names_and_stages(lm):
    variables = lm.init_variables(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).integers(0, 30, (3, 12)), jnp.int32)
    logits, _ = lm.apply(variables, x, False)
    assert logits.shape == (3, 12, 30)
    assert lm.stage_names == ("embed", "block0", "block1", "head")
    names = lm.structure.layer_names
    assert names == ("embed", "pos_embed", *[f"block{i}/{m}" for i in range(2) for m in
                                              ("attn/query", "attn/key", "attn/value", "attn/out", "mlp/fc1",
                                               "mlp/fc2")], "head")
    by_name = dict(zip(names, lm.structure.layers))
    # a pre-LayerNorm joins the layer it feeds: every block's parameters are its own layers'
    assert by_name["block0/attn/query"].norm_paths == (("block0", "ln1"),)
    assert by_name["block1/mlp/fc1"].norm_paths == (("block1", "ln2"),)
    assert by_name["head"].norm_paths == (("ln_f",),)
    assert by_name["embed"].units == 64 and by_name["embed"].fan_in == 30  # Embed: [vocab, d], units d
    assert lm.stage_of_layer == (0, 0) + (1,) * 6 + (2,) * 6 + (3,)
    assert variables["params"]["block0"]["attn"]["query"]["kernel"].shape == (64, 64)  # plain Dense [in, out]


def test_lm_is_causal(lm):
    """Changing the token at position t changes no logit before t."""
    variables = lm.init_variables(jax.random.key(1))
    x = jnp.asarray(np.random.default_rng(1).integers(2, 30, (1, 12)), jnp.int32)
    changed = x.at[0, 7].set((x[0, 7] + 1) % 28 + 2)
    a, _ = lm.apply(variables, x, False)
    b, _ = lm.apply(variables, changed, False)
    np.testing.assert_array_equal(a[0, :7], b[0, :7])
    assert not np.allclose(a[0, 7:], b[0, 7:])


def test_stages_compose(lm):
    """Running the stages one at a time gives the whole model's output."""
    variables = lm.init_variables(jax.random.key(2))
    x = jnp.asarray(np.random.default_rng(2).integers(0, 30, (2, 12)), jnp.int32)
    whole, _ = lm.apply(variables, x, False)
    h = x
    for s in range(len(lm.stage_names)):
        h, _ = lm.run_stages(variables, h, s, s + 1, False)
    np.testing.assert_allclose(h, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, patch", [((8, 8, 1), 2), ((28, 28, 1), 4)])
def test_vit_on_digits_and_mnist(shape, patch):
    assert transformer.vit_patch(*shape[:2]) == patch
    model = adapted("vit", 10, shape)
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    patches = (shape[0] // patch) * (shape[1] // patch)
    assert variables["params"]["embed"]["kernel"].shape == (patch * patch * shape[2], 64)
    assert variables["params"]["pos_embed"]["embedding"].shape == (patches, 64)
    logits = jax.eval_shape(lambda v: model.apply(v, jnp.zeros((2, *shape)), False)[0], variables)
    assert logits.shape == (2, 10)
    assert model.structure.layers[-1].norm_paths == (("ln_f",),)


def test_cls_pools_to_class_logits():
    model = adapted("transformer_cls", 2, (16,))
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    logits = jax.eval_shape(lambda v: model.apply(v, jnp.ones((3, 16), jnp.int32), False)[0], variables)
    assert logits.shape == (3, 2)
    assert variables["params"]["embed"]["embedding"].shape == (10_000, 64)


def test_gpt2_size_is_gpt2_small():
    """85M parameters in the blocks (12 x 7,087,872), counted from shapes alone."""
    module = registry.build_model("transformer_lm", 50257, (1024,), size="gpt2")
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 1024), jnp.int32)))
    blocks = sum(int(np.prod(a.shape)) for path, a in leaf_paths(shapes["params"]) if path[0].startswith("block"))
    assert blocks == 12 * 7_087_872 == 12 * transformer.SIZES["gpt2"].block_parameters()


def test_sizes_are_checked():
    with pytest.raises(UserError, match="--model-size 'huge' is unknown; choose one of tiny, small, base, gpt2"):
        registry.build_model("transformer_lm", 10, (8,), size="huge")
    with pytest.raises(UserError, match="--model-size 'small' applies to the models that come in sizes"):
        registry.build_model("mlp", 10, (8,), size="small")


class _PreNormChain(nn.Module):
    """Dense 6 -> LayerNorm -> Dense 4 -> ReLU -> Dense 3: the LayerNorm is fc2's pre-norm."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(6, name="fc1")(x.reshape(x.shape[0], -1))
        x = nn.relu(x)
        x = nn.Dense(4, name="fc2")(nn.LayerNorm(name="ln")(x))
        return nn.Dense(3, name="head")(nn.relu(x))


def test_pre_norm_follows_its_input_units_under_neuron_masks():
    """In a sequential chain a pre-norm's scale and bias are fed by the previous layer's units: a neuron mask
    over fc1's units switches the same entries of ln's leaves, and counts them."""
    model = from_linen(_PreNormChain(), input_shape=(5,), num_classes=3, sequential=True)
    assert [layer.norm_paths for layer in model.structure.layers] == [(), (("ln",),), ()]
    variables = model.init_variables(jax.random.key(0))
    fc1_units = jnp.asarray([True, False, True, True, False, False])
    mask = masks.full(model.structure)
    mask = mask._replace(neurons=(fc1_units, *mask.neurons[1:]))
    expanded = masks.expand(model.structure, mask, variables["params"])
    np.testing.assert_array_equal(expanded["ln"]["scale"], fc1_units)
    np.testing.assert_array_equal(expanded["ln"]["bias"], fc1_units)
    counted = masks.count_elements(model.structure, mask, variables["params"])
    assert int(counted) == sum(int(np.sum(a)) for a in jax.tree.leaves(expanded))


def test_post_norm_stays_with_the_layer_before():
    """A BatchNorm/LayerNorm fed straight by its layer stays that layer's, as before."""

    class PostNorm(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            x = nn.LayerNorm(name="ln")(nn.Dense(4, name="fc1")(x))
            return nn.Dense(2, name="head")(x)

    model = from_linen(PostNorm(), input_shape=(3,), num_classes=2, sequential=True)
    assert [layer.norm_paths for layer in model.structure.layers] == [(("ln",),), ()]


def test_build_structure_pre_norm_paths():
    params = {"ln": {"scale": np.ones(3), "bias": np.zeros(3)}, "fc": {"kernel": np.ones((3, 2)), "bias": np.ones(2)}}
    structure = build_structure({"params": params}, [("ln",), ("fc",)], [("ln",)], sequential=False,
                                pre_norm_paths=[("ln",)])
    assert structure.layers[0].norm_paths == (("ln",),)
    assert structure.role("params", ("ln", "scale")).on_input
    with pytest.raises(ValueError, match="normaliser ln comes before any layer"):
        build_structure({"params": params}, [("ln",), ("fc",)], [("ln",)], sequential=False)
