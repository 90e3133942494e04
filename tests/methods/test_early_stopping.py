"""Early stopping (FedSPU+ES): λ-mixed loss, permanent stop on a rise, sampling only from active clients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core.losses import model_loss
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import stepwise
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation, run
from fedpartial._src.methods.base import Holdout
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.methods.submodel.fedspu import fedspu
from tests.conftest import make_cohort

N, K, LAM = 6, 3, 0.7


# Tests of a few tiny rounds compared with a tolerance or checked for a property: compiled at -O0
# (tests/conftest.py); not the test that expects the wrapped method to equal the method bit for bit: two different
# programs, which the -O1 default compiles alike
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")


def _holdout(seed, k=K, h=4, flip=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(k, h, 4)).astype(np.float32)
    y = rng.integers(0, 3, (k, h)).astype(np.int32)
    mask = np.ones((k, h), bool)
    mask[1, 3] = False  # unequal held-out sizes
    return Holdout(x, (y + 1) % 3 if flip else y, mask)


def _round(model, method, lr=0.0, bn_policy="global"):
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=optax.sgd(lr),
                          strategy=stepwise(1), bn_policy=bn_policy)


@AT_O0
def test_mixed_loss_is_recorded_and_a_rise_stops_the_client_for_good(mlp):
    # lr = 0 and untracked BatchNorm statistics ('static'): the trained model is the global
    # model, so both losses can be computed by hand.
    r = _round(mlp, early_stopping(fedavg(), lam=LAM), bn_policy="static")
    state = r.init(jax.random.key(0))
    cohort = make_cohort((4,), k=K, client_ids=[0, 2, 4])._replace(holdout=_holdout(1))
    state, metrics = r(state, cohort, jax.random.key(0))
    stop = state.method_state.clients[1]
    g = state.variables
    for i, cid in enumerate([0, 2, 4]):
        steps = [model_loss(mlp, g, cohort.data.x[i, s], cohort.data.y[i, s], cohort.data.example_mask[i, s],
                            train=True)[0] for s in range(cohort.data.x.shape[1])]
        h = cohort.holdout
        val = model_loss(mlp, g, h.x[i], h.y[i], h.example_mask[i], train=True)[0]
        np.testing.assert_allclose(stop.last_loss[cid], LAM * np.mean(steps) + (1 - LAM) * val, rtol=1e-5)
    assert not stop.stopped.any()  # a first participation never stops
    assert np.isinf(np.asarray(stop.last_loss)[[1, 3, 5]]).all()

    # Held-out labels become each model's most likely classes: the loss falls, nobody stops.
    # (Not "the same data again": on a GPU, reductions may differ in the last bit between rounds.)
    better = cohort.holdout
    y_best = np.stack([np.argmax(np.asarray(mlp.apply(state.variables, better.x[i], True, better.example_mask[i])[0]),
                                 -1) for i in range(K)]).astype(np.int32)
    state, _ = r(state, cohort._replace(holdout=better._replace(y=y_best)), jax.random.key(1))
    assert not state.method_state.clients[1].stopped.any()
    cohort = cohort._replace(holdout=better._replace(y=y_best))

    # Client 2's held-out labels become its model's least likely classes: its validation loss
    # rises and it stops, in round index 2.
    worse = cohort.holdout
    logits, _ = mlp.apply(state.variables, worse.x[1], True, worse.example_mask[1])
    y = np.array(worse.y)
    y[1] = np.argmin(np.asarray(logits), -1)
    state, _ = r(state, cohort._replace(holdout=worse._replace(y=y)), jax.random.key(2))
    stop = state.method_state.clients[1]
    np.testing.assert_array_equal(stop.stopped, [False, False, True, False, False, False])
    np.testing.assert_array_equal(stop.stop_round, [-1, -1, 2, -1, -1, -1])
    active = r.method.active_clients(r.ctx, state.method_state)
    np.testing.assert_array_equal(active, [True, True, False, True, True, True])

    # Stopping is permanent, even if its loss falls afterwards.
    state, _ = r(state, cohort, jax.random.key(3))
    assert bool(state.method_state.clients[1].stopped[2])


def test_wrapping_changes_nothing_else(mlp):
    cohort = make_cohort((4,), k=K, client_ids=[0, 2, 4])._replace(holdout=_holdout(1))
    a, b = _round(mlp, fedspu(), lr=0.1), _round(mlp, early_stopping(fedspu()), lr=0.1)
    sa, sb = a.init(jax.random.key(0)), b.init(jax.random.key(0))
    for t in range(2):
        sa, ma = a(sa, cohort, jax.random.key(t))
        sb, mb = b(sb, cohort, jax.random.key(t))
    for x, y in zip(jax.tree.leaves(sa.variables), jax.tree.leaves(sb.variables)):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(sa.method_state.clients), jax.tree.leaves(sb.method_state.clients[0])):
        np.testing.assert_array_equal(x, y)
    assert traffic_totals(ma)["upload_bytes"] == traffic_totals(mb)["upload_bytes"]
    personal = b.method.personal(b.ctx, sb.method_state, sb.variables)
    for x, y in zip(jax.tree.leaves(personal.variables), jax.tree.leaves(sa.method_state.clients)):
        np.testing.assert_array_equal(x, y)
    assert b.method.name == "fedspu+es"


def test_needs_held_out_data(mlp):
    r = _round(mlp, early_stopping(fedavg()))
    with pytest.raises(ValueError, match="held-out split"):
        r(r.init(jax.random.key(0)), make_cohort((4,), k=K), jax.random.key(0))
    with pytest.raises(ValueError, match="λ"):
        early_stopping(fedavg(), lam=1.5)


def _config(**kw):
    base = dict(method="fedspu", num_clients=N, cohort_size=K, rounds=4, local_steps=1, local_epochs=None,
                batch_size=8,
                early_stopping=True, out_dir=None, eval_every=100,
                client_state="device")  # these tests edit the stop state inside the server state
    return RunConfig(**{**base, **kw})


def _stop(sim, ids):
    stop = sim.state.method_state.clients[1]
    stopped = stop.stopped.at[jnp.asarray(ids)].set(True)
    clients = (sim.state.method_state.clients[0], stop._replace(stopped=stopped))
    sim.state = sim.state._replace(method_state=sim.state.method_state._replace(clients=clients))


@AT_O0
def test_sampling_only_from_active_clients_and_all_when_fewer_than_k():
    sim = Simulation(_config())
    _stop(sim, [0, 1, 3])
    for t in range(5):
        ids, valid, _, _ = sim.sample_cohort(t)
        assert sorted(ids[valid]) == [2, 4, 5]  # exactly K = 3 left: all of them, every round
    _stop(sim, [4])
    ids, valid, _, seed = sim.sample_cohort(0)
    assert sorted(ids[valid]) == [2, 5] and valid.sum() == 2
    assert len(set(ids)) == K  # filler slots are distinct stopped clients, marked not valid
    before = jax.device_get(sim.state)  # host copy: the fused round (GPU default) donates the state
    cohort = sim.cohort(ids, seed, valid)
    assert not np.asarray(cohort.data.step_mask)[~valid].any()  # fillers train on nothing
    sim.state, metrics = sim.round(sim.state, cohort, jax.random.key(0))
    assert int(metrics["client_steps"]) == 2
    for filler in ids[~valid]:  # a filler's personal model and stop state are untouched
        for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x[filler], before.method_state.clients)),
                        jax.tree.leaves(jax.tree.map(lambda x: x[filler], sim.state.method_state.clients))):
            np.testing.assert_array_equal(a, b)


@AT_O0
def test_run_ends_early_when_every_client_has_stopped():
    config = _config(rounds=5)
    sim = Simulation(config)
    _stop(sim, list(range(N)))
    summary = run(config, sim=sim)
    assert summary["rounds"] == 0 and summary["rounds_saved"] == 5 and summary["stopped_clients"] == N


@AT_O0
def test_a_real_run_stops_clients_and_saves_rounds():
    """Noisy one-step rounds: every client's mixed loss rises at some point; the run ends early."""
    config = _config(rounds=60, client_lr=0.5, eval_every=5)
    summary = run(config)
    assert summary["stopped_clients"] == N
    assert summary["rounds"] < 60 and summary["rounds_saved"] == 60 - summary["rounds"]
    records = summary["records"]
    assert records[-1]["active_clients"] == 0 and "personal_accuracy" in records[-1]
    assert [r["active_clients"] for r in records] == sorted((r["active_clients"] for r in records), reverse=True)
    # Sampled clients never include a stopped one: the cohort shrinks below K only at the end.
    assert all(r["clients"] == min(K, prev) for r, prev in
               zip(records, [N] + [r["active_clients"] for r in records]))
