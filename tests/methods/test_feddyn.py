"""FedDyn: a plain-Python FedDyn the engine must match, α per client, per-client state, α = 0 is FedAvg."""

import jax
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.basic.feddyn import feddyn
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.zoo import MLP
from tests.conftest import make_cohort, mlp_grad

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N, K = 5, 3
LR, ALPHA = 0.1, 0.1
IDS = ([0, 1, 3], [1, 2, 4])
SIZES = np.array([15, 3, 10, 8, 6], np.float32)  # n of clients 0..4 (client 1 has 3 examples in both rounds)


@pytest.fixture(scope="module")
def model():
    return from_linen(MLP(num_classes=3, hidden=(5,)), input_shape=(4,), num_classes=3, sequential=True)


def population_counts():
    """[N, C] label counts whose row sums are the clients' sizes."""
    return np.stack([SIZES, np.zeros(N), np.zeros(N)], axis=1)


def cohorts():
    """Round 1: clients 0, 1, 3 (n = 15, 3, 8); round 2: clients 1, 2 and an empty padding slot (client 4)."""
    first = make_cohort((4,), k=K, steps=3, batch=5, seed=0, real_steps=[3, 1, 2], real_examples=[5, 3, 4],
                        client_ids=IDS[0])
    second = make_cohort((4,), k=K, steps=3, batch=5, seed=1, real_steps=[1, 2, 0], real_examples=[3, 5, 0],
                         client_ids=IDS[1])
    second = second._replace(info=second.info._replace(valid=np.array([True, True, False])))
    return [first, second]


def build(model, method, label_counts=None):
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=optax.sgd(LR),
                          strategy=fused(), label_counts=label_counts)


def run(r, data, state=None):
    """Host copies of the state before and after every round."""
    state = r.init(jax.random.key(0)) if state is None else state
    history = [jax.device_get(state)]
    for t, c in enumerate(data):
        state, _ = r(state, c, jax.random.key(t))
        history.append(jax.device_get(state))
    return history


def reference_round(params, lam, h, cohort, mean_size):
    """FedDyn one client at a time (paper's algorithm, α_i = α / (n_i / n̄) as the official code)."""
    def to64(tree):
        return jax.tree.map(lambda a: np.array(a, np.float64), tree)
    g = to64(params)
    models = []
    for k in range(K):
        if not cohort.info.valid[k]:
            continue  # a padding slot: nobody trains
        i = int(cohort.info.client_ids[k])
        a_i = ALPHA * mean_size / float(cohort.info.num_samples[k])
        p = to64(params)
        for s in range(cohort.data.step_mask.shape[1]):
            if not cohort.data.step_mask[k, s]:
                continue
            real = cohort.data.example_mask[k, s]
            x, y = cohort.data.x[k, s][real].astype(np.float64), cohort.data.y[k, s][real]
            # ∇ [ CE − <λ_i, θ> + α_i/2 ||θ − θ_g||² ]
            grad = jax.tree.map(lambda gr, lm, v, gl, a=a_i: gr - lm + a * (v - gl), mlp_grad(p, x, y), lam[i], p, g)
            p = jax.tree.map(lambda v, gr: v - LR * gr, p, grad)
        lam[i] = jax.tree.map(lambda lm, v, gl, a=a_i: lm - a * (v - gl), lam[i], p, g)
        models.append(p)
    h = jax.tree.map(lambda hh, gl, *ps: hh - ALPHA / N * sum(v - gl for v in ps), h, g, *models)
    new = jax.tree.map(lambda hh, *ps: sum(ps) / len(ps) - hh / ALPHA, h, *models)
    return new, lam, h


@pytest.fixture(scope="module")
def histories(model):
    """States of two FedDyn rounds, with every client's size known (population) and without (cohort).

    One compiled round serves both: knowing the sizes only sets the state's ``mean_size``
    (checked in ``test_alpha_per_client_uses_the_population_mean_when_known``).
    """
    r = build(model, feddyn(alpha=ALPHA))
    state = r.init(jax.random.key(0))  # a fresh state for each run: the fused round donates it
    known = state._replace(method_state=state.method_state._replace(
        server=state.method_state.server._replace(mean_size=jax.numpy.float32(SIZES.mean()))))
    return {"population": run(r, cohorts(), known), "cohort": run(r, cohorts())}


@pytest.mark.parametrize("population", [True, False], ids=["population-mean", "cohort-mean"])
def test_engine_matches_plain_python_feddyn(histories, population):
    data = cohorts()
    history = histories["population" if population else "cohort"]
    params = history[0].variables["params"]
    zeros = jax.tree.map(lambda a: np.zeros(a.shape), params)
    lam, h = {i: zeros for i in range(N)}, zeros
    for t, c in enumerate(data):
        real = np.asarray(c.info.valid)
        mean_size = SIZES.mean() if population else c.info.num_samples[real].mean()
        params, lam, h = reference_round(params, lam, h, c, mean_size)
        got = history[t + 1]
        def close(a, b):
            return np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
        jax.tree.map(close, got.variables["params"], params)
        jax.tree.map(close, got.method_state.server.h, h)
        for i in range(N):
            jax.tree.map(close, jax.tree.map(lambda a, i=i: a[i], got.method_state.clients), lam[i])


def test_client_state_changes_only_for_the_cohorts_real_clients(histories):
    lam = [jax.tree.leaves(s.method_state.clients) for s in histories["cohort"]]
    def changed(t, i):
        return any(not np.array_equal(a[i], b[i]) for a, b in zip(lam[t], lam[t + 1]))
    assert [changed(0, i) for i in range(N)] == [True, True, False, True, False]
    # Round 2: clients 1 and 2 train; client 4 sits in a padding slot; 0 and 3 keep their rows bit for bit.
    assert [changed(1, i) for i in range(N)] == [False, True, True, False, False]


def test_alpha_per_client_uses_the_population_mean_when_known(model):
    c = cohorts()[0]
    n = np.array([15.0, 3.0, 8.0])
    for label_counts, mean in ((population_counts(), SIZES.mean()), (None, n.mean())):
        r = build(model, feddyn(alpha=ALPHA), label_counts)
        state = r.init(jax.random.key(0))
        assert float(state.method_state.server.mean_size) == pytest.approx(mean if label_counts is not None else 0)
        plan = r.preview(state, c, jax.random.key(0)).plan
        np.testing.assert_allclose(plan.extra, ALPHA * mean / n, rtol=1e-6)


def test_alpha_zero_is_fedavg_with_uniform_weights(model):
    # Unequal steps and examples but equal n (2·2, 1·4, 2·2): uniform weights are FedAvg's n_k weights.
    data = [make_cohort((4,), k=K, steps=2, batch=4, seed=t, real_steps=[2, 1, 2], real_examples=[2, 4, 2],
                        client_ids=IDS[t]) for t in range(2)]
    dyn = run(build(model, feddyn(alpha=0.0)), data)
    avg = run(build(model, fedavg()), data)
    for a, b in zip(jax.tree.leaves(dyn[-1].variables), jax.tree.leaves(avg[-1].variables)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # No regulariser: λ and h stay 0.
    assert all(not np.any(a) for a in jax.tree.leaves(dyn[-1].method_state))


def test_bad_alpha_is_one_sentence():
    with pytest.raises(UserError, match="--dyn-alpha"):
        get_method("feddyn", alpha=-1.0)
    with pytest.raises(UserError, match="--dyn-alpha = -0.5"):  # a direct call: the option's check too
        feddyn(alpha=-0.5)
