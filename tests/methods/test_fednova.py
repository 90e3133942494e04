"""FedNova: a_i as the reference accumulates it, a plain-Python FedNova the engine must match, FedAvg reduction."""

import jax
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.methods.base import RoundView, Selection
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.basic.fednova import fednova, normalizer
from fedpartial._src.methods.catalog import METHODS
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.zoo import MLP
from tests.conftest import make_cohort, mlp_grad

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N, K = 5, 3
LR, MOMENTUM, WD = 0.1, 0.9, 1e-2


@pytest.fixture(scope="module")
def model():
    return from_linen(MLP(num_classes=3, hidden=(5,)), input_shape=(4,), num_classes=3, sequential=True)


def cohorts(real_steps=((3, 1, 2), (2, 3, 1))):
    """Two rounds, overlapping cohorts, unequal steps and examples (the rest is padding)."""
    ids = ([0, 1, 3], [1, 2, 4])
    return [make_cohort((4,), k=K, steps=3, batch=5, seed=t, real_steps=real_steps[t], real_examples=[5, 3, 4],
                        client_ids=ids[t]) for t in range(2)]


def build(model, method, opt):
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=opt,
                          strategy=fused())


def run(r, data):
    """(initial state, final state, per-round metrics), on the host."""
    state = r.init(jax.random.key(0))
    initial, metrics = jax.device_get(state), []
    for t, c in enumerate(data):
        state, m = r(state, c, jax.random.key(t))
        metrics.append(jax.device_get(m))
    return initial, jax.device_get(state), metrics


def reference_round(params, cohort, momentum, wd):
    """FedNova one client at a time, as the reference implementation computes it."""
    def to64(tree):
        return jax.tree.map(lambda a: np.array(a, np.float64), tree)
    g = to64(params)
    updates, a_list, n = [], [], []
    for k in range(K):
        p, buf = to64(params), None
        counter = a = 0.0
        for s in range(cohort.data.step_mask.shape[1]):
            if not cohort.data.step_mask[k, s]:
                continue  # a padded step does not exist
            real = cohort.data.example_mask[k, s]
            x, y = cohort.data.x[k, s][real].astype(np.float64), cohort.data.y[k, s][real]
            grad = mlp_grad(p, x, y)
            d_p = jax.tree.map(lambda gr, v: gr + wd * v, grad, p)  # weight decay: part of the gradient
            buf = d_p if buf is None else jax.tree.map(lambda b, d: momentum * b + d, buf, d_p)
            p = jax.tree.map(lambda v, b: v - LR * b, p, buf)
            if momentum:  # the reference's local normalising vector
                counter = counter * momentum + 1
                a += counter
            else:
                a += 1
        updates.append(jax.tree.map(lambda gl, v, a=a: (gl - v) / a, g, p))  # d_i
        a_list.append(a)
        n.append(float(cohort.info.num_samples[k]))
    ratio = np.array(n) / np.sum(n)
    tau_eff = float(np.dot(ratio, a_list))
    new = jax.tree.map(lambda gl, *d: gl - tau_eff * sum(r * di for r, di in zip(ratio, d)), g, *updates)
    return new, tau_eff


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_normalizer_is_the_reference_accumulation(rho):
    expected = []
    for tau in range(7):
        counter = a = 0.0
        for _ in range(tau):
            if rho:
                counter = counter * rho + 1
                a += counter
            else:
                a += 1
        expected.append(a)
    np.testing.assert_allclose(normalizer(np.arange(7), rho), expected, rtol=1e-6)
    if rho == 0.5:
        assert float(normalizer(np.array(3), rho)) == pytest.approx(1 + 1.5 + 1.75)


def test_engine_matches_plain_python_fednova(model):
    data = cohorts()
    opt = optax.chain(optax.add_decayed_weights(WD), optax.sgd(LR, momentum=MOMENTUM))
    initial, state, metrics = run(build(model, fednova(momentum=MOMENTUM), opt), data)
    expected = initial.variables["params"]
    for t, c in enumerate(data):
        expected, tau_eff = reference_round(expected, c, MOMENTUM, WD)
        assert float(metrics[t]["tau_eff"]) == pytest.approx(tau_eff, rel=1e-5)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(state.variables["params"])):
        np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-5)
    # Each client uploads its normalised update (as large as the model) and its a_i (4 bytes).
    model_bytes = sum(4 * np.size(a) for a in jax.tree.leaves(expected))
    assert traffic_totals(metrics[0])["upload_bytes"] == K * (model_bytes + 4)


def test_equal_steps_without_momentum_is_fedavg_and_unequal_steps_are_not(model):
    nova_round, avg_round = build(model, fednova(), optax.sgd(LR)), build(model, fedavg(), optax.sgd(LR))
    equal = cohorts(real_steps=((2, 2, 2), (3, 3, 3)))
    _, nova, _ = run(nova_round, equal)
    _, avg, _ = run(avg_round, equal)
    for a, b in zip(jax.tree.leaves(nova.variables), jax.tree.leaves(avg.variables)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    unequal = cohorts()  # same shapes: no recompilation
    _, nova, _ = run(nova_round, unequal)
    _, avg, _ = run(avg_round, unequal)
    gaps = [np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(nova.variables), jax.tree.leaves(avg.variables))]
    assert max(gaps) > 1e-3


def test_momentum_is_the_runs_own_setting():
    spec = METHODS["fednova"]
    assert spec.run_settings == ("momentum",) and not spec.options
    method = RunConfig(method="fednova", momentum=0.5).build_method()
    view = RoundView(key=None, round=None, global_vars=None, method_state=None, client_state=None, cohort=None,
                     data=None, client_steps=np.array([3, 1], np.int32),
                     selection=Selection(upload=None, weights=np.array([1.0, 3.0], np.float32),
                                         extra_upload_bytes=None))
    # a(3) = 1 + 1.5 + 1.75 and a(1) = 1 with ρ = 0.5; τ_eff = (4.25 + 3·1) / 4.
    assert float(method.metrics(None, view)["tau_eff"]) == pytest.approx((4.25 + 3.0) / 4)
    with pytest.raises(UserError, match="no option 'momentum'"):
        RunConfig(method="fednova", options={"momentum": 0.5}).build_method()
    with pytest.raises(UserError, match="momentum"):
        fednova(momentum=1.0)
