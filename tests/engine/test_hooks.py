"""Engine v2 hooks: per-step keys, start variables and step counts, the objective piece,
server data for init, the metrics hook, recorded decisions, the debug strategy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.types import Capabilities, ClientPlan, MethodContext, MethodState
from fedpartial._src.engine import strategy as strategies
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.types import hook_keys
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.population import server_examples
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.base import cross_entropy, make_method, upload_trained
from fedpartial._src.methods.catalog import get_method
from tests.conftest import make_cohort

# Rounds of a few tiny steps, compared with a tolerance or checked for what stays bit for bit: compiled at -O0
# (tests/conftest.py says why that changes nothing there); not the scanned pure round, a jit inside the test's jit
# (only a top-level jit takes compiler options)
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")
N, K = 6, 3
OPT = optax.sgd(0.1)


def build(model, method, strategy=None, **kw):
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=OPT,
                          strategy=strategy or strategies.stepwise(1), **kw)


def resampled_dropout(p=0.5):
    """A FedAD-like method: a fresh random neuron mask at every local step, from the step's key."""

    def step_plan(ctx, plan, key, step):
        keys = jax.random.split(key, ctx.structure.num_layers)
        neurons = tuple(jax.random.bernoulli(k, p, (u,)) for k, u in zip(keys, ctx.structure.units))
        return plan._replace(dropout=masks.from_neurons(ctx.structure, neurons))

    def select(ctx, view):  # the sub-models change every step: upload everything trained
        return upload_trained(ctx, view._replace(plan=ClientPlan()))

    return make_method("resampled", step_plan=step_plan, select=select)


@AT_O0
def test_every_step_has_its_own_key_and_a_hand_replay_matches(mlp):
    """The engine's client k, step s uses fold_in(fold_in(train_key, id_k), s); replaying that by hand
    with the client functions gives the same trained model."""
    cohort = make_cohort((4,), k=K, steps=3, client_ids=[1, 3, 4])
    method = resampled_dropout()
    r = build(mlp, method)
    state = jax.device_get(r.init(jax.random.key(0)))
    key = jax.random.key(11)
    new, _ = r(jax.tree.map(jnp.asarray, state), cohort, key)

    ctx = MethodContext(mlp, N, K)
    fns = make_client_fns(ctx, method, OPT)
    step = jax.jit(fns.step)  # one program for the 9 steps (eagerly, each of the step's operations was one)
    train_key = hook_keys(key).train
    masks_seen = []
    trained = []
    for k, cid in enumerate([1, 3, 4]):
        local = fns.init(state.variables)
        client_key = jax.random.fold_in(train_key, cid)
        for s in range(3):
            batch = jax.tree.map(lambda a: a[k, s], cohort.data)
            local = step(local, batch, ClientPlan(), state.variables, (), client_key, jnp.asarray(s))
            plan_key = jax.random.split(jax.random.fold_in(client_key, s))[0]
            masks_seen.append(np.asarray(method.step_plan(ctx, ClientPlan(), plan_key, s).dropout.neurons[0]))
        trained.append(fns.final(local, state.variables)[0])
    # Different steps and clients drew different masks.
    assert len({m.tobytes() for m in masks_seen}) > 5
    expected = jax.tree.map(lambda *a: np.average(np.stack(a), axis=0, weights=cohort.info.num_samples), *trained)
    chex.assert_trees_all_close(new.variables, expected, rtol=1e-5, atol=1e-6)


@AT_O0
def test_select_and_update_see_start_variables_and_real_step_counts(mlp):
    def init(ctx, view):
        return MethodState(clients=jnp.zeros((ctx.num_clients, 2), jnp.float32))

    def update(ctx, view):
        start_norm = jnp.sqrt(sum(jnp.sum(a.reshape(a.shape[0], -1) ** 2, axis=1)
                                  for a in jax.tree.leaves(view.start_vars["params"])))
        rows = jnp.stack([view.client_steps.astype(jnp.float32), start_norm], axis=1)
        return view.method_state._replace(clients=view.method_state.clients.at[view.cohort.client_ids].set(rows))

    cohort = make_cohort((4,), k=K, steps=3, real_steps=[3, 1, 2], client_ids=[0, 2, 5])
    for strategy in (strategies.stepwise(1), strategies.fused()):
        r = build(mlp, make_method("watch", init=init, update=update), strategy)
        state = r.init(jax.random.key(0))
        g = jax.device_get(state.variables["params"])
        new, metrics = r(state, cohort, jax.random.key(1))
        rows = np.asarray(new.method_state.clients)
        np.testing.assert_array_equal(rows[[0, 2, 5], 0], [3, 1, 2])
        norm = np.sqrt(sum(np.sum(np.square(a)) for a in jax.tree.leaves(g)))
        np.testing.assert_allclose(rows[[0, 2, 5], 1], norm, rtol=1e-6)
        np.testing.assert_array_equal(metrics["client_steps_per_client"], [3, 1, 2])


@AT_O0
def test_each_hook_gets_its_own_key(mlp):
    def update(ctx, view):
        return view.method_state._replace(server=jax.random.key_data(view.key))

    def metrics(ctx, view):
        return {"metrics_key": jax.random.key_data(view.key)}

    r = build(mlp, make_method("keys", update=update, metrics=metrics), strategies.fused())
    key = jax.random.key(3)
    new, m = r(r.init(jax.random.key(0)), make_cohort((4,), k=K), key)
    keys = hook_keys(key)
    np.testing.assert_array_equal(new.method_state.server, jax.random.key_data(keys.update))
    np.testing.assert_array_equal(m["metrics_key"], jax.random.key_data(keys.metrics))
    datas = {np.asarray(jax.random.key_data(k)).tobytes() for k in keys}
    assert len(datas) == len(keys)


