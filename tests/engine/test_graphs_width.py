"""The width graph (:func:`fedpartial._src.engine.graphs.width`): a narrow model is the full model's leading
channels/units on every axis, runs as a physically smaller model, and writes back in place."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import Batch, ClientPlan, MethodContext
from fedpartial._src.engine import graphs
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.models import resnet, zoo
from fedpartial._src.models.adapter import from_linen, from_stages
from fedpartial._src.models.registry import build_model, build_narrow_model

KEY = jax.random.key(0, impl="rbg")  # initialises conv nets far faster than threefry on CPU
# The forward passes compared below (exact zeros, values within a tolerance) compiled at XLA's -O0, as
# engine_compiled_at_o0 (tests/conftest.py) compiles the engine's rounds: the time is XLA compiling them
JIT_O0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def adapt(module, input_shape, num_classes, name):
    return from_linen(module, input_shape=input_shape, num_classes=num_classes,
                      sequential=not isinstance(module, resnet.ResNet20), name=name)


def small_resnet(shortcut="projection"):
    """ResNet20's class at a test size: stem, an identity block (4 channels), a downsampling block (8), head."""
    return resnet.ResNet20(num_classes=3, shortcut=shortcut, stage_features=(4, 8), blocks_per_stage=1)


def random_variables(model, seed=1):
    """Random values for every variable (biases, BatchNorm scales and running statistics included), drawn
    with numpy: an eager flax init costs seconds per model on CPU."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init_variables, KEY)

    def draw(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "var":
            return jnp.asarray(rng.uniform(0.5, 1.5, leaf.shape), jnp.float32)
        fan_in = np.prod(leaf.shape[:-1]) if len(leaf.shape) > 1 else 4
        return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(fan_in), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


# ---- narrowed zoo modules -----------------------------------------------------------------------


def test_narrowed_keeps_the_leading_ceil_r_c_of_every_hidden_layer():
    cases = [
        (zoo.MLP(10), 0.5, {"hidden": (100, 100)}),
        (zoo.CNN2C1F(10), 0.4375, {"features": (14, 28)}),
        (zoo.CNN2C3F(10), 0.1875, {"features": (2, 3), "hidden": (23, 16)}),  # ⌈1.125⌉, ⌈3⌉, ⌈22.5⌉, ⌈15.75⌉
        (zoo.LeNet5(10), 0.5, {"features": (3, 8), "hidden": (60, 42)}),
        (zoo.VGG9(10), 0.25, {"features": (16, 16, 32, 32, 64, 64, 128, 128)}),
        (resnet.ResNet20(10), 0.4375, {"stage_features": (7, 14, 28), "shortcut_offsets": None}),
        (resnet.ResNet20(10, shortcut="zeros"), 0.1875, {"stage_features": (3, 6, 12), "shortcut_offsets": (0, 8, 16)}),
        (zoo.FEMNISTCNN(62), 0.01, {"features": (1, 1), "hidden": 21}),
    ]
    for module, ratio, fields in cases:
        narrow = zoo.narrowed(module, ratio)
        for field, value in fields.items():
            assert getattr(narrow, field) == value, (type(module).__name__, field)
        assert narrow.num_classes == module.num_classes and narrow.train_scale == pytest.approx(1 / ratio)
        assert zoo.narrowed(module, ratio, scaler=False).train_scale == 1.0
    assert zoo.narrowed(zoo.MLP(10), 1.0) == zoo.MLP(10)  # the full width is the model itself
    assert build_narrow_model("resnet20", 10, (32, 32, 3), 0.4375) == zoo.narrowed(resnet.ResNet20(10), 0.4375)
    for bad in (0, 1.5, -0.2, True, "0.5"):
        with pytest.raises(UserError, match="must be a number in \\(0, 1\\]"):
            zoo.narrowed(zoo.MLP(10), bad)
    with pytest.raises(UserError, match="Dense has no width-reduced version"):
        zoo.narrowed(nn.Dense(3), 0.5)


# ---- slicing: extract / insert ------------------------------------------------------------------


def test_extract_insert_round_trip_and_the_conv_to_dense_rows():
    # CNN2C1F on 8×8: conv1 4 → 2 channels, conv2 6 → 3, head reads a 2×2×C map (tile 4).
    model = adapt(zoo.CNN2C1F(5, features=(4, 6)), (8, 8, 1), 5, "cnn")
    graph = graphs.width(model, 0.5, module=zoo.CNN2C1F(5, features=(4, 6)))
    variables = random_variables(model)
    part = graph.extract(variables)
    head = np.asarray(variables["params"]["head"]["kernel"])  # [2·2·6, 5]
    narrow_head = np.asarray(part["params"]["head"]["kernel"])  # [2·2·3, 5]
    assert narrow_head.shape == (12, 5)
    for pos in range(4):
        for c in range(3):  # flat index (h·W + w)·C + c, NHWC
            np.testing.assert_array_equal(narrow_head[pos * 3 + c], head[pos * 6 + c])
    np.testing.assert_array_equal(part["params"]["conv2"]["kernel"],
                                  variables["params"]["conv2"]["kernel"][:, :, :2, :3])
    # insert(v, extract(v)) is v, bit for bit; extract(insert(v, p)) is p.
    chex.assert_trees_all_equal(graph.insert(variables, part), variables)
    other = jax.tree.map(lambda a: a + 1.0, part)
    merged = graph.insert(variables, other)
    chex.assert_trees_all_equal(graph.extract(merged), other)
    # Everything outside the narrow part is untouched, and masks/params-only trees work too.
    changed = jax.tree.map(lambda a, b: np.asarray(a != b), merged, variables)
    held = graph.insert(jax.tree.map(lambda a: jnp.zeros(a.shape, bool), variables),
                        jax.tree.map(lambda a: jnp.ones(a.shape, bool), part))
    chex.assert_trees_all_equal(changed, jax.tree.map(np.asarray, held))
    assert set(graph.extract({"params": variables["params"]})) == {"params"}


def test_resnet20_width_slicing_keeps_residual_shapes_consistent():
    """The real ResNet20: every block reads the previous block's leading channels, conv1/conv2/shortcut/BN agree.
    (Option-A shortcuts have no variables; their channel alignment is checked by the forward test below.)"""
    shortcut = "projection"
    module = resnet.ResNet20(10, shortcut=shortcut)
    model = adapt(module, (8, 8, 3), 10, "resnet20")
    for ratio, widths in ((0.4375, (7, 14, 28)), (0.1875, (3, 6, 12))):
        narrow = graphs.narrow_model(model, ratio, module=module)
        p = jax.eval_shape(narrow.init_variables, KEY)["params"]
        stats = jax.eval_shape(narrow.init_variables, KEY)["batch_stats"]
        assert p["conv1"]["kernel"].shape == (3, 3, 3, widths[0])
        stream = widths[0]
        for s in range(3):
            for b in range(3):
                block, stats_b = p[f"stage{s + 1}_block{b + 1}"], stats[f"stage{s + 1}_block{b + 1}"]
                assert block["conv1"]["kernel"].shape == (3, 3, stream, widths[s])
                assert block["conv2"]["kernel"].shape == (3, 3, widths[s], widths[s])
                for bn in ("bn1", "bn2"):
                    assert block[bn]["scale"].shape == stats_b[bn]["mean"].shape == (widths[s],)
                if "shortcut_conv" in block:
                    assert block["shortcut_conv"]["kernel"].shape == (1, 1, stream, widths[s])
                    assert block["shortcut_bn"]["scale"].shape == (widths[s],)
                assert ("shortcut_conv" in block) == (shortcut == "projection" and s > 0 and b == 0)
                stream = widths[s]
        assert p["head"]["kernel"].shape == (widths[2], 10)
        # Every narrow leaf is a leading slice of its full leaf (the graph's slicer checks this).
        graphs.width(model, ratio, module=module)


@pytest.mark.parametrize("shortcut", ["projection", "zeros"])
def test_narrow_forward_equals_the_full_model_with_the_other_channels_zeroed(shortcut):
    """Exact statement: the full model fed the narrow variables zero-padded computes exactly zero in every
    dropped channel (conv outputs and residual stream) and the narrow model's values in the kept ones —
    in evaluation, and in training with the Scaler off (with it on, hidden conv outputs are ×1/r)."""
    module = small_resnet(shortcut)
    model = adapt(module, (8, 8, 3), 3, "resnet20")
    ratio = 0.5
    graph = graphs.width(model, ratio, module=module, scaler=False)
    narrow = graphs.narrow_model(model, ratio, module=module, scaler=False)
    variables = random_variables(model)
    part = JIT_O0(graph.extract)(variables)
    padded = JIT_O0(graph.insert)(jax.tree.map(jnp.zeros_like, variables), part)
    x = jax.random.normal(jax.random.key(2), (5, 8, 8, 3))
    full_out = JIT_O0(lambda v, x: model.intermediates(v, x, train=False))(padded, x)
    narrow_out = JIT_O0(lambda v, x: narrow.intermediates(v, x, train=False))(part, x)
    for name, got in narrow_out.items():
        want = np.asarray(full_out[name])
        c = got.shape[-1]
        np.testing.assert_allclose(got, want[..., :c], rtol=1e-5, atol=1e-5 * np.abs(want).max())
        if name != "stage:head":
            assert np.all(want[..., c:] == 0), name
    mask = jnp.ones(5, bool)
    full_logits, full_stats = JIT_O0(lambda v, x: model.apply(v, x, True, mask))(padded, x)
    full_stats = graph.extract({"batch_stats": full_stats})["batch_stats"]
    logits, stats = JIT_O0(lambda v, x: graph.apply(v, x, True, mask))(part, x)
    np.testing.assert_allclose(logits, full_logits, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(stats, full_stats, rtol=1e-5, atol=1e-6)
    # With the Scaler, block 1's bn1 normalises conv1's outputs ×1/r: its batch means (read off the
    # running-mean update m ← 0.9·m + 0.1·batch mean) are ×1/r.
    scaled = graphs.width(model, ratio, module=module)
    _, stats = JIT_O0(lambda v, x: scaled.apply(v, x, True, mask))(part, x)
    old = part["batch_stats"]["stage1_block1"]["bn1"]["mean"]
    def batch_mean(tree):
        return (tree["stage1_block1"]["bn1"]["mean"] - 0.9 * old) / 0.1
    np.testing.assert_allclose(batch_mean(stats), batch_mean(full_stats) / ratio, rtol=1e-4, atol=1e-5)


def test_the_scaler_multiplies_hidden_outputs_in_training_only():
    module = zoo.MLP(3, hidden=(4, 6))
    model = adapt(module, (2,), 3, "mlp")
    graph = graphs.width(model, 0.5, module=module)
    p = jax.tree.map(np.asarray, graph.extract(random_variables(model))["params"])
    x = np.random.default_rng(3).normal(size=(4, 2)).astype(np.float32)

    def by_hand(scale):
        h = np.maximum(scale * (x @ p["fc1"]["kernel"] + p["fc1"]["bias"]), 0)
        h = np.maximum(scale * (h @ p["fc2"]["kernel"] + p["fc2"]["bias"]), 0)
        return h @ p["head"]["kernel"] + p["head"]["bias"]

    assert p["fc1"]["kernel"].shape == (2, 2) and p["fc2"]["kernel"].shape == (2, 3)
    assert p["head"]["kernel"].shape == (3, 3)
    np.testing.assert_allclose(graph.apply({"params": p, "batch_stats": {}}, x, True)[0], by_hand(2.0), rtol=1e-5)
    np.testing.assert_allclose(graph.apply({"params": p, "batch_stats": {}}, x, False)[0], by_hand(1.0), rtol=1e-5)


# ---- cost: the narrow step is really smaller ----------------------------------------------------


def test_narrow_step_flops_scale_with_the_square_of_the_ratio():
    module = zoo.MLP(4, hidden=(256, 256, 256))
    model = adapt(module, (16,), 4, "mlp")
    ctx = MethodContext(model=model, num_clients=1, cohort_size=1)
    variables = random_variables(model)
    rng = np.random.default_rng(0)
    batch = Batch(jnp.asarray(rng.normal(size=(32, 16)), jnp.float32), jnp.asarray(rng.integers(0, 4, 32)),
                  jnp.ones(32, bool), jnp.asarray(True))

    def flops(graph):
        fns = make_client_fns(ctx, fedavg(), optax.sgd(0.1, momentum=0.9), graph=graph)
        lowered = jax.jit(fns.step).lower(fns.init(variables), batch, ClientPlan(), variables, (), jax.random.key(0), 0)
        return lowered.compile().cost_analysis()["flops"]

    full = flops(None)
    share = flops(graphs.width(model, 0.5, module=module)) / full
    assert 0.25 <= share <= 0.3, share  # ≈ r² = 0.25 (hidden 256×256 layers dominate), far below r = 0.5


# ---- models without a width-reduced version -----------------------------------------------------


def test_models_without_width_support_raise_one_sentence():
    staged = from_stages([nn.Dense(4), nn.Dense(3)], input_shape=(2,), num_classes=3, name="stages")
    with pytest.raises(UserError, match="model 'stages' has no width-reduced version"):
        graphs.width(staged, 0.5)
    # Named like a zoo model but built differently: the registry's model does not match it.
    other = adapt(zoo.MLP(3, hidden=(4,)), (2,), 3, "mlp")
    with pytest.raises(UserError, match="is not the zoo's MLP with these settings"):
        graphs.width(other, 0.5)
    with pytest.raises(UserError, match="is not the zoo's ResNet20"):
        graphs.width(adapt(small_resnet("zeros"), (8, 8, 3), 3, "resnet20"), 0.5, module=small_resnet())
    assert graphs.width(other, 1.0).extract is not None  # the full width needs no narrow model
    # A model built by name from the registry needs no module.
    by_name = adapt(build_model("mlp", 10, (8, 8, 1)), (8, 8, 1), 10, "mlp")
    narrow = graphs.narrow_model(by_name, 0.25)
    assert narrow.structure.units == (50, 50, 10) and narrow.name == "mlp@0.25"
