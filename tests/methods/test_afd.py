"""AFD (adaptive federated dropout): sub-models drawn from an activation score map judged by the loss."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import stepwise
from fedpartial._src.methods.base import ClientPlan, CohortInfo, InitView, MethodContext, RoundView
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.submodel.afd import ScoreMap, afd, empty_map, weighted_draw
from fedpartial._src.methods.submodel.common import neuron_mask
from tests.conftest import make_cohort

N, K = 6, 3
IDS = [1, 4, 5]
KEY = jax.random.key(3)
# TinyMLP units (6, 5, 3).  At rate 0.25 a layer keeps max(1, round(0.75·u)), halves up: fc1 4.5 → 5, fc2 3.75 → 4.
COUNTS = {0.25: (5, 4, 3), 0.5: (3, 3, 3), 0.0: (6, 5, 3), 0.9: (1, 1, 3)}


def cohort(seed=0, ids=IDS):
    return make_cohort((4,), k=K, steps=2, batch=4, seed=seed, client_ids=ids)


def build(mlp, method, record=False):
    return FederatedRound(mlp, method, num_clients=N, cohort_size=K, client_optimizer=optax.sgd(0.1),
                          strategy=stepwise(1), record_decisions=record)


def ctx_of(mlp):
    return MethodContext(model=mlp, num_clients=N, cohort_size=K)


def bools(*rows):
    return tuple(jnp.asarray(r, bool) for r in rows)


# ---- the sub-model's size ----------------------------------------------------------------------


def plan_of(mlp, method, method_state, key=KEY, ids=IDS):
    """The method's plan for the cohort ``ids`` (only the key, the ids and the state are read); run
    eagerly, as tiny arrays dispatch faster than a compilation."""
    info = CohortInfo(client_ids=jnp.asarray(ids, jnp.int32), num_samples=jnp.ones((K,)), valid=jnp.ones((K,), bool))
    rows = jax.tree.map(lambda a: a[info.client_ids], method_state.clients)
    view = RoundView(key=key, round=jnp.zeros((), jnp.int32), global_vars={}, method_state=method_state,
                     client_state=rows, cohort=info, data=None)
    return jax.device_get(method.plan(ctx_of(mlp), view))


def initial(mlp, method):
    return method.init(ctx_of(mlp), InitView(global_vars={}, key=KEY))


@pytest.mark.parametrize("variant, rates", [("single", sorted(COUNTS)), ("multi", [0.25])])
def test_rate_is_respected_per_layer(mlp, variant, rates):
    for rate in rates:
        counts = COUNTS[rate]
        m = afd(dropout_rate=rate, variant=variant)
        plan = plan_of(mlp, m, initial(mlp, m))
        for layer, want in enumerate(counts):
            np.testing.assert_array_equal(np.asarray(plan.dropout.neurons[layer]).sum(axis=1), [want] * K)
        assert np.asarray(plan.dropout.neurons[-1]).all()  # the classifier keeps every output
        for a, b in zip(jax.tree.leaves(plan.download), jax.tree.leaves(plan.dropout)):
            np.testing.assert_array_equal(a, b)  # each client receives exactly its sub-model
        same = all((np.asarray(n) == np.asarray(n)[:1]).all() for n in plan.dropout.neurons)
        # Single-model AFD: one sub-model for the whole cohort; multi-model: each client draws its own.
        assert same == (variant == "single" or rate == 0.0), rate


def test_bad_options_are_refused():
    for rate in (1.0, -0.1, "0.2", True):
        with pytest.raises(UserError, match="afd: --afd-rate = .* must be a number in \\[0, 1\\)"):
            afd(dropout_rate=rate)  # a direct call is checked by the option, as get_method is
    with pytest.raises(UserError, match="--afd-variant = 'both' must be one of single, multi"):
        afd(variant="both")
    with pytest.raises(UserError, match="--afd-rate"):
        get_method("afd", dropout_rate=1.0)
    assert get_method("afd", dropout_rate=0.5, variant="multi").name == "afd"


# ---- weighted random selection -----------------------------------------------------------------


def draws(scores, count, n=2000, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    scores = jnp.broadcast_to(jnp.asarray(scores, jnp.float32), (n, len(scores)))
    return np.asarray(jax.jit(weighted_draw)(keys, scores, jnp.full((n,), count, jnp.int32)))


def test_draw_is_proportional_to_the_scores():
    got = draws([0.6, 0.0, 0.3, 0.1, 0.0], 1)
    assert (got.sum(axis=1) == 1).all()
    np.testing.assert_allclose(got.mean(axis=0), [0.6, 0.0, 0.3, 0.1, 0.0], atol=0.04)
    # Two of three without replacement: P(unit 0 and 1 kept) = .6·.3/.4 + .3·.6/.7 = 0.7071… (Plackett–Luce).
    got = draws([0.6, 0.3, 0.1], 2)
    np.testing.assert_allclose((got[:, 0] & got[:, 1]).mean(), 0.6 * 0.3 / 0.4 + 0.3 * 0.6 / 0.7, atol=0.04)


def test_positive_scores_come_before_zero_scores():
    # As many positive scores as kept units: exactly those, whatever the key (even a tiny score).
    got = draws([0.0, 1e-30, 0.0, 0.5, 0.0, 0.2], 3, n=500)
    assert (got == [False, True, False, True, False, True]).all()
    # Fewer: every positive unit, the rest uniformly among the zero-score units.
    got = draws([0.0, 0.0, 0.7, 0.0, 0.0], 3)
    assert got[:, 2].all()
    np.testing.assert_allclose(got.mean(axis=0)[[0, 1, 3, 4]], 0.5, atol=0.04)


def test_all_zero_scores_draw_uniformly():
    got = draws([0.0] * 6, 2)
    assert (got.sum(axis=1) == 2).all()
    np.testing.assert_allclose(got.mean(axis=0), 2 / 6, atol=0.04)


# ---- the score map's update, by hand -----------------------------------------------------------


def view_for(mlp, method_state, client_state, used, losses, valid=(True, True, False), ids=IDS):
    """``update``'s view: every cohort client trained the sub-model ``used`` (fc1, fc2 rows, one per client)."""
    fc1, fc2 = (jnp.asarray(np.broadcast_to(np.asarray(u, bool), (K, len(u))) if np.ndim(u) == 1 else u, bool)
                for u in used)
    plan = ClientPlan(dropout=neuron_mask(mlp.structure, (fc1, fc2, jnp.ones((K, 3), bool))))
    info = CohortInfo(client_ids=jnp.asarray(ids, jnp.int32), num_samples=jnp.ones((K,)), valid=jnp.asarray(valid))
    return RoundView(key=KEY, round=jnp.zeros((), jnp.int32), global_vars={}, method_state=method_state,
                     client_state=client_state, cohort=info, data=None, plan=plan,
                     client_loss=jnp.asarray(losses, jnp.float32))


