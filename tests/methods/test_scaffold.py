"""SCAFFOLD (option II): a plain-Python reference over rounds, the reduction to FedAvg's first round,
control variates on uploaded elements only when wrapped around a partial method, and their traffic."""

import jax
import numpy as np
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.types import client_sgd
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.basic.scaffold import control_variates, scaffold
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.layerwise.fedldf import fedldf
from tests.conftest import make_cohort

N, K, STEPS, LR = 5, 3, 3, 0.1


# Tests of a few tiny rounds compared with a tolerance or checked for a property: compiled at -O0
# (tests/conftest.py); not the test that expects round 1 to equal FedAvg's bit for bit: two different
# programs, which the -O1 default compiles alike
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")


def cohorts(rounds=3):
    out = []
    for t in range(rounds):
        ids = np.sort(np.random.default_rng(t).choice(N, K, replace=False))
        out.append(make_cohort((4,), k=K, steps=STEPS, batch=5, seed=t, real_steps=[3, 1, 2],
                               real_examples=[5, 2, 4], client_ids=ids))
    return out


def reference_scaffold(model, variables, rounds):
    """SCAFFOLD written one client at a time in float64: Algorithm 1, option II, server step size 1."""
    to_np = lambda tree: jax.tree.map(lambda a: np.array(a, np.float64), tree)  # noqa: E731
    x, stats = to_np(variables["params"]), to_np(variables["batch_stats"])
    c = jax.tree.map(np.zeros_like, x)
    c_rows = [jax.tree.map(np.zeros_like, x) for _ in range(N)]
    for cohort in rounds:
        models, weights, new_rows = [], [], {}
        for k, cid in enumerate(np.asarray(cohort.info.client_ids)):
            y, s = x, stats
            steps = 0
            for t in range(STEPS):
                if not cohort.data.step_mask[k, t]:
                    continue
                real = cohort.data.example_mask[k, t]
                xb, yb = cohort.data.x[k, t][real], cohort.data.y[k, t][real]

                def loss(p, s=s, xb=xb, yb=yb):
                    logits, new = model.apply({"params": p, "batch_stats": s}, xb, True)
                    return -jax.nn.log_softmax(logits)[np.arange(len(yb)), yb].mean(), new

                (_, new_stats), g = jax.value_and_grad(loss, has_aux=True)(
                    jax.tree.map(lambda a: a.astype(np.float32), y))
                y = jax.tree.map(lambda p, g, ci, cc: p - LR * (g - ci + cc), y, to_np(g), c_rows[cid], c)
                s = to_np(new_stats)
                steps += 1
            new_rows[cid] = jax.tree.map(lambda ci, cc, a, b: ci - cc + (a - b) / (steps * LR), c_rows[cid], c, x, y)
            models.append((y, s))
            weights.append(float(cohort.info.num_samples[k]))
        w = np.array(weights) / np.sum(weights)
        delta_c = jax.tree.map(lambda *a: sum(a), *[jax.tree.map(np.subtract, new_rows[i], c_rows[i])
                                                     for i in new_rows])
        c = jax.tree.map(lambda cc, d: cc + d / N, c, delta_c)
        for i, row in new_rows.items():
            c_rows[i] = row
        x = jax.tree.map(lambda *a: sum(wi * ai for wi, ai in zip(w, a)), *[m[0] for m in models])
        stats = jax.tree.map(lambda *a: sum(wi * ai for wi, ai in zip(w, a)), *[m[1] for m in models])
    return x, c, c_rows


def build(model, method, strategy=None):
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=client_sgd(LR),
                          strategy=strategy or fused(), record_decisions=True)


def run(r, data):
    state = r.init(jax.random.key(0))
    metrics = []
    for t, c in enumerate(data):
        state, m = r(state, c, jax.random.key(t))
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics


@AT_O0
@pytest.mark.parametrize("strategy", [fused(), stepwise(1)], ids=str)
def test_engine_matches_plain_python_scaffold(mlp, strategy):
    r = build(mlp, scaffold(), strategy)
    start = jax.device_get(r.init(jax.random.key(0)).variables)
    data = cohorts()
    state, _ = run(r, data)
    x, c, c_rows = reference_scaffold(mlp, start, data)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=2e-4, atol=2e-5)  # noqa: E731
    jax.tree.map(close, state.variables["params"], x)
    jax.tree.map(close, state.method_state.server[1], c)
    for i in range(N):
        jax.tree.map(close, jax.tree.map(lambda r, i=i: r[i], state.method_state.clients[1]), c_rows[i])
    assert any(np.any(np.asarray(a) != 0) for a in jax.tree.leaves(state.method_state.server[1]))


def test_first_round_is_fedavgs_and_control_variates_count_as_traffic(mlp):
    """c = c_i = 0 at the start: the corrected gradient is the gradient, so round 1 equals FedAvg bit for bit;
    c goes down and c_i⁺ − c_i comes up with the model: every client moves its parameters' bytes once more
    each way (the parameters only: BatchNorm statistics have no control variate)."""
    data = cohorts(1)
    ours, m_ours = run(build(mlp, scaffold()), data)
    base, m_base = run(build(mlp, fedavg()), data)
    jax.tree.map(np.testing.assert_array_equal, ours.variables, base.variables)
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(base.variables["params"]))
    for key in ("upload_bytes", "download_bytes"):
        assert traffic_totals(m_ours[0])[key] == traffic_totals(m_base[0])[key] + K * param_bytes, key


@AT_O0
def test_wrapped_around_a_partial_method_control_variates_move_only_where_clients_uploaded(mlp):
    """FedLDF uploads the top-n clients' layers: a client's c_i changes on exactly the layers it uploaded, and
    c by the sum of those changes over N."""
    method = control_variates(fedldf(2))
    r = build(mlp, method)
    state = r.init(jax.random.key(0))
    (c0,) = cohorts(1)
    new, m = r(state, c0, jax.random.key(3))
    new, m = jax.device_get((new, m))
    upload = m["decisions"]["selection"].upload
    uploaded = jax.vmap(lambda mask: masks.expand(r.ctx.structure, mask, state.variables["params"]))(upload)
    rows = jax.tree.map(lambda a: a[np.asarray(c0.info.client_ids)], new.method_state.clients[1])
    some_kept = False
    for row, up in zip(jax.tree.leaves(rows), jax.tree.leaves(uploaded)):
        up = np.broadcast_to(np.asarray(up), row.shape)
        assert np.all(row[~up] == 0)  # not uploaded: c_i keeps its value (0)
        some_kept |= bool(np.any(~up))
    assert some_kept, "every element was uploaded: the case tests nothing"
    expected_c = jax.tree.map(lambda a: a.sum(0) / N, new.method_state.clients[1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), new.method_state.server[1],
                 expected_c)


def test_registered_with_the_cli_and_refuses_group_methods():
    assert get_method("scaffold").name == "scaffold"
    with pytest.raises(Exception, match="whole model"):
        control_variates(get_method("embracingfl", tier_mix="4,3,3"))
