"""The round: strategies agree, determinism, no retrace, padding clients, traffic metrics."""

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.engine._rows import rows_padded
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.runners import stepwise as stepwise_runner
from fedpartial._src.engine.runners.stepwise import Steps
from fedpartial._src.engine.strategy import debug, default_strategy, fused, parse_strategy, stepwise, streamed
from fedpartial._src.methods.base import ClientPlan, Selection, make_method
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.basic.fedprox import fedprox
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.registry import build_model
from tests.conftest import make_cohort

OPT = optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.1, momentum=0.9))
# fused(3) with K = 4: a scan over one chunk of 3, then the remainder chunk of 1 (jax.lax.map's chunking; the
# contract in tests/test_contract.py runs every method whole-cohort fused and relies on this for the chunks)
STRATEGIES = [fused(), fused(3), fused(None, unroll=True), stepwise(1), stepwise(3)]
# Tests of a few tiny rounds whose programs are compared with a tolerance, or checked for a property (what stays
# bit for bit, what is traced, what is counted): compiled at -O0 (tests/conftest.py says why that changes nothing
# there).  Not the learning-rate tests below, which expect two different programs to agree bit for bit, nor the trace
# count's, which jits the pure round inside a user's jit (only a top-level jit takes compiler options).
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")


def partial_method():
    """A method exercising every mask kind: per-client train masks, dropout, random upload."""

    def plan(ctx, view):
        k = view.cohort.client_ids.shape[0]
        keys = jax.random.split(view.key, k)
        neurons = tuple(jax.vmap(lambda kk: jax.random.bernoulli(kk, 0.7, (u,)))(keys) for u in ctx.structure.units)
        dropout = masks.from_neurons(ctx.structure, neurons)
        train = masks.from_layers(ctx.structure, jnp.array([[True, False, True]] * k).at[0, 1].set(True))
        return ClientPlan(train=train, dropout=dropout)

    return make_method("partial-test", plan=plan)


def run_rounds(model, method, strategy, cohorts, seed=0, k=4, server=None, n=8):
    r = FederatedRound(model, method, num_clients=n, cohort_size=k, client_optimizer=OPT,
                       server_optimizer=server, strategy=strategy)
    state = r.init(jax.random.key(seed))
    out = []
    for t, c in enumerate(cohorts):
        state, m = r(state, c, jax.random.fold_in(jax.random.key(seed), t))
        out.append({**jax.device_get(m), **traffic_totals(m)})
    return r, state, out


@pytest.fixture(scope="module")
def unequal_cohorts():
    # Clients with 3, 1, 2, 3 real steps and 5, 2, 4, 5 real examples per batch.
    return [make_cohort((4,), k=4, steps=3, seed=s, real_steps=[3, 1, 2, 3], real_examples=[5, 2, 4, 5])
            for s in range(2)]


# FedAvg's every strategy is checked against the plain loop by tests/benchmarks/test_strategies_smoke.py and
# the masked method below exercises strictly more, so the FedAvg case runs with -m slow only.
@AT_O0
@pytest.mark.parametrize("method", [pytest.param(fedavg, marks=pytest.mark.slow), partial_method],
                         ids=["fedavg", "masked"])
