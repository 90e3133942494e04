"""The single aggregation formula: hand-computed toys and hypothesis invariants."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedpartial._src.core import aggregation, masks


def test_three_client_toy_by_hand():
    g = {"w": jnp.array([10.0, 20.0, 30.0])}
    theta = {"w": jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])}
    m = {"w": jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 0]], bool)}
    w = jnp.array([1.0, 2.0, 3.0])
    out = aggregation.masked_weighted_mean(g, theta, m, w)
    # element 0: (1·1 + 2·4 + 3·7) / (1+2+3) = 30/6 = 5
    # element 1: (1·2 + 3·8) / (1+3) = 26/4 = 6.5   (client 1 did not upload it)
    # element 2: nobody uploaded → previous global 30
    chex.assert_trees_all_close(out, {"w": jnp.array([5.0, 6.5, 30.0])})


def test_zero_weight_client_is_ignored():
    g = {"w": jnp.zeros(2)}
    theta = {"w": jnp.array([[1.0, 1.0], [100.0, 100.0]])}
    m = {"w": jnp.ones((2, 2), bool)}
    out = aggregation.masked_weighted_mean(g, theta, m, jnp.array([1.0, 0.0]))
    chex.assert_trees_all_close(out, {"w": jnp.array([1.0, 1.0])})


# The invariants below call the formula on many cohorts of five shapes: jitted, each shape is one compiled program
# (eagerly, each of its operations was a program of its own, per shape)
MEAN = jax.jit(aggregation.masked_weighted_mean)
_cohorts = st.integers(1, 5).flatmap(
    lambda k: st.tuples(
        hnp.arrays(np.float32, (k, 6), elements=st.floats(-100, 100, width=32)),
        hnp.arrays(np.bool_, (k, 6)),
        # Weights are 0 or normal floats: XLA on CPU flushes denormals (1e-45) to zero.
        hnp.arrays(np.float32, (k,), elements=st.one_of(st.just(0.0), st.floats(0.125, 50.0, width=32))),
        hnp.arrays(np.float32, (6,), elements=st.floats(-100, 100, width=32)),
    )
)


@settings(max_examples=60, deadline=None)
@given(_cohorts)
def test_result_is_a_convex_combination_or_the_global_value(c):
    theta, m, w, g = c
    out = np.asarray(MEAN(g, theta, m, jnp.asarray(w)))
    contributes = m & (w[:, None] > 0)
    for j in range(6):
        if contributes[:, j].any():
            vals = theta[contributes[:, j], j]
            assert vals.min() - 1e-3 <= out[j] <= vals.max() + 1e-3
        else:
            assert out[j] == g[j]


@settings(max_examples=60, deadline=None)
@given(_cohorts, st.randoms(use_true_random=False))
def test_invariant_to_client_order(c, rnd):
    theta, m, w, g = c
    perm = list(range(len(w)))
    rnd.shuffle(perm)
    a = MEAN(g, theta, m, jnp.asarray(w))
    b = MEAN(g, theta[perm], m[perm], jnp.asarray(w[perm]))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(_cohorts, st.floats(0.1, 10.0))
def test_invariant_to_weight_scale(c, scale):
    theta, m, w, g = c
    a = MEAN(g, theta, m, jnp.asarray(w))
    b = MEAN(g, theta, m, jnp.asarray(w * np.float32(scale)))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(np.float32, (3, 4), elements=st.floats(-10, 10, width=32)))
def test_full_masks_equal_weights_is_the_mean(theta):
    out = MEAN(np.zeros(4, np.float32), theta, np.ones((3, 4), bool), jnp.ones(3))
    np.testing.assert_allclose(out, theta.mean(0), rtol=1e-5, atol=1e-5)


def test_structured_aggregate_matches_dense_formula(mlp):
    g = mlp.init_variables(jax.random.key(0))
    k = 3
    cohort = jax.tree.map(lambda a: a[None] + jnp.arange(1.0, k + 1).reshape((k,) + (1,) * a.ndim), g)
    layers = jnp.array([[1, 0, 1], [1, 1, 0], [0, 1, 1]], bool)
    neurons = (jnp.array([[1, 1, 0, 1, 1, 1]] * k, bool), jnp.ones((k, 5), bool), jnp.ones((k, 3), bool))
    upload = masks.Mask(layers, neurons)
    w = jnp.array([1.0, 2.0, 3.0])
    out = aggregation.aggregate(mlp.structure, g, cohort, upload, w)[0]
    dense = {c: jax.vmap(lambda m: masks.expand(mlp.structure, m, g[c], c))(upload) for c in g}
    for c in g:
        chex.assert_trees_all_close(out[c], aggregation.masked_weighted_mean(g[c], cohort[c], dense[c], w))
    # fc1's neuron 2 was masked out everywhere it would have been uploaded (clients 0, 1) → global kept
    np.testing.assert_array_equal(out["params"]["fc1"]["bias"][2], g["params"]["fc1"]["bias"][2])
    # head (layer 2) uploaded by clients 0 and 2 only: (1·(g+1) + 3·(g+3)) / 4 = g + 2.5
    chex.assert_trees_all_close(out["params"]["head"], jax.tree.map(lambda a: a + 2.5, g["params"]["head"]))


def test_server_sgd_one_is_fedavg_and_adam_moves_differently():
    g = {"w": jnp.array([1.0, 2.0])}
    new = {"w": jnp.array([3.0, 0.0])}
    sgd = optax.sgd(1.0)
    out, _ = aggregation.server_update(sgd, sgd.init(g), g, new)
    chex.assert_trees_all_close(out, new)
    adam = optax.adam(0.1)
    out, _ = aggregation.server_update(adam, adam.init(g), g, new)
    # Adam's first step moves each element by lr in the direction of (new - global).
    chex.assert_trees_all_close(out, {"w": jnp.array([1.1, 1.9])}, atol=1e-5)


def test_the_client_loop_and_the_dot_products_agree(mlp, monkeypatch):
    """weighted_sums contracts the client axis with a loop on a CPU and with dot products elsewhere: the same
    aggregate (and running sums) up to float summation order, structured or expanded masks alike."""
    g = mlp.init_variables(jax.random.key(0))
    k = 5
    keys = jax.random.split(jax.random.key(1), 4)
    cohort = jax.tree.map(lambda a: a[None] + jax.random.normal(keys[0], (k, *a.shape)), g)
    neurons = tuple(jax.random.bernoulli(kk, 0.6, (k, u)) for kk, u in zip(keys[1:], mlp.structure.units))
    upload = masks.Mask(jax.random.bernoulli(keys[3], 0.7, (k, mlp.structure.num_layers)), neurons)
    w = jnp.array([1.0, 0.0, 2.5, 3.0, 0.5])
    sums = aggregation.zero_sums(g)
    results, dot_calls = {}, []
    dot_sums = aggregation._sums
    monkeypatch.setattr(aggregation, "_sums", lambda *a: dot_calls.append(1) or dot_sums(*a))
    for dots in (False, True):
        monkeypatch.setattr(aggregation, "contract_with_dots", lambda dots=dots: dots)
        dot_calls.clear()
        results[dots] = (aggregation.aggregate(mlp.structure, g, cohort, upload, w),
                         aggregation.add_sums(mlp.structure, sums, g, cohort, upload, w),
                         aggregation.masked_weighted_mean(g["params"], cohort["params"], jax.vmap(
                             lambda m: masks.expand(mlp.structure, m, g["params"], "params"))(upload), w))
        assert bool(dot_calls) == dots  # each path really taken
    chex.assert_trees_all_close(results[False], results[True], rtol=1e-6, atol=1e-6)
    assert not all(np.all(r) for r in jax.tree.leaves(results[False][0][1]))  # some element nobody uploaded


@pytest.mark.parametrize("name", ["sgd", "adam", "yogi", "adagrad"])
def test_server_lr_scale_equals_the_server_optimizer_at_that_rate_bit_for_bit(name):
    """What ``--server-lrs`` relies on: every server optimizer built at rate 1, its updates times the rate,
    is the optimizer built at that rate (three steps, so the optimizer state matters), and the state is the same."""
    from fedpartial._src.experiment.config import RunConfig
    from fedpartial._src.experiment.parts import make_server_optimizer

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.asarray(rng.normal(size=3), jnp.float32)}
    targets = [jax.tree.map(lambda p: p + jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(3)]
    rate = 0.37
    at_rate = make_server_optimizer(RunConfig(server_optimizer=name, server_lr=rate))
    at_one = make_server_optimizer(RunConfig(server_optimizer=name, server_lr=1.0))
    step = jax.jit(aggregation.server_update, static_argnums=0)
    a, sa = params, at_rate.init(params)
    b, sb = params, at_one.init(params)
    for target in targets:
        a, sa = step(at_rate, sa, a, target)
        b, sb = step(at_one, sb, b, target, None, jnp.float32(rate))
    chex.assert_trees_all_equal((a, sa), (b, sb))
    assert not np.allclose(a["w"], params["w"])