@AT_O0
def test_the_objective_is_a_method_piece(mlp):
    """An objective of ||θ||² alone: one plain SGD step scales every parameter by (1 - 2η)."""

    def weight_norm(ctx, params, step):
        _, aux = cross_entropy(ctx, params, step)  # keep the reported loss and statistics
        return sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params)), aux

    r = build(mlp, make_method("norm", objective=weight_norm))
    state = jax.device_get(r.init(jax.random.key(0)))
    cohort = make_cohort((4,), k=K, steps=1)
    new, _ = r(jax.tree.map(jnp.asarray, state), cohort, jax.random.key(1))
    chex.assert_trees_all_close(new.variables["params"], jax.tree.map(lambda p: p * 0.8, state.variables["params"]),
                                rtol=1e-6, atol=1e-7)


@AT_O0
def test_init_receives_a_class_balanced_server_set_no_client_holds():
    def init(ctx, view):
        counts = jnp.bincount(view.server_data.y, length=10)
        return MethodState(server=counts)

    method = make_method("server-set", init=init, capabilities=Capabilities(server_examples_per_class=3))
    sim = Simulation(RunConfig(num_clients=10, cohort_size=2, rounds=1, local_steps=1, out_dir=None),
                     method=method)
    np.testing.assert_array_equal(sim.state.method_state.server, np.full(10, 3))
    held = set(np.concatenate(sim.clients).tolist())
    server = set(server_examples(sim.dataset.y_train, 3, sim.config.seed).tolist())
    np.testing.assert_array_equal(sim.server_data.x, sim.dataset.x_train[sorted(server)])
    assert len(server) == 30 and not (server & held)
    assert len(held) + len(server) == len(sim.dataset.y_train)  # every other example went to a client


@AT_O0
def test_method_metrics_reach_the_record_and_may_not_shadow_engine_names(mlp):
    sim = Simulation(RunConfig(method="fedldf", options={"n": 2}, num_clients=6, cohort_size=3, rounds=1,
                               local_steps=1, out_dir=None))
    record = next(sim.rounds())
    assert sorted(record["layers_uploaded_per_client"]) != [] and sum(record["layers_uploaded_per_client"]) == \
        2 * sim.model.structure.num_layers  # n = 2 uploads per layer
    assert len(record["mean_divergence_per_layer"]) == sim.model.structure.num_layers
    bad = make_method("bad", metrics=lambda ctx, view: {"train_loss": jnp.zeros(())})
    with pytest.raises(ValueError, match="train_loss"):
        r = build(mlp, bad, strategies.fused())
        r(r.init(jax.random.key(0)), make_cohort((4,), k=K), jax.random.key(0))


@AT_O0
def test_decisions_are_recorded_only_when_asked(mlp):
    cohort = make_cohort((4,), k=K)
    off = build(mlp, get_method("fedldf", n=2), strategies.fused())
    _, m = off(off.init(jax.random.key(0)), cohort, jax.random.key(1))
    assert "decisions" not in m
    on = build(mlp, get_method("fedldf", n=2), strategies.fused(), record_decisions=True)
    _, m = on(on.init(jax.random.key(0)), cohort, jax.random.key(1))
    layers = np.asarray(m["decisions"]["selection"].upload.layers)  # [K, L]
    assert layers.shape == (K, mlp.structure.num_layers)
    np.testing.assert_array_equal(layers.sum(axis=0), 2)  # FedLDF: n clients per layer


@AT_O0
@pytest.mark.xdist_group("debug_strategy")  # op by op: shares its ops with tests/core/test_views.py's debug rounds
def test_debug_strategy_runs_hooks_eagerly_and_matches_stepwise(mlp):
    """Un-jitted, a hook may read concrete values (here: float() of the round), which jit forbids."""

    def plan(ctx, view):
        assert float(view.round) >= 0  # a concrete value: only possible without jit
        return ClientPlan()

    cohort = make_cohort((4,), k=K, steps=2, real_steps=[2, 1, 2])
    fused = build(mlp, make_method("eager", plan=plan), strategies.fused())
    with pytest.raises(jax.errors.ConcretizationTypeError):
        fused(fused.init(jax.random.key(0)), cohort, jax.random.key(1))
    dbg = build(mlp, make_method("eager", plan=plan), strategies.debug())
    a, ma = dbg(dbg.init(jax.random.key(0)), cohort, jax.random.key(1))
    ref = build(mlp, get_method("fedavg"))
    b, mb = ref(ref.init(jax.random.key(0)), cohort, jax.random.key(1))
    chex.assert_trees_all_close(a.variables, b.variables, rtol=1e-5, atol=1e-6)
    assert traffic_totals(ma)["upload_bytes"] == traffic_totals(mb)["upload_bytes"]


def test_pure_round_can_be_scanned_over_rounds(mlp):
    """``functions.round`` is pure: lax.scan over three rounds equals three calls."""
    r = build(mlp, get_method("fedavg"), strategies.fused())
    fns = r.functions
    cohort = make_cohort((4,), k=K, steps=2)
    data = jax.tree.map(jnp.asarray, cohort)
    keys = jax.random.split(jax.random.key(5), 3)

    def body(state, key):
        state, metrics = fns.round(state, data, key)
        return state, metrics["train_loss"]

    scanned, losses = jax.jit(lambda s: jax.lax.scan(body, s, keys))(fns.init(jax.random.key(0)))
    state = r.init(jax.random.key(0))
    for key in keys:
        state, m = r(state, cohort, key)
    chex.assert_trees_all_close(scanned.variables, state.variables, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses[-1], m["train_loss"], rtol=1e-5)