def test_single_model_scores_over_rounds_by_hand(mlp):
    ctx, m = ctx_of(mlp), afd()
    state = m.init(ctx, InitView(global_vars={}, key=KEY))
    # Round 1 (no previous loss): nothing is judged; ℓ = mean over the real clients (the padding's 9 is ignored).
    used1 = ([1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0])
    state = m.update(ctx, view_for(mlp, state, (), used1, [2.0, 1.0, 9.0]))
    s = state.server
    assert float(s.loss) == 1.5 and bool(s.has_loss) and not bool(s.keep)
    for scores in s.scores:
        assert not np.asarray(scores).any()
    np.testing.assert_array_equal(s.neurons[0], used1[0])
    # Round 2: ℓ = 1.2 < 1.5, the units kept get (1.5 − 1.2) / 1.5 = 0.2 and the sub-model is kept.
    used2 = ([0, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1])
    state = m.update(ctx, view_for(mlp, state, (), used2, [1.0, 1.4, 100.0]))
    s = state.server
    np.testing.assert_allclose(s.scores[0], [0, 0.2, 0.2, 0.2, 0.2, 0.2], rtol=1e-6)
    np.testing.assert_allclose(s.scores[1], [0.2, 0, 0.2, 0.2, 0.2], rtol=1e-6)
    np.testing.assert_allclose(s.loss, 1.2, rtol=1e-6)
    assert bool(s.keep)
    # Round 3 (the same sub-model): ℓ = 1.4 > 1.2, nothing is rewarded, the sub-model will be redrawn.
    state = m.update(ctx, view_for(mlp, state, (), used2, [1.3, 1.5, 0.0]))
    s = state.server
    np.testing.assert_allclose(s.scores[0], [0, 0.2, 0.2, 0.2, 0.2, 0.2], rtol=1e-6)
    np.testing.assert_allclose(s.loss, 1.4, rtol=1e-6)
    assert not bool(s.keep)
    # Round 4: ℓ = 0.7, half of 1.4: the kept units' scores become 0.5 (replaced, not added); the others stay.
    used4 = ([1, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1])
    state = m.update(ctx, view_for(mlp, state, (), used4, [0.6, 0.8, 5.0]))
    np.testing.assert_allclose(state.server.scores[0], [0.5, 0.5, 0.2, 0.2, 0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(state.server.scores[1], [0.2, 0, 0.5, 0.5, 0.5], rtol=1e-6)
    assert bool(state.server.keep)


def test_multi_model_judges_each_client_by_its_own_loss(mlp):
    ctx, m = ctx_of(mlp), afd(variant="multi")
    state = m.init(ctx, InitView(global_vars={}, key=KEY))
    gather = lambda st, ids: jax.tree.map(lambda a: a[jnp.asarray(ids)], st.clients)  # noqa: E731
    fc1 = np.array([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 1]], bool)
    fc2 = np.array([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [1, 1, 0, 1, 1]], bool)
    # Round 1: clients 1, 4, 5 (5 is padding: nothing of it is written).
    state = m.update(ctx, view_for(mlp, state, gather(state, IDS), (fc1, fc2), [2.0, 1.0, 3.0], ids=IDS))
    c = state.clients
    np.testing.assert_array_equal(c.has_loss, [0, 1, 0, 0, 1, 0])
    np.testing.assert_allclose(c.loss, [0, 2.0, 0, 0, 1.0, 0])
    np.testing.assert_array_equal(c.neurons[0][1], fc1[0])
    assert not np.asarray(c.keep).any() and not any(np.asarray(s).any() for s in c.scores)
    # Round 2: clients 4 (1.0 → 0.8: rewarded 0.2), 0 (first time: not judged), 1 (2.0 → 2.5: not rewarded).
    ids = [4, 0, 1]
    state = m.update(ctx, view_for(mlp, state, gather(state, ids), (fc1, fc2), [0.8, 0.1, 2.5], (True,) * 3, ids))
    c = state.clients
    np.testing.assert_array_equal(c.keep, [0, 0, 0, 0, 1, 0])
    np.testing.assert_allclose(c.scores[0][4], 0.2 * fc1[0], rtol=1e-6)
    np.testing.assert_allclose(c.scores[1][4], 0.2 * fc2[0], rtol=1e-6)
    for client in (0, 1, 2, 3, 5):
        assert not np.asarray(c.scores[0][client]).any()
    np.testing.assert_allclose(c.loss, [0.1, 2.5, 0, 0, 0.8, 0], rtol=1e-6)
    np.testing.assert_array_equal(c.neurons[0][1], fc1[2])  # client 1 trained the third row's sub-model


# ---- the plan follows the score map ------------------------------------------------------------


def designed(method_state, scores, neurons, keep, multi=False):
    smap = ScoreMap(scores=tuple(jnp.asarray(s, jnp.float32) for s in scores), neurons=bools(*neurons),
                    loss=jnp.float32(1.0), has_loss=jnp.bool_(True), keep=jnp.bool_(keep))
    if multi:
        return method_state._replace(clients=jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), smap))
    return method_state._replace(server=smap)


