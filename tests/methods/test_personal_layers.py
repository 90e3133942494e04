"""FedPer, LG-FedAvg, FedRep (personal layers) and FedBN (personal normalisers): plain-Python references over two
rounds with a client sampled twice, the evaluated personal models, the traffic, the reductions to FedAvg, bad
splits."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import client_sgd
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import stepwise
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.personal.fedrep import head_steps as fedrep_head_steps
from tests.conftest import make_cohort
from tests.methods.test_heterofl import LR, MOMENTUM, SMALL, _narrow_grad, adapt, build, start

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N = 4
IDS = ([0, 2], [2, 3])  # client 2 trains in both rounds: its personal layers carry over
LAYERS = ("fc1", "fc2", "head")


def cohorts():
    return [make_cohort((4,), k=2, steps=3, batch=5, seed=t, real_steps=[3, 2], real_examples=[5, 3],
                        client_ids=ids) for t, ids in enumerate(IDS)]


def reference_head_steps(steps, body_fraction):
    head = round(steps * (1 - body_fraction))  # Python's round: half to even, as the engine's
    if steps >= 2 and 0 < body_fraction < 1:
        head = min(max(head, 1), steps - 1)
    return head


def reference(global_params, data, personal_layers, body_fraction=None, weight_decay=0.0):
    """The method as a textbook writes it, one client at a time: start from the global shared layers and the
    client's own personal ones, train everything with momentum SGD (L2 ``weight_decay`` added to the gradient),
    average the shared layers (n_k weights).  ``body_fraction`` (FedRep): the first round((1 - f)·steps) real
    steps train the personal layers only, the rest the shared ones only, but with 2 or more steps each part gets
    at least one; a frozen layer is skipped, as PyTorch's SGD skips a parameter with no gradient: neither its
    value nor its momentum moves."""
    g = jax.tree.map(lambda a: np.array(a, np.float64), global_params)
    own = {i: jax.tree.map(np.copy, g) for i in range(N)}
    for c in data:
        d, trained, weights = c.data, [], []
        for k, i in enumerate(np.asarray(c.info.client_ids)):
            p = {name: (own[i] if name in personal_layers else g)[name] for name in LAYERS}
            velocity = jax.tree.map(np.zeros_like, p)
            head_steps = None if body_fraction is None else reference_head_steps(d.step_mask[k].sum(), body_fraction)
            for s in range(d.step_mask.shape[1]):
                if not d.step_mask[k, s]:
                    continue
                trains = set(LAYERS) if head_steps is None else (
                    set(personal_layers) if s < head_steps else set(LAYERS) - set(personal_layers))
                grads = _narrow_grad(jax.tree.map(lambda a: a.astype(np.float32), p), d.x[k, s], d.y[k, s],
                                     d.example_mask[k, s].astype(np.float32), 1.0)
                velocity = {name: jax.tree.map(lambda v, dg, a: MOMENTUM * v + dg + weight_decay * a, velocity[name],
                                               grads[name], p[name]) if name in trains else velocity[name]
                            for name in LAYERS}
                p = {name: jax.tree.map(lambda a, v: a - LR * v, p[name], velocity[name]) if name in trains
                     else p[name] for name in LAYERS}
            own[i] = p
            trained.append(p)
            weights.append(float(c.info.num_samples[k]))
        w = np.asarray(weights) / sum(weights)
        g = {name: g[name] if name in personal_layers else
             jax.tree.map(lambda *leaves: sum(wk * a for wk, a in zip(w, leaves)), *[p[name] for p in trained])
             for name in LAYERS}
    return g, own


@pytest.mark.parametrize("name, personal, options, weight_decay", [
    ("fedper", ("head",), {}, 0.0), ("lgfedavg", ("fc1", "fc2"), {}, 0.0),
    ("fedrep", ("head",), {"body_fraction": 0.5}, 0.0),  # 3 real steps: 2 head, 1 body; 2 real steps: 1 and 1
    # Weight decay with momentum: the body frozen in the head steps must not carry their decay into its momentum
    # when the body steps unfreeze it (FedRep's Algorithm 1 takes plain steps on the body alone).  At f = 0.1
    # rounding alone would give the body no step; with 3 real steps it gets 1 (head 2), with 2 it gets 1 (head 1).
    ("fedrep", ("head",), {"body_fraction": 0.1}, 0.05),
])
def test_engine_matches_a_plain_python_reference(name, personal, options, weight_decay):
    model = adapt(SMALL, (4,))
    r = FederatedRound(model, get_method(name, **options), num_clients=N, cohort_size=2,
                       client_optimizer=client_sgd(LR, momentum=MOMENTUM, weight_decay=weight_decay),
                       strategy=stepwise(1))
    state = start(r)
    expected, own = reference(jax.device_get(state.variables["params"]), cohorts(), personal,
                              options.get("body_fraction"), weight_decay)
    for t, c in enumerate(cohorts()):
        state, m = r(state, c, jax.random.key(t))
    chex.assert_trees_all_close(jax.device_get(state.variables["params"]), expected, rtol=2e-5, atol=2e-6)
    # What is evaluated: the global shared layers with each client's own personal ones (client 1 never
    # trained: the initial model's).
    models = r.method.personal(r.ctx, state.method_state, state.variables)
    for i in range(N):
        got = jax.tree.map(lambda a: np.asarray(a[i]), models.variables["params"])
        want = {layer: (own[i] if layer in personal else expected)[layer] for layer in LAYERS}
        chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
    # Each client sends and receives the shared layers only: fc1 + fc2 = 65 values, or the head = 18.
    shared_values = 18 if name == "lgfedavg" else 30 + 35
    traffic = traffic_totals(m)
    for way in ("upload", "download"):
        np.testing.assert_array_equal(traffic[f"{way}_bytes_per_client"], [4 * shared_values] * 2)


@pytest.mark.parametrize("name, head_layers", [("fedper", 0), ("lgfedavg", 3)])
def test_sharing_every_layer_is_fedavg(name, head_layers):
    model = adapt(SMALL, (4,))
    results = []
    for method in (get_method(name, head_layers=head_layers), get_method("fedavg")):
        r = build(model, method, n=N, k=2)
        state = start(r)
        for t, c in enumerate(cohorts()):
            state, _ = r(state, c, jax.random.key(t))
        results.append(jax.device_get(state.variables))
    chex.assert_trees_all_close(*results, rtol=1e-6, atol=1e-7)


def test_a_split_beyond_the_model_is_one_sentence():
    model = adapt(SMALL, (4,))
    with pytest.raises(UserError, match="fedper: --head-layers 4 must be between 0 and the model's 3 layers"):
        start(build(model, get_method("fedper", head_layers=4), n=N, k=2))
    with pytest.raises(UserError, match="--head-layers = -1 must be a whole number of layers"):
        get_method("lgfedavg", head_layers=-1)
    with pytest.raises(UserError, match="--body-fraction = 1.5 must be a fraction of the local steps"):
        get_method("fedrep", body_fraction=1.5)


@pytest.mark.parametrize("body_fraction, steps, head", [
    # f = 0.1: round(0.9 s) head steps, kept between 1 and s - 1 from 2 steps on.
    (0.1, [0, 1, 2, 3, 10, 20], [0, 1, 1, 2, 9, 18]),
    (0.0, [0, 1, 2, 3, 10, 20], [0, 1, 2, 3, 10, 20]),  # head only
    (1.0, [0, 1, 2, 3, 10, 20], [0, 0, 0, 0, 0, 0]),  # body only
    (0.5, [1, 2, 3, 5], [0, 1, 2, 2]),  # half to even: round(0.5) = 0, round(1.5) = 2, round(2.5) = 2
])
def test_fedrep_splits_the_steps_so_both_parts_train(body_fraction, steps, head):
    """Hand-computed: at the default f = 0.1, 1 step trains the head, 2 steps one each (rounding alone would
    give the body none), 3 steps 2 + 1, 10 steps 9 + 1, 20 steps 18 + 2; f = 0 and 1 are exact."""
    got = fedrep_head_steps(jnp.asarray(steps, jnp.int32), body_fraction)
    np.testing.assert_array_equal(got, head)
    assert [reference_head_steps(s, body_fraction) for s in steps] == head


def test_fedrep_with_no_body_steps_never_moves_the_shared_body():
    """Every step trains the head: the clients upload the body they received, so the global body stays."""
    model = adapt(SMALL, (4,))
    r = build(model, get_method("fedrep", body_fraction=0.0), n=N, k=2)
    state = start(r)
    before = jax.device_get(state.variables["params"])
    for t, c in enumerate(cohorts()):
        state, _ = r(state, c, jax.random.key(t))
    after = jax.device_get(state.variables["params"])
    for layer in ("fc1", "fc2"):
        chex.assert_trees_all_close(after[layer], before[layer], rtol=1e-6, atol=1e-7)
    assert not np.allclose(state.method_state.clients["params"]["head"]["kernel"][2], before["head"]["kernel"])


def test_a_run_reports_personal_accuracy():
    """By name from the run configuration, as the CLI builds it: clients hold out data and the summary
    reports each client's own model next to the global one."""
    config = RunConfig(method="fedper", model="mlp", num_clients=4, cohort_size=2, rounds=2, local_steps=2,
                       batch_size=8, out_dir=None, partition="iid", strategy="fused")
    records = list(Simulation(config).rounds())
    assert 0 <= records[-1]["personal_accuracy"] <= 1 and "global_client_accuracy" in records[-1]


