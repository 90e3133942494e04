"""FedAD importance: HRank of conv filters, signed input-weight sums of dense neurons."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.adaptive.hrank import feature_map_ranks, filter_ranks
from fedpartial._src.methods.adaptive.importance import dense_weight_sums, importance_kinds, unit_importance
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.registry import build_model


class PointConv(nn.Module):
    """1x1 conv -> (BN) -> ReLU -> flatten -> Dense(2): filter c's map is relu(bn(Σ_i w_ic x_i + b_c))."""

    features: int
    batch_norm: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.features, (1, 1), name="conv1")(x)
        if self.batch_norm:
            x = nn.BatchNorm(use_running_average=not train, name="bn1")(x)
        x = nn.relu(x)
        return nn.Dense(2, name="head")(x.reshape((x.shape[0], -1)))


class SmallCNN(nn.Module):
    """Conv 3x3 (3) -> BN -> ReLU -> pool -> Conv 3x3 (4) -> ReLU -> flatten -> Dense(5) -> ReLU -> Dense(2)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(3, (3, 3), padding="SAME", name="conv1")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, name="bn1")(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME", name="conv2")(x))
        x = nn.relu(nn.Dense(5, name="fc1")(x.reshape((x.shape[0], -1))))
        return nn.Dense(2, name="head")(x)


def point_model(features, channels=1, hw=4, batch_norm=False):
    return from_linen(PointConv(features, batch_norm), input_shape=(hw, hw, channels), num_classes=2,
                      sequential=True, name="point")


def random_variables(model, seed=0):
    """Random variables shaped like the model's, from NumPy (cheaper to make than compiling its initialisers)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init_variables, jax.random.key(0))

    def fill(path, leaf):
        values = rng.normal(scale=0.5, size=leaf.shape).astype(np.float32)
        return np.abs(values) + 0.5 if path[-1].key == "var" else values

    return jax.tree_util.tree_map_with_path(fill, shapes)


def with_conv(model, kernel, bias, bn=None):
    """Variables of a PointConv with the 1x1 kernel ``[C_in, C_out]``, bias and BatchNorm (a dict) set by hand."""
    v = random_variables(model)
    params = dict(v["params"])
    params["conv1"] = {"kernel": jnp.asarray(kernel, jnp.float32)[None, None], "bias": jnp.asarray(bias, jnp.float32)}
    stats = dict(v["batch_stats"])
    if bn:
        params["bn1"] = {"scale": jnp.asarray(bn["scale"], jnp.float32), "bias": jnp.asarray(bn["bias"], jnp.float32)}
        stats["bn1"] = {"mean": jnp.asarray(bn["mean"], jnp.float32), "var": jnp.asarray(bn["var"], jnp.float32)}
    return {"params": params, "batch_stats": stats}


def image(*maps):
    """``[H, W, C]`` image whose channel ``c`` is ``maps[c]``."""
    return np.stack([np.asarray(m, np.float32) for m in maps], axis=-1)


SIGNS = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
RANK1_MIXED = np.outer(SIGNS, SIGNS)  # rank 1, but its ReLU is a checkerboard of rank 2
RANK1_POS = np.outer([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 2.0, 0.5]).astype(np.float32)
RANK2_POS = (RANK1_POS + np.outer([4.0, 1.0, 1.0, 2.0], [0.0, 1.0, 3.0, 1.0])).astype(np.float32)
FULL_POS = (np.eye(4) * 3.0 + 1.0).astype(np.float32)  # 3I + 11^T: full rank 4


# ------------------------------------------------------------------ matrix ranks


def test_feature_map_ranks_of_known_maps():
    maps = np.stack([np.zeros((4, 4)), RANK1_POS, RANK2_POS, FULL_POS, RANK1_MIXED, -FULL_POS]).astype(np.float32)
    got = feature_map_ranks(maps)
    chex.assert_trees_all_equal(got, jnp.array([0, 1, 2, 4, 1, 4], jnp.int32))
    # Non-square maps and extra leading axes; agrees with NumPy's default tolerance.
    rng = np.random.default_rng(0)
    rect = rng.normal(size=(2, 3, 3, 5)).astype(np.float32)
    rect[0, 1] = np.outer(rng.normal(size=3), rng.normal(size=5))
    chex.assert_trees_all_equal(np.asarray(feature_map_ranks(rect)), np.linalg.matrix_rank(rect).astype(np.int32))
    assert int(feature_map_ranks(rect)[0, 1]) == 1


