"""FedSelect: a growing personal part (the most-changed neurons) kept out of the shared model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.costs import footprint as costs
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.methods.base import CohortInfo, MethodContext, RoundView
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.submodel.fedselect import FedSelectState, fedselect
from tests.conftest import make_cohort

OPT = optax.sgd(0.3)
N, K = 6, 4
ROUNDS = 2  # planned rounds: f_0 = 0.25 (start), f_1 = 0.5 (end)
IDS = ([0, 1, 2, 3], [2, 3, 4, 5])  # clients 2 and 3 train in both rounds; 4 and 5 only in the second
INIT_KEY = jax.random.key(11)
STRATEGIES = {"fused": fused, "stepwise": lambda: stepwise(1)}
# Round 1 (f = 0.5): fc1 keeps max(1, round(0.5·6)) = 3 personal neurons, fc2 round(2.5) = 3 (halves
# up; Python's round would give 2), the classifier none.
PERSONAL_COUNTS = (3, 3)


def cohort(t):
    # n_k = 3·5, 2·3, 3·4, 1·2 = 15, 6, 12, 2 (unequal steps and examples, padded).
    return make_cohort((4,), k=K, steps=3, batch=5, seed=20 + t, real_steps=[3, 2, 3, 1],
                       real_examples=[5, 3, 4, 2], client_ids=IDS[t])


def round_key(t):
    return jax.random.fold_in(jax.random.key(5), t)


# The module fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which
# builds it once.
pytestmark = pytest.mark.xdist_group("fedselect")


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def rounds(mlp):
    cache = {}

    def get(name="fedselect", strategy="stepwise"):
        if (name, strategy) not in cache:
            method = fedselect(0.25, 0.5) if name == "fedselect" else fedavg()
            cache[name, strategy] = FederatedRound(
                mlp, method, num_clients=N, cohort_size=K, client_optimizer=OPT,
                strategy=STRATEGIES[strategy](), rounds=ROUNDS)
        return cache[name, strategy]

    return get


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def run(rounds):
    """States before/after each of the two rounds, the round-1 plan and start models, the metrics."""
    r = rounds()
    states = [r.init(INIT_KEY)]
    begins, metrics = [], []
    for t in range(2):
        preview = r.preview(states[-1], cohort(t), round_key(t))
        begins.append(jax.device_get((preview.plan, preview.start_vars)))
        state, m = r(states[-1], cohort(t), round_key(t))
        states.append(state)
        metrics.append(traffic_totals(m))
    return [jax.device_get(s) for s in states], begins, metrics


def flat(tree):
    return dict(leaf_paths(tree))


def hand_update_norms(trained, start):
    """Per neuron, the L2 norm of ``trained - start`` over its kernel column, bias and BN scale/bias."""
    d = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), trained, start)
    fc1 = (d["fc1"]["kernel"] ** 2).sum(0) + d["fc1"]["bias"] ** 2 + d["bn1"]["scale"] ** 2 + d["bn1"]["bias"] ** 2
    fc2 = (d["fc2"]["kernel"] ** 2).sum(0) + d["fc2"]["bias"] ** 2
    head = (d["head"]["kernel"] ** 2).sum(0) + d["head"]["bias"] ** 2
    return [np.sqrt(fc1), np.sqrt(fc2), np.sqrt(head)]


def top(scores, count):
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))  # ties: lowest index
    return np.isin(np.arange(len(scores)), order[:count])


def personal_columns(p1, p2):
    """TinyMLP elements a client keeps for itself: the whole columns of personal neurons."""
    p1, p2 = np.asarray(p1, bool), np.asarray(p2, bool)
    params = {
        "fc1": {"kernel": np.broadcast_to(p1, (4, 6)), "bias": p1},
        "bn1": {"scale": p1, "bias": p1},
        "fc2": {"kernel": np.broadcast_to(p2, (6, 5)), "bias": p2},  # every input row of a personal column
        "head": {"kernel": np.zeros((5, 3), bool), "bias": np.zeros(3, bool)},
    }
    return {"params": params, "batch_stats": {"bn1": {"mean": p1, "var": p1}}}


def expected_personal(states):
    """Round 1's personal neurons of clients 2 and 3, from their round-0 update computed by hand."""
    w0, s1 = states[0], states[1]
    out = {}
    for i in (2, 3):
        trained = jax.tree.map(lambda a: a[i], s1.method_state.clients.variables["params"])
        norms = hand_update_norms(trained, w0.variables["params"])  # round 0 started from w⁰ (no personal part)
        out[i] = [top(norms[layer], PERSONAL_COUNTS[layer]) for layer in (0, 1)]
    return out


# ---- the first round -------------------------------------------------------------------------------


