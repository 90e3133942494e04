"""The shared pieces of the neuron-level personalised methods: tiers, counts, neuron choices, merge, schedule."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core import masks
from fedpartial._src.methods import selection
from fedpartial._src.methods.submodel import common as submodel
from fedpartial._src.methods.base import MethodContext

# ---- client tiers ----------------------------------------------------------------------------------


def test_tier_of_equal_clusters():
    # N = 10, 5 tiers: tier = floor(id·5/10) = id // 2 → ids 0,1 → 0; 2,3 → 1; …; 8,9 → 4.
    tiers = np.asarray(submodel.tier_of(jnp.arange(10), 10, 5))
    np.testing.assert_array_equal(tiers, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert tiers.dtype == np.int32


def test_tier_of_uneven_population():
    # N = 7, 5 tiers: floor(id·5/7) = 0/7, 5/7, 10/7, 15/7, 20/7, 25/7, 30/7 → 0, 0, 1, 2, 2, 3, 4.
    np.testing.assert_array_equal(submodel.tier_of(jnp.arange(7), 7, 5), [0, 0, 1, 2, 2, 3, 4])
    # One tier: everyone in tier 0; as many tiers as clients: tier = id.
    np.testing.assert_array_equal(submodel.tier_of(jnp.arange(7), 7, 1), np.zeros(7))
    np.testing.assert_array_equal(submodel.tier_of(jnp.arange(7), 7, 7), np.arange(7))


def test_check_tiers_rejects_bad_ratios():
    assert submodel.check_tiers("x", [0.5, 1]) == (0.5, 1.0)
    for bad in ([], [0.0], [1.5], [True], ["0.5"]):
        with pytest.raises(ValueError, match="x:"):
            submodel.check_tiers("x", bad)


# ---- neuron counts -----------------------------------------------------------------------------


@pytest.mark.parametrize("p, u, by_round, by_ceil", [
    (0.2, 6, 1, 2),  # 1.2 → round 1, ceil 2
    (0.5, 5, 3, 3),  # 2.5 → halves up: 3 (Python's round would give 2)
    (0.4, 5, 2, 2),  # 2.0 exactly
    (0.6, 5, 3, 3),  # 0.6·5 = 3.0000000000000004 in float: ceil must still give 3
    (0.7, 10, 7, 7),  # 7.000000000000001 in float
    (0.3, 5, 2, 2),  # 1.5 → 2
    (0.1, 3, 1, 1),  # 0.3 → round 0, raised to 1
    (0.8, 6, 5, 5),  # 4.8
    (1.0, 6, 6, 6),
])
def test_kept_units_round_half_up_and_ceil(p, u, by_round, by_ceil):
    assert submodel.kept_units(p, u) == by_round
    assert submodel.kept_units(p, u, "round") == masks.keep_count(p, u) == by_round
    assert submodel.kept_units(p, u, "ceil") == by_ceil


def test_kept_units_round_half_up_survives_float_error():
    # Exact halves: 0.35·90 = 31.5, 0.7·45 = 31.5, 0.29·50 = 14.5, 0.58·25 = 14.5 → halves up: 32, 32, 15, 15.
    cases = [(0.35, 90), (0.7, 45), (0.29, 50), (0.58, 25)]
    assert [submodel.kept_units(p, u) for p, u in cases] == [32, 32, 15, 15]


def test_schedule_counts_round_exact_halves_up():
    structure = SimpleNamespace(units=(50, 90), num_layers=2)  # schedule_counts reads only these
    # A constant schedule at 0.53 and 0.65: 26.5 → 27, 47.7 → 48; 32.5 → 33, 58.5 → 59.
    assert [int(c) for c in submodel.schedule_counts(structure, 0.53, 0.53, 3, jnp.asarray(1))] == [27, 48]
    assert [int(c) for c in submodel.schedule_counts(structure, 0.65, 0.65, None, jnp.asarray(7))] == [33, 59]
    # The ramp 0.25 → 0.5 over 5 rounds: f = 0.25, 0.3125, 0.375, 0.4375, 0.5; clamped after the end.
    ramp = [int(submodel.schedule_counts(structure, 0.25, 0.5, 5, jnp.asarray(t))[0]) for t in range(7)]
    assert ramp == [13, 16, 19, 22, 25, 25, 25]  # 12.5→13, 15.625→16, 18.75→19, 21.875→22, 25


def test_kept_units_rejects_unknown_rounding():
    with pytest.raises(ValueError, match="rounding 'floor'"):
        submodel.kept_units(0.5, 4, "floor")


def test_keep_table_by_hand(mlp):
    # TinyMLP units (6, 5, 3).  round(p·u), halves up, at least 1:
    #   p=0.2: 1.2→1, 1.0→1;  p=0.4: 2.4→2, 2.0→2;  p=0.6: 3.6→4, 3.0→3;  p=0.8: 4.8→5, 4.0→4;
    #   p=1: 6, 5.
    # ceil(p·u): p=0.2: 2, 1;  p=0.4: 3, 2;  then as above.  The classifier column is always 3.
    by_round = submodel.keep_table(mlp.structure, submodel.DEFAULT_TIERS)
    by_ceil = submodel.keep_table(mlp.structure, submodel.DEFAULT_TIERS, "ceil")
    np.testing.assert_array_equal(by_round, [[1, 1, 3], [2, 2, 3], [4, 3, 3], [5, 4, 3], [6, 5, 3]])
    np.testing.assert_array_equal(by_ceil, [[2, 1, 3], [3, 2, 3], [4, 3, 3], [5, 4, 3], [6, 5, 3]])
    assert by_round.dtype == np.int32


def test_cohort_counts_follow_the_tiers(mlp):
    ctx = MethodContext(model=mlp, num_clients=10, cohort_size=4)
    # ids 1, 2, 5, 9 → tiers 0, 1, 2, 4 → rows 0, 1, 2, 4 of the keep table above.
    counts = submodel.cohort_counts(ctx, submodel.DEFAULT_TIERS, jnp.array([1, 2, 5, 9]))
    assert len(counts) == 3
    np.testing.assert_array_equal(counts[0], [1, 2, 4, 6])
    np.testing.assert_array_equal(counts[1], [1, 2, 3, 5])
    np.testing.assert_array_equal(counts[2], [3, 3, 3, 3])
    ceil = submodel.cohort_counts(ctx, submodel.DEFAULT_TIERS, jnp.array([1, 2, 5, 9]), "ceil")
    np.testing.assert_array_equal(ceil[0], [2, 3, 4, 6])


# ---- neuron choices ----------------------------------------------------------------------------


def test_top_count_per_row_hand_case():
    scores = jnp.array([
        [0.5, 2.0, 2.0, 1.0],  # tie at 2.0 → column 1 before column 2
        [3.0, jnp.nan, 1.0, 2.0],  # NaN is the lowest score
        [1.0, 1.0, 1.0, 1.0],  # all tied → leftmost
        [4.0, 3.0, 2.0, 1.0],
    ])
    counts = jnp.array([1, 3, 2, 0])
    got = np.asarray(jax.jit(selection.top_count_per_row)(scores, counts))
    np.testing.assert_array_equal(got, [
        [False, True, False, False],
        [True, False, True, True],
        [True, True, False, False],
        [False, False, False, False],  # count 0: nothing
    ])


def test_top_count_per_row_counts_above_columns_keep_everything():
    scores = jax.random.normal(jax.random.key(0), (3, 4))
    top = jax.jit(selection.top_count_per_row)
    assert np.asarray(top(scores, jnp.array([4, 5, 100]))).all()
    assert not np.asarray(top(scores, jnp.zeros(3, jnp.int32))).any()


def test_top_count_per_row_is_jittable_with_traced_counts():
    f = jax.jit(selection.top_count_per_row)
    scores = jnp.array([[1.0, 3.0, 2.0]] * 3)
    np.testing.assert_array_equal(np.asarray(f(scores, jnp.array([0, 1, 2]))).sum(axis=1), [0, 1, 2])
    np.testing.assert_array_equal(f(scores, jnp.array([0, 1, 2]))[2], [False, True, True])


def test_random_neurons_exact_counts_and_distinct_clients():
    units = (6, 5, 3)
    counts = (jnp.array([1, 2, 4, 6]), jnp.array([1, 2, 3, 5]), jnp.array([3, 3, 3, 3]))
    draw = jax.jit(submodel.random_neurons, static_argnums=2)
    chosen = draw(jax.random.key(0), counts, units)
    for c, n, u in zip(counts, chosen, units):
        assert n.shape == (4, u) and n.dtype == bool
        np.testing.assert_array_equal(np.asarray(n).sum(axis=1), c)
    # Same key: same draw; another key: another draw.
    again = draw(jax.random.key(0), counts, units)
    for a, b in zip(chosen, again):
        np.testing.assert_array_equal(a, b)
    other = draw(jax.random.key(1), counts, units)
    assert any(not np.array_equal(a, b) for a, b in zip(chosen, other))
    # Different clients with the same count get different draws (fixed key: not flaky).
    same = (jnp.full((4,), 3),)
    rows = np.asarray(draw(jax.random.key(0), same, (6,))[0])
    assert len({r.tobytes() for r in rows}) > 1


def test_random_neurons_cover_every_neuron_roughly_uniformly():
    # 300 draws of 2 neurons out of 6: each neuron expected 100 times.  Fixed keys, loose bounds.
    keys = jax.random.split(jax.random.key(0), 300)
    draw = jax.jit(jax.vmap(lambda k: submodel.random_neurons(k, (jnp.array([2]),), (6,))[0][0]))
    hits = np.asarray(draw(keys)).sum(axis=0)
    assert hits.sum() == 600
    assert np.all(hits > 50) and np.all(hits < 150), hits


def test_leftmost_neurons():
    got = submodel.leftmost_neurons((jnp.array([0, 2, 6, 9]),), (6,))[0]
    np.testing.assert_array_equal(got, [
        [0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1],  # more than the units: all of them
    ])


def test_strongest_neurons_ties_to_lowest_index():
    scores = (jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]), jnp.array([[0.1, 0.2], [0.2, 0.1]]))
    counts = (jnp.array([1, 3]), jnp.array([1, 1]))
    a, b = jax.jit(submodel.strongest_neurons)(scores, counts)
    np.testing.assert_array_equal(a, [[False, True, False, False], [True, True, True, False]])
    np.testing.assert_array_equal(b, [[False, True], [True, False]])


def test_neuron_mask_protects_the_classifier(mlp):
    neurons = (jnp.array([[1, 0, 0, 0, 0, 0]], bool), jnp.array([[0, 1, 0, 0, 0]], bool), jnp.zeros((1, 3), bool))
    m = submodel.neuron_mask(mlp.structure, neurons)
    np.testing.assert_array_equal(m.neurons[2], [[True, True, True]])
    np.testing.assert_array_equal(m.neurons[0], neurons[0])
    assert m.inputs is None  # wired
    assert np.asarray(m.layers).all()


# ---- merge -------------------------------------------------------------------------------------


def _hand_masks(n1, n2, layers=(True, True, True)):
    """Element masks of the TinyMLP for fc1 neurons ``n1``, fc2 neurons ``n2`` (wired, head all on)."""
    n1, n2 = np.asarray(n1, bool), np.asarray(n2, bool)
    l1, l2, l3 = layers
    p = {
        "fc1": {"kernel": np.broadcast_to(n1, (4, 6)) & l1, "bias": n1 & l1},
        "bn1": {"scale": n1 & l1, "bias": n1 & l1},
        "fc2": {"kernel": np.outer(n1, n2) & l2, "bias": n2 & l2},  # kernel[i, j]: fc1 unit i → fc2 unit j
        "head": {"kernel": np.broadcast_to(n2[:, None], (5, 3)) & l3, "bias": np.ones(3, bool) & l3},
    }
    s = {"bn1": {"mean": n1 & l1, "var": n1 & l1}}
    return {"params": p, "batch_stats": s}


@pytest.mark.parametrize("layers", [(True, True, True), (True, False, True)], ids=["all-layers", "fc2-off"])
def test_merge_takes_global_on_received_elements(mlp, layers):
    g = jax.device_get(mlp.init_variables(jax.random.key(0)))
    g["batch_stats"] = jax.tree.map(lambda a: a + 0.5, g["batch_stats"])  # not the init values 0 / 1
    personal = jax.tree.map(lambda a: a + 10.0, g)  # every personal value differs from the global one
    n1 = [True, False, True, False, False, True]
    n2 = [False, True, False, False, True]
    mask = masks.Mask(layers=jnp.array(layers), neurons=(jnp.array(n1), jnp.array(n2), jnp.ones(3, bool)))
    merged = jax.device_get(jax.jit(lambda m, a, b: submodel.merge(mlp.structure, m, a, b))(mask, g, personal))
    expected_on = _hand_masks(n1, n2, layers)
    for collection in ("params", "batch_stats"):
        for module, leaves in expected_on[collection].items():
            for name, on in leaves.items():
                got = merged[collection][module][name]
                want = np.where(on, g[collection][module][name], personal[collection][module][name])
                np.testing.assert_array_equal(got, want, err_msg=f"{collection}/{module}/{name}")
    # Spot checks of the wiring: fc2 kernel [0, 1] joins two received neurons, [1, 1] does not.
    if layers[1]:
        assert merged["params"]["fc2"]["kernel"][0, 1] == g["params"]["fc2"]["kernel"][0, 1]
    assert merged["params"]["fc2"]["kernel"][1, 1] == personal["params"]["fc2"]["kernel"][1, 1]
    assert merged["batch_stats"]["bn1"]["mean"][1] == personal["batch_stats"]["bn1"]["mean"][1]


def test_merge_with_unwired_mask_takes_whole_columns(mlp):
    g = jax.device_get(mlp.init_variables(jax.random.key(0)))
    personal = jax.tree.map(lambda a: a - 3.0, g)
    n1 = jnp.array([True, False, True, False, False, True])
    n2 = jnp.array([False, True, False, False, True])
    mask = masks.unwired(mlp.structure, masks.from_neurons(mlp.structure, (n1, n2, jnp.ones(3, bool))))
    merged = jax.device_get(submodel.merge(mlp.structure, mask, g, personal))
    # fc2 columns 1 and 4 are global in every row (even rows of fc1 units that are off).
    cols = np.asarray(n2)
    np.testing.assert_array_equal(merged["params"]["fc2"]["kernel"][:, cols], g["params"]["fc2"]["kernel"][:, cols])
    np.testing.assert_array_equal(merged["params"]["fc2"]["kernel"][:, ~cols],
                                  personal["params"]["fc2"]["kernel"][:, ~cols])
    np.testing.assert_array_equal(merged["params"]["head"]["kernel"], g["params"]["head"]["kernel"])


# ---- schedule ----------------------------------------------------------------------------------


def test_schedule_ramps_linearly_and_clamps():
    ramp = [float(submodel.schedule(0.25, 0.5, jnp.asarray(t), 5)) for t in range(-1, 8)]
    # rounds = 5: f_t = 0.25 + 0.25·t/4 for t = 0..4; clamped before and after.
    np.testing.assert_allclose(ramp, [0.25, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.5, 0.5, 0.5], rtol=1e-7)
    # Unknown or single-round horizons use the end value.
    assert float(submodel.schedule(0.25, 0.5, jnp.asarray(0), None)) == 0.5
    assert float(submodel.schedule(0.25, 0.5, jnp.asarray(0), 1)) == 0.5
    # A decreasing ramp works the same way; the schedule is jittable.
    f = jax.jit(lambda t: submodel.schedule(0.8, 0.2, t, 4))
    np.testing.assert_allclose([float(f(jnp.asarray(t))) for t in range(4)], [0.8, 0.6, 0.4, 0.2], rtol=1e-6)


def test_schedule_counts_on_a_model(mlp):
    s = mlp.structure  # units (6, 5, 3)

    def counts(f, t=0):
        return [int(c) for c in submodel.schedule_counts(s, f, f, 4, jnp.asarray(t))]

    # 0.25: 1.5 → 2, 1.25 → 1, 0.75 → 1;  0.5: 3, 2.5 → 3 (halves up), 1.5 → 2;  0.01: all raised to 1.
    assert counts(0.25) == [2, 1, 1]
    assert counts(0.5) == [3, 3, 2]
    assert counts(0.01) == [1, 1, 1]
    assert counts(1.0) == [6, 5, 3]
    # Traced round inside jit: 0.25 → 0.5 over 3 rounds, round 1 is f = 0.375: 2.25 → 2, 1.875 → 2, 1.125 → 1.
    jitted = jax.jit(lambda t: submodel.schedule_counts(s, 0.25, 0.5, 3, t))(jnp.int32(1))
    assert [int(c) for c in jitted] == [2, 2, 1]