@pytest.mark.parametrize("variant", ["single", "multi"])
def test_the_plan_follows_the_scores(mlp, variant):
    m = afd(variant=variant)
    state, multi = initial(mlp, m), variant == "multi"
    # Exactly 5 fc1 and 4 fc2 units have a positive score: a redraw keeps exactly those, for any key.
    scores = ([0.1, 0.3, 0.0, 0.2, 0.9, 1e-3], [0.5, 0.5, 0.0, 0.1, 0.2], [0.0] * 3)
    stored = ([1, 1, 1, 0, 1, 1], [1, 0, 1, 1, 1], [1, 1, 1])
    for t in range(3):
        plan = plan_of(mlp, m, designed(state, scores, stored, False, multi), jax.random.fold_in(KEY, t))
        np.testing.assert_array_equal(plan.dropout.neurons[0], np.broadcast_to([1, 1, 0, 1, 1, 1], (K, 6)))
        np.testing.assert_array_equal(plan.dropout.neurons[1], np.broadcast_to([1, 1, 0, 1, 1], (K, 5)))
    # A good sub-model is sent again as it is, whatever the scores say.
    plan = plan_of(mlp, m, designed(state, scores, stored, True, multi))
    for layer, want in enumerate(stored):
        np.testing.assert_array_equal(plan.dropout.neurons[layer], np.broadcast_to(want, (K, len(want))))