def test_strategies_agree(mlp, unequal_cohorts, method):
    results = [run_rounds(mlp, method(), s, unequal_cohorts)[1:] for s in STRATEGIES]
    ref_state, ref_metrics = results[0]
    for state, metrics in results[1:]:
        chex.assert_trees_all_close(state.variables, ref_state.variables, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(metrics[-1]["train_loss"], ref_metrics[-1]["train_loss"], rtol=1e-5)
        assert metrics[-1]["upload_bytes"] == ref_metrics[-1]["upload_bytes"]


@AT_O0
def test_strategies_agree_on_conv_model(cnn):
    cohorts = [make_cohort((4, 4, 1), k=4, steps=2, seed=3, real_steps=[2, 1, 2, 2])]
    results = [run_rounds(cnn, fedavg(), s, cohorts)[1] for s in (fused(), stepwise(1))]
    chex.assert_trees_all_close(results[0].variables, results[1].variables, rtol=1e-5, atol=1e-5)


def masks_always(monkeypatch):
    """Makes every stepwise step the masked variant (the data's step and example masks, the select)."""
    masked = Steps.fn
    monkeypatch.setattr(Steps, "fn", lambda self, g, c, full=False: masked(self, g, c))


@AT_O0
@pytest.mark.parametrize("chunk", [1, 3])
def test_stepwise_drops_the_masks_only_where_the_chunk_has_no_padding(mlp, unequal_cohorts, monkeypatch, chunk):
    """Real steps 3, 1, 2, 3 and real examples 5, 2, 4, 5 of 5: one client at a time, clients 0 and 3
    run without masks and clients 1 and 2 (partial batches) with them; in chunks of 3, the first chunk
    holds padded steps and examples and keeps the masks.  The result equals running every step with the
    masks up to float reassociation (the MLP's BatchNorm statistics are the same sums in another order)."""
    r, state, metrics = run_rounds(mlp, fedavg(), stepwise(chunk), unequal_cohorts)
    used = {(c, full) for _, c, full in r.runner.steps.fns}
    assert used == ({(None, True), (None, False)} if chunk == 1 else {(3, False), (1, True)})

    masks_always(monkeypatch)
    r2, state2, metrics2 = run_rounds(mlp, fedavg(), stepwise(chunk), unequal_cohorts)
    assert {full for *_, full in r2.runner.steps.fns} == {False}
    chex.assert_trees_all_close(state2, state, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([m["train_loss"] for m in metrics2], [m["train_loss"] for m in metrics], rtol=1e-6)


@AT_O0
def test_stepwise_without_masks_keeps_batchnorm_statistics_up_to_float_noise(cnn, monkeypatch):
    """The conv model's BatchNorm over [B, H, W] with and without the example mask."""
    cohorts = [make_cohort((4, 4, 1), k=4, steps=2, seed=3, real_steps=[2, 1, 2, 2], real_examples=[5, 5, 3, 5])]
    r, state, _ = run_rounds(cnn, fedavg(), stepwise(1), cohorts)
    assert {full for *_, full in r.runner.steps.fns} == {True, False}
    masks_always(monkeypatch)
    _, masked, _ = run_rounds(cnn, fedavg(), stepwise(1), cohorts)
    chex.assert_trees_all_close(state.variables, masked.variables, rtol=1e-5, atol=1e-6)


@AT_O0
def test_stepwise_gives_each_chunk_its_optimizer_state_and_never_stacks_the_cohorts(mlp, unequal_cohorts, monkeypatch):
    """The cohort's local states ``[K]`` hold no optimizer state (SGD with momentum: one momentum per
    parameter, K of them would be as large as the cohort's models); each chunk gets a fresh one when it
    is taken out, so the trained result equals plain Python SGD with momentum from zero per client
    (tests/test_reference.py), and the chunk written back carries none."""
    r = FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=4, client_optimizer=OPT,
                       strategy=stepwise(1))
    state = r.init(jax.random.key(0))
    cohort = jax.device_put(unequal_cohorts[0])
    _, groups = r.runner._begin(state, cohort, r.runner._key_data(jax.random.key(1)))
    assert groups[0][0].opt_state == ()
    written = []
    put = stepwise_runner._put
    monkeypatch.setattr(stepwise_runner, "_put",
                        lambda size, start, tree, rows: written.append(rows) or put(size, start, tree, rows))
    r(state, unequal_cohorts[0], jax.random.key(1))
    assert len(written) == 4 and all(rows.opt_state == () for rows in written)


# The debug strategy runs its rounds op by op: each primitive is lowered and compiled on its first use in a process,
# so the tests that run it share one xdist worker (tests/core/test_views.py, tests/engine/test_hooks.py), where
# the next test's ops (the same model's step) are already there
DEBUG_GROUP = pytest.mark.xdist_group("debug_strategy")


@pytest.mark.parametrize("strategy", [fused(), stepwise(1), streamed(2), pytest.param(debug(), marks=DEBUG_GROUP)],
                         ids=str)
def test_trace_count_counts_traces_of_the_jitted_pieces_from_outside(mlp, unequal_cohorts, strategy):
    """``trace_count`` reads JAX's trace cache, so nothing runs inside traced code: every jitted piece is
    traced for the first round's shapes and not again for another round of the same shapes, the debug
    strategy traces nothing, and the pure round traced inside a user's jit counts too, once per shape."""
    r, state, _ = run_rounds(mlp, fedavg(), strategy, unequal_cohorts[:1])
    first = r.trace_count
    assert (first == 0) == (strategy.kind == "debug")
    state, _ = r(state, unequal_cohorts[1], jax.random.key(7))
    assert r.trace_count == first
    round_fn = jax.jit(r.functions.round)
    cohort = jax.tree.map(jnp.asarray, unequal_cohorts[0])
    for t in range(2):
        state, _ = round_fn(state, cohort, jax.random.key(t))
    assert r.trace_count == first + 1
    with pytest.raises(AttributeError):
        r.trace_count = 0  # read-only: counted, not kept


@AT_O0
def test_invalid_padding_client_changes_nothing(mlp):
    c = make_cohort((4,), k=4, steps=2, seed=1)
    # Clients 0-2 real; client 3 is a padding slot (valid False): same result as a cohort where
    # client 3 has zero weight, and it contributes no traffic.
    padded = c._replace(info=c.info._replace(valid=np.array([True, True, True, False])))
    zero_w = c._replace(info=c.info._replace(num_samples=c.info.num_samples * np.array([1, 1, 1, 0], np.float32)))
    _, a, ma = run_rounds(mlp, fedavg(), fused(), [padded])
    _, b, mb = run_rounds(mlp, fedavg(), fused(), [zero_w])
    chex.assert_trees_all_close(a.variables, b.variables, rtol=1e-6, atol=1e-7)
    assert ma[0]["upload_bytes"] * 4 == mb[0]["upload_bytes"] * 3


@AT_O0
def test_fedavg_traffic_is_the_whole_model_per_client(mlp):
    c = make_cohort((4,), k=4, steps=1)
    r, _, m = run_rounds(mlp, fedavg(), fused(), [c])
    v = r.model.init_variables(jax.random.key(0))
    model_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(v))  # params + BN statistics
    assert m[0]["upload_bytes"] == m[0]["download_bytes"] == 4 * model_bytes


