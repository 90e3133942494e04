"""FedAD and FedDHAD: rates against each device's budget, the schedule, sub-model masks (per round and per
step), dropout-aware aggregation by hand on 3 clients, reductions to FedAvg / FedDH, the Hessian rate, and
the device model's FLOPs of the kept units."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpartial._src.core import masks
from fedpartial._src.core.losses import model_loss
from fedpartial._src.core.types import InitView, MethodContext, RoundView, client_sgd
from fedpartial._src.costs import devices
from fedpartial._src.costs import footprint as costs
from fedpartial._src.data.sources import ArrayDataset
from fedpartial._src.engine.client import make_client_fns, trainable_mask
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.engine.types import hook_keys
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.adaptive import hessian, importance
from fedpartial._src.methods.adaptive.fedad import AdaptiveState, fedad, feddhad
from fedpartial._src.methods.adaptive.rates import device_targets, sample_units, unit_rates, unit_shares
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.weighting.feddh import feddh
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")
OPT = optax.sgd(0.1, momentum=0.9)
KEY = jax.random.key(0)
N, K = 6, 3
IDS = np.array([1, 3, 4], np.int32)


def build(model, method, *, times=None, counts=None, strategy=None):
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=OPT,
                          strategy=strategy or fused(), record_decisions=True,
                          label_counts=counts, execution_times=times)


def cohort(seed=0, ids=IDS):
    return make_cohort((4,), k=K, steps=2, batch=4, seed=seed, real_examples=[4, 2, 3], client_ids=ids)


def with_rates(state, target, shares_value=1.0, fedad_part=lambda s: s, put=None):
    """The state with every hidden unit's share set to ``shares_value`` and the targets ``d*``."""
    s = fedad_part(state.method_state.server)
    s = s._replace(shares=tuple(jnp.full_like(x, shares_value) for x in s.shares[:-1]) + (s.shares[-1],),
                   target=jnp.asarray(target, jnp.float32))
    server = s if put is None else put(state.method_state.server, s)
    return state._replace(method_state=state.method_state._replace(server=server))


# ---- rates --------------------------------------------------------------------------------------


def test_unit_shares_sum_per_kind_and_favour_unimportant_units():
    scores = (jnp.array([1.0, 3.0]), jnp.array([2.0, 2.0, 0.0]), jnp.array([0.5, -0.5]), jnp.array([9.0, 9.0]))
    kinds = ("conv", "conv", "dense", "dense")
    shares = unit_shares(kinds, scores)
    conv = np.concatenate([shares[0], shares[1]])
    np.testing.assert_allclose(conv.sum(), 5.0, rtol=1e-6)  # softmax over all 5 conv filters × 5
    scores = -np.array([1, 3, 2, 2, 0.0])
    np.testing.assert_allclose(conv, 5 * np.exp(scores) / np.exp(scores).sum(), rtol=1e-6)
    np.testing.assert_allclose(shares[2], 2 * np.exp([-0.5, 0.5]) / np.exp([-0.5, 0.5]).sum(), rtol=1e-6)
    np.testing.assert_array_equal(shares[3], 0.0)  # the classifier is never dropped


def test_rates_respect_each_devices_budget():
    shares = unit_shares(("conv", "dense", "dense"), (jnp.array([1.0, 2.0, 3.0]), jnp.array([0.1, 0.2]),
                                                      jnp.zeros(2)))
    target = jnp.array([0.0, 0.1, 0.3])
    rates = unit_rates(shares, target, max_rate=0.9)
    for layer, n in ((0, 3), (1, 2)):  # unclipped: Σ_i d_k^i = N_kind · d*_k
        np.testing.assert_allclose(rates[layer].sum(-1), n * np.asarray(target), rtol=1e-6)
    np.testing.assert_array_equal(rates[2], 0.0)
    clipped = unit_rates(shares, jnp.array([0.8]), max_rate=0.9)
    assert float(jnp.max(clipped[0])) == pytest.approx(0.9) and float(jnp.max(clipped[0])) < 1
    assert float(clipped[0].sum()) < 3 * 0.8  # clipping only removes rate


