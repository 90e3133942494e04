"""Faults (issue 13): a non-finite client is left out; a diverged round is rejected and stops the run."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.cli.main import main
from fedpartial._src.core.errors import DivergedError, UserError
from fedpartial._src.data.sources import ArrayDataset
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods import base
from tests.conftest import make_cohort

N, K = 4, 3
KEY = jax.random.key(0)
STRATEGIES = {"fused": fused(), "stepwise": stepwise(1)}


def counting():
    """FedAvg that counts, per client, the rounds it took part in (through ``scatter_clients``) and
    reports every client's trained params and the validity the hooks after training see."""

    def init(ctx, view):
        return base.MethodState(clients=jnp.zeros((ctx.num_clients,), jnp.int32))

    def update(ctx, view):
        clients = base.scatter_clients(view.method_state.clients, view.cohort.client_ids, view.client_state + 1,
                                       view.cohort.valid)
        return base.MethodState(clients=clients)

    def metrics(ctx, view):
        return {"trained": view.trained_vars["params"], "seen_valid": view.cohort.valid}

    return base.make_method("counting", init=init, update=update, metrics=metrics)


def build(model, strategy, server=None):
    return FederatedRound(model, counting(), num_clients=N, cohort_size=K, client_optimizer=optax.sgd(0.1),
                          server_optimizer=server, strategy=strategy)


def cohort(poisoned=(), valid=(True,) * K):
    c = make_cohort((4,), k=K, steps=2, batch=4, seed=1, real_examples=[4, 2, 3])
    x = c.data.x.copy()
    for k in poisoned:
        x[k, 0, 0, 0] = np.nan  # one input of one real example
    return c._replace(data=c.data._replace(x=x), info=c.info._replace(valid=np.asarray(valid)))


def one_round(model, strategy, c, server=None):
    r = build(model, strategy, server)
    state = r.init(KEY)
    before = jax.device_get(state)  # the fused round donates ``state``
    after, metrics = r(state, c, jax.random.key(1))
    return before, jax.device_get(after), jax.device_get(metrics)


# The module fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which
# builds it once.
pytestmark = pytest.mark.xdist_group("faults")
# Rounds of a few tiny steps checked for what they flag and keep: compiled at -O0 (tests/conftest.py says why that
# changes nothing there); not the test that compares its round with the shared runs, built at -O1 before any
# test's fixture
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def poisoned_runs(mlp):
    return {name: one_round(mlp, s, cohort(poisoned=[1])) for name, s in STRATEGIES.items()}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_nonfinite_client_is_left_out_of_aggregation(poisoned_runs, name):
    before, after, m = poisoned_runs[name]
    assert int(m["nonfinite_clients"]) == 1 and not bool(m["diverged"])
    assert np.isnan(m["client_loss"][1]) and np.isfinite(m["client_loss"][[0, 2]]).all()
    np.testing.assert_allclose(m["train_loss"], (m["client_loss"][0] + m["client_loss"][2]) / 2, rtol=1e-6)
    np.testing.assert_array_equal(m["seen_valid"], [True, False, True])  # select/update/metrics see it as padding
    # Its trained params are its start (the global model): nothing non-finite reaches a hook.
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[1], m["trained"]), before.variables["params"])
    # FedAvg over the two others, by hand: (n0 θ0 + n2 θ2) / (n0 + n2) with n = 4 and 3 real examples × 2 steps.
    n0, n2 = 8.0, 6.0
    expected = jax.tree.map(lambda t: (n0 * t[0] + n2 * t[2]) / (n0 + n2), m["trained"])
    chex.assert_trees_all_close(after.variables["params"], expected, rtol=1e-6, atol=1e-7)
    chex.assert_tree_all_finite(after)
    assert int(after.round) == 1  # the run goes on
    # Its per-client state row is untouched; the others counted the round.
    np.testing.assert_array_equal(after.method_state.clients, [1, 0, 1, 0])
    # It downloaded and trained, but uploaded nothing.
    assert m["upload_bytes_per_layer"][1].sum() == 0 and m["upload_bytes_per_layer"][0].sum() > 0
    assert m["download_bytes_per_layer"][1].sum() == m["download_bytes_per_layer"][0].sum() > 0
    assert m["client_steps_per_client"][1] == 2