# FedAvg's fused round on the first cohort, the baseline of the next two tests, traced, lowered and run once for
# both (the persistent cache shares only the compilation; they stay on one xdist worker, which builds it once)
FEDAVG_BASELINE = pytest.mark.xdist_group("engine_fedavg_baseline")


@pytest.fixture(scope="module")
def fedavg_one_round(mlp, unequal_cohorts):
    """The server state after FedAvg's fused round on ``unequal_cohorts[0]``."""
    return run_rounds(mlp, fedavg(), fused(), unequal_cohorts[:1])[1]


@FEDAVG_BASELINE
def test_fedprox_mu_zero_is_fedavg_and_mu_pulls_towards_global(mlp, unequal_cohorts, fedavg_one_round):
    s, avg = fused(), fedavg_one_round
    _, prox0, _ = run_rounds(mlp, fedprox(0.0), s, unequal_cohorts[:1])
    _, prox, _ = run_rounds(mlp, fedprox(10.0), s, unequal_cohorts[:1])
    chex.assert_trees_all_close(avg.variables, prox0.variables, rtol=1e-6, atol=1e-7)
    init = FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=4, client_optimizer=OPT).init(
        jax.random.key(0)).variables["params"]

    def dist(p):  # in numpy: each jnp operation on each leaf shape would be a compiled program
        return sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2))
                   for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(init)))

    assert dist(prox.variables["params"]) < dist(avg.variables["params"])


@FEDAVG_BASELINE
def test_server_adam_differs_from_fedavg(mlp, unequal_cohorts, fedavg_one_round):
    avg = fedavg_one_round
    _, adam, _ = run_rounds(mlp, fedavg(), fused(), unequal_cohorts[:1], server=optax.adam(0.01))
    assert not np.allclose(avg.variables["params"]["head"]["kernel"], adam.variables["params"]["head"]["kernel"])