# ---- FedBN: the normalisers stay local ---------------------------------------------------------------


def is_norm(path):
    return path[0] == "bn1"  # TinyMLP's one BatchNorm (its scale, bias, mean and var)


def fedbn_reference(model, variables, data):
    """FedBN as a textbook writes it with the model's own forward pass: each client starts from the global
    weights and its own BatchNorm (scale, bias, running statistics), trains everything with momentum SGD, and
    the server averages all but the BatchNorm (n_k weights)."""
    g = jax.tree.map(lambda a: np.array(a, np.float64), variables)
    own = {i: jax.tree.map(np.copy, g) for i in range(N)}

    def merged(i):
        return {c: jax.tree_util.tree_map_with_path(
            lambda path, a, b: b if is_norm(tuple(k.key for k in path)) else a, g[c], own[i][c]) for c in g}

    def loss(params, stats, x, y, mask):
        logits, new_stats = model.apply({"params": params, "batch_stats": stats}, x, True, mask)
        logp = jax.nn.log_softmax(logits)
        ce = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
        return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1), new_stats

    grad = jax.jit(jax.grad(loss, has_aux=True))
    for c in data:
        d, trained, weights = c.data, [], []
        for k, i in enumerate(np.asarray(c.info.client_ids)):
            v = merged(i)
            p, stats = v["params"], v["batch_stats"]
            velocity = jax.tree.map(np.zeros_like, p)
            for s in range(d.step_mask.shape[1]):
                if not d.step_mask[k, s]:
                    continue
                grads, stats = grad(jax.tree.map(lambda a: a.astype(np.float32), p),
                                    jax.tree.map(lambda a: a.astype(np.float32), stats),
                                    d.x[k, s], d.y[k, s], d.example_mask[k, s])
                velocity = jax.tree.map(lambda vel, dg: MOMENTUM * vel + np.asarray(dg), velocity, grads)
                p = jax.tree.map(lambda a, vel: a - LR * vel, p, velocity)
                stats = jax.tree.map(np.asarray, stats)
            own[i] = {"params": p, "batch_stats": stats}
            trained.append(own[i])
            weights.append(float(c.info.num_samples[k]))
        w = np.asarray(weights) / sum(weights)
        mean = jax.tree.map(lambda *leaves: sum(wk * a for wk, a in zip(w, leaves)), *trained)
        g = {coll: jax.tree_util.tree_map_with_path(
            lambda path, old, new: old if is_norm(tuple(k.key for k in path)) else new, g[coll], mean[coll])
             for coll in g}
    return g, own


