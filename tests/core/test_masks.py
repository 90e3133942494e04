"""Layer structure derivation and structured mask expansion / counting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpartial._src.core import masks


def test_mlp_structure(mlp):
    s = mlp.structure
    assert s.layer_names == ("fc1", "fc2", "head")
    assert s.units == (6, 5, 3)
    assert s.layers[0].norm_paths == (("bn1",),)
    assert [l.feeds_from for l in s.layers] == [None, 0, 1]
    assert s.role("batch_stats", ("bn1", "mean")).layer == 0
    assert not s.role("params", ("bn1", "scale")).has_input_axis
    assert s.role("params", ("fc2", "kernel")).has_input_axis


def test_cnn_structure_conv_to_dense_tiling(cnn):
    s = cnn.structure
    assert s.layer_names == ("conv1", "conv2", "head")
    # conv2 output is 2x2x4 after one pool of a 4x4 input → head has 16 inputs, 4 per channel
    assert s.layers[2].fan_in == 16 and s.layers[2].feeds_from == 1 and s.layers[2].input_tile == 4
    assert s.layers[1].input_tile == 1


def test_conv_to_dense_expansion_element_by_element(cnn):
    params = cnn.init_variables(jax.random.key(0))["params"]
    channels = jnp.array([True, False, True, False])
    mask = masks.Mask(jnp.ones(3, bool), (jnp.ones(3, bool), channels, jnp.ones(3, bool)))
    m = masks.expand(cnn.structure, mask, params)
    head = np.asarray(m["head"]["kernel"])  # [16, 3]
    # NHWC flatten: row i = (h*W + w)*C + c  → fed by channel i % 4
    for i in range(16):
        assert head[i].all() == bool(channels[i % 4]), i
        assert head[i].any() == bool(channels[i % 4]), i
    conv2 = np.asarray(m["conv2"]["kernel"])  # [3, 3, 3, 4]: output channels masked
    np.testing.assert_array_equal(conv2.all(axis=(0, 1, 2)), np.asarray(channels))
    np.testing.assert_array_equal(np.asarray(m["conv2"]["bias"]), np.asarray(channels))
    assert np.asarray(m["conv1"]["kernel"]).all()


def test_parameter_active_iff_both_neurons_active(mlp):
    params = mlp.init_variables(jax.random.key(0))["params"]
    n1 = jnp.array([1, 0, 1, 1, 0, 1], bool)
    n2 = jnp.array([0, 1, 1, 0, 1], bool)
    mask = masks.Mask(jnp.ones(3, bool), (n1, n2, jnp.ones(3, bool)))
    m = masks.expand(mlp.structure, mask, params)
    np.testing.assert_array_equal(m["fc2"]["kernel"], np.outer(n1, n2))
    np.testing.assert_array_equal(m["fc1"]["kernel"], np.broadcast_to(n1, (4, 6)))
    np.testing.assert_array_equal(m["head"]["kernel"], np.broadcast_to(np.asarray(n2)[:, None], (5, 3)))
    np.testing.assert_array_equal(m["bn1"]["scale"], n1)


def test_layer_mask_switches_whole_layers(mlp):
    variables = mlp.init_variables(jax.random.key(0))
    mask = masks.from_layers(mlp.structure, jnp.array([False, True, False]))
    m = masks.expand_variables(mlp.structure, mask, variables)
    assert not np.asarray(m["batch_stats"]["bn1"]["mean"]).any()
    assert not np.asarray(m["params"]["bn1"]["bias"]).any()
    assert np.asarray(m["params"]["fc2"]["kernel"]).all()
    assert not np.asarray(m["params"]["head"]["bias"]).any()


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_count_equals_expanded_sum(cnn, data):
    variables = cnn.init_variables(jax.random.key(0))
    k = 3
    draw = lambda shape: np.array(data.draw(st.lists(st.booleans(), min_size=int(np.prod(shape)),
                                                       max_size=int(np.prod(shape))))).reshape(shape)
    mask = masks.Mask(jnp.asarray(draw((k, 3))), tuple(jnp.asarray(draw((k, u))) for u in cnn.structure.units))
    counts = masks.count_elements(cnn.structure, mask, variables["params"])
    for i in range(k):
        one = jax.tree.map(lambda a: a[i], mask)
        expanded = masks.expand(cnn.structure, one, variables["params"])
        assert int(counts[i]) == sum(int(np.sum(e)) for e in jax.tree.leaves(expanded))
    nbytes = masks.count_bytes(cnn.structure, mask, variables, ("params", "batch_stats"))
    stats = masks.count_elements(cnn.structure, mask, variables["batch_stats"], "batch_stats")
    np.testing.assert_array_equal(nbytes, 4 * (counts + stats))


def test_input_scale_zeroes_rows_reading_dropped_units(mlp):
    params = mlp.init_variables(jax.random.key(0))["params"]
    scale = (jnp.array([2.0, 0.0, 2.0, 2.0, 0.0, 2.0]), jnp.ones(5), jnp.ones(3))
    s = masks.input_scale(mlp.structure, scale, params)
    np.testing.assert_array_equal(s["fc2"]["kernel"], np.broadcast_to(np.asarray(scale[0])[:, None], (6, 5)))
    assert np.all(np.asarray(s["fc1"]["kernel"]) == 1.0) and np.all(np.asarray(s["fc2"]["bias"]) == 1.0)


def test_stored_masks_are_far_below_one_percent_of_cohort_parameters():
    import flax.linen as nn

    from fedpartial._src.models.adapter import from_linen

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            x = nn.relu(nn.Dense(200)(x.reshape((x.shape[0], -1))))
            x = nn.relu(nn.Dense(200)(x))
            return nn.Dense(10)(x)

    model = from_linen(Wide(), input_shape=(28, 28, 1), num_classes=10, sequential=True)
    k = 100
    three_kinds = [masks.full(model.structure, (k,)) for _ in range(3)]
    stored = sum(masks.mask_storage_bytes(m) for m in three_kinds)
    params = model.init_variables(jax.random.key(0))["params"]
    cohort_bytes = k * sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    # train + dropout + upload masks for 100 clients of a 199k-parameter MLP: 0.16%
    assert stored / cohort_bytes < 0.005


def test_neuron_masks_rejected_for_non_sequential_models(mlp):
    from fedpartial._src.models.adapter import from_linen
    from tests.conftest import TinyMLP

    residual = from_linen(TinyMLP(), input_shape=(4,), num_classes=3, sequential=False)
    assert all(l.feeds_from is None for l in residual.structure.layers)
    with pytest.raises(ValueError, match="sequential"):
        masks.uses_neurons(residual.structure)


def test_unwired_neuron_mask_keeps_whole_input_columns(cnn):
    variables = cnn.init_variables(jax.random.key(0))
    channels = jnp.array([[True, False, True, False]])
    wired = masks.Mask(jnp.ones((1, 3), bool), (jnp.array([[True, False, True]]), channels, jnp.ones((1, 3), bool)))
    free = masks.unwired(cnn.structure, wired)
    one = jax.tree.map(lambda a: a[0], free)
    m = masks.expand(cnn.structure, one, variables["params"])
    # conv2's kept output channels keep every input channel, even conv1's dropped channel 1
    np.testing.assert_array_equal(np.asarray(m["conv2"]["kernel"]).all(axis=(0, 1, 2)), np.asarray(channels[0]))
    assert np.asarray(m["head"]["kernel"]).all()
    counts = masks.count_elements(cnn.structure, free, variables["params"])
    assert int(counts[0]) == sum(int(np.sum(e)) for e in jax.tree.leaves(m))
    assert int(counts[0]) > int(masks.count_elements(cnn.structure, wired, variables["params"])[0])


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_bytes_per_layer_equal_the_expanded_masks_bytes_with_norms_and_unwired_inputs(mlp, data):
    """Per layer, every kind of leaf (kernels fed by a layer, biases, BatchNorm parameters and statistics under
    their own norm bit, inputs unwired): the counted bytes are the expanded mask's on-elements × 4."""
    variables = mlp.init_variables(jax.random.key(0))
    structure, k = mlp.structure, 3
    bools = lambda *shape: np.array(data.draw(st.lists(st.booleans(), min_size=int(np.prod(shape)),  # noqa: E731
                                                       max_size=int(np.prod(shape))))).reshape(shape)
    mask = masks.Mask(jnp.asarray(bools(k, 3)), tuple(jnp.asarray(bools(k, u)) for u in structure.units),
                      norms=jnp.asarray(bools(k, 3)))
    if data.draw(st.booleans()):
        mask = masks.unwired(structure, mask)
    per_layer = np.asarray(masks.count_bytes_per_layer(structure, mask, variables, ("params", "batch_stats")))
    for i in range(k):
        one = jax.tree.map(lambda a: a[i], mask)
        expanded = masks.expand_variables(structure, one, variables)
        want = np.zeros(3, np.int64)
        for c in ("params", "batch_stats"):
            for (path, e) in jax.tree_util.tree_leaves_with_path(expanded[c]):
                role = structure.role(c, tuple(p.key for p in path))
                want[role.layer] += 4 * int(np.sum(e))
        np.testing.assert_array_equal(per_layer[i], want)
    np.testing.assert_array_equal(per_layer.sum(-1), masks.count_bytes(structure, mask, variables,
                                                                       ("params", "batch_stats")))


@pytest.mark.parametrize("fixture", ["mlp", "cnn", "staged_mlp"])
def test_the_whole_models_bytes_per_layer_are_its_leaves_bytes(fixture, request):
    """The host-side count a round uses for a whole-model download equals the full mask counted in the round
    and each layer's leaves' bytes."""
    model = request.getfixturevalue(fixture)
    variables = model.init_variables(jax.random.key(0))
    structure = model.structure
    host = masks.whole_model_bytes_per_layer(structure, variables, ("params", "batch_stats"))
    counted = masks.count_bytes_per_layer(structure, masks.full(structure, (2,)), variables, ("params", "batch_stats"))
    np.testing.assert_array_equal(np.broadcast_to(host, (2, structure.num_layers)), counted)
    nbytes = np.zeros(structure.num_layers, np.int64)
    for c in ("params", "batch_stats"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(variables.get(c, {})):
            nbytes[structure.role(c, tuple(p.key for p in path)).layer] += leaf.nbytes
    np.testing.assert_array_equal(host, nbytes)
    assert isinstance(host, np.ndarray) and host.dtype == np.int32