def test_bad_cohort_shapes_are_reported(mlp):
    r = FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=4, client_optimizer=OPT)
    state = r.init(jax.random.key(0))
    with pytest.raises(ValueError, match="expects"):
        r(state, make_cohort((5,), k=4), jax.random.key(0))
    with pytest.raises(ValueError, match="built for 4"):
        r(state, make_cohort((4,), k=3), jax.random.key(0))
    with pytest.raises(ValueError, match="cohort size 9"):
        FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=9, client_optimizer=OPT)
    with pytest.raises(ValueError, match="strategy"):
        parse_strategy("parallel")
    with pytest.raises(ValueError, match="padding 4 must be between 0 and the cohort size 4 less one"):
        FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=4, client_optimizer=OPT, padding=4)


def test_padding_rows_may_take_a_cohort_past_the_population(mlp):
    """The whole population of 6 padded to 8 (4 devices): the 6 real clients are what must fit."""
    r = FederatedRound(mlp, fedavg(), num_clients=6, cohort_size=8, client_optimizer=OPT, padding=2)
    assert (r.ctx.cohort_size, r.ctx.clients_per_round) == (8, 6)
    with pytest.raises(ValueError, match="cohort size 7 must be between 1 and the population size 6"):
        FederatedRound(mlp, fedavg(), num_clients=6, cohort_size=8, client_optimizer=OPT, padding=1)


def test_rows_padded_runs_copies_of_the_first_rows_and_keeps_n():
    seen = []

    def train(global_vars, args):
        seen.append(args["x"].shape[0])
        return {"y": args["x"] * global_vars, "k": args["key"]}

    args = {"x": jnp.arange(3.0), "key": jax.random.split(jax.random.key(0), 3)}
    out = rows_padded(train, 4)(2.0, args)
    assert seen == [4]
    np.testing.assert_array_equal(out["y"], [0.0, 2.0, 4.0])
    assert out["k"].shape == (3,)
    rows_padded(train, 3)(2.0, args)
    assert seen == [4, 3]  # already a multiple: run as it is


@AT_O0
def test_static_batchnorm_policy_neither_tracks_nor_uploads_statistics(mlp):
    c = make_cohort((4,), k=4, steps=2)
    r = FederatedRound(mlp, fedavg(), num_clients=4, cohort_size=4, client_optimizer=OPT, bn_policy="static")
    state = jax.device_get(r.init(jax.random.key(0)))  # host copy: the fused round (GPU default) donates
    new, m = r(state, c, jax.random.key(1))
    chex.assert_trees_all_equal(new.variables["batch_stats"], state.variables["batch_stats"])
    params_bytes = sum(a.size * 4 for a in jax.tree.leaves(state.variables["params"]))
    assert traffic_totals(m)["upload_bytes"] == 4 * params_bytes
    # 'global' aggregates running statistics like parameters: they move.
    g = FederatedRound(mlp, fedavg(), num_clients=4, cohort_size=4, client_optimizer=OPT)
    moved, _ = g(g.init(jax.random.key(0)), c, jax.random.key(1))
    assert not np.allclose(moved.variables["batch_stats"]["bn1"]["mean"], state.variables["batch_stats"]["bn1"]["mean"])


def skip_layer_after_first_round(layer):
    """Round 1 uploads everything; later rounds no client uploads ``layer``."""

    def select(ctx, view):
        k = view.cohort.client_ids.shape[0]
        layers = jnp.ones((k, ctx.structure.num_layers), bool).at[:, layer].set(view.round == 0)
        return Selection(masks.from_layers(ctx.structure, layers), view.cohort.num_samples, jnp.zeros((k,), jnp.int32))

    return make_method("skip-layer", select=select)


@AT_O0
@pytest.mark.parametrize("server", [optax.adam(0.01), optax.sgd(1.0, momentum=0.9), optax.yogi(0.01)],
                         ids=["adam", "momentum", "yogi"])
