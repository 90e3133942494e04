"""Tests of the model zoo (fedpartial._src.models.zoo / registry)."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.models import resnet, zoo
from fedpartial._src.models.registry import MODELS, ModelSpec, build_model

# Natural input shape and class count of each registry entry.
NATURAL = {
    "mlp": ((8, 8, 1), 10),  # offline digits
    "cnn2c1f": ((28, 28, 1), 62),  # EMNIST
    "cnn2c3f": ((32, 32, 3), 10),  # CIFAR-10
    "lenet5": ((32, 32, 3), 10),  # CIFAR-10
    "vgg9": ((32, 32, 3), 10),  # CIFAR-10
    "resnet20": ((32, 32, 3), 10),  # CIFAR-10
    "femnist_cnn": ((28, 28, 1), 62),  # FEMNIST
}
BN_MODELS = {"vgg9", "resnet20"}


def _key(seed: int):
    # The RBG PRNG compiles much faster on CPU than the default threefry, which
    # keeps initialising VGG-9/ResNet20 (and the whole file) quick.
    return jax.random.key(seed, impl="rbg")


def _x(shape, seed: int = 1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_registry_covers_the_zoo():
    # the token-id models and the vision transformer have their own tests (test_bilstm.py, test_transformer.py,
    # test_recurrent.py)
    assert set(MODELS) == set(NATURAL) | {"bilstm", "transformer_lm", "transformer_cls", "vit", "shakespeare_lstm",
                                          "sent140_lstm"}
    for name, spec in MODELS.items():
        assert isinstance(spec, ModelSpec)
        assert spec.description and "\n" not in spec.description, name
    assert {n for n, s in MODELS.items() if not s.sequential} == {"resnet20", "bilstm", "transformer_lm",
                                                                  "transformer_cls", "vit", "shakespeare_lstm",
                                                                  "sent140_lstm"}


def _param_count(module: nn.Module, input_shape, batch: int = 2) -> int:
    variables = jax.eval_shape(
        module.init, _key(0), jnp.zeros((batch, *input_shape), jnp.float32)
    )
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(variables["params"])))


# ------------------------------------------------------------------ forward passes


@pytest.mark.parametrize("name", sorted(NATURAL))
def test_init_and_forward(name):
    input_shape, num_classes = NATURAL[name]
    model = build_model(name, num_classes, input_shape)
    x = _x((3, *input_shape))
    variables = model.init(_key(0), x)
    has_bn = name in BN_MODELS
    assert ("batch_stats" in variables) == has_bn

    logits_eval = model.apply(variables, x, train=False)
    chex.assert_shape(logits_eval, (3, num_classes))
    chex.assert_type(logits_eval, jnp.float32)
    chex.assert_tree_all_finite(logits_eval)

    if has_bn:
        logits_train, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
        new_stats = updates["batch_stats"]
        chex.assert_trees_all_equal_structs(new_stats, variables["batch_stats"])
        old = jax.tree.leaves(variables["batch_stats"])
        new = jax.tree.leaves(new_stats)
        assert all(not np.allclose(a, b) for a, b in zip(old, new, strict=True))
    else:
        logits_train = model.apply(variables, x, train=True)
    chex.assert_shape(logits_train, (3, num_classes))
    chex.assert_type(logits_train, jnp.float32)
    chex.assert_tree_all_finite(logits_train)


def test_batchnorm_momentum_and_epsilon():
    model = resnet.ResNet20(num_classes=10)
    x = _x((4, 8, 8, 3)) * 2.0 + 1.0
    variables = model.init(_key(0), x)
    # bn1 normalises conv1's output: capture it to recompute its batch mean.
    captured = {}

    def grab(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.module.path == ("conv1",) and context.method_name == "__call__":
            captured["y"] = out
        return out

    with nn.intercept_methods(grab):
        _, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    batch_mean = jnp.mean(captured["y"], axis=(0, 1, 2))
    # momentum 0.9 from the initial running mean 0: new mean = 0.1 * batch mean.
    np.testing.assert_allclose(
        updates["batch_stats"]["bn1"]["mean"], 0.1 * batch_mean, rtol=1e-4, atol=1e-6
    )
    bn = [m for m in _layer_calls(model, (8, 8, 3), modules=True) if isinstance(m, nn.BatchNorm)]
    assert len(bn) == 21  # stem + 2 per block + 2 projection shortcuts
    assert all(m.momentum == 0.9 and m.epsilon == 1e-5 for m in bn)
    assert all(m.use_running_average for m in bn)  # init/eval uses running statistics


def test_eval_mode_is_pure_and_deterministic():
    model = build_model("vgg9", 10, (16, 16, 3))
    x = _x((2, 16, 16, 3))
    variables = model.init(_key(0), x)
    a = model.apply(variables, x)  # no mutable collections needed in eval mode
    b = model.apply(variables, x, train=False)
    np.testing.assert_array_equal(a, b)
    # eval uses the running statistics, train mode the batch statistics
    shifted = {
        "params": variables["params"],
        "batch_stats": jax.tree.map(lambda s: s + 0.5, variables["batch_stats"]),
    }
    assert not np.allclose(model.apply(shifted, x), a)
    t1, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
    t2, _ = model.apply(shifted, x, train=True, mutable=["batch_stats"])
    np.testing.assert_allclose(t1, t2, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ parameter counts

PARAM_COUNTS = [
    # mlp, 8x8x1, 10 classes: 64*200+200 + 200*200+200 + 200*10+10
    ("mlp", (8, 8, 1), 10, 12_800 + 200 + 40_000 + 200 + 2_000 + 10),  # 55,210
    # cnn2c1f, 28x28x1, 62 classes (SAME convs, 28 -> 14 -> 7):
    # conv1 5*5*1*32+32 = 832; conv2 5*5*32*64+64 = 51,264; head 7*7*64*62+62 = 194,494
    ("cnn2c1f", (28, 28, 1), 62, 832 + 51_264 + 194_494),  # 246,590
    # cnn2c1f, 8x8x1, 10 classes (8 -> 4 -> 2): 832 + 51,264 + 2*2*64*10+10
    ("cnn2c1f", (8, 8, 1), 10, 832 + 51_264 + 2_570),  # 54,666
    # cnn2c3f, 32x32x3, 10 classes (VALID: 32 -> 28 -> 14 -> 10 -> 5):
    # conv1 5*5*3*6+6 = 456; conv2 5*5*6*16+16 = 2,416; fc1 400*120+120 = 48,120;
    # fc2 120*84+84 = 10,164; head 84*10+10 = 850
    ("cnn2c3f", (32, 32, 3), 10, 456 + 2_416 + 48_120 + 10_164 + 850),  # 62,006
    # cnn2c3f, 8x8x1, 10 classes (auto -> SAME: 8 -> 4 -> 2):
    # conv1 5*5*1*6+6 = 156; conv2 2,416; fc1 2*2*16*120+120 = 7,800; fc2 10,164; head 850
    ("cnn2c3f", (8, 8, 1), 10, 156 + 2_416 + 7_800 + 10_164 + 850),  # 21,386
    # lenet5, 32x32x3, 10 classes: same network as cnn2c3f; FedDHAD reports 62,006
    ("lenet5", (32, 32, 3), 10, 456 + 2_416 + 48_120 + 10_164 + 850),  # 62,006
    # lenet5, 28x28x1, 10 classes (VALID: 28 -> 24 -> 12 -> 8 -> 4):
    # 156 + 2,416 + fc1 4*4*16*120+120 = 30,840 + 10,164 + 850
    ("lenet5", (28, 28, 1), 10, 156 + 2_416 + 30_840 + 10_164 + 850),  # 44,426
    # vgg9, 32x32x3, 10 classes: 3x3 convs without bias, BN scale+bias per channel,
    # pools after conv 2,4,6,8 (32 -> 2), head on 2*2*512 = 2,048 features.
    # convs 27*64 + 64*64*9 + 64*128*9 + 128*128*9 + 128*256*9 + 256*256*9
    #       + 256*512*9 + 512*512*9 = 4,683,456; BN 2*(64+64+128+128+256+256+512+512)
    #       = 3,840; head 2,048*10+10 = 20,490
    ("vgg9", (32, 32, 3), 10, 4_683_456 + 3_840 + 20_490),  # 4,707,786
    # femnist_cnn, 28x28x1, 62 classes (SAME: 28 -> 14 -> 7): conv1 832; conv2 51,264;
    # fc1 7*7*64*2048+2048 = 6,424,576; head 2048*62+62 = 127,038 (= EmbracingFL's table)
    ("femnist_cnn", (28, 28, 1), 62, 832 + 51_264 + 6_424_576 + 127_038),  # 6,603,710
]


@pytest.mark.parametrize("name,input_shape,num_classes,expected", PARAM_COUNTS)
def test_param_counts(name, input_shape, num_classes, expected):
    assert _param_count(build_model(name, num_classes, input_shape), input_shape) == expected


# ResNet20, 32x32x3, 10 classes (convs without bias; BN = scale+bias):
#   stem: conv 3*3*3*16 = 432, BN 32                                     ->     464
#   stage 1: 3 blocks x 2 x (3*3*16*16 = 2,304 + BN 32)                  ->  14,016
#   stage 2: block 1: 3*3*16*32 = 4,608 + 64 + 3*3*32*32 = 9,216 + 64   ->  13,952
#            blocks 2-3: 2 x 2 x (9,216 + 64)                            ->  37,120
#   stage 3: block 1: 3*3*32*64 = 18,432 + 128 + 3*3*64*64 = 36,864 + 128 -> 55,552
#            blocks 2-3: 2 x 2 x (36,864 + 128)                          -> 147,968
#   head: 64*10 + 10                                                     ->     650
#   zero-padding shortcuts (option A):                              total 269,722
#   1x1 projections: + (16*32 + 64) + (32*64 + 128) = 2,752         total 272,474
RESNET20_ZEROS = 464 + 14_016 + 13_952 + 37_120 + 55_552 + 147_968 + 650
RESNET20_PROJECTION = RESNET20_ZEROS + (512 + 64) + (2_048 + 128)


def test_resnet20_param_counts():
    assert RESNET20_ZEROS == 269_722 and RESNET20_PROJECTION == 272_474
    shape = (32, 32, 3)
    assert _param_count(resnet.ResNet20(num_classes=10, shortcut="zeros"), shape) == 269_722
    assert _param_count(resnet.ResNet20(num_classes=10, shortcut="projection"), shape) == 272_474
    assert _param_count(build_model("resnet20", 10, shape), shape) == 272_474
    # EmbracingFL's 272,762 = ours + a 1x1 16->16 projection (256) + its BN (32).
    assert 272_762 - 272_474 == 16 * 16 + 2 * 16


def test_resnet20_zero_shortcut_forward():
    model = resnet.ResNet20(num_classes=10, shortcut="zeros")
    x = _x((2, 9, 9, 3))  # odd size on purpose
    variables = model.init(_key(0), x)
    logits, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
    chex.assert_shape(logits, (2, 10))
    chex.assert_tree_all_finite(logits)
    assert not any("shortcut" in "/".join(map(str, p)) for p, _ in _flat(variables["params"]))


def test_resnet20_rejects_unknown_shortcut():
    with pytest.raises(ValueError, match="shortcut"):
        resnet.ResNet20(num_classes=10, shortcut="identity")


def _flat(tree):
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(tuple(k.key for k in path), leaf) for path, leaf in leaves]


# ------------------------------------------------------------------ call order

LAYER_TYPES = (nn.Conv, nn.Dense, nn.BatchNorm)


def _layer_calls(model: nn.Module, input_shape, modules: bool = False):
    """Paths (or modules) of every Conv/Dense/BatchNorm __call__ during init, in order."""
    calls = []

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and isinstance(context.module, LAYER_TYPES):
            calls.append(context.module if modules else context.module.path)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(model.init, _key(0), jnp.zeros((2, *input_shape)))
    return calls


def _resnet20_order(projection: bool):
    order = [("conv1",), ("bn1",)]
    for s in (1, 2, 3):
        for b in (1, 2, 3):
            blk = f"stage{s}_block{b}"
            order += [(blk, "conv1"), (blk, "bn1"), (blk, "conv2"), (blk, "bn2")]
            if projection and s > 1 and b == 1:
                order += [(blk, "shortcut_conv"), (blk, "shortcut_bn")]
    return order + [("head",)]


EXPECTED_ORDER = {
    "mlp": [("fc1",), ("fc2",), ("head",)],
    "cnn2c1f": [("conv1",), ("conv2",), ("head",)],
    "cnn2c3f": [("conv1",), ("conv2",), ("fc1",), ("fc2",), ("head",)],
    "lenet5": [("conv1",), ("conv2",), ("fc1",), ("fc2",), ("head",)],
    "vgg9": [p for i in range(1, 9) for p in ((f"conv{i}",), (f"bn{i}",))] + [("head",)],
    "resnet20": _resnet20_order(projection=True),
    "femnist_cnn": [("conv1",), ("conv2",), ("fc1",), ("head",)],
}


def _check_order_contract(model, input_shape, expected):
    mods = _layer_calls(model, input_shape, modules=True)
    paths = [m.path for m in mods]
    assert paths == expected
    assert len(set(paths)) == len(paths), "a layer module is called more than once"
    # every BatchNorm directly follows the Conv/Dense it normalises (same parent,
    # matching name), and the classifier is the last layer called.
    for i, m in enumerate(mods):
        if isinstance(m, nn.BatchNorm):
            prev = mods[i - 1]
            assert i > 0 and isinstance(prev, (nn.Conv, nn.Dense)), paths[i]
            assert prev.path[:-1] == m.path[:-1]
            assert prev.path[-1].replace("conv", "bn") == m.path[-1]
    assert isinstance(mods[-1], nn.Dense) and paths[-1] == ("head",)


@pytest.mark.parametrize("name", sorted(NATURAL))
def test_call_order(name):
    input_shape, num_classes = NATURAL[name]
    model = build_model(name, num_classes, input_shape)
    _check_order_contract(model, input_shape, EXPECTED_ORDER[name])


def test_call_order_resnet20_zero_shortcut():
    _check_order_contract(
        resnet.ResNet20(num_classes=10, shortcut="zeros"), (8, 8, 3), _resnet20_order(projection=False)
    )


def test_params_tree_names_match_layers():
    # Every recorded layer owns its own entry of the params tree, and nothing else does.
    for name, (input_shape, num_classes) in NATURAL.items():
        model = build_model(name, num_classes, input_shape)
        variables = jax.eval_shape(model.init, _key(0), jnp.zeros((2, *input_shape)))
        owners = {p[:-1] for p, _ in _flat(variables["params"])}
        assert owners == set(EXPECTED_ORDER[name]), name


# ------------------------------------------------------------------ flatten contract


def test_conv_channel_feeds_dense_rows_by_flat_index():
    # flat index = (h*W + w)*C + c: with the head rows of conv2 channel c zeroed,
    # conv2's channel-c parameters cannot change the logits.
    model = build_model("cnn2c1f", 10, (8, 8, 1))
    x = _x((2, 8, 8, 1))
    params = model.init(_key(0), x)["params"]
    c, channels = 5, 64
    rows = np.arange(params["head"]["kernel"].shape[0]) % channels == c
    params["head"]["kernel"] = params["head"]["kernel"].at[rows].set(0.0)
    base = model.apply({"params": params}, x)
    changed = jax.tree.map(lambda a: a, params)
    changed["conv2"]["kernel"] = changed["conv2"]["kernel"].at[..., c].add(3.0)
    changed["conv2"]["bias"] = changed["conv2"]["bias"].at[c].add(3.0)
    np.testing.assert_allclose(model.apply({"params": changed}, x), base, rtol=1e-6, atol=1e-6)
    # ...whereas another channel does change them.
    other = jax.tree.map(lambda a: a, params)
    other["conv2"]["bias"] = other["conv2"]["bias"].at[c + 1].add(3.0)
    assert not np.allclose(model.apply({"params": other}, x), base)


# ------------------------------------------------------------------ input shapes


def test_small_inputs():
    # Offline digits (8x8x1): every model but VGG-9 runs.
    for name in NATURAL:
        if name == "vgg9":
            with pytest.raises(ValueError, match=r"\(8, 8, 1\)"):
                build_model(name, 10, (8, 8, 1))
            continue
        model = build_model(name, 10, (8, 8, 1))
        out = jax.eval_shape(
            lambda x, m=model: m.init_with_output(_key(0), x)[0], jnp.zeros((2, 8, 8, 1))
        )
        assert out.shape == (2, 10) and out.dtype == jnp.float32, name


def test_cnn2c3f_padding_rule():
    auto = zoo.CNN2C3F(num_classes=10)
    assert auto.resolved_padding((32, 32, 3)) == "VALID"
    assert auto.resolved_padding((16, 16, 1)) == "VALID"
    assert auto.resolved_padding((15, 32, 1)) == "SAME"
    assert auto.resolved_padding((8, 8, 1)) == "SAME"
    valid = zoo.CNN2C3F(num_classes=10, padding="VALID")
    with pytest.raises(ValueError, match=r"\(8, 8, 1\)"):
        valid.validate_input_shape((8, 8, 1))
    with pytest.raises(ValueError, match=r"\(8, 8, 1\)"):
        valid.init(_key(0), jnp.zeros((1, 8, 8, 1)))
    with pytest.raises(ValueError, match="padding"):
        zoo.CNN2C3F(num_classes=10, padding="same")


def _vanishes(model, input_shape) -> bool:
    """Ground truth: does some Conv/Dense receive an empty input (or the trace fail)?"""
    empty = []

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and isinstance(context.module, (nn.Conv, nn.Dense)):
            empty.append(0 in args[0].shape)
        return next_fun(*args, **kwargs)

    try:
        with nn.intercept_methods(record):
            jax.eval_shape(model.init, _key(0), jnp.zeros((1, *input_shape)))
    except Exception:  # noqa: BLE001 - e.g. a VALID conv larger than its input
        return True
    return any(empty)


@pytest.mark.parametrize(
    "name,sizes",
    [
        ("cnn2c1f", (3, 4, 5)),
        ("cnn2c3f", (3, 4, 15, 16)),
        ("lenet5", (3, 4, 15, 16)),
        ("vgg9", (15, 16, 17)),
        ("femnist_cnn", (3, 4, 5)),
        ("resnet20", (1, 2, 3)),
    ],
)
def test_shape_validation_matches_reality(name, sizes, monkeypatch):
    cls = type(build_model(name, 10, NATURAL[name][0]))
    for size in sizes:
        for shape in ((size, size, 1), (size, 32, 1), (32, size, 1)):
            try:
                build_model(name, 10, shape)
                accepted = True
            except ValueError as err:
                assert str(shape) in str(err)
                accepted = False
            with monkeypatch.context() as m:
                m.setattr(cls, "validate_input_shape", lambda self, s: None)
                feasible = not _vanishes(build_model(name, 10, (32, 32, 1)), shape)
            assert accepted == feasible, (name, shape)
    if name == "cnn2c3f":  # forcing VALID moves the limit to 16x16
        m = zoo.CNN2C3F(num_classes=10, padding="VALID")
        with pytest.raises(ValueError):
            m.validate_input_shape((15, 15, 1))
        m.validate_input_shape((16, 16, 1))


# ------------------------------------------------------------------ build_model errors


def test_build_model_unknown_name_lists_allowed_names():
    with pytest.raises(ValueError) as info:
        build_model("resnet18", 10, (32, 32, 3))
    msg = str(info.value)
    assert "resnet18" in msg
    for name in MODELS:
        assert name in msg


@pytest.mark.parametrize(
    "name,num_classes,input_shape,match",
    [
        ("mlp", 0, (8, 8, 1), "num_classes"),
        ("mlp", 2.5, (8, 8, 1), "num_classes"),
        ("mlp", True, (8, 8, 1), "num_classes"),
        ("mlp", 10, (), r"\(\)"),
        ("mlp", 10, (8, 0, 1), r"\(8, 0, 1\)"),
        ("mlp", 10, 64, "input_shape"),
        ("cnn2c1f", 10, (28, 28), r"\(28, 28\)"),
        ("resnet20", 10, (2, 32, 32, 3), r"\(2, 32, 32, 3\)"),
        ("vgg9", 10, (8, 8, 1), r"\(8, 8, 1\)"),
    ],
)
def test_build_model_rejects_bad_arguments(name, num_classes, input_shape, match):
    with pytest.raises(ValueError, match=match):
        build_model(name, num_classes, input_shape)


def test_mlp_hidden_is_configurable():
    model = zoo.MLP(num_classes=3, hidden=(7,))
    assert _param_count(model, (4,)) == 4 * 7 + 7 + 7 * 3 + 3
    assert _layer_calls(model, (4,)) == [("fc1",), ("head",)]