def test_masks_follow_the_rates_and_scale_kept_units():
    rates = (jnp.tile(jnp.array([[0.0, 0.5, 0.9, 0.25]]), (4000, 1)), jnp.zeros((4000, 2)))
    kept, scales = sample_units(KEY, rates, jnp.arange(4000))
    np.testing.assert_allclose(np.mean(kept[0], 0), [1.0, 0.5, 0.1, 0.75], atol=0.03)
    np.testing.assert_allclose(np.where(kept[0], scales[0], 0)[kept[0][:, 1], 1], 2.0)  # 1 / (1 − 0.5)
    assert np.all(np.asarray(scales[0])[~np.asarray(kept[0])] == 0)
    # A layer never loses every unit; a client's draw depends on its id only.
    all_drop = (jnp.full((5, 3), 0.999999),)
    assert np.all(np.asarray(sample_units(KEY, all_drop, jnp.arange(5))[0][0]).sum(-1) >= 1)
    a = sample_units(KEY, (rates[0][:3],), jnp.array([7, 8, 9]))[0][0]
    b = sample_units(KEY, (rates[0][:2],), jnp.array([9, 7]))[0][0]
    np.testing.assert_array_equal(a[2], b[0])


# ---- the schedule (importance scripted) -----------------------------------------------------------


def test_device_targets_by_hand_for_both_readings():
    """A slow device (ET 8), the reference (ET 4) and a fast one (ET 1) at d_avg = 0.3, capped at 0.5."""
    times, ref, d_avg = jnp.array([8.0, 4.0, 1.0]), jnp.asarray(4.0), jnp.asarray(0.3)
    # time-matched: 8·(1 − d) = 4·0.7 → d = 0.65, capped to 0.5; the reference keeps d_avg; 1 − 4·0.7/1 < 0 → 0
    np.testing.assert_allclose(device_targets("time-matched", d_avg, times, ref, 0.5), [0.5, 0.3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(device_targets("time-matched", d_avg, times, ref, 0.9), [0.65, 0.3, 0.0], rtol=1e-6)
    # literal: min(4·0.3 / ET, 1): the slow device drops least, the fast one most
    np.testing.assert_allclose(device_targets("literal", d_avg, times, ref, 0.5), [0.15, 0.3, 1.0], rtol=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.05, 50.0), min_size=1, max_size=8), st.floats(0.05, 50.0), st.floats(0.0, 0.95),
       st.floats(0.05, 0.95))
def test_time_matched_targets_never_leave_a_device_slower_than_the_cap_allows(times, ref, d_avg, max_rate):
    """Under time-matched, a device's expected compute time at its target, ET_k·(1 − d*_k), is at most the
    reference's at d_avg, ET_ref·(1 − d_avg) — except where the cap binds, and then at most ET_k·(1 − max_rate);
    a device never drops more than it must, nor more than the cap."""
    d_avg = min(d_avg, max_rate)
    t = np.asarray(times, np.float32)
    d = np.asarray(device_targets("time-matched", jnp.float32(d_avg), jnp.asarray(t), jnp.float32(ref), max_rate))
    assert np.all((d >= 0) & (d <= max_rate + 1e-6))
    budget = ref * (1 - d_avg)
    time = t * (1 - d)
    capped = np.isclose(d, max_rate, atol=1e-6)
    assert np.all(time[~capped] <= budget * (1 + 1e-5) + 1e-6)
    np.testing.assert_allclose(time[capped], t[capped] * (1 - max_rate), rtol=1e-5)
    # a device slower than the budget and under the cap meets it exactly; a faster one drops nothing
    np.testing.assert_allclose(time[(t > budget) & ~capped], budget, rtol=1e-4)
    assert np.all(d[t < budget * (1 - 1e-5)] == 0)


