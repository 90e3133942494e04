"""Element masks: a level below the unit, per client — expanded, counted (values and positions), aggregated
element-wise by the one formula, and frozen element by element in local training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpartial._src.core import aggregation, masks
from fedpartial._src.core.types import ClientPlan, MethodContext, client_sgd
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.methods.base import make_method
from tests.conftest import make_cohort

K = 3


def random_elements(params, rng, density, dense=("bias", "scale")):
    """``[K, ...]`` element masks: kernels sparse at ``density``, the leaves named in ``dense`` dense ``[K]``."""
    def leaf(path, a):
        if path[-1].key in dense:
            return rng.random(K) < 0.7
        return rng.random((K, *a.shape)) < density
    return jax.tree_util.tree_map_with_path(leaf, params)


def structured(mlp, rng):
    """``[K]`` structured masks: random layers and hidden units (the output units on)."""
    s = mlp.structure
    neurons = tuple(rng.random((K, u)) < 0.8 for u in s.units[:-1]) + (np.ones((K, s.units[-1]), bool),)
    return masks.Mask(rng.random((K, s.num_layers)) < 0.8, neurons)


def expanded(mlp, mask, params):
    return jax.vmap(lambda m: masks.expand(mlp.structure, m, params))(mask)


def test_an_element_is_on_iff_every_level_says_so(mlp):
    params = mlp.init_variables(jax.random.key(0))["params"]
    rng = np.random.default_rng(0)
    base, elements = structured(mlp, rng), random_elements(params, rng, 0.5)
    got = expanded(mlp, masks.with_elements(base, elements), params)
    want = jax.tree.map(lambda s, e: s & e.reshape(e.shape + (1,) * (s.ndim - e.ndim)), expanded(mlp, base, params),
                        elements)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    # the other collections ignore the element level
    stats = mlp.init_variables(jax.random.key(0))["batch_stats"]
    one = jax.tree.map(lambda a: a[0], masks.with_elements(base, elements))
    jax.tree.map(np.testing.assert_array_equal, masks.expand(mlp.structure, one, stats, "batch_stats"),
                 masks.expand(mlp.structure, one._replace(elements=None), stats, "batch_stats"))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), density=st.sampled_from([0.0, 0.05, 0.3, 1.0]))
def test_counts_are_the_expanded_elements_and_bytes_add_the_cheaper_positions(mlp, seed, density):
    """Elements: the expanded mask's on-elements.  Bytes: values (4 each) plus, for a sparse leaf, a bitmap
    (⌈size/8⌉) or int32 indices (4 each), whichever is smaller; a dense leaf sends no positions."""
    variables = mlp.init_variables(jax.random.key(0))
    params = variables["params"]
    rng = np.random.default_rng(seed)
    mask = masks.with_elements(structured(mlp, rng), random_elements(params, rng, density))
    on = expanded(mlp, mask, params)
    count = sum(np.asarray(e).reshape(K, -1).sum(1) for e in jax.tree.leaves(on))
    np.testing.assert_array_equal(masks.count_elements(mlp.structure, mask, params), count)
    want = np.zeros(K, np.int64)
    for (path, e), el in zip(jax.tree_util.tree_leaves_with_path(on), jax.tree.leaves(mask.elements)):
        n = np.asarray(e).reshape(K, -1).sum(1)
        want += 4 * n
        if el.ndim > 1:  # sparse
            want += np.minimum(-(-e[0].size // 8), 4 * n)
    got = masks.count_bytes(mlp.structure, mask, {"params": params}, ("params",))
    np.testing.assert_array_equal(got, want)
    per_layer = masks.count_bytes_per_layer(mlp.structure, mask, variables, ("params", "batch_stats"))
    stats = masks.count_bytes(mlp.structure, mask._replace(elements=None), variables, ("batch_stats",))
    np.testing.assert_array_equal(np.asarray(per_layer).sum(-1), want + np.asarray(stats))


def test_aggregation_averages_each_element_over_the_clients_that_sent_it(mlp):
    """The one formula Σ w m θ / Σ w m, element by element; an element nobody sent keeps the global value."""
    variables = mlp.init_variables(jax.random.key(0))
    params = variables["params"]
    rng = np.random.default_rng(1)
    mask = masks.with_elements(masks.full(mlp.structure, (K,)), random_elements(params, rng, 0.4, dense=()))
    trained = jax.tree.map(lambda a: a[None] + jnp.asarray(rng.normal(size=(K, *a.shape)), a.dtype), params)
    weights = jnp.asarray([1.0, 2.0, 5.0])
    new, received = aggregation.aggregate(mlp.structure, {"params": params}, {"params": trained}, mask, weights,
                                          ("params",))
    m = expanded(mlp, mask, params)
    for g, t, e, got, r in zip(*(jax.tree.leaves(x) for x in (params, trained, m, new["params"], received))):
        w = np.asarray(weights).reshape((K,) + (1,) * g.ndim) * np.asarray(e)
        den = w.sum(0)
        want = np.where(den > 0, (w * np.asarray(t, np.float64)).sum(0) / np.where(den > 0, den, 1), g)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(r, den > 0)
        np.testing.assert_array_equal(np.asarray(got)[den == 0], np.asarray(g)[den == 0])


def test_an_element_not_trained_keeps_its_value_and_momentum(mlp):
    """A train mask with an element level: the elements off stay bit for bit, the others move."""
    v = mlp.init_variables(jax.random.key(2))
    rng = np.random.default_rng(3)
    elements = jax.tree.map(lambda e: e[0], random_elements(v["params"], rng, 0.5, dense=()))
    train = masks.with_elements(masks.full(mlp.structure), elements)
    fns = make_client_fns(MethodContext(mlp, 4, 4), make_method("t"),
                          optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9)))
    data = jax.tree.map(lambda a: a[0], make_cohort((4,), steps=3).data)
    local = fns.init(v)
    for s in range(3):
        local = jax.jit(fns.step)(local, jax.tree.map(lambda a, s=s: a[s], data), ClientPlan(train=train), v, (),
                                  jax.random.key(0), s)
    out = fns.final(local, v)[0]["params"]
    for before, after, on in zip(jax.tree.leaves(v["params"]), jax.tree.leaves(out), jax.tree.leaves(elements)):
        on = np.broadcast_to(np.asarray(on), before.shape)
        np.testing.assert_array_equal(np.asarray(after)[~on], np.asarray(before)[~on])
        assert np.all(np.asarray(after)[on] != np.asarray(before)[on])


def test_intersecting_keeps_the_element_level(mlp):
    params = mlp.init_variables(jax.random.key(0))["params"]
    rng = np.random.default_rng(4)
    a = masks.with_elements(structured(mlp, rng), random_elements(params, rng, 0.5))
    b = structured(mlp, rng)
    both = masks.intersect(a, b)
    jax.tree.map(np.testing.assert_array_equal, expanded(mlp, both, params),
                 jax.tree.map(jnp.logical_and, expanded(mlp, a, params), expanded(mlp, b, params)))
    c = masks.with_elements(b, random_elements(params, rng, 0.5))
    jax.tree.map(np.testing.assert_array_equal, expanded(mlp, masks.intersect(a, c), params),
                 jax.tree.map(jnp.logical_and, expanded(mlp, a, params), expanded(mlp, c, params)))


def test_each_layers_trained_share_and_the_rounds_metric(mlp):
    """layer_densities: a layer's on-elements over its elements; a round whose train masks have an element level
    reports it per client (``trained_density``, what --sparse-flops credits)."""
    params = mlp.init_variables(jax.random.key(0))["params"]
    rng = np.random.default_rng(5)
    mask = masks.with_elements(structured(mlp, rng), random_elements(params, rng, 0.3))
    on = expanded(mlp, mask, params)
    want = np.zeros((K, mlp.structure.num_layers))
    total = np.zeros(mlp.structure.num_layers)
    for (path, e), leaf in zip(jax.tree_util.tree_leaves_with_path(on), jax.tree.leaves(params)):
        layer = mlp.structure.role("params", tuple(k.key for k in path)).layer
        want[:, layer] += np.asarray(e).reshape(K, -1).sum(1)
        total[layer] += leaf.size
    np.testing.assert_allclose(masks.layer_densities(mlp.structure, mask, params), want / total, rtol=1e-6)

    def plan(ctx, view):
        return ClientPlan(train=mask)

    r = FederatedRound(mlp, make_method("sparse", plan=plan), num_clients=K, cohort_size=K,
                       client_optimizer=client_sgd(0.1))
    _, metrics = r(r.init(jax.random.key(0)), make_cohort((4,), k=K, steps=2), jax.random.key(1))
    np.testing.assert_allclose(metrics["trained_density"], want / total, rtol=1e-6)