def test_fedbn_matches_a_plain_python_reference(mlp):
    r = build(mlp, get_method("fedbn"), n=N, k=2, strategy=stepwise(1))
    state = start(r)
    expected, own = fedbn_reference(mlp, jax.device_get(state.variables), cohorts())
    for t, c in enumerate(cohorts()):
        state, m = r(state, c, jax.random.key(t))
    chex.assert_trees_all_close(jax.device_get(state.variables), expected, rtol=2e-5, atol=2e-6)
    # Never uploaded: the global BatchNorm is the initial one; each client evaluates its own.
    chex.assert_trees_all_equal(state.variables["params"]["bn1"], start(r).variables["params"]["bn1"])
    models = r.method.personal(r.ctx, state.method_state, state.variables)
    for i in (0, 2, 3):
        got = jax.tree.map(lambda a: np.asarray(a[i]), models.variables)
        want = {c: {layer: (own[i] if layer == "bn1" else expected)[c][layer] for layer in expected[c]}
                for c in expected}
        chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
    # Traffic: everything but the BatchNorm's 6 + 6 parameters and 6 + 6 statistics, both ways.
    everything = sum(a.size for a in jax.tree.leaves(state.variables))
    traffic = traffic_totals(m)
    for way in ("upload", "download"):
        np.testing.assert_array_equal(traffic[f"{way}_bytes_per_client"], [4 * (everything - 24)] * 2)


def test_fedbn_needs_a_normaliser():
    with pytest.raises(UserError, match="fedbn: the model has no BatchNorm"):
        start(build(adapt(SMALL, (4,)), get_method("fedbn"), n=N, k=2))