def test_relu_post_activation_ranks_by_hand():
    # Filters: +x (ReLU of the mixed-sign rank-1 map is a rank-2 checkerboard), -x, x - 100 (all zero).
    model = point_model(3)
    v = with_conv(model, [[1.0, -1.0, 1.0]], [0.0, 0.0, -100.0])
    x = np.stack([image(RANK1_MIXED), image(RANK1_POS), image(RANK2_POS), image(-FULL_POS)])
    ranks = filter_ranks(model, v, x)
    assert ranks[1] is None  # the dense head
    # +x: 2, 1, 2, 0 -> 5/4;  -x: 2 (complementary checkerboard), 0, 0, 4 -> 6/4;  x - 100: 0.
    np.testing.assert_allclose(np.asarray(ranks[0]), [1.25, 1.5, 0.0])


def test_batch_norm_shift_applied_before_relu():
    model = point_model(2, batch_norm=True)
    x = np.stack([image(RANK1_POS), image(FULL_POS)])
    neutral = dict(scale=[1.0, 1.0], bias=[0.0, 0.0], mean=[0.0, 0.0], var=[1.0 - 1e-5] * 2)
    v = with_conv(model, [[1.0, 1.0]], [0.0, 0.0], neutral)
    np.testing.assert_allclose(np.asarray(filter_ranks(model, v, x)[0]), [2.5, 2.5])
    # A large negative BN shift zeroes filter 0; a large running mean zeroes filter 1; the conv
    # output itself (what intermediates returns) is unchanged, so only BN explains rank 0.
    v = with_conv(model, [[1.0, 1.0]], [0.0, 0.0],
                  dict(scale=[1.0, 1.0], bias=[-100.0, 0.0], mean=[0.0, 100.0], var=[1.0, 1.0]))
    np.testing.assert_allclose(np.asarray(filter_ranks(model, v, x)[0]), [0.0, 0.0])
    # A negative BN scale flips the sign: relu(-x) of positive maps is zero.
    v = with_conv(model, [[1.0, 1.0]], [0.0, 0.0],
                  dict(scale=[-1.0, 1.0], bias=[0.0, 0.0], mean=[0.0, 0.0], var=[1.0, 1.0]))
    np.testing.assert_allclose(np.asarray(filter_ranks(model, v, x)[0]), [0.0, 2.5])


# ------------------------------------------------------- against an independent NumPy pass


def _np_conv_same3(x, k, b):
    """NHWC 3x3 'SAME' cross-correlation, written out."""
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    h, w = x.shape[1:3]
    out = np.zeros((x.shape[0], h, w, k.shape[-1]), np.float32)
    for di in range(3):
        for dj in range(3):
            out += np.einsum("bhwc,co->bhwo", xp[:, di:di + h, dj:dj + w], k[di, dj])
    return out + b


def _np_ranks(maps):
    """Mean over images of np.linalg.matrix_rank of each channel's [H, W] map."""
    return np.array([[np.linalg.matrix_rank(m[..., c]) for c in range(m.shape[-1])] for m in maps]).mean(0)