def test_what_nobody_uploaded_stays_bit_identical_under_any_server_optimizer(mlp, unequal_cohorts, server):
    """The bug of engine v1: fc2, uploaded by nobody after round 1, kept moving on stale optimizer state."""
    r = FederatedRound(mlp, skip_layer_after_first_round(1), num_clients=8, cohort_size=4,
                       client_optimizer=OPT, server_optimizer=server, strategy=fused())
    state = r.init(jax.random.key(0))
    states = []
    for t in range(3):
        state, _ = r(state, unequal_cohorts[t % 2], jax.random.key(t))
        states.append(jax.device_get(state.variables["params"]))
    chex.assert_trees_all_equal(states[1]["fc2"], states[0]["fc2"])
    chex.assert_trees_all_equal(states[2]["fc2"], states[0]["fc2"])
    assert not np.array_equal(states[2]["fc1"]["kernel"], states[0]["fc1"]["kernel"])  # the rest still moves


def test_traffic_totals_do_not_overflow_int32():
    """FedAvg, femnist_cnn, 128 clients: 128 × 26,414,840 B = 3,381,099,520 B (> 2³¹)."""
    model = from_linen(build_model("femnist_cnn", 62, (28, 28, 1)), input_shape=(28, 28, 1), num_classes=62,
                       sequential=True)
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    full = masks.full(model.structure, (128,))
    per_layer = masks.count_bytes_per_layer(model.structure, full, variables, ("params",))
    totals = traffic_totals({"upload_bytes_per_layer": per_layer, "download_bytes_per_layer": per_layer})
    assert totals["upload_bytes"] == 3_381_099_520 == 128 * 6_603_710 * 4
    assert totals["upload_bytes_per_client"].dtype == np.int64


def _lr_round(mlp, strategy, lr, cohorts, scale=None):
    """Final variables and last metrics of ``cohorts`` with SGD at ``lr`` and the cohorts' ``lr_scale``."""
    opt = optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(lr, momentum=0.9))
    r = FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=4, client_optimizer=opt, strategy=strategy)
    if scale is not None:
        cohorts = [c._replace(info=c.info._replace(lr_scale=np.asarray(scale, np.float32))) for c in cohorts]
    state = r.init(jax.random.key(0))
    for t, c in enumerate(cohorts):
        state, m = r(state, c, jax.random.key(t))
    return state.variables, m


@pytest.mark.parametrize("strategy", [fused(), stepwise(1), streamed(2),
                                      streamed(1, stepwise=True)], ids=str)
def test_cohort_lr_scale_equals_the_optimizer_at_that_rate_bit_for_bit(mlp, unequal_cohorts, strategy):
    """A cohort's ``lr_scale`` multiplies each client's updates: with the optimizer at rate 1 and the
    cohort at rate r, the rounds are those of the optimizer at rate r, bit for bit (how learning-rate
    replicas share one round)."""
    want, want_m = _lr_round(mlp, strategy, 0.07, unequal_cohorts)
    got, got_m = _lr_round(mlp, strategy, 1.0, unequal_cohorts, [0.07] * 4)
    chex.assert_trees_all_equal(got, want)
    assert float(got_m["train_loss"]) == float(want_m["train_loss"])


def test_cohort_lr_scale_is_per_client(mlp, unequal_cohorts):
    """Rates 0.01..0.5 in one cohort: client k, alone in it (the others padding), trains as at its rate."""
    rates, one = [0.01, 0.05, 0.2, 0.5], unequal_cohorts[:1]
    for k in (0, 2):
        alone = [c._replace(info=c.info._replace(valid=np.arange(4) == k)) for c in one]
        chex.assert_trees_all_equal(_lr_round(mlp, fused(), 1.0, alone, rates)[0],
                                    _lr_round(mlp, fused(), rates[k], alone)[0])


