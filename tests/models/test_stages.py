"""Staged models: zoo stage boundaries, Model.apply_stages / stage_variables / intermediates, from_stages."""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from fedpartial._src.models.registry import MODELS, build_model
from fedpartial._src.models.adapter import from_linen, from_nnx, from_stages
from fedpartial._src.models import zoo
from fedpartial._src.core.structure import leaf_paths
from tests.conftest import TinyMLP, make_cohort

NUM_CLASSES = 10
BN_MODELS = ("resnet20", "vgg9")
RESNET_BLOCKS = tuple(f"stage{s}_block{b}" for s in (1, 2, 3) for b in (1, 2, 3))
STAGES = {
    "mlp": ("fc1", "fc2", "head"),
    "cnn2c1f": ("conv1", "conv2", "head"),
    "cnn2c3f": ("conv1", "conv2", "fc1", "fc2", "head"),
    "lenet5": ("conv1", "conv2", "fc1", "fc2", "head"),
    "vgg9": tuple(f"conv{i}" for i in range(1, 9)) + ("head",),
    "resnet20": ("stem",) + RESNET_BLOCKS + ("head",),
    "femnist_cnn": ("conv1", "conv2", "fc1", "head"),
    "bilstm": ("embedding", "bilstm", "head"),
    "vit": ("embed", "block0", "block1", "head"),
}
# the token-id models have their own tests (test_bilstm.py, test_transformer.py, test_recurrent.py)
TOKEN_MODELS = {"bilstm", "transformer_lm", "transformer_cls", "shakespeare_lstm", "sent140_lstm"}
IMAGE_MODELS = sorted(set(MODELS) - TOKEN_MODELS)


def _shape(name):
    return (16, 16, 3) if name == "vgg9" else (8, 8, 3)  # VGG-9's four pools need 16x16


@functools.cache
def _model(name, shape=None):
    shape = shape or _shape(name)
    return from_linen(build_model(name, NUM_CLASSES, shape), input_shape=shape,
                      num_classes=NUM_CLASSES, sequential=MODELS[name].sequential)


@functools.cache
def _variables(name, shape=None):
    return _random_variables(_model(name, shape))