def test_a_nonfinite_client_is_treated_as_padding_and_strategies_agree(mlp, poisoned_runs):
    _, padded, _ = one_round(mlp, stepwise(1), cohort(valid=(True, False, True)))
    for name, (_, after, _) in poisoned_runs.items():
        chex.assert_trees_all_close(after.variables, padded.variables, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(poisoned_runs["fused"][1], poisoned_runs["stepwise"][1], rtol=1e-5, atol=1e-6)


@AT_O0
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_client_nonfinite_flags_the_round_and_changes_no_model(mlp, name):
    before, after, m = one_round(mlp, STRATEGIES[name], cohort(poisoned=[0, 1, 2]))
    assert bool(m["diverged"]) and int(m["nonfinite_clients"]) == K
    chex.assert_trees_all_equal(after.variables, before.variables)  # nobody uploaded: the global model stays
    chex.assert_trees_all_equal(after.method_state, before.method_state)  # every client was padding


@AT_O0
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_nonfinite_global_model_flags_the_round(mlp, name):
    _, after, m = one_round(mlp, STRATEGIES[name], cohort(), server=optax.sgd(float("inf")))
    assert bool(m["diverged"]) and int(m["nonfinite_clients"]) == 0
    assert not all(np.all(np.isfinite(a)) for a in jax.tree.leaves(after.variables))


# ---- Simulation: records, DivergedError (the run's last good checkpoint is kept: tests/experiment/test_checkpoint.py)

TINY = dict(method="fedavg", partition="iid", num_clients=4, cohort_size=4, rounds=2, local_steps=1,
            local_epochs=None, batch_size=16, out_dir=None, strategy="stepwise")


def dataset(nan_rows=()):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    x[list(nan_rows)] = np.nan
    y = rng.integers(0, 3, 40).astype(np.int32)
    return ArrayDataset("tiny", x, y, np.ones((8, 4), np.float32), y[:8], 3)


@AT_O0
def test_simulation_counts_a_nonfinite_client_and_goes_on(mlp):
    records = list(Simulation(RunConfig(**TINY), dataset([5]), model=mlp).rounds())
    assert [r["nonfinite_clients"] for r in records] == [1, 1]  # every client takes part in every round
    assert np.isfinite(records[-1]["train_loss"]) and np.isfinite(records[-1]["test_loss"])


@AT_O0
def test_simulation_stops_when_every_client_is_nonfinite(mlp):
    sim = Simulation(RunConfig(**TINY), dataset(range(40)), model=mlp)
    first = jax.device_get(sim.state)
    with pytest.raises(DivergedError, match=r"^round 1: every client's update was non-finite") as info:
        next(sim.rounds())
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
    chex.assert_trees_all_equal(jax.device_get(sim.state.variables), first.variables)  # nobody uploaded


@AT_O0
def test_simulation_stops_when_the_global_model_is_nonfinite(mlp):
    sim = Simulation(RunConfig(**TINY), dataset(), model=mlp, server_optimizer=optax.sgd(float("inf")))
    first = jax.device_get(sim.state)
    with pytest.raises(DivergedError, match=r"^round 1: the global model became non-finite"):
        next(sim.rounds())
    assert sim.progress["round"] == 0  # the diverged round is not counted (nor checkpointed by run())
    del first


@AT_O0
def test_cli_exits_non_zero_with_one_sentence_on_divergence(tmp_path, capsys):
    # lr 1e30 keeps round 1 finite (the loss is taken before the step) and blows every client up in round 2.
    status = main(["run", "--dataset", "synthetic", "--lr", "1e30", "--clients", "4", "--cohort", "2",
                   "--rounds", "2", "--local-steps", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the line after the progress bar
    assert status != 0  # 1 today: the CLI maps DivergedError (a UserError) to "diverged", exit 1
    assert re.fullmatch(r"fedpartial: \w+: round 2: every client's update was non-finite .*", err), err
