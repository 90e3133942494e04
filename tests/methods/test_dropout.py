"""The dropout baselines of FedSPU (FedDrop, FjORD, Hermes, FedMP, PruneFL) as sub-model methods."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.costs import flops
from fedpartial._src.costs import footprint as costs
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.methods.base import CohortInfo, MethodContext, RoundView
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.submodel.common import SubmodelState
from fedpartial._src.methods.submodel.dropout import feddrop, fedmp, fjord, hermes, prunefl
from fedpartial._src.models.adapter import from_linen
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

LR = 0.3
OPT = optax.sgd(LR)  # plain SGD: the plain-Python reference below applies p - lr·g by hand
N, K = 10, 4
# Tiers are floor(id·5/10) = id // 2: ids 0, 3, 5, 7 are tiers 0, 1, 2, 3 (p = 0.2, 0.4, 0.6, 0.8).
# No client keeps everything, so some elements are kept by nobody.
IDS = [0, 3, 5, 7]
# TinyMLP units (6, 5, 3).  Neurons kept per layer, per client (tiers 0..3):
#   round(p·u) halves up:  fc1 1.2→1, 2.4→2, 3.6→4, 4.8→5;  fc2 1, 2, 3, 4;  head always 3.
#   FjORD ceil(p·u):       fc1 2, 3, 4, 5;                   fc2 1, 2, 3, 4.
ROUND_COUNTS = ([1, 2, 4, 5], [1, 2, 3, 4], [3, 3, 3, 3])
CEIL_COUNTS = ([2, 3, 4, 5], [1, 2, 3, 4], [3, 3, 3, 3])

FACTORIES = {"feddrop": feddrop, "fjord": fjord, "hermes": hermes, "fedmp": fedmp, "prunefl": prunefl}
NAMES = list(FACTORIES)
STRATEGIES = {"fused": fused, "stepwise": lambda: stepwise(1)}
INIT_KEY = jax.random.key(42)
ROUND_KEY = jax.random.key(7)


def counts_of(name):
    return CEIL_COUNTS if name == "fjord" else ROUND_COUNTS


def cohort(seed=0, ids=IDS):
    # Clients with 3, 2, 3, 1 real steps and 5, 3, 4, 2 real examples: n_k = 15, 6, 12, 2.
    return make_cohort((4,), k=K, steps=3, batch=5, seed=seed, real_steps=[3, 2, 3, 1],
                       real_examples=[5, 3, 4, 2], client_ids=ids)


@pytest.fixture(scope="module")
def rounds(mlp):
    cache = {}

    def get(name, strategy="stepwise", bn_policy="global"):
        if (name, strategy, bn_policy) not in cache:
            cache[name, strategy, bn_policy] = FederatedRound(
                mlp, FACTORIES[name](), num_clients=N, cohort_size=K, client_optimizer=OPT,
                bn_policy=bn_policy, strategy=STRATEGIES[strategy]())
        return cache[name, strategy, bn_policy]

    return get


def plan_of(r, state, c, key):
    """The plan the round computes for this state, cohort and key (its first jitted piece)."""
    plan = r.preview(state, c, key).plan
    return jax.device_get(plan)


@pytest.fixture(scope="module")
def one_round(rounds):
    """``get(name)``: (initial state, plan, state after one round, metrics) on the shared cohort."""
    cache = {}

    def get(name):
        if name not in cache:
            r = rounds(name)
            state0 = r.init(INIT_KEY)
            c = cohort()
            plan = plan_of(r, state0, c, ROUND_KEY)
            state1, metrics = r(state0, c, ROUND_KEY)
            cache[name] = (jax.device_get(state0), plan, jax.device_get(state1), jax.device_get(metrics))
        return cache[name]

    return get


def wired_masks(n1, n2):
    """TinyMLP element masks of a sub-model with fc1 neurons ``n1`` and fc2 neurons ``n2`` (head all on).

    An element is on iff its output neuron and the neuron feeding it are kept; BatchNorm scale,
    bias and statistics follow their fc1 neuron.
    """
    n1, n2 = np.asarray(n1, bool), np.asarray(n2, bool)
    params = {
        "fc1": {"kernel": np.broadcast_to(n1, (4, 6)), "bias": n1},
        "bn1": {"scale": n1, "bias": n1},
        "fc2": {"kernel": np.outer(n1, n2), "bias": n2},  # kernel[i, j]: fc1 unit i → fc2 unit j
        "head": {"kernel": np.broadcast_to(n2[:, None], (5, 3)), "bias": np.ones(3, bool)},
    }
    return {"params": params, "batch_stats": {"bn1": {"mean": n1, "var": n1}}}


def client_masks(plan, k):
    return wired_masks(plan.dropout.neurons[0][k], plan.dropout.neurons[1][k])


def flat(tree):
    return dict(leaf_paths(tree))


# ---- (a) the sub-model each client trains ----------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_each_client_keeps_its_tier_count(one_round, name):
    _, plan, state1, _ = one_round(name)
    for layer, want in enumerate(counts_of(name)):
        np.testing.assert_array_equal(np.asarray(plan.dropout.neurons[layer]).sum(axis=1), want,
                                      err_msg=f"layer {layer}")
    assert np.asarray(plan.dropout.neurons[2]).all()  # the classifier keeps every unit
    assert np.asarray(plan.dropout.layers).all()
    assert plan.dropout.inputs is None  # wired: a weight exists iff both its neurons do
    assert plan.train is None and plan.dropout_scale is None
    # The client receives exactly its sub-model.
    for a, b in zip(jax.tree.leaves(plan.download), jax.tree.leaves(plan.dropout)):
        np.testing.assert_array_equal(a, b)
    # The state remembers which sub-model each sampled client trained.
    for layer in range(3):
        np.testing.assert_array_equal(state1.method_state.clients.neurons[layer][IDS], plan.dropout.neurons[layer])


def test_fjord_keeps_the_leftmost_neurons(one_round):
    _, plan, _, _ = one_round("fjord")
    for layer, (units, counts) in enumerate(zip((6, 5, 3), CEIL_COUNTS)):
        want = np.arange(units)[None, :] < np.asarray(counts)[:, None]
        np.testing.assert_array_equal(plan.dropout.neurons[layer], want)


def test_feddrop_is_random_but_reproducible(rounds, one_round):
    r = rounds("feddrop")
    state0, plan, _, _ = one_round("feddrop")
    c = cohort()
    again = plan_of(r, state0, c, ROUND_KEY)
    for a, b in zip(plan.dropout.neurons, again.dropout.neurons):
        np.testing.assert_array_equal(a, b)
    # The next round's key (the driver folds in the round index) draws other sub-models.
    later = plan_of(r, state0, c, jax.random.fold_in(ROUND_KEY, 1))
    assert any(not np.array_equal(a, b) for a, b in zip(plan.dropout.neurons[:2], later.dropout.neurons[:2]))
    # Not ordered dropout: some client's kept set is not a prefix (fixed key, so not flaky).
    draws = [plan, later] + [plan_of(r, state0, c, jax.random.fold_in(ROUND_KEY, t)) for t in (2, 3)]
    prefixes = [np.array_equal(n, np.sort(n, axis=1)[:, ::-1]) for p in draws for n in p.dropout.neurons[:2]]
    assert not all(prefixes)


# ---- (b) aggregation over the clients that kept an element ----------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_aggregation_over_keepers(one_round, name):
    state0, plan, state1, _ = one_round(name)
    c = cohort()
    n_k = np.asarray(c.info.num_samples, np.float64)  # 15, 6, 12, 2
    old, new = state0.variables, state1.variables
    personal = state1.method_state.clients.variables
    per_client = [client_masks(plan, k) for k in range(K)]
    seen = {0: 0, 1: 0, "many": 0}
    for collection in ("params", "batch_stats"):
        for path, g in leaf_paths(old[collection]):
            kept = np.stack([np.broadcast_to(flat(m[collection])[path], g.shape) for m in per_client])
            got = flat(new[collection])[path]
            trained = flat(personal[collection])[path][IDS]  # each sampled client's trained values
            keepers = kept.sum(axis=0)
            # Kept by nobody: the previous global value, bit for bit.
            np.testing.assert_array_equal(got[keepers == 0], g[keepers == 0], err_msg=f"{path}")
            # Kept by one client: that client's trained value.
            only = keepers == 1
            owner = np.argmax(kept, axis=0)
            np.testing.assert_allclose(got[only], np.take_along_axis(trained, owner[None], 0)[0][only],
                                       rtol=1e-6, atol=1e-7, err_msg=f"{path}")
            # Kept by several: the n_k-weighted mean over them.
            w = n_k.reshape((K,) + (1,) * g.ndim) * kept
            mean = np.sum(w * trained, axis=0) / np.maximum(w.sum(axis=0), 1e-30)
            np.testing.assert_allclose(got[keepers > 1], mean[keepers > 1], rtol=1e-5, atol=1e-6)
            seen[0] += int((keepers == 0).sum())
            seen[1] += int(only.sum())
            seen["many"] += int((keepers > 1).sum())
    assert all(v > 0 for v in seen.values()), seen  # every case occurred


# ---- (c) dropped neurons take no part in local training ------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_dropped_neurons_have_no_effect_on_local_training(rounds, one_round, name):
    """Two starts that differ only outside a client's sub-model train to the same sub-model.

    Every element outside the sub-model (a dropped neuron's own parameters and the weights
    reading a dropped neuron) is replaced by other values; if dropped neurons acted in the
    forward pass, the loss and the kept elements would differ.  The elements outside the
    sub-model are also bit-identical before and after training.
    """
    r = rounds(name)
    state0, plan, _, _ = one_round(name)
    init, step = jax.jit(r.clients[0].init), jax.jit(r.clients[0].step)
    g = state0.variables
    data = cohort().data
    for k in range(K):
        plan_k = jax.tree.map(lambda a: None if a is None else a[k], plan)
        on = client_masks(plan, k)
        other = {c: jax.tree.map(lambda a, m: np.where(m, a, a + 1.0 + np.abs(a)).astype(a.dtype),
                                 g[c], on[c]) for c in g}
        finals = []
        for start in (g, other):
            local = init(start)
            for s in range(data.x.shape[1]):
                local = step(local, jax.tree.map(lambda a: a[k, s], data), plan_k, g, (), jax.random.key(k), s)
            local = jax.device_get(local)
            finals.append(local)
            # Outside the sub-model nothing moved.
            for path, before in leaf_paths(start["params"]):
                off = ~np.broadcast_to(flat(on["params"])[path], before.shape)
                np.testing.assert_array_equal(flat(local.variables["params"])[path][off], before[off])
        a, b = finals
        assert a.loss_sum == b.loss_sum and a.steps == b.steps
        for collection in ("params", "batch_stats"):
            for path, va in leaf_paths(a.variables[collection]):
                m = np.broadcast_to(flat(on[collection])[path], va.shape)
                np.testing.assert_array_equal(va[m], flat(b.variables[collection])[path][m],
                                              err_msg=f"client {k} {collection}/{path}")
        # Something was actually trained.
        assert not np.array_equal(a.variables["params"]["head"]["bias"], g["params"]["head"]["bias"])


# ---- norm-based choices ------------------------------------------------------------------------

# A personal model whose L2 and L1 rankings differ.  Every neuron's parameters (fc1: kernel column
# of 4, bias, BN scale, BN bias = 7 values; fc2: kernel column of 6 + bias = 7 values) are 0.1
# (L2 = 0.1·√7 ≈ 0.26, L1 = 0.7) except three designed neurons, whose other values are 0:
#   A: one weight 3.0            → L2 3.0,    L1 3.0
#   B: one weight 2.8            → L2 2.8,    L1 2.8
#   C: three weights 1.5         → L2 2.598,  L1 4.5
# so L2 ranks A, B, C and L1 ranks C, A, B; the filler neurons follow, ties by lowest index.
# Client k's designed neurons sit at (A, B, C) = (2+k, 0+k, 4+k) mod 6 in fc1 and (1+k, 3+k, 0+k) mod 5 in fc2.
DESIGN = {0: (2, 0, 4), 1: (1, 3, 0)}


def designed_params(g_params, k):
    p = jax.tree.map(lambda a: np.full(a.shape, 0.1, a.dtype), g_params)
    units = {0: 6, 1: 5}
    for layer, (module, norm) in {0: ("fc1", "bn1"), 1: ("fc2", None)}.items():
        a, b, c = ((j + k) % units[layer] for j in DESIGN[layer])
        for j in (a, b, c):
            p[module]["kernel"][:, j] = 0.0
            p[module]["bias"][j] = 0.0
            if norm:
                p[norm]["scale"][j] = 0.0
                p[norm]["bias"][j] = 0.0
        p[module]["kernel"][0, a] = 3.0
        p[module]["kernel"][1, b] = 2.8
        p[module]["kernel"][:3, c] = 1.5
    return p


def designed_choice(k, layer, count, order):
    units = (6, 5)[layer]
    a, b, c = ((j + k) % units for j in DESIGN[layer])
    ranked = ([a, b, c] if order == 2 else [c, a, b])
    ranked += sorted(set(range(units)) - set(ranked))
    return np.isin(np.arange(units), ranked[:count])


def designed_state(state):
    g = jax.device_get(state.variables)
    rows = [designed_params(g["params"], k) for k in range(K)]
    stacked = jax.tree.map(np.array, state.method_state.clients.variables)  # writable copies
    for k, i in enumerate(IDS):
        for path, leaf in leaf_paths(stacked["params"]):
            leaf[i] = flat(rows[k])[path]
    clients = state.method_state.clients._replace(variables=stacked)
    return state._replace(method_state=state.method_state._replace(clients=clients))


def hand_view(r, state, c, key=ROUND_KEY):
    """A RoundView built by hand, as the round builds it for ``plan``."""
    info = CohortInfo(client_ids=jnp.asarray(c.info.client_ids), num_samples=jnp.asarray(c.info.num_samples),
                      valid=jnp.asarray(c.info.valid))
    client_state = jax.tree.map(lambda a: jnp.asarray(a)[np.asarray(c.info.client_ids)], state.method_state.clients)
    return RoundView(key=key, round=jnp.zeros((), jnp.int32), global_vars=state.variables,
                     method_state=state.method_state, client_state=client_state, cohort=info,
                     data=jax.tree.map(jnp.asarray, c.data))


@pytest.mark.parametrize("name, order", [("hermes", 2), ("fedmp", 1)])
def test_norm_choice_uses_the_clients_own_model(rounds, name, order):
    r = rounds(name)
    state = designed_state(r.init(INIT_KEY))
    c = cohort()
    expected = [np.stack([designed_choice(k, layer, ROUND_COUNTS[layer][k], order) for k in range(K)])
                for layer in (0, 1)]
    # e.g. client 0 (1 fc1 neuron): Hermes keeps neuron 2 (L2 3.0), FedMP neuron 4 (L1 4.5).
    assert expected[0][0].tolist() == ([0, 0, 1, 0, 0, 0] if order == 2 else [0, 0, 0, 0, 1, 0])
    # The two rankings disagree for the clients keeping 1 or 2 neurons per layer, so a method
    # scoring with the other norm would fail here.
    other = 3 - order
    for layer in (0, 1):
        for k in (0, 1):
            assert not np.array_equal(expected[layer][k],
                                      designed_choice(k, layer, ROUND_COUNTS[layer][k], other)), (layer, k)
    plan = jax.jit(lambda v: FACTORIES[name]().plan(r.ctx, v))(hand_view(r, state, c))
    for layer in (0, 1):
        np.testing.assert_array_equal(plan.dropout.neurons[layer], expected[layer], err_msg=f"layer {layer}")
    # The same through a whole round.
    state1, _ = r(state, c, ROUND_KEY)
    for layer in (0, 1):
        np.testing.assert_array_equal(state1.method_state.clients.neurons[layer][np.asarray(IDS)], expected[layer])


def test_prunefl_keeps_the_largest_gradient_norms(mlp, rounds):
    r = rounds("prunefl")
    state = jax.device_get(r.init(INIT_KEY))
    # Personal models: the global model plus each client's own noise (so "own model" matters).
    rng = np.random.default_rng(3)
    stacked = jax.tree.map(np.array, state.method_state.clients.variables)  # writable copies
    for i in IDS:
        for path, leaf in leaf_paths(stacked["params"]):
            leaf[i] = leaf[i] + rng.normal(scale=0.5, size=leaf[i].shape).astype(leaf.dtype)
    state = state._replace(method_state=state.method_state._replace(
        clients=state.method_state.clients._replace(variables=stacked)))
    c = cohort()

    def loss(params, stats, x, y, m):
        # The 'global' BatchNorm policy evaluates with running statistics (train=False).
        logits, _ = mlp.apply({"params": params, "batch_stats": stats}, x, False)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]
        return jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0)

    grad = jax.jit(jax.grad(loss))
    expected = [[], []]
    for k, i in enumerate(IDS):
        mine = jax.tree.map(lambda a: a[i], stacked)
        # The client's first local batch (client 3 has 2 real examples of 5: the mask matters).
        g = jax.device_get(grad(mine["params"], mine["batch_stats"], c.data.x[k, 0], c.data.y[k, 0],
                                c.data.example_mask[k, 0].astype(np.float32)))
        norms = [
            np.sqrt((g["fc1"]["kernel"] ** 2).sum(0) + g["fc1"]["bias"] ** 2 + g["bn1"]["scale"] ** 2
                    + g["bn1"]["bias"] ** 2),
            np.sqrt((g["fc2"]["kernel"] ** 2).sum(0) + g["fc2"]["bias"] ** 2),
        ]
        for layer in (0, 1):
            s = norms[layer].astype(np.float64)
            top = sorted(range(len(s)), key=lambda j: (-s[j], j))[:ROUND_COUNTS[layer][k]]
            expected[layer].append(np.isin(np.arange(len(s)), top))
    expected = [np.stack(e) for e in expected]
    plan = jax.jit(lambda v: prunefl().plan(r.ctx, v))(hand_view(r, state, c))
    for layer in (0, 1):
        np.testing.assert_array_equal(plan.dropout.neurons[layer], expected[layer], err_msg=f"layer {layer}")
    state1, _ = r(state, c, ROUND_KEY)
    for layer in (0, 1):
        np.testing.assert_array_equal(state1.method_state.clients.neurons[layer][np.asarray(IDS)], expected[layer])


# ---- traffic -----------------------------------------------------------------------------------

# Floats of a TinyMLP sub-model with a fc1 and b fc2 neurons (wired), BatchNorm 'global':
#   fc1 kernel 4a + bias a + bn1 scale a + bias a + mean a + var a = 9a;  fc2 kernel a·b + bias b;
#   head kernel 3b + bias 3  →  9a + ab + 4b + 3   (the 'static' policy drops the 2a statistics).
# round counts (a, b) = (1,1), (2,2), (4,3), (5,4):  17, 33, 63, 84 floats;  static: 15, 29, 55, 74.
# FjORD (a, b) = (2,1), (3,2), (4,3), (5,4):         27, 44, 63, 84 floats.
# Index bytes per client: per masked layer (fc1: 6 units, fc2: 5) min(4·count, ⌈units/8⌉) = 1 → 2;
# FjORD sends one int32 width per masked layer → 8.
FLOATS = {"round": [17, 33, 63, 84], "fjord": [27, 44, 63, 84], "static": [15, 29, 55, 74]}
EXPECTED_TRAFFIC = {  # (download, upload) per client
    "feddrop": ([4 * f + 2 for f in FLOATS["round"]], [4 * f for f in FLOATS["round"]]),  # server chose
    "fjord": ([4 * f + 8 for f in FLOATS["fjord"]], [4 * f for f in FLOATS["fjord"]]),
    "hermes": ([4 * f for f in FLOATS["round"]], [4 * f + 2 for f in FLOATS["round"]]),  # client chose
    "fedmp": ([4 * f for f in FLOATS["round"]], [4 * f + 2 for f in FLOATS["round"]]),
    "prunefl": ([4 * f for f in FLOATS["round"]], [4 * f + 2 for f in FLOATS["round"]]),
}


@pytest.mark.parametrize("name", NAMES)
def test_traffic_by_hand(mlp, one_round, name):
    state0, plan, _, metrics = one_round(name)
    down, up = EXPECTED_TRAFFIC[name]
    assert sum(up) == {"feddrop": 788, "fjord": 872}.get(name, 796)
    metrics = traffic_totals(metrics)
    np.testing.assert_array_equal(metrics["upload_bytes_per_client"], up)
    np.testing.assert_array_equal(metrics["download_bytes_per_client"], down)
    assert int(metrics["upload_bytes"]) == sum(up)
    assert int(metrics["download_bytes"]) == sum(down)
    # Cross-check the hand count with the library's counters.
    params_bytes = masks.count_bytes(mlp.structure, plan.dropout, state0.variables, ("params", "batch_stats"))
    np.testing.assert_array_equal(params_bytes, [4 * f for f in FLOATS["fjord" if name == "fjord" else "round"]])
    if name != "fjord":
        np.testing.assert_array_equal(costs.index_bytes(mlp.structure, plan.dropout), [2] * K)
        # Under the 'static' policy the statistics are not sent: 9a → 7a floats per fc1 neuron.
        np.testing.assert_array_equal(masks.count_bytes(mlp.structure, plan.dropout, state0.variables, ("params",)),
                                      [4 * f for f in FLOATS["static"]])


# ---- a plain-Python FedDrop round ----------------------------------------------------------------


def reference_round(model, global_vars, c, kept):
    """One sub-model round, one client at a time, plain SGD, numpy aggregation.

    ``kept`` = (fc1 neurons [K, 6], fc2 neurons [K, 5]).  Each client trains the whole model
    with the weights *reading* a dropped neuron zeroed by hand in the forward pass (fc2 rows of
    dropped fc1 units, head rows of dropped fc2 units): a dropped neuron's own parameters then
    get a zero gradient, so plain SGD leaves them alone.
    """
    x, y, em, sm = (np.asarray(a) for a in c.data)

    def loss(params, stats, keep1, keep2, xb, yb, mb):
        fwd = {**params,
               "fc2": {**params["fc2"], "kernel": params["fc2"]["kernel"] * keep1[:, None]},
               "head": {**params["head"], "kernel": params["head"]["kernel"] * keep2[:, None]}}
        logits, new_stats = model.apply({"params": fwd, "batch_stats": stats}, xb, True, mb)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], axis=1)[:, 0]
        w = mb.astype(jnp.float32)
        return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0), new_stats

    grad = jax.jit(jax.grad(loss, has_aux=True))
    trained = []
    for k in range(K):
        params, stats = global_vars["params"], global_vars["batch_stats"]
        keep1, keep2 = (np.asarray(n[k], np.float32) for n in kept)
        for s in range(x.shape[1]):
            if not sm[k, s]:
                continue  # a padded step
            g, stats = grad(params, stats, keep1, keep2, x[k, s], y[k, s], em[k, s])
            params = jax.tree.map(lambda p, d: p - LR * d, params, g)
        trained.append(jax.device_get({"params": params, "batch_stats": stats}))

    n_k = np.asarray(c.info.num_samples, np.float64)
    new = {}
    for collection, tree in global_vars.items():
        leaves = []
        for path, g in leaf_paths(tree):
            num = np.zeros(g.shape)
            den = np.zeros(g.shape)
            for k in range(K):
                m = np.broadcast_to(flat(wired_masks(kept[0][k], kept[1][k])[collection])[path], g.shape)
                num += n_k[k] * m * flat(trained[k][collection])[path]
                den += n_k[k] * m
            leaves.append(np.where(den > 0, num / np.where(den > 0, den, 1.0), g))
        new[collection] = jax.tree.unflatten(jax.tree.structure(tree), leaves)
    return new, trained


@pytest.fixture(scope="module")
def feddrop_reference(mlp, one_round):
    state0, plan, _, _ = one_round("feddrop")
    kept = (np.asarray(plan.dropout.neurons[0]), np.asarray(plan.dropout.neurons[1]))
    return reference_round(mlp, state0.variables, cohort(), kept)


def test_engine_matches_plain_python_feddrop(one_round, feddrop_reference):
    _, _, state1, _ = one_round("feddrop")
    expected, _ = feddrop_reference
    expected = jax.tree.map(lambda a: np.asarray(a, np.float32), expected)
    chex.assert_trees_all_close(state1.variables, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(state1.variables["params"]["head"]["kernel"],
                           one_round("feddrop")[0].variables["params"]["head"]["kernel"])


def test_personal_state_after_a_round(one_round, feddrop_reference):
    state0, plan, state1, _ = one_round("feddrop")
    _, trained = feddrop_reference
    clients = state1.method_state.clients
    assert isinstance(clients, SubmodelState)
    for k, i in enumerate(IDS):
        mine = jax.tree.map(lambda a: a[i], clients.variables)
        chex.assert_trees_all_close(mine, trained[k], rtol=1e-5, atol=1e-5)
        for layer in range(3):
            np.testing.assert_array_equal(clients.neurons[layer][i], plan.dropout.neurons[layer][k])
    others = np.setdiff1d(np.arange(N), IDS)
    before = state0.method_state.clients
    for a, b in zip(jax.tree.leaves(clients.variables), jax.tree.leaves(before.variables)):
        np.testing.assert_array_equal(a[others], b[others])
    for layer in range(3):
        assert clients.neurons[layer][others].all()  # a client that never trained holds the full w⁰


def test_personal_models_read_out(mlp, one_round):
    _, plan, state1, _ = one_round("feddrop")
    ctx = MethodContext(model=mlp, num_clients=N, cohort_size=K)
    personal = feddrop().personal(ctx, state1.method_state, state1.variables)
    assert personal.stacked
    chex.assert_trees_all_equal(personal.variables, state1.method_state.clients.variables)
    for layer in range(3):
        np.testing.assert_array_equal(np.asarray(personal.submodel.neurons[layer])[np.asarray(IDS)],
                                      plan.dropout.neurons[layer])


# ---- strategies --------------------------------------------------------------------------------


# ---- conv → flatten → dense --------------------------------------------------------------------


def test_feddrop_cnn_head_rows_of_dropped_channels(cnn):
    # TinyCNN units (3, 4, 3); ids 1, 3, 6 are tiers 0, 1, 3 → conv2 keeps round(0.8), round(1.6),
    # round(3.2) = 1, 2, 3 of its 4 channels; conv1 keeps 1, 1, 2 of 3.
    ids = [1, 3, 6]
    r = FederatedRound(cnn, feddrop(), num_clients=N, cohort_size=3, client_optimizer=OPT,
                       strategy=stepwise(1))
    state0 = r.init(INIT_KEY)
    c = make_cohort((4, 4, 1), k=3, steps=2, batch=4, seed=5, client_ids=ids)
    plan = plan_of(r, state0, c, ROUND_KEY)
    np.testing.assert_array_equal(np.asarray(plan.dropout.neurons[0]).sum(1), [1, 1, 2])
    np.testing.assert_array_equal(np.asarray(plan.dropout.neurons[1]).sum(1), [1, 2, 3])
    view = hand_view(r, state0, c)._replace(plan=plan)
    upload = feddrop().select(r.ctx, view).upload
    g = jax.device_get(state0.variables["params"])
    expand = jax.jit(lambda m: masks.expand(cnn.structure, m, g))
    for k in range(len(ids)):
        channels = np.asarray(plan.dropout.neurons[1][k])
        up = expand(jax.tree.map(lambda a: a[k], upload))
        head = np.asarray(up["head"]["kernel"])  # [16, 3]
        for row in range(16):  # NHWC flatten: row = (h·2 + w)·4 + c is fed by channel row % 4
            assert head[row].all() == head[row].any() == bool(channels[row % 4]), (k, row)
        # conv2 kernel [3, 3, 3, 4]: on iff its conv1 input channel and conv2 output channel are kept.
        want = np.outer(np.asarray(plan.dropout.neurons[0][k]), channels)
        np.testing.assert_array_equal(np.asarray(up["conv2"]["kernel"]),
                                      np.broadcast_to(want, (3, 3, 3, 4)))
        # The forward pass reads the same wiring: the head rows of a dropped channel are scaled by 0.
        scale = jax.device_get(masks.submodel_scale(cnn.structure, jax.tree.map(lambda a: a[k], plan.dropout), g))
        np.testing.assert_array_equal(scale["head"]["kernel"][:, 0], channels[np.arange(16) % 4].astype(np.float32))


# ---- FedDrop on dense layers only (FedDHAD's baseline) -------------------------------------------


class TinyConvDense(nn.Module):
    """Conv(4) → ReLU → pool → flatten → Dense(6) → ReLU → Dense(3): a conv layer and a hidden dense layer."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME", name="conv")(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))  # 2·2·4 = 16 features
        x = nn.relu(nn.Dense(6, name="fc")(x))
        return nn.Dense(3, name="head")(x)