@pytest.mark.parametrize("target", ["literal", "time-matched"])
def test_schedule_and_device_targets(mlp, monkeypatch, target):
    """h = 1, C = 2: the rates are recomputed after the variation has not decreased for 2 rounds, then again
    whenever it decreases; the device targets from ET_ref, the biggest client's time, by either reading."""
    method = fedad(rate=0.3, measure_every=1, patience=2, target=target)
    ctx = MethodContext(model=mlp, num_clients=N, cohort_size=K)
    g = mlp.init_variables(KEY)
    times = np.array([1.0, 2.0, 4.0, 0.5, 8.0, 3.0])
    counts = np.ones((N, 3)) * np.array([[1], [1], [5], [1], [1], [1]])  # client 2 holds the most data
    state = method.init(ctx, InitView(global_vars=g, key=KEY, label_counts=counts, execution_times=times))
    assert float(state.server.reference_time) == 4.0

    line = tuple(jnp.ones((u,)) / np.sqrt(sum(mlp.structure.units)) for u in mlp.structure.units)
    script = [0.0, 3.0, 7.0, 12.0, 13.0, 15.0]  # R_t = c_t · e: Δ = 3, 4, 5, 1, 2
    expect_updates = [0, 0, 0, 1, 2, 2]  # no decrease for 2 rounds at t=3; a decrease after it at t=4
    c = cohort()
    for t, (ct, updates) in enumerate(zip(script, expect_updates)):
        monkeypatch.setattr(importance, "unit_importance", lambda model, v, x, m, ct=ct: tuple(ct * e for e in line))
        view = RoundView(key=KEY, round=jnp.asarray(t), global_vars=g, method_state=state, client_state=(),
                         cohort=c.info, data=c.data, trained_vars=jax.tree.map(lambda a: jnp.stack([a] * K), g),
                         start_vars=jax.tree.map(lambda a: jnp.stack([a] * K), g))
        state = method.update(ctx, view)
        s: AdaptiveState = state.server
        assert int(s.updates) == updates, t
        if t:
            np.testing.assert_allclose(float(s.variation), script[t] - script[t - 1], rtol=1e-5)
    expect = (np.minimum(4.0 * 0.3 / times, 1.0) if target == "literal"
              else np.clip(1 - 4.0 * 0.7 / times, 0.0, 0.5))  # default max_rate 0.5
    np.testing.assert_allclose(s.target, expect, rtol=1e-6)
    np.testing.assert_allclose(float(s.global_rate), 0.3)
    chex.assert_trees_all_close(s.shares, unit_shares(importance.importance_kinds(mlp), tuple(13.0 * e for e in line)))


# ---- a round with forced rates ----------------------------------------------------------------------


def trained_too(method):
    """The method with every client's trained variables added to its metrics (for hand computations)."""
    own = method.metrics
    return method._replace(metrics=lambda ctx, view: {**own(ctx, view), "trained": view.trained_vars})