# ---- whole rounds ------------------------------------------------------------------------------


def run(r, rounds, seed=0):
    state, out = r.init(KEY), []
    for t in range(rounds):
        c = cohort(seed)  # the same clients and data each round: the loss mostly falls
        key = jax.random.fold_in(KEY, t)
        before = jax.device_get(state)  # the round donates its input state
        state, metrics = r(state, c, key)
        metrics = jax.device_get(metrics)
        out.append((before, metrics["decisions"]["plan"], metrics, jax.device_get(state)))
    return out


# The module fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which
# builds it once.
# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = [pytest.mark.xdist_group("afd"), pytest.mark.usefixtures("engine_compiled_at_o0")]


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def single_round(mlp):
    return build(mlp, afd(), record=True)


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def single_rounds(single_round):
    return run(single_round, 4)


def test_rounds_update_the_map_as_described(single_rounds):
    rewarded = 0
    for t, (before, plan, metrics, after) in enumerate(single_rounds):
        prev, s = before.method_state.server, after.method_state.server
        loss = np.mean(metrics["client_loss"])
        np.testing.assert_allclose(s.loss, loss, rtol=1e-6)
        np.testing.assert_allclose(s.loss, metrics["train_loss"], rtol=1e-6)
        improved = t > 0 and loss < prev.loss
        assert bool(s.keep) == improved
        np.testing.assert_array_equal(metrics["afd_submodel_reused"], [bool(prev.keep)] * K)
        for layer in range(3):
            used = np.asarray(plan.dropout.neurons[layer][0])
            np.testing.assert_array_equal(s.neurons[layer], used)
            want = (np.where(used, (prev.loss - loss) / prev.loss, prev.scores[layer]) if improved
                    else prev.scores[layer])
            np.testing.assert_allclose(s.scores[layer], want, rtol=1e-5)
            if bool(prev.keep):  # a good sub-model was sent again
                np.testing.assert_array_equal(used, prev.neurons[layer])
        rewarded += improved
    assert rewarded >= 2  # the loss fell at least twice, so the map was really exercised