@pytest.fixture(scope="module")
def conv_dense():
    return from_linen(TinyConvDense(), input_shape=(4, 4, 1), num_classes=3, sequential=True, name="conv_dense")


def feddrop_plan(model, method, key=ROUND_KEY, ids=(0, 4, 9)):
    """FedDrop's plan for a cohort (the server's random choice reads only the key and the ids); eager."""
    k = len(ids)
    info = CohortInfo(client_ids=jnp.asarray(ids, jnp.int32), num_samples=jnp.ones((k,)), valid=jnp.ones((k,), bool))
    view = RoundView(key=key, round=jnp.zeros((), jnp.int32), global_vars={}, method_state=(), client_state=(),
                     cohort=info, data=None)
    ctx = MethodContext(model=model, num_clients=N, cohort_size=k)
    plan = method.plan(ctx, view)
    return ctx, view._replace(plan=plan), jax.device_get(plan)


def test_feddrop_dense_only_thins_dense_layers_only(conv_dense):
    structure = conv_dense.structure
    assert structure.kinds == ("conv", "dense", "dense") and structure.units == (4, 6, 3)
    variables = conv_dense.init_variables(INIT_KEY)
    # --tiers 0.5 --dense-only: the conv keeps its 4 filters, the hidden dense layer round(0.5·6) = 3 of 6 units.
    # Without --dense-only the conv is thinned too: round(0.5·4) = 2 of its 4 filters.
    got = {}
    for dense_only, want in ((True, (4, 3, 3)), (False, (2, 3, 3))):
        method = feddrop(tiers=(0.5,), dense_only=dense_only)
        ctx, view, plan = feddrop_plan(conv_dense, method)
        for layer, count in enumerate(want):
            np.testing.assert_array_equal(np.asarray(plan.dropout.neurons[layer]).sum(axis=1), [count] * 3)
        upload = jax.device_get(method.select(ctx, view).upload)
        for a, b in zip(jax.tree.leaves(upload), jax.tree.leaves(plan.dropout)):
            np.testing.assert_array_equal(a, b)
        got[dense_only] = (ctx, plan, upload)

    # dense-only: the whole conv kernel is trained and uploaded; fc has 3 of its 6 columns (all 16 input rows).
    ctx, plan, upload = got[True]
    for k in range(3):
        up = masks.expand(structure, jax.tree.map(lambda a: a[k], upload), variables["params"])
        assert np.asarray(up["conv"]["kernel"]).all() and np.asarray(up["conv"]["bias"]).all()
        cols = np.asarray(plan.dropout.neurons[1][k])
        np.testing.assert_array_equal(np.asarray(up["fc"]["kernel"]), np.broadcast_to(cols, (16, 6)))
        np.testing.assert_array_equal(np.asarray(up["head"]["kernel"]), np.broadcast_to(cols[:, None], (6, 3)))

    # Traffic by hand, per client: dense-only 36 + 4 (conv) + 16·3 + 3 (fc) + 3·3 + 3 (head) = 103 floats, and a
    # 1-byte bit-mask naming fc's units (nothing names the conv's, it is never thinned); thinned everywhere:
    # 9·2 + 2 (conv) + 8·3 + 3 (fc: 2 channels × 4 positions feed it) + 3·3 + 3 = 59 floats and 1 + 1 bytes.
    for dense_only, floats, index in ((True, 103, 1), (False, 59, 2)):
        ctx, plan, _ = got[dense_only]
        np.testing.assert_array_equal(masks.count_bytes(structure, plan.dropout, variables, ("params",)),
                                      [4 * floats] * 3)
        np.testing.assert_array_equal(plan.extra_download_bytes, [index] * 3)
    # FLOPs: each layer's kernel work is the share (kept inputs/inputs)·(kept outputs/outputs).
    kernel, _ = flops.kept_shares(conv_dense, got[True][1].dropout)
    np.testing.assert_allclose(kernel, np.broadcast_to([1.0, 0.5, 0.5], (3, 3)))
    kernel, _ = flops.kept_shares(conv_dense, got[False][1].dropout)
    np.testing.assert_allclose(kernel, np.broadcast_to([0.5, 0.25, 0.5], (3, 3)))