def test_filter_ranks_match_numpy_on_hand_set_cnn():
    model = from_linen(SmallCNN(), input_shape=(8, 8, 2), num_classes=2, sequential=True, name="small")
    rng = np.random.default_rng(1)
    v = random_variables(model)
    p = {k: dict(val) for k, val in v["params"].items()}
    p["conv1"] = {"kernel": rng.normal(size=(3, 3, 2, 3)).astype(np.float32),
                  "bias": rng.normal(size=3).astype(np.float32)}
    p["conv2"] = {"kernel": rng.normal(size=(3, 3, 3, 4)).astype(np.float32),
                  "bias": np.array([0.1, -0.2, -50.0, 0.3], np.float32)}  # filter 2 is dead: rank 0
    p["bn1"] = {"scale": np.array([1.5, -0.7, 1.0], np.float32), "bias": np.array([0.2, 0.1, -0.3], np.float32)}
    stats = {"bn1": {"mean": np.array([0.5, -0.3, 0.1], np.float32), "var": np.array([2.0, 0.5, 1.0], np.float32)}}
    variables = {"params": p, "batch_stats": stats}
    x = rng.normal(size=(4, 8, 8, 2)).astype(np.float32)
    x[1, :, :4] = 0.0  # half an image empty: low-rank maps

    # Independent NumPy forward pass.
    y1 = _np_conv_same3(x, p["conv1"]["kernel"], p["conv1"]["bias"])
    bn = stats["bn1"]
    a1 = np.maximum((y1 - bn["mean"]) / np.sqrt(bn["var"] + 1e-5) * p["bn1"]["scale"] + p["bn1"]["bias"], 0.0)
    pooled = a1.reshape(4, 4, 2, 4, 2, 3).max(axis=(2, 4))
    a2 = np.maximum(_np_conv_same3(pooled, p["conv2"]["kernel"], p["conv2"]["bias"]), 0.0)

    ranks = filter_ranks(model, variables, x)
    assert importance_kinds(model) == ("conv", "conv", "dense", "dense") == model.structure.kinds
    assert ranks[2] is None and ranks[3] is None
    np.testing.assert_allclose(np.asarray(ranks[0]), _np_ranks(a1.astype(np.float32)))
    np.testing.assert_allclose(np.asarray(ranks[1]), _np_ranks(a2.astype(np.float32)))
    assert float(ranks[1][2]) == 0.0 and float(ranks[0].max()) > 4.0  # the test is not vacuous
    # The tie-breaker sees the same activations: 0.5/B · mean|a_c| / max_c mean|a_c|, B = 4.
    imp = unit_importance(model, variables, x)
    for got, r, a in ((imp[0], ranks[0], a1), (imp[1], ranks[1], a2)):
        act = a.mean(axis=(0, 1, 2))
        np.testing.assert_allclose(np.asarray(got - r), 0.125 * act / act.max(), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ dense neurons


def test_dense_weight_sums_and_classifier_zeros(mlp, cnn):
    v = random_variables(mlp, 3)
    sums = dense_weight_sums(mlp, v["params"])
    for s, layer in zip(sums, mlp.structure.layers, strict=True):
        np.testing.assert_allclose(np.asarray(s), np.asarray(v["params"][layer.name]["kernel"]).sum(0), rtol=1e-6)
    assert filter_ranks(mlp, v, np.zeros((2, 4), np.float32)) == (None, None, None)
    imp = unit_importance(mlp, v, np.zeros((2, 4), np.float32))
    chex.assert_trees_all_close(imp[:2], sums[:2])
    chex.assert_trees_all_equal(imp[2], jnp.zeros((3,), jnp.float32))
    # Signed, not absolute: a neuron with negative input weights has a negative sum.
    p = dict(v["params"], fc2={"kernel": -jnp.ones((6, 5)), "bias": jnp.full((5,), 9.0)})
    chex.assert_trees_all_equal(dense_weight_sums(mlp, p)[1], jnp.full((5,), -6.0))

    vc = random_variables(cnn, 4)
    csums = dense_weight_sums(cnn, vc["params"])
    assert csums[0] is None and csums[1] is None
    imp = unit_importance(cnn, vc, np.ones((2, 4, 4, 1), np.float32))
    chex.assert_shape(imp, [(3,), (4,), (3,)])
    chex.assert_trees_all_equal(imp[2], jnp.zeros((3,), jnp.float32))


# ------------------------------------------------------------------ tie-breaking


def test_ties_broken_by_activation_and_rank_order_kept():
    # Input: channel 0 a rank-1 map of large values, channel 1 a full-rank map of tiny values.
    model = point_model(5, channels=2)
    kernel = [[1.0, 2.0, 2.0, 0.0, 0.5],
              [0.0, 0.0, 0.0, 0.01, 0.0]]
    v = with_conv(model, kernel, [0.0] * 5)
    x = np.stack([image(100 * RANK1_POS, FULL_POS), image(100 * RANK1_POS, FULL_POS)])
    ranks = np.asarray(filter_ranks(model, v, x)[0])
    np.testing.assert_allclose(ranks, [1.0, 1.0, 1.0, 4.0, 1.0])
    imp = np.asarray(unit_importance(model, v, x)[0])
    # Ties (rank 1) ordered by activation: weight 2 > 1 > 0.5; equal activations stay exactly equal.
    assert imp[1] == imp[2] > imp[0] > imp[4]
    # Filter 3 has a far smaller activation but a higher rank: it stays the most important.
    assert imp[3] > imp[1]
    # The tie-breaker is 0.5/B · t with t = activation / max activation: hand-computed for B = 2.
    mean_abs = np.array([1.0, 2.0, 2.0, 0.01 * FULL_POS.mean() / (100 * RANK1_POS.mean()), 0.5])
    np.testing.assert_allclose(imp - ranks, 0.25 * mean_abs / mean_abs.max(), rtol=1e-5, atol=1e-6)
    assert np.all(imp - ranks <= 0.25) and np.all(imp - ranks >= 0)


def test_tie_breaker_never_reorders_distinct_average_ranks():
    # Over B = 3 images filter 0 has ranks (1, 1, 1) and filter 1 (1, 1, 2): averages differ by 1/3.
    # Filter 0's activations are the largest possible, filter 1's tiny: the order stays.
    model = point_model(2, channels=2)
    v = with_conv(model, [[1000.0, 0.0], [0.0, 1e-3]], [0.0, 0.0])
    x = np.stack([image(RANK1_POS, RANK1_POS), image(RANK1_POS, RANK1_POS), image(RANK1_POS, RANK2_POS)])
    ranks = np.asarray(filter_ranks(model, v, x)[0])
    np.testing.assert_allclose(ranks, [1.0, 4.0 / 3.0], rtol=1e-6)
    imp = np.asarray(unit_importance(model, v, x)[0])
    assert imp[1] > imp[0]


# ------------------------------------------------------------- masks, batches, transforms


def test_example_mask_and_several_batches():
    model = point_model(3)
    v = with_conv(model, [[1.0, -1.0, 0.5]], [0.0, 0.0, 0.1])
    real = np.stack([image(RANK1_MIXED), image(RANK2_POS), image(-FULL_POS)])
    junk = np.full((1, 4, 4, 1), 7.0, np.float32)
    junk[0, 0, 0, 0] = np.nan
    padded = np.concatenate([real[:2], junk, real[2:], junk, junk])
    mask = np.array([True, True, False, True, False, False])
    want = unit_importance(model, v, real)
    chex.assert_trees_all_close(unit_importance(model, v, padded, mask), want, rtol=1e-6)
    # [S, B, ...]: the same images in two batches of three (padding included) average alike.
    chex.assert_trees_all_close(unit_importance(model, v, padded.reshape(2, 3, 4, 4, 1), mask.reshape(2, 3)),
                                want, rtol=1e-6)
    # No real image: zeros, not NaN.
    none = unit_importance(model, v, padded, np.zeros(6, bool))
    chex.assert_trees_all_equal(none[0], jnp.zeros((3,), jnp.float32))
    chex.assert_tree_all_finite(none)
    with pytest.raises(UserError, match="example_mask"):
        filter_ranks(model, v, padded, mask[:5])
    with pytest.raises(UserError, match="shape"):
        filter_ranks(model, v, padded[..., 0])


def test_jit_and_vmap_over_clients_match_separate_calls():
    model = from_linen(SmallCNN(), input_shape=(8, 8, 2), num_classes=2, sequential=True, name="small")
    cohort = jax.tree.map(lambda a, b: np.stack([a, b]), random_variables(model, 5), random_variables(model, 6))
    x = np.random.default_rng(6).normal(size=(2, 2, 3, 8, 8, 2)).astype(np.float32)  # [K, S, B, ...]
    mask = jnp.array([[[True, True, True], [True, False, False]], [[True, False, True], [False, False, True]]])

    fn = jax.jit(lambda v, xb, m: unit_importance(model, v, xb, m))
    both = jax.vmap(fn)(cohort, x, mask)
    for k in range(2):
        one = jax.tree.map(lambda a, k=k: a[k], cohort)
        separate = unit_importance(model, one, x[k], mask[k])
        chex.assert_trees_all_close(jax.tree.map(lambda a, k=k: a[k], both), separate, rtol=1e-6, atol=1e-6)
        chex.assert_trees_all_close(fn(one, x[k], mask[k]), separate, rtol=1e-6, atol=1e-6)
    chex.assert_tree_all_finite(both)
    chex.assert_trees_all_equal(jax.vmap(fn)(cohort, x, mask), both)  # deterministic


def test_lenet5_zoo_model():
    shape = (12, 12, 3)
    model = from_linen(build_model("lenet5", 10, shape), input_shape=shape, num_classes=10, sequential=True,
                       name="lenet5")
    v = random_variables(model, 7)
    x = np.random.default_rng(8).normal(size=(4, *shape)).astype(np.float32)
    imp = jax.jit(lambda v, x: unit_importance(model, v, x))(v, x)
    assert importance_kinds(model) == ("conv", "conv", "dense", "dense", "dense")
    chex.assert_shape(imp, [(6,), (16,), (120,), (84,), (10,)])
    chex.assert_tree_all_finite(imp)
    ranks = filter_ranks(model, v, x)
    # conv1 maps are 12x12 (SAME below 16x16), conv2's 6x6: ranks are bounded by the map size.
    assert float(ranks[0].max()) <= 12 and float(ranks[1].max()) <= 6
    np.testing.assert_array_less(np.asarray(imp[0]) - np.asarray(ranks[0]), 0.5 / 4 + 1e-6)
    chex.assert_trees_all_close(imp[2], v["params"]["fc1"]["kernel"].sum(0), rtol=1e-5, atol=1e-5)
