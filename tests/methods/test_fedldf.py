"""FedLDF and its baselines (Random, HDFL, FedADP); the shared selection pieces; Theorem 1."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from benchmarks.fedldf_bound import convergence_bound
from fedpartial._src.core import aggregation, masks
from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.engine.types import Cohort
from fedpartial._src.methods import selection
from fedpartial._src.methods.base import Batch, ClientPlan, CohortInfo, MethodContext, MethodState, RoundView
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.layerwise.fedldf import fedadp, fedldf, hdfl, index_bytes, random_layers
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

OPT = optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.1, momentum=0.9))

# ---- a hand-built cohort: client k's layer l is the global layer + C[k, l] everywhere ----------

# Per layer (columns fc1, fc2, head) the expected top-2 for n = 2:
#   fc1: client 2 (0.5), then 1 and 3 tie at 0.4 → client 1 (lowest index)
#   fc2: |−0.3| (client 0) and 0.25 (client 4) — the divergence is a norm
#   head: all tie → clients 0 and 1
C = np.array([
    [0.1, -0.3, 0.2],
    [0.4, 0.1, 0.2],
    [0.5, 0.2, 0.2],
    [0.4, 0.05, 0.2],
    [0.2, 0.25, 0.2],
], np.float32)
EXPECTED_TOP2 = [[1, 2], [0, 4], [0, 1]]
N_K = np.array([10.0, 20.0, 30.0, 40.0, 50.0], np.float32)
# Parameters per layer of the tiny MLP: fc1 kernel 4x6 + bias 6 + bn1 scale 6 + bias 6; fc2 6x5 + 5; head 5x3 + 3.
LAYER_PARAMS = [42, 35, 18]


def hand_cohort(model, offsets=C, zero_global=False):
    """(global variables, trained variables [K, ...]) with layer offsets ``offsets[k, l]``.

    ``zero_global`` makes every update exactly ``offsets[k, l]`` (no float rounding of
    ``g + c - g``), so equal offsets give exactly tied scores inside a layer too.
    """
    g = jax.device_get(model.init_variables(jax.random.key(0)))
    if zero_global:
        g = jax.tree.map(np.zeros_like, g)
    structure = model.structure

    def offset_tree(collection, tree):
        flat = leaf_paths(tree)
        leaves = [np.asarray(leaf)[None] + offsets[:, structure.role(collection, path).layer].reshape(
            (-1,) + (1,) * np.ndim(leaf)) for path, leaf in flat]
        return jax.tree.unflatten(jax.tree.structure(tree), leaves)

    trained = {c: offset_tree(c, t) for c, t in g.items()}
    return g, trained


def make_view(model, global_vars, trained_vars, num_samples=N_K, key=None, valid=None):
    k = len(num_samples)
    info = CohortInfo(client_ids=jnp.arange(k, dtype=jnp.int32), num_samples=jnp.asarray(num_samples),
                      valid=jnp.ones((k,), bool) if valid is None else jnp.asarray(valid))
    ctx = MethodContext(model=model, num_clients=k, cohort_size=k)
    view = RoundView(key=jax.random.key(0) if key is None else key, round=jnp.zeros((), jnp.int32),
                     global_vars=global_vars, method_state=MethodState(), client_state=(), cohort=info,
                     data=None, plan=ClientPlan(), trained_vars=trained_vars)
    return ctx, view


def test_layer_divergence_matches_hand_values(mlp):
    g, trained = hand_cohort(mlp)
    d = selection.layer_divergence(mlp.structure, trained["params"], g["params"])
    assert d.shape == (3, 5)
    expected = np.abs(C.T) * np.sqrt(np.array(LAYER_PARAMS, np.float32))[:, None]
    np.testing.assert_allclose(d, expected, rtol=1e-5)


def test_top_n_picks_hand_expected_clients_with_lowest_index_tie_break(mlp):
    g, trained = hand_cohort(mlp)
    d = selection.layer_divergence(mlp.structure, trained["params"], g["params"])
    chosen = np.asarray(selection.top_n_per_row(d, 2))
    assert [list(np.flatnonzero(row)) for row in chosen] == EXPECTED_TOP2


def test_fedldf_aggregates_each_layer_over_its_selected_clients(mlp):
    g, trained = hand_cohort(mlp)
    ctx, view = make_view(mlp, g, trained)
    sel = fedldf(2).select(ctx, view)
    assert [list(np.flatnonzero(col)) for col in np.asarray(sel.upload.layers).T] == EXPECTED_TOP2
    np.testing.assert_array_equal(sel.extra_upload_bytes, np.full(5, 3 * 4))
    new = aggregation.aggregate(mlp.structure, g, trained, sel.upload, sel.weights)[0]
    for collection in ("params", "batch_stats"):  # running statistics follow their layer's clients
        for path, leaf in leaf_paths(new[collection]):
            layer = mlp.structure.role(collection, path).layer
            who = EXPECTED_TOP2[layer]
            shift = np.sum(N_K[who] * C[who, layer]) / np.sum(N_K[who])
            glob = np.asarray(dict(leaf_paths(g[collection]))[path])
            np.testing.assert_allclose(leaf, glob + shift, atol=1e-6, err_msg=f"{collection}/{path}")


def test_fedldf_never_selects_padding_clients(mlp):
    g, trained = hand_cohort(mlp)
    valid = np.array([True, True, False, True, True])  # client 2 has fc1's largest divergence
    ctx, view = make_view(mlp, g, trained, valid=valid)
    layers = np.asarray(fedldf(2).select(ctx, view).upload.layers)
    assert not layers[2].any()
    assert list(np.flatnonzero(layers[:, 0])) == [1, 3]


def test_fedadp_uploads_top_neurons_with_whole_columns(mlp):
    # Offsets are uniform within a layer, so every neuron ties and each client uploads neuron 0.
    g, trained = hand_cohort(mlp, zero_global=True)
    ctx, view = make_view(mlp, g, trained)
    sel = fedadp(0.2).select(ctx, view)
    for chosen in sel.upload.neurons:
        np.testing.assert_array_equal(np.asarray(chosen), np.eye(1, chosen.shape[1], dtype=bool).repeat(5, 0))
    new = aggregation.aggregate(mlp.structure, g, trained, sel.upload, sel.weights)[0]
    kernel, g_kernel = np.asarray(new["params"]["fc2"]["kernel"]), np.asarray(g["params"]["fc2"]["kernel"])
    # Column 0 comes from every client (all rows, although the fc1 units feeding them were not
    # uploaded): the n_k-weighted mean; every other column keeps the global value.
    np.testing.assert_allclose(kernel[:, 0], g_kernel[:, 0] + np.sum(N_K * C[:, 1]) / N_K.sum(), atol=1e-6)
    np.testing.assert_array_equal(kernel[:, 1:], g_kernel[:, 1:])


def test_neuron_update_norms_by_hand(mlp):
    g = jax.device_get(mlp.init_variables(jax.random.key(0)))["params"]
    trained = jax.tree.map(lambda a: np.stack([a, a]), g)
    trained["fc2"]["kernel"][1, :, 3] += 2.0  # client 1, neuron 3 of fc2: 6 weights moved by 2
    trained["fc2"]["bias"][1, 3] += 1.0
    trained["bn1"]["scale"][0, 5] -= 3.0  # BatchNorm scale counts for fc1's neuron 5
    norms = selection.neuron_update_norms(mlp.structure, trained, g)
    expected = [np.zeros((2, 6)), np.zeros((2, 5)), np.zeros((2, 3))]
    expected[1][1, 3] = math.sqrt(6 * 4 + 1)
    expected[0][0, 5] = 3.0
    for got, want in zip(norms, expected):
        np.testing.assert_allclose(got, want, atol=1e-6)


# ---- rounds through the engine -------------------------------------------------------------------
# One FederatedRound per (method, strategy), shared by the tests below: building a round compiles
# it, and every cohort here has the same shapes (K = 5 clients, 2 steps of 5 examples).

K = 5
FACTORIES = {
    "fedavg": fedavg, "fedldf": lambda: fedldf(2), "fedldf-all": lambda: fedldf(K),
    "random": lambda: random_layers(2), "hdfl": lambda: hdfl(2), "fedadp": lambda: fedadp(0.2),
}
STRATEGIES = {"fused": fused, "stepwise": lambda: stepwise(1)}


@pytest.fixture(scope="module")
def rounds(mlp):
    cache = {}

    def get(name, strategy="fused"):
        if (name, strategy) not in cache:
            cache[name, strategy] = FederatedRound(
                mlp, FACTORIES[name](), num_clients=8, cohort_size=K, client_optimizer=OPT,
                strategy=STRATEGIES[strategy]())
        return cache[name, strategy]

    return get


def cohort(seed, **kw):
    return make_cohort((4,), k=K, steps=2, batch=5, seed=seed, **kw)


def run_rounds(r, cohorts, seed=0):
    """(final state, per-round metrics, trace count after each round)."""
    state, metrics, traces = r.init(jax.random.key(seed)), [], []
    for t, c in enumerate(cohorts):
        state, m = r(state, c, jax.random.fold_in(jax.random.key(seed), t))
        metrics.append(jax.device_get(m))
        traces.append(r.trace_count)
    return state, metrics, traces


@pytest.fixture(scope="module")
def three_rounds(rounds):
    """``get(name)``: three rounds of a method on the same unequal cohorts and seed (run once)."""
    cohorts = [cohort(s, real_steps=[2, 1, 2, 2, 1], real_examples=[5, 3, 5, 4, 2],
                      client_ids=[s, s + 1, s + 2, s + 3, s + 4]) for s in range(3)]
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = run_rounds(rounds(name), cohorts)
        return cache[name]

    return get


def test_n_equal_k_is_fedavg(three_rounds):
    ldf, avg = three_rounds("fedldf-all")[0], three_rounds("fedavg")[0]
    chex.assert_trees_all_close(ldf.variables, avg.variables, rtol=0, atol=1e-6)


def permuted(c, perm):
    def take(a):
        return np.asarray(a)[perm]
    return Cohort(jax.tree.map(take, c.data), jax.tree.map(take, c.info))


def test_invariant_to_client_order(rounds):
    c = cohort(3, real_examples=[5, 2, 4, 3, 5])
    perm = np.array([3, 0, 4, 1, 2])
    a = run_rounds(rounds("fedldf"), [c])[0]
    b = run_rounds(rounds("fedldf"), [permuted(c, perm)])[0]
    chex.assert_trees_all_close(a.variables, b.variables, rtol=1e-6, atol=1e-6)


def reference_fedldf_round(model, global_vars, cohort, n):
    """FedLDF one client at a time: un-vmapped jitted local training, numpy selection and averages."""
    k_clients = cohort.info.client_ids.shape[0]
    ctx = MethodContext(model=model, num_clients=k_clients, cohort_size=k_clients)
    fns = make_client_fns(ctx, fedavg(), OPT)  # FedLDF's local training is FedAvg's
    init, step = jax.jit(fns.init), jax.jit(fns.step)
    plan, structure = ClientPlan(), model.structure
    trained = []
    for k in range(k_clients):
        local = init(global_vars)
        for s in range(cohort.data.step_mask.shape[1]):
            batch = Batch(*(np.asarray(a)[k, s] for a in cohort.data))
            local = step(local, batch, plan, global_vars, (), jax.random.key(k), s)
        trained.append(jax.device_get(local.variables))

    num_layers = structure.num_layers
    sq = np.zeros((num_layers, k_clients))
    for k in range(k_clients):
        for (path, theta), g in zip(leaf_paths(trained[k]["params"]), jax.tree.leaves(global_vars["params"])):
            diff = np.asarray(theta, np.float64) - np.asarray(g, np.float64)
            sq[structure.role("params", path).layer, k] += np.sum(diff ** 2)
    divergence = np.sqrt(sq)
    chosen = [sorted(range(k_clients), key=lambda k: (-divergence[layer, k], k))[:n] for layer in range(num_layers)]

    weights = np.asarray(cohort.info.num_samples, np.float64)
    new = {}
    for collection, tree in global_vars.items():
        leaves = []
        for i, (path, _) in enumerate(leaf_paths(tree)):
            who = chosen[structure.role(collection, path).layer]
            values = [np.asarray(jax.tree.leaves(trained[k][collection])[i], np.float64) for k in who]
            leaves.append(sum(weights[k] * v for k, v in zip(who, values)) / weights[who].sum())
        new[collection] = jax.tree.unflatten(jax.tree.structure(tree), leaves)
    return new, chosen


@pytest.mark.parametrize("strategy", ["fused", "stepwise"])
def test_engine_matches_plain_python_fedldf(mlp, rounds, strategy):
    cohorts = [cohort(s, real_steps=[2, 1, 2, 2, 1], real_examples=[5, 3, 5, 4, 2]) for s in (7, 8)]
    r = rounds("fedldf", strategy)
    state = r.init(jax.random.key(0))
    expected = jax.device_get(state.variables)
    selections, traces = [], []
    for t, c in enumerate(cohorts):
        expected, chosen = reference_fedldf_round(mlp, expected, c, 2)
        expected = jax.tree.map(lambda a: np.asarray(a, np.float32), expected)
        selections.append(chosen)
        state, _ = r(state, c, jax.random.key(t))
        traces.append(r.trace_count)
    assert any(len({tuple(c) for c in chosen}) > 1 for chosen in selections)  # layers pick differently
    assert traces[1] == traces[0]  # no retrace in round 2 (stepwise too)
    chex.assert_trees_all_close(jax.device_get(state.variables), expected, rtol=1e-5, atol=1e-5)


# ---- traffic -------------------------------------------------------------------------------------


def test_traffic_formulas(three_rounds):
    n, num_layers = 2, 3
    for t in range(3):
        up = {name: traffic_totals(three_rounds(name)[1][t])["upload_bytes"] for name in FACTORIES}
        avg = up["fedavg"]
        assert avg == K * 107 * 4  # a full model: 107 floats (parameters + BatchNorm statistics)
        assert up["fedldf-all"] == avg + K * num_layers * 4
        assert up["fedldf"] * K == n * avg + K * (K * num_layers * 4)  # n/K·FedAvg + K·L·4, exactly
        assert up["random"] * K == n * avg
        assert up["hdfl"] * K == n * avg
        # FedADP, by hand: one neuron per layer (max(1, round(0.2·units)) = 1 for 6, 5 and 3 units).
        # fc1 neuron: 4 kernel + bias + BN scale, bias, mean, var = 9 floats; fc2: 6 + 1; head: 5 + 1
        # → 22 floats = 88 bytes, plus per layer min(4, ⌈units/8⌉) = 1 index byte → 91 per client.
        assert up["fedadp"] == K * 91 < avg


def test_index_bytes_takes_the_cheaper_encoding():
    assert index_bytes(6, 1) == 1  # bit-mask
    assert index_bytes(100, 1) == 4  # one int32 beats 13 bytes of bits
    assert index_bytes(100, 20) == 13
    assert index_bytes(512, 102) == 64


# ---- random baselines ----------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [random_layers, hdfl], ids=["random", "hdfl"])
def test_random_baselines_n_per_layer_deterministic_per_key(mlp, factory):
    g, trained = hand_cohort(mlp)
    select = jax.jit(lambda key: factory(2).select(*make_view(mlp, g, trained, key=key)).upload.layers)
    draws = [np.asarray(select(jax.random.key(s))) for s in range(8)]
    for layers in draws:
        np.testing.assert_array_equal(layers.sum(axis=0), [2, 2, 2])  # exactly n contributors per layer
        if factory is hdfl:  # whole models: a client uploads all layers or none
            assert set(layers.sum(axis=1)) <= {0, 3}
    assert len({d.tobytes() for d in draws}) > 1
    np.testing.assert_array_equal(np.asarray(select(jax.random.key(3))), draws[3])


def test_random_draws_are_roughly_uniform():
    keys = jax.random.split(jax.random.key(0), 400)
    counts = np.asarray(jax.vmap(lambda key: selection.random_n_per_row(key, 1, 5, 2)[0])(keys)).sum(axis=0)
    assert counts.sum() == 800
    assert np.all(np.abs(counts - 160) < 50), counts


# ---- top-n properties ----------------------------------------------------------------------------


top_n_jit = jax.jit(selection.top_n_per_row, static_argnums=1)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_top_n_properties(data):
    rows, cols = 3, data.draw(st.sampled_from([1, 6]))  # few shapes: each (shape, n) compiles once
    n = data.draw(st.integers(1, cols))
    # Few distinct values, so ties are common.
    scores = data.draw(hnp.arrays(np.float32, (rows, cols), elements=st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0])))
    valid = data.draw(hnp.arrays(bool, (cols,)))
    mask = np.asarray(top_n_jit(jnp.asarray(scores), n))
    assert (mask.sum(axis=1) == n).all()
    for row, s in zip(mask, scores):
        if n < cols:
            assert s[row].min() >= s[~row].max()
            # Among equal scores at the boundary, the selected indices come first.
            boundary = s[row].min()
            tied = np.flatnonzero(s == boundary)
            assert list(np.flatnonzero(row & (s == boundary))) == list(tied[: row[tied].sum()])
    masked = np.asarray(top_n_jit(jnp.asarray(scores), n, jnp.asarray(valid)))
    assert (masked.sum(axis=1) == min(n, valid.sum())).all()
    assert not masked[:, ~valid].any()


def test_top_n_rejects_bad_n():
    with pytest.raises(ValueError, match="1 ≤ n ≤ 3"):
        selection.top_n_per_row(jnp.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="positive integer"):
        fedldf(0)


def test_n_larger_than_cohort_is_reported_when_the_round_is_built(mlp):
    r = FederatedRound(mlp, fedldf(5), num_clients=8, cohort_size=4, client_optimizer=OPT)
    with pytest.raises(ValueError, match="exceeds the cohort size 4"):
        r.init(jax.random.key(0))


def test_keep_count_rounds_halves_up():
    assert [masks.keep_count(0.2, u) for u in (1, 3, 5, 6, 8, 10, 64)] == [1, 1, 1, 1, 2, 2, 13]
    assert masks.keep_count(0.25, 10) == 3
    with pytest.raises(ValueError, match="fraction"):
        fedadp(0.0)


# ---- Theorem 1 -----------------------------------------------------------------------------------


def test_convergence_bound_hand_case():
    # q = 1 - 1/2 = 0.5;  A = 2·0.1·0.1²·2²·0.5·(1 + 1·0.5) = 0.006;  B = (1/0.1)·0.006 + 0.5·1/2 = 0.31
    r = convergence_bound(1.0, 0.1, 0.1, 2.0, 1.0, 1, 2, 1.0, t=2, initial_gap=1.0)
    assert r["A"] == pytest.approx(0.006)
    assert r["B"] == pytest.approx(0.31)
    assert r["xi2_max"] == pytest.approx(1 / (2 * 2 * 0.01 * 4))  # 6.25
    assert r["condition_holds"] and r["contracts"]
    assert r["bound"] == pytest.approx(0.006 ** 2 + 0.31 * (1 + 0.006))
    assert r["asymptotic_gap"] == pytest.approx(0.31 / 0.994)


def test_convergence_bound_tightens_with_n_and_vanishes_at_k():
    args = dict(xi1=0.5, xi2=0.2, eta=0.05, num_layers=9, beta=2.0, K=20, G=3.0)
    results = [convergence_bound(n=n, **args) for n in range(0, 21)]
    for key in ("A", "B", "asymptotic_gap"):
        values = [r[key] for r in results]
        assert all(a > b for a, b in zip(values, values[1:])), key
    assert results[-1]["A"] == results[-1]["B"] == results[-1]["asymptotic_gap"] == 0.0
    # The stated condition on ξ₂ makes A < 1 for every n (it is the n = 0 case).
    assert all(r["condition_holds"] and r["contracts"] for r in results)
    assert results[0]["A"] == pytest.approx(args["xi2"] / results[0]["xi2_max"])
    violated = convergence_bound(0.5, 1.1 * results[0]["xi2_max"], 0.05, 9, 2.0, 0, 20, 3.0)
    assert not violated["condition_holds"] and not violated["contracts"]
    assert violated["asymptotic_gap"] == math.inf
