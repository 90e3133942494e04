"""Ditto: a plain-Python reference over two rounds with a client sampled twice (the global model FedAvg's, each
personal model trained with λ/2·‖v − w^t‖²), the global model equal to FedAvg's bit for bit, the personal
models evaluated, and the optimizer it needs."""

import chex
import jax
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import client_sgd
from fedpartial._src.costs.devices import CostModel
from fedpartial._src.engine import types as engine_types
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.methods.catalog import get_method
from tests.methods.test_heterofl import LR, MOMENTUM, SMALL, _narrow_grad, adapt, start
from tests.methods.test_personal_layers import N, cohorts

LAM = 0.5


# Tests of a few tiny rounds compared with a tolerance or checked for a property: compiled at -O0
# (tests/conftest.py); not the test that expects the global model to equal FedAvg's bit for bit: two different
# programs, which the -O1 default compiles alike
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")


def build(method, strategy=None, optimizer=client_sgd(LR, MOMENTUM)):
    return FederatedRound(adapt(SMALL, (4,)), method, num_clients=N, cohort_size=2, client_optimizer=optimizer,
                          strategy=strategy or fused())


def sgd(p, d, k, pull=None):
    """Client ``k``'s momentum SGD over its real steps of ``d``; ``pull``: add λ(v − pull) to every gradient."""
    velocity = jax.tree.map(np.zeros_like, p)
    for s in range(d.step_mask.shape[1]):
        if not d.step_mask[k, s]:
            continue
        grads = _narrow_grad(jax.tree.map(lambda a: a.astype(np.float32), p), d.x[k, s], d.y[k, s],
                             d.example_mask[k, s].astype(np.float32), 1.0)
        grads = jax.tree.map(np.asarray, grads)
        if pull is not None:
            grads = jax.tree.map(lambda g, v, w: g + LAM * (v - w), grads, p, pull)
        velocity = jax.tree.map(lambda v, dg: MOMENTUM * v + dg, velocity, grads)
        p = jax.tree.map(lambda a, v: a - LR * v, p, velocity)
    return p


def reference(global_params, data):
    """Ditto as its Algorithm 1 reads, one client at a time: the global model trained and averaged (n_k weights)
    as FedAvg's; the client's personal model trained from where it was, pulled towards the round's w^t."""
    g = jax.tree.map(lambda a: np.array(a, np.float64), global_params)
    own = {i: jax.tree.map(np.copy, g) for i in range(N)}
    for c in data:
        trained, weights = [], []
        for k, i in enumerate(np.asarray(c.info.client_ids)):
            trained.append(sgd(g, c.data, k))
            weights.append(float(c.info.num_samples[k]))
            own[i] = sgd(own[i], c.data, k, pull=g)
        w = np.asarray(weights) / sum(weights)
        g = jax.tree.map(lambda *leaves: sum(wk * a for wk, a in zip(w, leaves)), *trained)
    return g, own


@AT_O0
def test_engine_matches_a_plain_python_reference():
    r = build(get_method("ditto", lam=LAM), stepwise(1))
    state = start(r)
    expected, own = reference(jax.device_get(state.variables["params"]), cohorts())
    for t, c in enumerate(cohorts()):
        state, m = r(state, c, jax.random.key(t))
    chex.assert_trees_all_close(jax.device_get(state.variables["params"]), expected, rtol=2e-5, atol=2e-6)
    # What is evaluated: each client's personal model (client 1 was never sampled: the initial model).
    models = r.method.personal(r.ctx, state.method_state, state.variables)
    for i in range(N):
        chex.assert_trees_all_close(jax.tree.map(lambda a: np.asarray(a[i]), models.variables["params"]), own[i],
                                    rtol=2e-5, atol=2e-6)
    assert not np.allclose(own[2]["head"]["kernel"], expected["head"]["kernel"])


def test_the_uploaded_global_model_is_fedavgs_bit_for_bit():
    results = []
    for method in (get_method("ditto"), get_method("fedavg")):
        r = build(method)
        state = start(r)
        for t, c in enumerate(cohorts()):
            state, _ = r(state, c, jax.random.key(t))
        results.append(jax.device_get(state.variables))
    chex.assert_trees_all_equal(*results)


@AT_O0
def test_the_device_model_counts_both_trainings():
    """A client trains the global model and then its personal one on the same batches: its FLOPs of local work,
    and with them its simulated time, are twice FedAvg's (``Capabilities.local_passes``)."""
    cohort, steps = engine_types.data_spec(cohorts()[0]), np.array([3.0, 2.0])
    fedavg, ditto = (CostModel(build(get_method(name)), compiled=False).client_flops(cohort, steps)
                     for name in ("fedavg", "ditto"))
    assert get_method("ditto").capabilities.local_passes == 2 and fedavg[0] > 0
    np.testing.assert_array_equal(ditto, 2 * fedavg)


def test_options_and_the_optimizer_it_needs():
    with pytest.raises(UserError, match="--lam = -1"):
        get_method("ditto", lam=-1)
    r = build(get_method("ditto"), optimizer=optax.sgd(LR))
    with pytest.raises(UserError, match="ditto trains each client's personal model at the client's learning rate"):
        r(start(r), cohorts()[0], jax.random.key(0))
