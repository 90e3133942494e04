"""FedPart: a plain-Python reference over three rounds, the reduction to FedAvg, the schedule by hand, the upload
traffic of the scheduled layers, and bad options in one sentence."""

import chex
import jax
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import client_sgd
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise, streamed
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.layerwise.fedpart import fedpart, schedule
from tests.conftest import make_cohort
from tests.methods.test_heterofl import LR, MOMENTUM, SMALL, _narrow_grad, adapt, build, start

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N = 4
IDS = ([0, 2], [1, 3], [2, 3])
LAYERS = ("fc1", "fc2", "head")  # SMALL's layers, input to output
VALUES = {"fc1": 4 * 6 + 6, "fc2": 6 * 5 + 5, "head": 5 * 3 + 3}  # float32 values of each layer


def cohorts():
    return [make_cohort((4,), k=2, steps=3, batch=5, seed=t, real_steps=[3, 2], real_examples=[5, 3],
                        client_ids=ids) for t, ids in enumerate(IDS)]


def reference(global_params, data, trained_in):
    """FedPart as a textbook writes it, one client at a time: in round t every client starts from the global
    model, trains only the layers ``trained_in[t]`` with momentum SGD (the others keep their values), and the
    server replaces those layers by their n_k-weighted mean."""
    g = jax.tree.map(lambda a: np.array(a, np.float64), global_params)
    for t, c in enumerate(data):
        d, trained, weights = c.data, [], []
        for k in range(d.step_mask.shape[0]):
            p = jax.tree.map(np.copy, g)
            velocity = jax.tree.map(np.zeros_like, p)
            for s in range(d.step_mask.shape[1]):
                if not d.step_mask[k, s]:
                    continue
                grads = _narrow_grad(jax.tree.map(lambda a: a.astype(np.float32), p), d.x[k, s], d.y[k, s],
                                     d.example_mask[k, s].astype(np.float32), 1.0)
                for name in trained_in[t]:
                    velocity[name] = jax.tree.map(lambda v, dg: MOMENTUM * v + np.asarray(dg), velocity[name],
                                                  grads[name])
                    p[name] = jax.tree.map(lambda a, v: a - LR * v, p[name], velocity[name])
            trained.append(p)
            weights.append(float(c.info.num_samples[k]))
        w = np.asarray(weights) / sum(weights)
        for name in trained_in[t]:
            g[name] = jax.tree.map(lambda *leaves: sum(wk * a for wk, a in zip(w, leaves)),
                                   *[p[name] for p in trained])
    return g


@pytest.mark.parametrize("options, trained_in", [
    ({}, (("fc1",), ("fc2",), ("head",))),
    ({"layers_per_round": 2, "full_rounds": 1}, (LAYERS, ("fc1", "fc2"), ("head",))),
])
def test_engine_matches_a_plain_python_reference(options, trained_in):
    r = FederatedRound(adapt(SMALL, (4,)), get_method("fedpart", **options), num_clients=N, cohort_size=2,
                       client_optimizer=client_sgd(LR, momentum=MOMENTUM), strategy=stepwise(1))
    state = start(r)
    expected = reference(jax.device_get(state.variables["params"]), cohorts(), trained_in)
    everything = sum(VALUES.values())
    for t, c in enumerate(cohorts()):
        state, m = r(state, c, jax.random.key(t))
        # Each client uploads exactly the scheduled layers and receives the whole model.
        traffic = traffic_totals(m)
        np.testing.assert_array_equal(traffic["upload_bytes_per_client"],
                                      [4 * sum(VALUES[name] for name in trained_in[t])] * 2)
        np.testing.assert_array_equal(traffic["download_bytes_per_client"], [4 * everything] * 2)
        np.testing.assert_array_equal(m["layers_uploaded_per_client"], [len(trained_in[t])] * 2)
    chex.assert_trees_all_close(jax.device_get(state.variables["params"]), expected, rtol=2e-5, atol=2e-6)


def test_training_every_layer_together_is_fedavg():
    model = adapt(SMALL, (4,))
    results = []
    for method in (get_method("fedpart", layers_per_round=5, full_rounds=1), get_method("fedavg")):
        r = build(model, method, n=N, k=2)
        state = start(r)
        for t, c in enumerate(cohorts()[:2]):
            state, _ = r(state, c, jax.random.key(t))
        results.append(jax.device_get(state.variables))
    chex.assert_trees_all_close(*results, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_layers, options, rounds", [
    # One layer a round, input to output, then again from the input.
    (3, {}, ["0", "1", "2", "0", "1", "2", "0", "1"]),
    # Each layer for two rounds.
    (3, {"rounds_per_layer": 2}, ["0", "0", "1", "1", "2", "2", "0", "0"]),
    # Two layers together; 3 is not a multiple of 2, so the last group is the output layer alone.
    (3, {"layers_per_round": 2}, ["01", "2", "01", "2", "01", "2", "01", "2"]),
    # Two full rounds before every cycle (the paper's code repeats them).
    (3, {"full_rounds": 2}, ["012", "012", "0", "1", "2", "012", "012", "0"]),
    (4, {"layers_per_round": 3, "rounds_per_layer": 2, "full_rounds": 1},
     ["0123", "012", "012", "3", "3", "0123", "012", "012"]),
    # As many layers as the model has, or more: every round trains everything (FedAvg).
    (3, {"layers_per_round": 3}, ["012"] * 8),
    (3, {"layers_per_round": 7, "full_rounds": 2}, ["012"] * 8),
])
def test_the_schedule_by_hand(num_layers, options, rounds):
    got = ["".join(str(layer) for layer in np.flatnonzero(schedule(t, num_layers, **options))) for t in range(8)]
    assert got == rounds
    # Traced, as the round calls it: the same layers.
    traced = jax.jit(lambda t: schedule(t, num_layers, **options))
    for t in range(8):
        np.testing.assert_array_equal(traced(np.int32(t)), schedule(t, num_layers, **options))


def test_bad_options_are_one_sentence():
    with pytest.raises(UserError, match=r"^fedpart: --layers-per-round = 0 must be a positive integer\.$"):
        get_method("fedpart", layers_per_round=0)
    with pytest.raises(UserError, match=r"^fedpart: --rounds-per-layer = 1.5 must be a positive integer\.$"):
        get_method("fedpart", rounds_per_layer=1.5)
    with pytest.raises(UserError, match=r"^fedpart: --full-rounds = -1 must be an integer ≥ 0\.$"):
        fedpart(full_rounds=-1)  # the factory called directly checks too


def test_streamed_equals_fused():
    """FedPart declares itself streamable per client (its upload is its own train mask)."""
    model = adapt(SMALL, (4,))
    results = []
    for strategy in (fused(), streamed(1)):
        r = build(model, get_method("fedpart"), n=N, k=2, strategy=strategy)
        state = start(r)
        for t, c in enumerate(cohorts()[:2]):
            state, _ = r(state, c, jax.random.key(t))
        results.append(jax.device_get(state.variables))
    chex.assert_trees_all_close(*results, rtol=1e-6, atol=1e-7)