def test_first_round_is_fedavg(rounds, run):
    states, begins, metrics = run
    plan0, start0 = begins[0]
    # Nobody has trained: no personal part, everything is received ...
    for n in plan0.download.neurons:
        assert np.asarray(n).all()
    assert np.asarray(plan0.download.layers).all()
    assert plan0.dropout is None and plan0.train is None
    chex.assert_trees_all_equal(start0, jax.tree.map(lambda a: np.broadcast_to(a, (K, *a.shape)), states[0].variables))
    # ... and everything is uploaded: one round is FedAvg's round.
    r = rounds("fedavg")
    avg, avg_metrics = r(r.init(INIT_KEY), cohort(0), round_key(0))
    avg_metrics = traffic_totals(avg_metrics)
    chex.assert_trees_all_close(states[1].variables, jax.device_get(avg.variables), rtol=0, atol=1e-6)
    # 107 floats (95 parameters + 12 BatchNorm statistics) = 428 bytes per client, no index bytes.
    np.testing.assert_array_equal(metrics[0]["upload_bytes_per_client"], [428] * K)
    assert metrics[0]["upload_bytes"] == metrics[0]["download_bytes"] == avg_metrics["upload_bytes"] == 4 * 428


def test_state_after_first_round(run):
    states, _, _ = run
    clients = states[1].method_state.clients
    assert isinstance(clients, FedSelectState)
    np.testing.assert_array_equal(clients.trained, [True, True, True, True, False, False])
    w0 = states[0].variables["params"]
    for i in range(N):
        mine = jax.tree.map(lambda a: a[i], clients.variables["params"])
        want = hand_update_norms(mine, w0) if i < 4 else [np.zeros(u) for u in (6, 5, 3)]
        for layer in range(3):
            np.testing.assert_allclose(clients.change[layer][i], want[layer], rtol=1e-5, atol=1e-6)
    # Clients not sampled still hold w⁰.
    for a, b in zip(jax.tree.leaves(clients.variables), jax.tree.leaves(states[0].method_state.clients.variables)):
        np.testing.assert_array_equal(a[4:], b[4:])


# ---- the second round: a personal part ------------------------------------------------------------


def test_personal_neurons_are_the_most_changed(run):
    states, begins, _ = run
    plan1, _ = begins[1]
    want = expected_personal(states)
    change = states[1].method_state.clients.change
    for k, i in enumerate(IDS[1]):
        personal = [~np.asarray(n[k]) for n in plan1.download.neurons]
        assert not personal[2].any()  # the classifier stays shared
        if i in want:
            for layer in (0, 1):
                assert personal[layer].sum() == PERSONAL_COUNTS[layer]
                np.testing.assert_array_equal(personal[layer], want[i][layer], err_msg=f"client {i} layer {layer}")
                # The same from the stored change.
                np.testing.assert_array_equal(personal[layer], top(change[layer][i], PERSONAL_COUNTS[layer]))
        else:  # never trained: no personal part yet
            assert not personal[0].any() and not personal[1].any()
    # Personal neurons take their whole input column: the mask is unwired.
    assert plan1.download.inputs is not None
    for layer, inp in enumerate(plan1.download.inputs[1:], start=1):
        assert np.asarray(inp).all(), layer


def test_counts_follow_the_schedule(mlp):
    # A longer horizon, by hand: rounds = 5, f_t = 0.25 + 0.25·t/4.
    #   t=0: 0.25 → fc1 1.5→2, fc2 1.25→1;  t=2: 0.375 → 2.25→2, 1.875→2;  t=4: 0.5 → 3, 2.5→3.
    method = fedselect(0.25, 0.5)
    ctx = MethodContext(model=mlp, num_clients=2, cohort_size=2, rounds=5)
    change = (jnp.tile(jnp.arange(6.0), (2, 1)), jnp.tile(jnp.arange(5.0), (2, 1)), jnp.ones((2, 3)))
    state = FedSelectState(variables=None, change=change, trained=jnp.array([True, False]))
    info = CohortInfo(jnp.arange(2, dtype=jnp.int32), jnp.ones(2), jnp.ones(2, bool))
    plan = jax.jit(lambda t: method.plan(ctx, RoundView(key=jax.random.key(0), round=t, global_vars=None,
                                                        method_state=None, client_state=state, cohort=info,
                                                        data=None)))
    for t, (c1, c2) in {0: (2, 1), 2: (2, 2), 4: (3, 3), 9: (3, 3)}.items():
        personal = [~np.asarray(n) for n in plan(jnp.asarray(t, jnp.int32)).download.neurons]
        # Client 0 trained: its largest changes are the last neurons; client 1 never trained.
        np.testing.assert_array_equal(personal[0][0], np.arange(6) >= 6 - c1, err_msg=f"t={t}")
        np.testing.assert_array_equal(personal[1][0], np.arange(5) >= 5 - c2, err_msg=f"t={t}")
        assert not personal[2].any() and not personal[0][1].any() and not personal[1][1].any()


def test_start_model_keeps_own_values_on_personal_columns(run):
    states, begins, _ = run
    plan1, start1 = begins[1]
    g = states[1].variables
    own = states[1].method_state.clients.variables
    for k, i in enumerate(IDS[1]):
        personal = personal_columns(~np.asarray(plan1.download.neurons[0][k]),
                                    ~np.asarray(plan1.download.neurons[1][k]))
        for collection in ("params", "batch_stats"):
            for path, glob in leaf_paths(g[collection]):
                mine = flat(own[collection])[path][i]
                want = np.where(np.broadcast_to(flat(personal[collection])[path], glob.shape), mine, glob)
                np.testing.assert_array_equal(flat(start1[collection])[path][k], want, err_msg=f"{i} {path}")
    # The personal values are really the client's own (they differ from the global model).
    k = IDS[1].index(2)
    p1 = ~np.asarray(plan1.download.neurons[0][k])
    assert not np.allclose(start1["params"]["fc1"]["kernel"][k][:, p1], g["params"]["fc1"]["kernel"][:, p1])