@pytest.mark.parametrize("name", ["fedad", "feddhad"])
def test_dropout_aware_aggregation_by_hand(mlp, name):
    """3 clients, d*_k = 0.5: per element the weighted mean over the clients that kept it, else the global
    value (weights n_k for FedAD, FedDH's q_k for FedDHAD); dropped units are neither sent nor uploaded."""
    method = trained_too(fedad() if name == "fedad" else feddhad())
    counts = np.tile(np.array([[3.0, 1.0, 0.0]]), (N, 1))
    r = build(mlp, method, counts=counts)
    state = r.init(KEY)
    if name == "fedad":
        state = with_rates(state, np.full(N, 0.5))
    else:
        state = with_rates(state, np.full(N, 0.5), fedad_part=lambda s: s[0], put=lambda old, s: (s, old[1]))
    old = jax.device_get(state.variables)
    new, m = r(state, cohort(), jax.random.fold_in(KEY, 3))
    plan, sel = m["decisions"]["plan"], m["decisions"]["selection"]
    kept_units = np.concatenate([np.asarray(n) for n in plan.dropout.neurons[:-1]], axis=1)
    assert 0 < kept_units.mean() < 1  # some units dropped, some kept
    w = np.asarray(sel.weights, np.float64)
    if name == "fedad":
        np.testing.assert_allclose(w, np.asarray(cohort().info.num_samples))
    def expand(mask):  # [K] structured masks -> [K, ...] per element
        return jax.vmap(lambda mk: masks.expand_variables(mlp.structure, mk, old))(mask)

    upload, down = expand(sel.upload), expand(plan.download)
    chex.assert_trees_all_equal(upload, down)  # what a client receives is what it sends back
    trained, new_vars = m["trained"], jax.device_get(new.variables)
    leaves = lambda tree: jax.tree.leaves(tree)  # noqa: E731  (the same order in every tree)
    dropped_somewhere = 0
    is_params = {c: jax.tree.map(lambda _, c=c: c == "params", t) for c, t in old.items()}
    for g, th, up, got, is_param in zip(leaves(old), leaves(trained), leaves(upload), leaves(new_vars),
                                        leaves(is_params)):
        g, th, got = np.asarray(g, np.float64), np.asarray(th, np.float64), np.asarray(got, np.float64)
        km = np.broadcast_to(np.asarray(up), th.shape)  # [K, ...] elements each client uploaded
        ww = w.reshape((K,) + (1,) * g.ndim) * km
        den = ww.sum(0)
        expect = np.where(den > 0, (ww * th).sum(0) / np.maximum(den, 1e-30), g)
        np.testing.assert_allclose(got, expect, rtol=2e-5, atol=1e-6)
        # A dropped unit's parameters are not trained: each client's copy holds the global value (its
        # BatchNorm statistics may move — nothing reads them and they are not uploaded) ...
        if is_param:
            np.testing.assert_array_equal(np.where(km, 0, th), np.where(km, 0, np.broadcast_to(g, th.shape)))
        # ... and an element every client dropped keeps its global value bit for bit.
        np.testing.assert_array_equal(got[den == 0], g[den == 0])
        dropped_somewhere += int((den == 0).sum())
    assert dropped_somewhere > 0
    # The server chose the sub-models: it pays their index bytes, and sends only the kept units.
    full = masks.count_bytes(mlp.structure, masks.full(mlp.structure, (K,)), old, ("params", "batch_stats"))
    down_bytes = np.asarray(m["download_bytes_per_layer"]).sum(-1)
    kept_bytes = np.asarray(masks.count_bytes(mlp.structure, plan.download, old, ("params", "batch_stats")))
    index = np.asarray(costs.index_bytes(mlp.structure, plan.dropout))
    np.testing.assert_array_equal(down_bytes, kept_bytes + index)
    assert np.all(down_bytes < np.asarray(full))


@pytest.mark.parametrize("pair", ["fedavg", "feddh"])
def test_zero_rates_reduce_to_the_method_without_dropout(mlp, pair):
    """With every rate 0 (a global rate of 0, recomputed every round) FedAD is FedAvg and FedDHAD is FedDH."""
    counts = np.tile(np.array([[3.0, 1.0, 0.0]]), (N, 1)) + np.arange(N)[:, None] * np.array([[0, 1, 2]])
    ours = (fedad if pair == "fedavg" else feddhad)(rate=0.0, measure_every=1, patience=0)
    theirs = fedavg() if pair == "fedavg" else feddh()
    results = []
    for method in (ours, theirs):
        r = build(mlp, method, counts=counts, strategy=stepwise())
        state = r.init(KEY)
        for t in range(3):
            state, m = r(state, cohort(seed=t, ids=np.roll(IDS, t) % N), jax.random.fold_in(KEY, t))
        results.append((jax.device_get(state.variables), np.asarray(m["decisions"]["selection"].weights)))
    chex.assert_trees_all_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6)