def _random_variables(model):
    """Random variables of the model's structure, drawn with numpy (a Flax init costs seconds on CPU).

    Running statistics are not the initial 0/1, so that eval mode visibly uses them.
    """
    abstract = jax.eval_shape(model.init_variables, jax.random.key(0))
    rng = np.random.default_rng(0)

    def fill(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        kind = path[-1].key
        if kind == "kernel":
            return jnp.asarray(noise / np.sqrt(np.prod(leaf.shape[:-1])))
        if kind in ("scale", "var"):
            return jnp.asarray(1.0 + 0.2 * np.abs(noise))
        return jnp.asarray(0.1 * noise)  # bias, mean

    return jax.tree_util.tree_map_with_path(fill, abstract)


def _x(shape, batch=3, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((batch, *shape)), jnp.float32)


def _paths(tree):
    return sorted("/".join(p) for p, _ in leaf_paths(tree))


# ------------------------------------------------------------------ stage names and layers


def test_registry_is_covered():
    assert set(STAGES) == (set(MODELS) - TOKEN_MODELS) | {"bilstm"}


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_stage_names_need_no_call_and_map_layers(name):
    module = build_model(name, NUM_CLASSES, _shape(name))
    assert module.stage_names == STAGES[name]  # an unbound module answers
    model = _model(name)
    assert model.stage_names == STAGES[name] and model.num_stages == len(STAGES[name])
    stage_of = model.stage_of_layer
    assert len(stage_of) == model.structure.num_layers
    assert list(stage_of) == sorted(stage_of) and stage_of[-1] == model.num_stages - 1
    assert set(stage_of) == set(range(model.num_stages))  # every stage owns a layer
    for layer, stage in zip(model.structure.layers, stage_of, strict=True):
        # ResNet's conv1 is its stem; ViT's position table is part of its embedding
        owner = layer.path[0] if layer.path[0] in STAGES[name] else {"pos_embed": "embed"}.get(layer.path[0], "stem")
        assert model.stage_names[stage] == owner, layer.name


def test_resnet20_stages_at_block_boundaries():
    model = _model("resnet20")
    assert model.num_stages == 11
    moderate, weak = 4, 7  # docs/decisions.md#embracingfl: stem + 3 blocks frozen, stem + 6 blocks frozen
    assert model.stage_names[moderate] == "stage2_block1" and model.stage_names[weak] == "stage3_block1"
    names = model.structure.layer_names
    assert [s for n, s in zip(names, model.stage_of_layer) if n.startswith("stage1_block1/")] == [1, 1]
    assert [s for n, s in zip(names, model.stage_of_layer) if n.startswith("stage2_block1/")] == [4, 4, 4]
    suffix = model.stage_variables(_variables("resnet20"), moderate)
    assert sorted(suffix["params"]) == sorted(RESNET_BLOCKS[3:] + ("head",))
    assert sorted(suffix["batch_stats"]) == sorted(RESNET_BLOCKS[3:])
    assert sorted(suffix["params"]["stage2_block1"]) == [
        "bn1", "bn2", "conv1", "conv2", "shortcut_bn", "shortcut_conv"]


# ------------------------------------------------------------------ parameter trees are unchanged


def test_parameter_trees_are_unchanged():
    v = _variables("cnn2c1f")
    assert _paths(v) == [f"params/{m}/{leaf}" for m in ("conv1", "conv2", "head")
                         for leaf in ("bias", "kernel")]
    module = build_model("cnn2c1f", 10, (8, 8, 3))
    assert _paths(v) == _paths(jax.eval_shape(module.init, jax.random.key(0), _x((8, 8, 3))))
    v = _variables("resnet20")
    blocks = sorted(RESNET_BLOCKS)
    assert sorted(v["params"]) == sorted(["conv1", "bn1", "head", *blocks])
    assert sorted(v["batch_stats"]) == sorted(["bn1", *blocks])
    assert sorted(v["params"]["stage1_block1"]) == ["bn1", "bn2", "conv1", "conv2"]
    assert sorted(v["batch_stats"]["stage3_block1"]) == ["bn1", "bn2", "shortcut_bn"]
    assert sorted(v["params"]["stage1_block1"]["conv1"]) == ["kernel"]


# ------------------------------------------------------------------ prefix + suffix = the model


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_every_cut_composes_to_the_full_model(name):
    model, v = _model(name), _variables(name)
    x = _x(model.input_shape)
    full, stats = model.apply(v, x, False)
    out, same_stats = model.apply_stages(v, x)
    np.testing.assert_array_equal(out, full)
    chex.assert_trees_all_equal(same_stats, stats)
    for c in range(model.num_stages + 1):
        h, _ = model.apply_stages(v, x, stop=c)
        if c == 0:
            np.testing.assert_array_equal(h, x)
        out, _ = model.apply_stages(v, h, start=c)
        np.testing.assert_allclose(out, full, rtol=1e-5, atol=1e-5, err_msg=f"cut {c}")
        suffix = model.stage_variables(v, c)
        out_sub, _ = model.apply_stages(suffix, h, start=c)
        np.testing.assert_array_equal(out_sub, out)


def test_cnn2c3f_stages_with_valid_and_auto_padding():
    for shape in ((32, 32, 3), (8, 8, 1)):  # VALID and SAME under padding="auto"
        model, v = _model("cnn2c3f", shape), _variables("cnn2c3f", shape)
        x = _x(shape)
        h, _ = model.apply_stages(v, x, stop=1)
        out, _ = model.apply_stages(model.stage_variables(v, 1), h, start=1)
        np.testing.assert_allclose(out, model.apply(v, x, False)[0], rtol=1e-5, atol=1e-5)
    # The raw module cannot pick "auto" padding without the image; fixing it for the shape can.
    module = zoo.CNN2C3F(num_classes=10)
    with pytest.raises(ValueError, match="for_input_shape"):
        module.init(jax.random.key(0), jnp.zeros((1, 14, 14, 6)), start=1)
    assert module.for_input_shape((32, 32, 3)).padding == "VALID"
    assert module.for_input_shape((8, 8, 3)).padding == "SAME"


def test_stage_range_is_checked():
    model, v = _model("mlp"), _variables("mlp")
    x = _x(model.input_shape)
    for start, stop in ((2, 1), (0, 4), (-1, None), (4, None)):
        with pytest.raises(ValueError, match="range"):
            model.apply_stages(v, x, start=start, stop=stop)
    with pytest.raises(ValueError, match="range"):
        model.stage_variables(v, 1, 0)


def test_apply_stages_under_jit():
    model, v = _model("resnet20"), _variables("resnet20")
    x = _x(model.input_shape)
    f = jax.jit(model.apply_stages, static_argnames=("start", "stop", "train"))
    h, _ = f(v, x, stop=4)
    np.testing.assert_allclose(h, model.apply_stages(v, x, stop=4)[0], rtol=1e-5, atol=1e-5)
    out, stats = f(model.stage_variables(v, 4), h, start=4, train=True)
    assert set(stats) == set(RESNET_BLOCKS[3:])
    chex.assert_shape(out, (3, NUM_CLASSES))


# ------------------------------------------------------------------ stage_variables is a pytree function


def test_stage_variables_on_stacked_trees_and_masks():
    model, v = _model("resnet20"), _variables("resnet20")
    stacked = jax.tree.map(lambda a: jnp.stack([a, a + 1.0]), v)
    sub = model.stage_variables(stacked, 7, 10)
    assert sorted(sub["params"]) == sorted(RESNET_BLOCKS[6:])
    chex.assert_trees_all_equal_structs(sub, model.stage_variables(v, 7, 10))
    assert jax.tree.leaves(sub)[0].shape[0] == 2
    masks = jax.tree.map(lambda a: jnp.ones(a.shape, bool), v)
    assert _paths(model.stage_variables(masks, 0)) == _paths(v)
    assert model.stage_variables(masks, 10)["batch_stats"] == {}
    parts = [_paths(model.stage_variables(v, i, i + 1)) for i in range(model.num_stages)]
    assert sorted(p for part in parts for p in part) == _paths(v)  # a partition of the leaves
    # jit-compatible: it only picks dict entries
    sizes = jax.jit(lambda t: jax.tree.map(jnp.size, model.stage_variables(t, 10)))(v)
    assert int(sizes["params"]["head"]["kernel"]) == 64 * NUM_CLASSES


# ------------------------------------------------------------------ intermediates


@pytest.mark.parametrize("name", sorted(set(IMAGE_MODELS) - {"vit"}))  # vit's position table is not per example
def test_intermediates_hold_stages_and_layers(name):
    model, v = _model(name), _variables(name)
    x = _x(model.input_shape)
    outs = model.intermediates(v, x)
    assert set(outs) == {f"stage:{s}" for s in model.stage_names} | set(model.structure.layer_names)
    np.testing.assert_allclose(outs["stage:head"], model.apply(v, x, False)[0], rtol=1e-5, atol=1e-5)
    penultimate, _ = model.apply_stages(v, x, stop=model.num_stages - 1)
    np.testing.assert_allclose(outs[f"stage:{model.stage_names[-2]}"], penultimate, rtol=1e-5, atol=1e-5)
    for layer in model.structure.layers:
        assert outs[layer.name].shape[0] == 3 and outs[layer.name].shape[-1] == layer.units, layer.name
    np.testing.assert_array_equal(outs["head"], outs["stage:head"])


def test_intermediates_jit_and_resnet_representation():
    model, v = _model("resnet20"), _variables("resnet20")
    x = _x(model.input_shape)
    outs = jax.jit(model.intermediates, static_argnames="train")(v, x, train=True)
    # The penultimate stage is the last block; the head pools it to the 64 features it classifies.
    chex.assert_shape(outs["stage:stage3_block3"], (3, 2, 2, 64))
    chex.assert_shape(outs["stage:stage2_block1"], (3, 4, 4, 32))
    chex.assert_shape(outs["stage1_block1/conv1"], (3, 8, 8, 16))
    logits, _ = model.apply(v, x, True)  # train mode: batch statistics
    # Jitted vs eager: TF32 convolutions on a GPU differ in the 4th digit.
    np.testing.assert_allclose(outs["stage:head"], logits, rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ BatchNorm in train mode


def _assert_close_trees(a, b):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", BN_MODELS)
def test_train_mode_stages_match_full_batch_statistics(name):
    model, v = _model(name), _variables(name)
    x = _x(model.input_shape, batch=6)
    mask = jnp.array([True, True, True, True, False, False])
    logits, stats = model.apply(v, x, True, mask)
    out, stats_all = model.apply_stages(v, x, train=True, example_mask=mask)
    np.testing.assert_array_equal(out, logits)
    chex.assert_trees_all_equal(stats_all, stats)
    # Stage by stage, each with only its own variables: same statistics, same logits.
    h = x
    for i in range(model.num_stages):
        h, part = model.apply_stages(model.stage_variables(v, i, i + 1), h, start=i, stop=i + 1,
                                     train=True, example_mask=mask)
        _assert_close_trees(part, model.stage_variables({"batch_stats": stats}, i, i + 1)["batch_stats"])
    np.testing.assert_allclose(h, logits, rtol=1e-4, atol=1e-5)
    # Padded examples leave the statistics (and the real examples' outputs) alone...
    junk = x.at[4:].set(100.0 * _x(model.input_shape, batch=2, seed=7))
    h_prefix, _ = model.apply_stages(v, junk, stop=3, train=True, example_mask=mask)
    out, suffix_stats = model.apply_stages(model.stage_variables(v, 3), h_prefix, start=3, train=True,
                                           example_mask=mask)
    _assert_close_trees(suffix_stats, model.stage_variables({"batch_stats": stats}, 3)["batch_stats"])
    np.testing.assert_allclose(out[:4], logits[:4], rtol=1e-4, atol=1e-4)
    # ...which they would change without the mask.
    _, unmasked = model.apply_stages(v, junk, train=True)
    assert not np.allclose(unmasked["bn1"]["mean"], stats["bn1"]["mean"])


# ------------------------------------------------------------------ models that are not staged


def test_plain_linen_module_is_one_stage():
    model = from_linen(TinyMLP(), input_shape=(4,), num_classes=3, sequential=True)
    assert model.stage_names == ("model",) and model.num_stages == 1
    assert model.stage_of_layer == (0, 0, 0)
    v = _random_variables(model)
    x = _x((4,), batch=5)
    mask = jnp.array([True, True, True, False, False])
    for train in (False, True):
        a = model.apply(v, x, train, mask)
        b = model.apply_stages(v, x, start=0, stop=1, train=train, example_mask=mask)
        chex.assert_trees_all_equal(a, b)
    assert _paths(model.stage_variables(v, 0)) == _paths(v)
    outs = model.intermediates(v, x)
    assert set(outs) == {"stage:model", "fc1", "fc2", "head"}
    np.testing.assert_allclose(outs["stage:model"], model.apply(v, x, False)[0], rtol=1e-6)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(4, 5, rngs=rngs)
        self.head = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.fc1(x)))


