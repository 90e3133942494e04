"""Each hook sees only the RoundView fields that exist at its phase (``VIEW_FIELDS``), under every strategy;
the local step sees the method's server state, the client's rows and its learning rate; ``transform_grads``
changes each step's gradient and never a frozen element."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedpartial as fp
from fedpartial import masks
from fedpartial._src.core import aggregation
from fedpartial._src.engine.strategy import fused
from tests.conftest import make_cohort

N, K = 5, 3
# The rounds of the first two tests, a few tiny steps checked for what the hooks saw and moved: compiled at -O0
# (tests/conftest.py says why that changes nothing here); not the last test's two programs expected bit for bit
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")
# The debug strategy runs its rounds op by op: each primitive is lowered and compiled on its first use in a process,
# so the tests that run it share one xdist worker (tests/engine/test_engine.py, tests/engine/test_hooks.py), where
# the next test's ops (the same model's step) are already there
DEBUG = pytest.param(fp.debug(), marks=pytest.mark.xdist_group("debug_strategy"))


def spy(seen: dict, streamable=None):
    """A FedAvg that records which view fields are set when each hook runs (at trace time: no side effect
    reaches traced values; the dict is filled while the round is traced or run eagerly)."""

    def record(hook, view):
        seen.setdefault(hook, set()).update(f for f in fp.RoundView._fields if getattr(view, f) is not None)

    def plan(ctx, view):
        record("plan", view)
        return fp.ClientPlan()

    def summarize(ctx, view):
        record("summarize", view)
        return jnp.zeros((view.cohort.valid.shape[0],))

    def select(ctx, view):
        record("select", view)
        return fp.upload_trained(ctx, view)

    def aggregate(ctx, view):  # the one formula, as the engine would compute it
        record("aggregate", view)
        new, received = aggregation.aggregate(ctx.structure, view.global_vars, view.trained_vars,
                                              view.selection.upload, view.selection.weights, ("params",))
        return new["params"], received

    def server_correct(ctx, view):
        record("server_correct", view)
        return view.aggregated["params"]

    def update(ctx, view):
        record("update", view)
        return view.method_state

    def metrics(ctx, view):
        record("metrics", view)
        return {}

    return fp.make_method("spy", plan=plan, summarize=summarize, select=select, update=update, metrics=metrics,
                          server_correct=None if streamable else server_correct,
                          aggregate=None if streamable else aggregate,
                          capabilities=fp.Capabilities(streamable=streamable))


@AT_O0
@pytest.mark.parametrize("strategy", [fp.fused(), fp.stepwise(2), DEBUG, fp.streamed(2)], ids=str)
def test_every_hook_sees_only_the_fields_of_its_phase(mlp, strategy):
    seen: dict = {}
    method = spy(seen, streamable="summary" if strategy.kind == "stream" else None)
    rnd = fp.FederatedRound(mlp, method, num_clients=N, cohort_size=K, client_optimizer=fp.client_sgd(0.1),
                            strategy=strategy)
    rnd(rnd.init(jax.random.key(0)), make_cohort((4,), k=K, steps=2), jax.random.key(1))
    hooks = {"plan", "summarize", "select", "update", "metrics"} | ({"server_correct", "aggregate"}
                                                                   if method.server_correct else set())
    assert set(seen) == hooks
    for hook, fields in seen.items():
        assert fields <= fp.VIEW_FIELDS[hook], (hook, fields - fp.VIEW_FIELDS[hook])
    if strategy.kind == "fused":  # the table is exact: every listed field is set (this run holds no data out)
        for hook, fields in seen.items():
            assert fields == fp.VIEW_FIELDS[hook] - {"holdout"}, hook


def control_variate_method(seen: list):
    """Each step's gradient is g − c_i + c, with c the server state and c_i the client's rows (constants here),
    and the step reports the rate and states it saw."""

    def init(ctx, view):
        c = jax.tree.map(lambda a: jnp.full_like(a, 0.5), view.global_vars["params"])
        rows = jax.tree.map(lambda a: jnp.zeros((ctx.num_clients, *a.shape), a.dtype), c)
        return fp.MethodState(server=c, clients=rows)

    def zero_loss(ctx, params, step):
        seen.append((step.lr, step.server_state, step.client_state))
        logits, stats = step.forward(params, step.batch.x)
        return 0.0 * jnp.sum(logits), fp.LossAux(loss=jnp.zeros(()), batch_stats=stats)

    def correct(ctx, grads, step):
        return jax.tree.map(lambda g, c_i, c: g - c_i + c, grads, step.client_state, step.server_state)

    def plan(ctx, view):  # the output layer frozen: transform_grads must not move it
        layers = jnp.ones((view.cohort.valid.shape[0], ctx.structure.num_layers), bool).at[:, -1].set(False)
        return fp.ClientPlan(train=masks.from_layers(ctx.structure, layers))

    return fp.make_method("cv", init=init, plan=plan, objective=zero_loss, transform_grads=correct)


@AT_O0
@pytest.mark.parametrize("strategy", [fp.fused(), fp.stepwise(1), DEBUG], ids=str)
def test_local_steps_see_server_state_client_rows_and_rate_and_transform_the_gradient(mlp, strategy):
    """A zero loss leaves only the correction: plain SGD (no momentum) at rate 0.1 for 2 steps moves every
    trainable element by exactly −2 · 0.1 · 0.5, and the frozen output layer not at all."""
    seen: list = []
    rnd = fp.FederatedRound(mlp, control_variate_method(seen), num_clients=N, cohort_size=K,
                            client_optimizer=fp.client_sgd(0.1), strategy=strategy)
    state = rnd.init(jax.random.key(0))
    before = jax.device_get(state.variables["params"])
    new, _ = rnd(state, make_cohort((4,), k=K, steps=2), jax.random.key(1))
    after = jax.device_get(new.variables["params"])
    lr, server, rows = seen[-1]
    if strategy.kind == "debug":  # values, not tracers
        assert np.allclose(np.asarray(lr), 0.1) and np.allclose(jax.tree.leaves(server)[0], 0.5)
    assert jax.tree.structure(rows) == jax.tree.structure(server)  # the client's own rows
    assert [np.shape(a) for a in jax.tree.leaves(rows)] == [np.shape(a) for a in jax.tree.leaves(before)]
    for name in (n for n in before if "kernel" in before[n]):
        moved = after[name]["kernel"] - before[name]["kernel"]
        expected = 0.0 if name == "head" else -2 * 0.1 * 0.5
        np.testing.assert_allclose(moved, expected, atol=1e-6, err_msg=name)


@pytest.mark.xdist_group("debug_strategy")
def test_rate_is_unknown_with_a_plain_optax_transformation_and_known_with_client_sgd(mlp):
    seen: list = []
    method = fp.make_method("rates", select=lambda ctx, view: seen.append(view.client_lr) or fp.upload_trained(ctx,
                                                                                                             view))
    cohort = make_cohort((4,), k=K, steps=1)
    for optimizer in (optax.sgd(0.1), fp.client_sgd(0.1)):
        rnd = fp.FederatedRound(mlp, method, num_clients=N, cohort_size=K, client_optimizer=optimizer,
                                strategy=fp.debug())
        rnd(rnd.init(jax.random.key(0)), cohort, jax.random.key(1))
    assert seen[0] is None
    np.testing.assert_allclose(seen[1], np.full(K, 0.1, np.float32))
    # replicas: a round built at rate 1 whose cohort carries each client's rate
    rnd = fp.FederatedRound(mlp, method, num_clients=N, cohort_size=K, client_optimizer=fp.client_sgd(1.0),
                            strategy=fp.debug())
    scaled = cohort._replace(info=cohort.info._replace(lr_scale=np.full(K, 0.05, np.float32)))
    rnd(rnd.init(jax.random.key(0)), scaled, jax.random.key(1))
    np.testing.assert_allclose(seen[2], np.full(K, 0.05, np.float32))


def test_client_sgd_is_optax_sgd_bit_for_bit(mlp):
    """The rate applied once, after a rate-1 direction, trains exactly as optax's own SGD."""
    cohort = make_cohort((4,), k=K, steps=3)
    results = []
    for optimizer in (optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.05, momentum=0.9)),
                      fp.client_sgd(0.05, momentum=0.9, weight_decay=1e-3)):
        rnd = fp.FederatedRound(mlp, fp.methods.fedavg(), num_clients=N, cohort_size=K, client_optimizer=optimizer,
                                strategy=fused())
        new, _ = rnd(rnd.init(jax.random.key(0)), cohort, jax.random.key(1))
        results.append(jax.device_get(new.variables))
    jax.tree.map(np.testing.assert_array_equal, *results)