def test_dropped_units_are_not_uploaded_and_keep_their_global_value(mlp, single_rounds):
    structure = mlp.structure
    for before, plan, metrics, after in single_rounds:
        sel = metrics["decisions"]["selection"]
        for a, b in zip(jax.tree.leaves(sel.upload), jax.tree.leaves(plan.dropout)):
            np.testing.assert_array_equal(a, b)
        kept = masks.expand_variables(structure, jax.tree.map(lambda a: a[0], plan.dropout), before.variables)
        moved = 0
        for old, new, on in zip(jax.tree.leaves(before.variables), jax.tree.leaves(after.variables),
                                jax.tree.leaves(kept)):
            on = np.broadcast_to(on, old.shape)
            np.testing.assert_array_equal(new[~on], old[~on])
            moved += int((new[on] != old[on]).sum())
        assert moved > 0
        # Traffic by hand: fc1 keeps 5, fc2 4 → 4·5+5 + 2·5 (BN) + 2·5 (stats) + 5·4+4 + 4·3+3 = 84 floats;
        # down: + 1 + 1 index bytes (bit-masks of 6 and 5 units); up: + 4 bytes of loss.
        totals = traffic_totals(metrics)
        np.testing.assert_array_equal(totals["download_bytes_per_client"], [4 * 84 + 2] * K)
        np.testing.assert_array_equal(totals["upload_bytes_per_client"], [4 * 84 + 4] * K)


def test_the_same_seed_gives_the_same_run(mlp, single_round, single_rounds):
    again = run(single_round, 4)
    for (_, p1, _, s1), (_, p2, _, s2) in zip(single_rounds, again):
        chex.assert_trees_all_equal(p1.dropout, p2.dropout)
        chex.assert_trees_all_equal(s1, s2)
    # Another key draws another first sub-model.
    state = initial(mlp, afd())
    plans = [plan_of(mlp, afd(), state, jax.random.key(s)).dropout.neurons[:2] for s in range(4)]
    assert any(not all(np.array_equal(a, b) for a, b in zip(plans[0], p)) for p in plans[1:])


def test_multi_model_rounds_leave_other_clients_alone(mlp):
    rounds = run(build(mlp, afd(variant="multi"), record=True), 2)
    outside = np.setdiff1d(np.arange(N), IDS)
    for before, plan, metrics, after in rounds:
        chex.assert_trees_all_equal(jax.tree.map(lambda a: a[outside], after.method_state.clients),
                                    jax.tree.map(lambda a: a[outside], before.method_state.clients))
        c = jax.tree.map(lambda a: a[np.asarray(IDS)], after.method_state.clients)
        np.testing.assert_allclose(c.loss, metrics["client_loss"], rtol=1e-6)
        for layer in range(3):
            np.testing.assert_array_equal(c.neurons[layer], plan.dropout.neurons[layer])
    # Round 2 judged every client against its own round-1 loss.
    (_, _, m1, _), (_, _, m2, after) = rounds
    np.testing.assert_array_equal(after.method_state.clients.keep[np.asarray(IDS)],
                                  m2["client_loss"] < m1["client_loss"])


def test_empty_map_shapes(mlp):
    smap = empty_map(ctx_of(mlp), (N,))
    assert [s.shape for s in smap.scores] == [(N, 6), (N, 5), (N, 3)]
    assert smap.loss.shape == smap.keep.shape == (N,)


def test_command_line_flags():
    from fedpartial._src.cli.main import build_parser, config_from_args

    parser = build_parser()
    args = parser.parse_args(["run", "--method", "afd", "--afd-rate", "0.4", "--afd-variant", "multi"])
    assert config_from_args(args).options == {"dropout_rate": 0.4, "variant": "multi"}
    helped = build_parser(["run", "--method", "afd", "--help"])  # --help shows the named method's options
    text = helped.command("run").format_help()
    assert "--afd-rate" in text and "--afd-variant" in text