# ---- per-step masks --------------------------------------------------------------------------------


def test_step_masks_differ_between_steps_and_repeat_from_the_seed(mlp):
    method = fedad(resample="step")
    ctx = MethodContext(model=mlp, num_clients=N, cohort_size=K)
    r = build(mlp, method)
    state = with_rates(r.init(KEY), np.full(N, 0.5))
    plan = jax.tree.map(lambda a: a[0], r.preview(state, cohort(), KEY).plan)
    client_key = jax.random.key(11)
    masks_of = [np.concatenate([np.asarray(n) for n in method.step_plan(
        ctx, plan, jax.random.fold_in(client_key, i), jnp.asarray(i)).dropout.neurons[:-1]]) for i in range(4)]
    assert len({m.tobytes() for m in masks_of}) > 1  # steps draw different masks
    again = method.step_plan(ctx, plan, jax.random.fold_in(client_key, 2), jnp.asarray(2)).dropout.neurons[:-1]
    np.testing.assert_array_equal(np.concatenate([np.asarray(n) for n in again]), masks_of[2])
    # The round itself: the same seed gives the same model; the round-level plan sends everything.
    a, m = r(state, cohort(), KEY)
    b, _ = r(with_rates(r.init(KEY), np.full(N, 0.5)), cohort(), KEY)
    chex.assert_trees_all_equal(jax.device_get(a.variables), jax.device_get(b.variables))
    assert all(np.all(n) for n in m["decisions"]["plan"].dropout.neurons)
    np.testing.assert_allclose(m["dropout_keep_probability"][0], 0.5)


def momentum_of(opt_state):
    """The momentum buffer (optax's ``TraceState.trace``) in a client optimizer's state."""
    found = [s.trace for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
             if isinstance(s, optax.TraceState)]
    assert len(found) == 1
    return found[0]


def test_units_dropped_in_a_step_keep_their_value_and_momentum(mlp):
    """FedAD's per-step masks under momentum and weight decay: a unit dropped in a step keeps its parameters and
    its momentum buffer bit for bit in that step (no decay reaches it); the units kept move."""
    method = fedad(resample="step")
    ctx = MethodContext(model=mlp, num_clients=N, cohort_size=K)
    r = build(mlp, method)
    state = with_rates(r.init(KEY), np.full(N, 0.5))
    plan = jax.tree.map(lambda a: a[0], r.preview(state, cohort(), KEY).plan)
    fns = make_client_fns(ctx, method, client_sgd(0.1, momentum=0.9, weight_decay=0.05))
    data, client_key = jax.tree.map(lambda a: a[0], cohort().data), jax.random.key(11)
    local = fns.init(state.variables)
    step = jax.jit(fns.step)
    for s in range(2):
        before = local
        local = step(local, jax.tree.map(lambda a: a[s], data), plan, state.variables, (), client_key, s)
        step_plan = method.step_plan(ctx, plan, jax.random.split(jax.random.fold_in(client_key, s))[0], s)
        trained = masks.expand(ctx.structure, trainable_mask(ctx, step_plan), state.variables["params"])
        for name in ("params", "trace"):
            old, new = ((x.variables["params"] if name == "params" else momentum_of(x.opt_state))
                        for x in (before, local))
            for o, n, t in zip(jax.tree.leaves(old), jax.tree.leaves(new), jax.tree.leaves(trained)):
                t = np.broadcast_to(np.asarray(t), o.shape)
                np.testing.assert_array_equal(np.asarray(n)[~t], np.asarray(o)[~t])
                assert t.any() and not np.array_equal(np.asarray(n)[t], np.asarray(o)[t])


# ---- the Hessian criterion --------------------------------------------------------------------------