def test_upload_excludes_exactly_the_personal_columns(mlp, rounds, run):
    states, begins, metrics = run
    plan1, _ = begins[1]
    r = rounds()
    c = cohort(1)
    info = jax.tree.map(jnp.asarray, c.info)
    view = RoundView(key=round_key(1), round=jnp.asarray(1), global_vars=states[1].variables,
                     method_state=states[1].method_state, client_state=None, cohort=info, data=c.data,
                     plan=plan1)
    sel = jax.device_get(jax.jit(lambda v: fedselect(0.25, 0.5).select(r.ctx, v))(view))
    expand = jax.jit(lambda m, v: masks.expand_variables(mlp.structure, m, v))
    personal_neurons = []
    for k in range(K):
        p = [~np.asarray(plan1.download.neurons[layer][k]) for layer in range(3)]
        personal_neurons.append(p)
        up = jax.device_get(expand(jax.tree.map(lambda a: a[k], sel.upload), states[1].variables))
        kept_home = personal_columns(p[0], p[1])
        for collection in ("params", "batch_stats"):
            for path, on in leaf_paths(up[collection]):
                np.testing.assert_array_equal(on, ~np.broadcast_to(flat(kept_home[collection])[path], on.shape),
                                              err_msg=f"{k} {collection}/{path}")
    # Index bytes tell the server which neurons stay home: per masked layer min(4·count, ⌈units/8⌉)
    # = min(12, 1) = 1 for clients 2 and 3 (fc1, fc2) → 2; nothing for clients 4 and 5.
    neurons_mask = masks.from_neurons(mlp.structure, [np.stack([p[layer] for p in personal_neurons])
                                                      for layer in range(3)])
    np.testing.assert_array_equal(sel.extra_upload_bytes, costs.index_bytes(mlp.structure, neurons_mask))
    np.testing.assert_array_equal(sel.extra_upload_bytes, [2, 2, 0, 0])
    # Bytes by hand: a personal fc1 column is 4 kernel + bias + BN scale, bias, mean, var = 9 floats,
    # a personal fc2 column 6 + 1 = 7 floats: 107 - 3·9 - 3·7 = 59 floats = 236 bytes (+2 index bytes).
    np.testing.assert_array_equal(metrics[1]["upload_bytes_per_client"], [238, 238, 428, 428])
    assert metrics[1]["download_bytes"] == 236 + 236 + 428 + 428
    np.testing.assert_array_equal(sel.weights, c.info.num_samples)


def test_second_round_aggregation_and_change(run):
    states, begins, _ = run
    plan1, start1 = begins[1]
    c = cohort(1)
    n_k = np.asarray(c.info.num_samples, np.float64)
    clients = states[2].method_state.clients
    trained = jax.tree.map(lambda a: a[np.asarray(IDS[1])], clients.variables)
    homes = [personal_columns(~np.asarray(plan1.download.neurons[0][k]), ~np.asarray(plan1.download.neurons[1][k]))
             for k in range(K)]
    for collection in ("params", "batch_stats"):
        for path, g in leaf_paths(states[1].variables[collection]):
            up = np.stack([~np.broadcast_to(flat(h[collection])[path], g.shape) for h in homes])
            w = n_k.reshape((K,) + (1,) * g.ndim) * up
            want = np.sum(w * flat(trained[collection])[path], axis=0) / w.sum(axis=0)  # 4 and 5 upload all
            np.testing.assert_allclose(flat(states[2].variables[collection])[path], want, rtol=1e-5, atol=1e-6)
    # The change remembered for the next round is measured from each client's own start model.
    for k, i in enumerate(IDS[1]):
        want = hand_update_norms(jax.tree.map(lambda a: a[k], trained["params"]),
                                 jax.tree.map(lambda a: a[k], start1["params"]))
        for layer in range(3):
            np.testing.assert_allclose(clients.change[layer][i], want[layer], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(clients.trained, [True] * N)
    # Client 0 and 1 were not sampled in round 1: unchanged.
    for a, b in zip(jax.tree.leaves(clients), jax.tree.leaves(states[1].method_state.clients)):
        np.testing.assert_array_equal(a[:2], b[:2])


def test_personal_read_out(mlp, run):
    states, _, _ = run
    ctx = MethodContext(model=mlp, num_clients=N, cohort_size=K)
    personal = fedselect().personal(ctx, states[2].method_state, states[2].variables)
    assert personal.stacked and personal.submodel is None
    chex.assert_trees_all_equal(personal.variables, states[2].method_state.clients.variables)


# ---- strategies --------------------------------------------------------------------------------