def test_feddrop_dense_only_is_random_and_matches_plain_feddrop_on_an_mlp(mlp):
    # An MLP has no conv layer: dense-only draws exactly what plain FedDrop draws, index bytes included.
    _, _, a = feddrop_plan(mlp, feddrop(dense_only=True), ids=IDS)
    _, _, b = feddrop_plan(mlp, feddrop(), ids=IDS)
    chex.assert_trees_all_equal(a, b)
    _, _, c = feddrop_plan(mlp, feddrop(dense_only=True), key=jax.random.fold_in(ROUND_KEY, 1), ids=IDS)
    assert any(not np.array_equal(x, y) for x, y in zip(a.dropout.neurons[:2], c.dropout.neurons[:2]))


def test_feddrop_dense_only_option_and_flag(tmp_path):
    from fedpartial._src.cli.main import build_parser, config_from_args, main

    parser = build_parser()
    args = ["run", "--method", "feddrop", "--tiers", "0.5"]
    assert config_from_args(parser.parse_args(args + ["--dense-only"])).options == {"tiers": (0.5,), "dense_only": True}
    assert config_from_args(parser.parse_args(args + ["--no-dense-only"])).options["dense_only"] is False
    assert "dense_only" not in config_from_args(parser.parse_args(args)).options
    assert get_method("feddrop", dense_only=True).name == "feddrop"
    with pytest.raises(UserError, match="--dense-only"):
        get_method("feddrop", dense_only="yes")
    assert main(["run", "--method", "fjord", "--dense-only", "--out", str(tmp_path)]) == 2