def test_nnx_model_is_one_stage_with_intermediates():
    linear_call = nnx.Linear.__call__
    model = from_nnx(NnxNet(nnx.Rngs(0)), input_shape=(4,), num_classes=3, sequential=True)
    assert model.stage_names == ("model",) and model.stage_of_layer == (0, 0)
    v = _random_variables(model)
    x = _x((4,), batch=2)
    outs = jax.jit(model.intermediates)(v, x)
    assert set(outs) == {"stage:model", "fc1", "head"}
    chex.assert_shape(outs["fc1"], (2, 5))
    np.testing.assert_allclose(outs["stage:model"], model.apply(v, x, False)[0], rtol=1e-6)
    assert nnx.Linear.__call__ is linear_call  # the call hooks are removed again


# ------------------------------------------------------------------ from_stages


class Body(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(6)(x.reshape((x.shape[0], -1)))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.relu(x)


def test_from_stages_structure_and_split():
    model = from_stages([Body(), nn.Dense(3)], input_shape=(8,), num_classes=3, names=("body", "head"),
                        sequential=True)
    assert model.stage_names == ("body", "head") and model.stage_of_layer == (0, 1)
    assert model.structure.layer_names == ("body/Dense_0", "head")
    assert model.structure.layers[0].norm_paths == (("body", "BatchNorm_0"),)
    assert model.structure.layers[1].feeds_from == 0
    v = _random_variables(model)
    assert _paths(v) == sorted(["params/body/Dense_0/kernel", "params/body/Dense_0/bias",
                                "params/body/BatchNorm_0/scale", "params/body/BatchNorm_0/bias",
                                "params/head/kernel", "params/head/bias",
                                "batch_stats/body/BatchNorm_0/mean", "batch_stats/body/BatchNorm_0/var"])
    x = _x((8,), batch=4)
    h, _ = model.apply_stages(v, x, stop=1)
    out, _ = model.apply_stages(model.stage_variables(v, 1), h, start=1)
    np.testing.assert_allclose(out, model.apply(v, x, False)[0], rtol=1e-6)
    assert set(model.intermediates(v, x)) == {"stage:body", "stage:head", "body/Dense_0", "head"}
    default = from_stages([Body(), nn.Dense(3)], input_shape=(8,), num_classes=3)
    assert default.stage_names == ("stage0", "stage1")
    assert sorted(jax.eval_shape(default.init_variables, jax.random.key(0))["params"]) == ["stage0", "stage1"]


def test_from_stages_rejects_bad_input():
    with pytest.raises(ValueError, match="logits"):
        from_stages([Body()], input_shape=(8,), num_classes=3)
    with pytest.raises(ValueError, match="distinct"):
        from_stages([Body(), nn.Dense(3)], input_shape=(8,), num_classes=3, names=("a", "a"))
    with pytest.raises(ValueError, match="name"):
        from_stages([Body(), nn.Dense(3)], input_shape=(8,), num_classes=3, names=("a",))


def test_from_stages_runs_in_the_engine():
    from fedpartial._src.engine.round import FederatedRound
    from fedpartial._src.methods.basic.fedavg import fedavg

    model = from_stages([Body(), nn.Dense(3)], input_shape=(8,), num_classes=3, sequential=True)
    r = FederatedRound(model, fedavg(), num_clients=4, cohort_size=4, client_optimizer=optax.sgd(0.1))
    state = r.init(jax.random.key(0))
    before = jax.tree.map(np.array, state.variables)  # the round may donate the state's buffers
    new, metrics = r(state, make_cohort((8,), k=4), jax.random.key(1))
    assert np.isfinite(float(metrics["train_loss"]))
    for stage in range(model.num_stages):  # both stages trained (a bias before BatchNorm gets no gradient)
        old, trained = (model.stage_variables(t, stage, stage + 1)["params"] for t in (before, new.variables))
        chex.assert_trees_all_equal_structs(old, trained)
        kernels = [(a, b) for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(old)[0],
                                                  jax.tree.leaves(trained)) if "kernel" in jax.tree_util.keystr(path)]
        assert len(kernels) == 1 and not np.allclose(*kernels[0])


def test_module_docstring_example_runs():
    from fedpartial._src.models import adapter

    code = adapter.__doc__.split("as a list of modules with :func:`from_stages`::")[1]
    namespace: dict = {}
    with jax.default_prng_impl("rbg"):  # a faster init on CPU
        exec(compile("\n".join(line[4:] for line in code.splitlines()), "<docstring>", "exec"), namespace)
    chex.assert_shape(namespace["logits"], (4, 10))
