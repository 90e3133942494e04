"""Buffered asynchronous aggregation, its pure pieces: the server step equals the synchronous round when
nothing is stale, staleness weights by hand, arrival order, and which methods are refused."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.engine import asynchronous as asyn
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.basic.fednova import fednova
from fedpartial._src.methods.basic.scaffold import scaffold
from fedpartial._src.methods.layerwise.fedldf import fedldf
from tests.conftest import make_cohort

OPT = optax.sgd(0.1, momentum=0.9)


def build(mlp, method, strategy, k=4, server=None):
    return FederatedRound(mlp, method, num_clients=8, cohort_size=k, client_optimizer=OPT, strategy=strategy,
                          server_optimizer=server)


def test_fresh_server_step_is_the_synchronous_round_bit_for_bit(mlp):
    """M = C = K, nothing stale: dispatch + server step give the synchronous round's state and metrics exactly,
    for a masked method (FedLDF's top-n) and a server optimizer with state (Adam), under the fused strategy (the
    stepwise one, the CPU default, is checked over whole runs by tests/experiment/test_asynchronous.py)."""
    strategy = fused()
    cohort = make_cohort((4,), k=4, steps=3, seed=1, real_steps=[3, 1, 2, 3], real_examples=[5, 2, 4, 5])
    key = jax.random.key(7)
    r = build(mlp, fedldf(n=2), strategy, server=optax.adam(0.01))
    state = r.init(jax.random.key(0))
    sync_state, sync_metrics = r(jax.tree.map(jnp.copy, state), cohort, key)
    a = asyn.AsyncRound(r, concurrency=4, staleness=asyn.parse_staleness("poly:0.5"))
    rows = a.dispatch(state, cohort, key)
    pool = a.put(a.empty_pool(state, cohort, key), rows, np.arange(4))
    arrived = a.take(pool, np.arange(4))
    new_state, metrics = a.server_step(state, arrived, np.zeros(4, int), key)
    chex.assert_trees_all_equal(jax.device_get(new_state), jax.device_get(sync_state))
    for name, value in jax.device_get(sync_metrics).items():
        chex.assert_trees_all_equal(jax.device_get(metrics[name]), value)
    np.testing.assert_array_equal(metrics["staleness_weight"], np.ones(4))


def test_stale_update_is_scaled_and_applied_to_the_current_model(mlp):
    """A stale row's update θ − start is scaled by s(τ) and added to the current global model (FedAvg, SGD at rate
    1, one client): x_new = x + s(τ) · Δ, element by element."""
    cohort = make_cohort((4,), k=1, steps=2, seed=2)
    r = build(mlp, fedavg(), stepwise(1), k=1)
    state = r.init(jax.random.key(0))
    a = asyn.AsyncRound(r, concurrency=1, staleness=asyn.parse_staleness("poly:1"))
    rows = a.dispatch(state, cohort, jax.random.key(3))
    moved = state._replace(variables=jax.tree.map(lambda v: v + 0.25, state.variables))  # the model moved on
    new_state, _ = a.server_step(moved, rows, np.array([3]), jax.random.key(4))
    delta = jax.tree.map(lambda t, s: t[0] - s[0], rows.trained["params"], rows.start["params"])
    expected = jax.tree.map(lambda x, d: x + d / 4.0, moved.variables["params"], delta)  # s(3) = 1/(1+3)
    chex.assert_trees_all_close(new_state.variables["params"], expected, rtol=1e-6, atol=1e-6)


def test_staleness_functions_by_hand():
    tau = np.array([0, 1, 3, 8])
    np.testing.assert_allclose(asyn.staleness_weight(asyn.parse_staleness("constant"), tau), [1, 1, 1, 1])
    np.testing.assert_allclose(asyn.staleness_weight(asyn.parse_staleness("poly"), tau),
                               [1, 2 ** -0.5, 0.5, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(asyn.staleness_weight(asyn.parse_staleness("poly:2"), tau), [1, 0.25, 1 / 16, 1 / 81],
                               rtol=1e-6)
    # hinge:a:b — 1 up to b, then 1 / (a (τ − b) + 1)
    np.testing.assert_allclose(asyn.staleness_weight(asyn.parse_staleness("hinge:0.5:1"), tau),
                               [1, 1, 1 / 2, 1 / 4.5], rtol=1e-6)
    jnp_weights = asyn.staleness_weight(asyn.parse_staleness("hinge:0.5:1"), jnp.asarray(tau))
    np.testing.assert_allclose(jnp_weights, [1, 1, 1 / 2, 1 / 4.5], rtol=1e-6)


@pytest.mark.parametrize("text", ["linear", "poly:-1", "poly:1:2", "hinge:1", "hinge:a:b", "constant:1", "poly:nan"])
def test_bad_staleness_is_one_sentence(text):
    with pytest.raises(UserError, match=r"--staleness .* is not allowed: it must be constant, poly"):
        asyn.parse_staleness(text)


def test_next_arrivals_is_top_m_by_time_ties_to_the_lower_slot():
    arrival = np.array([5.0, 1.0, np.inf, 1.0, 0.5])
    busy = np.array([True, True, False, True, True])
    np.testing.assert_array_equal(asyn.next_arrivals(arrival, busy, 3), [4, 1, 3])
    np.testing.assert_array_equal(asyn.next_arrivals(arrival, busy, 10), [4, 1, 3, 0])


@pytest.mark.parametrize("method", [fednova, scaffold], ids=["fednova", "scaffold"])
def test_methods_of_the_whole_cohort_are_refused(mlp, method):
    r = build(mlp, method(), stepwise(1))
    with pytest.raises(UserError, match=f"method {r.method.name} is not defined on a buffer .* --mode sync"):
        asyn.AsyncRound(r, concurrency=4, staleness=("constant", ()))