def test_a_methods_own_rates_compose_with_the_cohorts(mlp, unequal_cohorts):
    """A method's ``ClientPlan.lr_scale`` (0.5) times the cohort's (0.2) is a rate of 0.1."""
    halve = make_method("halve", plan=lambda ctx, view: ClientPlan(lr_scale=jnp.full(4, 0.5, jnp.float32)))
    opt = optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(1.0, momentum=0.9))
    r = FederatedRound(mlp, halve, num_clients=8, cohort_size=4, client_optimizer=opt)
    state = r.init(jax.random.key(0))
    for t, c in enumerate(unequal_cohorts):
        state, _ = r(state, c._replace(info=c.info._replace(lr_scale=np.full(4, 0.2, np.float32))), jax.random.key(t))
    want, _ = _lr_round(mlp, default_strategy(), 0.1, unequal_cohorts)
    chex.assert_trees_all_close(state.variables, want, rtol=1e-6, atol=1e-7)


def _batched_products(jaxpr) -> int:
    """How many ``dot_general``s in ``jaxpr`` (and every jaxpr nested in it) have batch dimensions."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (_, (lhs_batch, _)) = eqn.params["dimension_numbers"]
            count += bool(lhs_batch)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _batched_products(sub)
    return count


@pytest.mark.parametrize("chunk, batched", [(1, False), (2, True)])
def test_a_chunk_of_one_client_trains_un_vmapped(mlp, chunk, batched):
    """``fused:1`` maps its clients one at a time with no vmap around them: XLA:CPU ran a vmap of one client's
    matrix products as batched products, 27 % slower a round (docs/decisions.md); chunks of 2 are vmapped."""
    rnd = FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=4, client_optimizer=OPT, strategy=fused(chunk))
    cohort = make_cohort((4,))
    jaxpr = jax.make_jaxpr(rnd.pure_round)(rnd.init(jax.random.key(0)), cohort, jax.random.key(1)).jaxpr
    assert (_batched_products(jaxpr) > 0) == batched


@pytest.mark.parametrize("chunk, batched", [(1, False), (2, True)])
def test_a_streamed_chunk_of_one_client_trains_un_vmapped(mlp, monkeypatch, chunk, batched):
    """``stream:1`` trains its chunk of one client un-vmapped too (``program.map_clients``); chunks of 2 are
    vmapped.  The chunk's jitted pass is traced again from the shapes it was called with."""
    rnd = FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=4, client_optimizer=OPT, strategy=streamed(chunk))
    calls, original = {}, rnd.runner._stream_fn

    def recording(name, fn, donate=()):
        jitted = original(name, fn, donate)

        def call(*args):
            calls[name] = (fn, jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args))
            return jitted(*args)
        return call

    monkeypatch.setattr(rnd.runner, "_stream_fn", recording)
    rnd(rnd.init(jax.random.key(0)), make_cohort((4,)), jax.random.key(1))
    fn, shapes = calls["per_client"]
    assert (_batched_products(jax.make_jaxpr(fn)(*shapes).jaxpr) > 0) == batched


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the options are XLA:CPU's")
def test_a_fused_round_on_cpu_is_compiled_with_fewer_copies_and_the_same_results(mlp):
    """The fused round is compiled with ``CPU_COMPILER_OPTIONS``: by region analysis XLA's copy insertion copies
    fewer of the carried parameters and optimizer states each local step (half, for this MLP with momentum), and the
    results are the same bit for bit."""
    from fedpartial._src.engine.runners import base

    rnd = FederatedRound(mlp, fedavg(), num_clients=8, cohort_size=4, client_optimizer=OPT, strategy=fused(1))
    state, cohort = rnd.init(jax.random.key(0)), make_cohort((4,))
    args = (state, rnd.runner.whole(cohort), jax.random.key_data(jax.random.key(1)))
    default = jax.jit(rnd.runner.round.__wrapped__, compiler_options={
        **base.CPU_COMPILER_OPTIONS, "xla_cpu_copy_insertion_use_region_analysis": False})

    def copies(jitted) -> int:
        return jitted.lower(*args).compile().as_text().count(" copy(")

    assert copies(rnd.runner.round) < copies(default)
    chex.assert_trees_all_equal(jax.device_get(rnd.runner.round(*jax.tree.map(jnp.copy, args))[0]),
                                jax.device_get(default(*jax.tree.map(jnp.copy, args))[0]))