def test_hessian_global_rate_is_the_weighted_mean_of_each_clients_eigen_gap_rate(mlp):
    method = trained_too(fedad(measure_every=1, patience=0, lanczos_steps=6))
    r = build(mlp, method)
    state = r.init(KEY)
    c = cohort()
    start = jax.device_get(state.variables)
    new, m = r(state, c, KEY)
    assert int(new.method_state.server.updates) == 1
    update_key = hook_keys(KEY).update

    @jax.jit  # one compilation for every client (eagerly, each client's closure recompiled every scan)
    def client_rate(trained, x, y, mask, key):
        def loss(params):
            return model_loss(mlp, {**trained, "params": params}, x, y, mask, train=False)[0]

        eigs = hessian.hessian_spectrum(loss, trained["params"], 6, key)
        return hessian.eigengap_rate(eigs, hessian.secant_lipschitz(jax.grad(loss), start["params"],
                                                                    trained["params"]))

    rates = []
    for i in range(K):  # the criterion outside the engine, client by client, on its first local batch
        trained = jax.tree.map(lambda a, i=i: a[i], m["trained"])
        x, y, mask = c.data.x[i, 0], c.data.y[i, 0], c.data.example_mask[i, 0]
        rates.append(float(client_rate(trained, x, y, mask, jax.random.fold_in(update_key, int(IDS[i])))))
    n = np.asarray(c.info.num_samples, np.float64)
    expect = min(float(np.sum(n * np.array(rates)) / n.sum()), 0.5)  # d_avg is capped at max_rate
    np.testing.assert_allclose(float(new.method_state.server.global_rate), expect, rtol=1e-4, atol=1e-6)


# ---- the device model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    return ArrayDataset("toy", x[:200], y[:200], x[200:], y[200:], 3)


@pytest.mark.parametrize("resample", ["round", "step"])
def test_flops_and_traffic_count_only_kept_units(mlp, small_data, resample):
    def sim(method, **options):
        cfg = RunConfig(method=method, num_clients=N, cohort_size=K, rounds=2, local_steps=2, batch_size=8,
                        options=options, out_dir=None, seed=1)
        s = Simulation(cfg, small_data, model=mlp)
        return s, list(s.rounds())

    s, ours = sim("fedad", rate=0.5, measure_every=1, patience=0, resample=resample)
    _, base = sim("fedavg")
    # ET°_k: the full model's local work on each device, as the device model computes it.
    steps = np.array([2 if n else 0 for n in s.sizes])
    per_step = s.costs.group_costs(s.cohort(np.arange(K), 0))[0].step_flops
    model_bytes = sum(int(np.size(a)) * 4 for a in jax.tree.leaves(s.state.variables))
    np.testing.assert_allclose(np.asarray(s.state.method_state.server.execution_times),
                               devices.expected_execution_time(s.devices, steps * per_step, model_bytes, model_bytes),
                               rtol=1e-5)
    assert ours[0]["client_flops"] == base[0]["client_flops"]  # round 1: no rate yet, the full model
    assert ours[1]["client_flops"] < 0.95 * base[1]["client_flops"]
    if resample == "round":
        assert ours[1]["upload_bytes"] < base[1]["upload_bytes"]
    else:
        assert ours[1]["upload_bytes"] == base[1]["upload_bytes"]  # every step's mask differs: all is sent


def test_fedad_is_registered_with_its_options():
    m = get_method("fedad", rate=0.25, resample="step")
    assert m.name == "fedad" and m.step_plan is not None and m.capabilities.needs_execution_times
    assert get_method("feddhad").name == "feddhad"
    with pytest.raises(Exception, match="resample"):
        get_method("fedad", resample="sometimes")
    assert get_method("fedad", target="literal").name == "fedad"
    with pytest.raises(Exception, match="--ad-target = .backwards. must be one of time-matched, literal"):
        get_method("fedad", target="backwards")
