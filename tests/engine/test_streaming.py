"""The streamed strategy: the cohort a chunk at a time, aggregated from running sums, equals the fused round."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import aggregation, masks, memory
from fedpartial._src.core.errors import UserError
from fedpartial._src.data import packing
from fedpartial._src.engine import strategy as strategies
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.types import ClientData
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.experiment.simulation import run as simulation_run
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.basic.fedprox import fedprox
from fedpartial._src.methods.layerwise.fedldf import fedldf, random_layers
from fedpartial._src.methods.submodel.fedspu import fedspu
from tests.conftest import make_cohort

# Rounds of a few tiny steps, compared with a tolerance (integer metrics exactly): compiled at -O0
# (tests/conftest.py says why that changes nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")
OPT = optax.sgd(0.1, momentum=0.9)
K, N = 7, 12
REAL_STEPS = [3, 1, 2, 3, 2, 3, 1]
REAL_EXAMPLES = [5, 2, 4, 5, 3, 5, 1]
#: metrics that are integers: they must be equal, not close
EXACT = ("client_steps", "client_steps_per_client", "upload_bytes_per_layer", "download_bytes_per_layer",
         "nonfinite_clients", "diverged", "layers_uploaded_per_client")


def cohorts(rounds=2, valid=None):
    """Unequal clients; the last round's client 5 is a padding slot when ``valid`` says so."""
    out = []
    for s in range(rounds):
        c = make_cohort((4,), k=K, steps=3, seed=s, real_steps=REAL_STEPS, real_examples=REAL_EXAMPLES,
                        client_ids=(np.arange(K) * 5 + s) % N)
        if valid is not None:
            c = c._replace(info=c.info._replace(valid=np.asarray(valid, bool)))
        out.append(c)
    return out


_ROUNDS = {}


def round_for(model, name, strategy):
    """One FederatedRound per (method, strategy), shared by the tests: each is compiled once."""
    if (name, str(strategy)) not in _ROUNDS:
        factory, server = METHODS[name]
        _ROUNDS[name, str(strategy)] = FederatedRound(
            model, factory(), num_clients=N, cohort_size=K, client_optimizer=OPT, server_optimizer=server,
            strategy=strategy)
    return _ROUNDS[name, str(strategy)]


def run(model, name, strategy, rounds):
    r = round_for(model, name, strategy)
    state = r.init(jax.random.key(0))
    metrics = []
    for t, c in enumerate(rounds):
        state, m = r(state, c, jax.random.fold_in(jax.random.key(1), t))
        metrics.append(jax.device_get(m))
    return r, state, metrics


def assert_same_round(a, b):
    (_, state_a, metrics_a), (_, state_b, metrics_b) = a, b
    chex.assert_trees_all_close(state_a.variables, state_b.variables, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state_a.opt_state, state_b.opt_state, rtol=1e-5, atol=1e-6)
    for ma, mb in zip(metrics_a, metrics_b):
        assert set(ma) == set(mb)
        for name in ma:
            if name in EXACT:
                np.testing.assert_array_equal(ma[name], mb[name], err_msg=name)
            else:
                chex.assert_trees_all_close(ma[name], mb[name], rtol=1e-5, atol=1e-6)


METHODS = {
    "fedavg": (fedavg, None),
    "fedprox": (lambda: fedprox(mu=0.1), None),
    "fedadam": (fedavg, optax.adam(0.05, b1=0.9, b2=0.99, eps=1e-3)),  # the --server-opt adam of a run
    "fedldf": (lambda: fedldf(2), None),
    "random": (lambda: random_layers(2), None),
}
SLOW = pytest.mark.slow  # the same paths as the unmarked cases, other methods and chunk sizes
CASES = [("fedavg", 3), ("fedldf", 3)] + [pytest.param(*c, marks=SLOW) for c in (
    ("fedprox", 3), ("fedadam", 3), ("fedavg", 7), ("fedldf", 7), ("random", 3))]


@pytest.mark.parametrize("name, chunk", CASES)
def test_streamed_equals_fused(mlp, name, chunk):
    rounds = cohorts(valid=[True, True, True, True, True, False, True])  # 7 clients, one padding slot
    fused = run(mlp, name, strategies.fused(), rounds)
    streamed = run(mlp, name, strategies.streamed(chunk), rounds)
    assert_same_round(fused, streamed)


# Stepwise chunks: one client un-vmapped (chunk 1, the CPU layout) and 3 vmapped with a padded last chunk;
# FedLDF for the two-pass ("summary") path.  The 7 clients' unequal steps and examples make some steps run
# masked and others (a chunk with no padding at that step) without masks.
STEPWISE_CASES = [("fedavg", 1), ("fedldf", 3)] + [pytest.param(*c, marks=SLOW) for c in (
    ("fedavg", 3), ("fedldf", 1), ("fedadam", 1))]


@pytest.mark.parametrize("name, chunk", STEPWISE_CASES)
def test_stepwise_chunks_equal_the_stepwise_round(mlp, name, chunk):
    rounds = cohorts(valid=[True, True, True, True, True, False, True])
    streamed = run(mlp, name, strategies.streamed(chunk, stepwise=True), rounds)
    assert_same_round(run(mlp, name, strategies.stepwise(1), rounds), streamed)
    # trained by the jitted step, not a scan; without masks only where a chunk has no padding at that step
    # (clients of 5 real examples alone in a chunk of one; every chunk of 3 holds a client with fewer)
    want = {(0, None, True), (0, None, False)} if chunk == 1 else {(0, chunk, False)}
    assert set(streamed[0].runner.steps.fns) == want and "chunk_start" in streamed[0].runner._stream_fns


def test_stepwise_chunks_do_not_retrace(mlp):
    r = round_for(mlp, "fedldf", strategies.streamed(3, stepwise=True))
    state = r.init(jax.random.key(0))
    counts = []
    for t, c in enumerate(cohorts(3)):
        state, _ = r(state, c, jax.random.key(t))
        counts.append(r.trace_count)
    assert counts == [counts[0]] * 3


def test_streamed_takes_one_chunk_of_data_at_a_time(mlp):
    c = cohorts(1)[0]
    taken = []

    def take(rows):
        taken.append(list(rows))
        return jax.tree.map(lambda a: a[rows], c.data)

    lazy = c._replace(data=ClientData(take, ClientData.of(c.data).spec))
    streamed = run(mlp, "fedldf", strategies.streamed(3), [lazy])
    # first pass: every client once, 3 at a time; second pass: only clients that upload a layer
    assert taken[:3] == [[0, 1, 2], [3, 4, 5], [6]]
    uploads = streamed[2][0]["layers_uploaded_per_client"]
    assert sorted(sum(taken[3:], [])) == list(np.flatnonzero(uploads))
    assert all(len(t) <= 3 for t in taken)
    assert_same_round(run(mlp, "fedldf", strategies.fused(), [c]), streamed)


@pytest.mark.parametrize("name, stepwise", [("fedavg", False), ("fedldf", False), ("fedldf", True)])
def test_a_chunk_is_packed_only_when_every_chunk_but_the_last_has_finished(mlp, monkeypatch, name, stepwise):
    """Bounded memory: dispatch never runs ahead of the computation, so at most two chunks' data are alive
    (the one training and the next being packed), whatever the cohort size."""
    c = cohorts(1)[0]
    factory, server = METHODS[name]
    r = FederatedRound(mlp, factory(), num_clients=N, cohort_size=K, client_optimizer=OPT,
                       server_optimizer=server, strategy=strategies.streamed(2, stepwise=stepwise))
    outputs, unfinished = [], []
    compile_ = r.runner._stream_fn

    def spy(fn_name, fn, donate=()):
        compiled = compile_(fn_name, fn, donate)
        if fn_name not in ("per_client", "summaries", "add"):
            return compiled

        def call(*args):
            result = compiled(*args)
            outputs.append(result)
            return result
        return call

    monkeypatch.setattr(r.runner, "_stream_fn", spy)

    def take(rows):
        unfinished.append(sum(not a.is_ready() for o in outputs[:-1] for a in jax.tree.leaves(o)
                              if not a.is_deleted()))  # (a donated running sum lives on as the next one)
        return jax.tree.map(lambda a: a[rows], c.data)

    lazy = c._replace(data=ClientData(take, ClientData.of(c.data).spec))
    r(r.init(jax.random.key(0)), lazy, jax.random.key(1))
    assert len(unfinished) >= 4 and not any(unfinished)


def test_streamed_excludes_a_nonfinite_client_as_fused_does(mlp):
    c = cohorts(1)[0]
    x = c.data.x.copy()
    x[2, 0, 0, 0] = np.inf  # client 2's first example
    bad = [c._replace(data=c.data._replace(x=x))]
    fused = run(mlp, "fedldf", strategies.fused(), bad)  # both passes clean faults with the same code
    streamed = run(mlp, "fedldf", strategies.streamed(3), bad)
    assert int(streamed[2][0]["nonfinite_clients"]) == 1
    assert_same_round(fused, streamed)


def test_no_retrace_across_rounds(mlp):
    for name, traced in (("fedavg", 3), ("fedldf", 5)):  # begin, chunk pass(es), selection, finish
        r = round_for(mlp, name, strategies.streamed(3))
        before = r.trace_count
        state = r.init(jax.random.key(0))
        counts = []
        for t, c in enumerate(cohorts(3)):
            state, _ = r(state, c, jax.random.key(t))
            counts.append(r.trace_count)
        assert counts[0] <= traced and counts == [counts[0]] * 3
        assert before in (0, counts[0])


def test_three_clients_streamed_by_hand():
    # One leaf of 2 elements; client k uploads element j where m[k, j]; weights w.
    theta = np.array([[1.0, 10.0], [3.0, 20.0], [5.0, 40.0]], np.float32)
    m = np.array([[True, False], [True, True], [False, False]])
    w = np.array([1.0, 3.0, 2.0], np.float32)
    g = {"params": {"a": jnp.array([7.0, 8.0])}}
    sums = {"params": ({"a": jnp.zeros(2)}, {"a": jnp.zeros(2)})}
    for rows in ([0, 1], [2]):  # chunks of 2 and 1
        num, den = aggregation._sums(jnp.asarray(theta[rows]), jnp.asarray(m[rows]), jnp.asarray(w[rows]))
        sums = {"params": ({"a": sums["params"][0]["a"] + num}, {"a": sums["params"][1]["a"] + den})}
    new, received = aggregation.finish_sums(g, sums)
    # element 0: (1·1 + 3·3) / (1 + 3) = 2.5; element 1: only client 1 → 20
    np.testing.assert_allclose(new["params"]["a"], [2.5, 20.0])
    np.testing.assert_array_equal(received["a"], [True, True])
    # nobody uploads element 1: the global value stays
    sums = {"params": ({"a": jnp.array([4.0, 0.0])}, {"a": jnp.array([2.0, 0.0])})}
    new, received = aggregation.finish_sums(g, sums)
    np.testing.assert_allclose(new["params"]["a"], [2.0, 8.0])
    np.testing.assert_array_equal(received["a"], [True, False])


def test_add_sums_over_chunks_equals_aggregate(mlp):
    g = mlp.init_variables(jax.random.key(0))
    rng = np.random.default_rng(0)
    cohort_vars = jax.tree.map(lambda a: a[None] + rng.normal(size=(5, *a.shape)).astype(np.float32), g)
    layers = jnp.asarray(rng.random((5, mlp.structure.num_layers)) < 0.6)
    upload = masks.from_layers(mlp.structure, layers)
    w = jnp.asarray([1.0, 2.0, 0.0, 4.0, 5.0])
    ref, ref_received = aggregation.aggregate(mlp.structure, g, cohort_vars, upload, w)
    sums = aggregation.zero_sums(g)
    for lo, hi in ((0, 2), (2, 4), (4, 5)):
        part = lambda t, lo=lo, hi=hi: jax.tree.map(lambda a: a[lo:hi], t)  # noqa: E731
        sums = aggregation.add_sums(mlp.structure, sums, g, part(cohort_vars), part(upload), w[lo:hi])
    new, received = aggregation.finish_sums(g, sums)
    chex.assert_trees_all_close(new, ref, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_equal(received, ref_received)


def test_a_method_that_needs_the_whole_cohort_is_refused(mlp):
    with pytest.raises(UserError, match="^method fedspu needs the whole cohort at once, so it cannot be streamed; "
                                        "use the fused, stepwise or debug strategy.$"):
        FederatedRound(mlp, fedspu(), num_clients=N, cohort_size=K, client_optimizer=OPT,
                       strategy=strategies.streamed(3))


def test_run_config_refuses_streaming_what_cannot_stream():
    with pytest.raises(ConfigError, match="^--strategy stream:50 is not allowed: method fedspu needs the whole "
                                          "cohort at once"):
        RunConfig(method="fedspu", strategy="stream:50", out_dir=None).validate()
    with pytest.raises(ConfigError, match=r"^--strategy stream:50 is not allowed: early stopping \(--es\)"):
        RunConfig(method="fedavg", strategy="stream:50", early_stopping=True, out_dir=None).validate()
    RunConfig(method="fedldf", strategy="stream:50", out_dir=None).validate()
    assert strategies.parse_strategy("stream:50") == strategies.streamed(50)
    assert strategies.parse_strategy("stream-stepwise:4") == strategies.streamed(4, stepwise=True)
    assert str(strategies.streamed(4, stepwise=True)) == "stream-stepwise:4"
    for text in ("stream", "stream-stepwise"):
        with pytest.raises(ValueError, match="'stream:N', 'stream-stepwise:N'"):
            strategies.parse_strategy(text)
    with pytest.raises(ValueError, match="^stepwise chunks are a choice of the streamed strategy, not of 'fused'"):
        strategies.Strategy("fused", 2, stepwise_chunks=True)
    with pytest.raises(ConfigError, match="^--strategy stream-stepwise:50 is not allowed: method fedspu needs"):
        RunConfig(method="fedspu", strategy="stream-stepwise:50", out_dir=None).validate()


# ---- memory estimate and refusal ------------------------------------------------------------------


def test_estimate_grows_with_clients_in_flight(mlp):
    fused = round_for(mlp, "fedavg", strategies.fused())
    streamed = round_for(mlp, "fedavg", strategies.streamed(3))
    a = memory.estimate(fused, num_steps=3, batch_size=5, example_shape=(4,))
    b = memory.estimate(streamed, num_steps=3, batch_size=5, example_shape=(4,))
    assert (a.in_flight, b.in_flight) == (K, 3)
    assert a.server == b.server and a.per_client == b.per_client
    assert a.total - b.total == (K - 3) * a.per_client
    # per client: the packed data (twice) is exactly S·B·(4 floats + label + mask) + S step flags
    assert a.data == K * 2 * (3 * 5 * (4 * 4 + 4 + 1) + 3)


def test_refusal_names_the_estimate_and_the_fix():
    est = memory.MemoryEstimate(server=2**30, clients=8 * 2**30, data=2 * 2**30, in_flight=10_000,
                                per_client=2**20)
    gpu = functools.partial(strategies.bounded_strategy, platform="gpu")
    assert memory.refusal(est, 100 * 2**30, "RAM", strategy="fused", cohort_size=10_000, stream=gpu) is None
    # (0.9 · 8 GiB − 1 GiB) / 1 MiB = 6348 clients fit; 2 significant digits
    assert memory.clients_that_fit(est, 8 * 2**30) == 6348
    assert memory.refusal(est, 8 * 2**30, "RAM", strategy="fused", cohort_size=10_000, stream=gpu) == (
        "the run needs about 11.0 GiB (fused strategy, 10000 clients in flight) but 8.0 GiB of RAM is "
        "available; use --strategy stream:6300.")
    cpu = functools.partial(strategies.bounded_strategy, platform="cpu")  # no model: as one with convolutions
    assert memory.refusal(est, 8 * 2**30, "RAM", strategy="stepwise:1", cohort_size=10_000,
                          stream=cpu).endswith("; use --strategy stream-stepwise:1.")
    assert memory.refusal(est, 8 * 2**30, "RAM", strategy="fused", cohort_size=10_000,
                          stream=None).endswith("; use a --cohort of at most 6300.")
    assert "even for one client at a time" in memory.refusal(est, 2**30, "RAM", strategy="fused",
                                                             cohort_size=10_000, stream=gpu)
    assert memory.clients_that_fit(est, 2**30) == 0


def test_bounded_strategy_by_platform_and_model(mlp, cnn):
    conv = cnn
    assert str(strategies.bounded_strategy(6300, "cpu", conv)) == "stream-stepwise:1"  # conv: one client, un-vmapped
    assert str(strategies.bounded_strategy(6300, "cpu", mlp)) == f"stream-stepwise:{strategies.DENSE_CPU_CHUNK}"
    assert str(strategies.bounded_strategy(3, "cpu", mlp)) == "stream-stepwise:3"
    assert str(strategies.bounded_strategy(6300, "gpu", conv)) == "stream:6300"
    with pytest.raises(ValueError, match="must be at least 1"):
        strategies.bounded_strategy(0, "cpu", mlp)


def test_simulation_is_refused_before_anything_is_built(monkeypatch):
    # the fused estimate is about 303 MiB
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (288 * 2**20, "RAM"))
    built = []
    monkeypatch.setattr(FederatedRound, "init", lambda self, key, **given: built.append(key))
    config = RunConfig(dataset="synthetic", num_clients=40, cohort_size=40, local_steps=2, batch_size=8,
                       out_dir=None, strategy="fused")
    # on CPU the fix named for a dense model is the stepwise-chunked stream (strategies.bounded_strategy)
    with pytest.raises(ConfigError, match=r"^The run needs about 30\d MiB \(fused strategy, 40 clients in "
                                          r"flight\) but 288 MiB of RAM is available; use --strategy "
                                          r"stream-stepwise:2\.$"):
        Simulation(config)
    assert not built
    Simulation(dataclasses.replace(config, strategy="stream-stepwise:2"))  # the fix it names is accepted
    assert len(built) == 1


def test_a_run_decides_its_layout_then_builds_its_round_once(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (288 * 2**20, "RAM"))
    builds = []
    build = FederatedRound.__init__
    monkeypatch.setattr(FederatedRound, "__init__", lambda self, *a, **kw: builds.append(kw["strategy"])
                        or build(self, *a, **kw))
    config = RunConfig(dataset="synthetic", num_clients=40, cohort_size=40, local_steps=2, batch_size=8,
                       out_dir=None, rounds=1)
    sim = Simulation(config)  # streamed: the decision came from estimates, the round was built after it
    assert [str(s) for s in builds] == ["stream-stepwise:2"] and sim.round.strategy is builds[0]


def test_auto_streams_a_cohort_that_does_not_fit(monkeypatch):
    # the whole cohort (stepwise:1 keeps every trained model) needs about 303 MiB; 288 MiB are available
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (288 * 2**20, "RAM"))
    config = RunConfig(dataset="synthetic", num_clients=40, cohort_size=40, local_steps=2, batch_size=8,
                       out_dir=None, rounds=2, eval_every=2)
    sim = Simulation(config)
    # (0.9 · 288 MiB − the server's share) / one client's bytes = 2 clients fit
    assert str(sim.round.strategy) == "stream-stepwise:2" and sim.data_placement == "host"
    assert sim.memory.in_flight == 2 and sim.memory.total < 0.9 * 288 * 2**20
    assert sim.strategy_note.startswith("auto streams the cohort: stepwise:1 would need about 30")
    assert sim.strategy_note.endswith("but 288 MiB of RAM is available")
    named = Simulation(dataclasses.replace(config, strategy="stream-stepwise:2"))
    assert named.strategy_note is None
    chex.assert_trees_all_close(sim.state, named.state)
    # the same rounds as the strategy named: the choice changes how the cohort runs, not what it computes
    summaries = [simulation_run(config, sim=s) for s in (sim, named)]
    assert summaries[0]["final_test_accuracy"] == summaries[1]["final_test_accuracy"]
    assert summaries[0]["strategy"] == "stream-stepwise:2" and "strategy_note" in summaries[0]
    assert "strategy_note" not in summaries[1]


@pytest.mark.parametrize("changed", [dict(strategy="stepwise:1"), dict(method="fedspu"), dict(early_stopping=True)],
                         ids=["named-strategy", "cannot-stream", "early-stopping"])
def test_auto_does_not_stream_a_run_it_may_not(monkeypatch, changed):
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (288 * 2**20, "RAM"))
    config = RunConfig(dataset="synthetic", num_clients=40, cohort_size=40, local_steps=2, batch_size=8,
                       out_dir=None, **changed)
    with pytest.raises(ConfigError, match=r"^The run needs about \d+ MiB .* but 288 MiB of RAM is available[;,] "):
        Simulation(config)


def test_auto_keeps_its_strategy_when_the_cohort_fits(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (64 * 2**30, "RAM"))
    sim = Simulation(RunConfig(dataset="synthetic", num_clients=40, cohort_size=40, local_steps=2, batch_size=8,
                               out_dir=None))
    assert str(sim.round.strategy) == "stepwise:1" and sim.strategy_note is None


def test_packing_with_client_keys_does_not_depend_on_the_others():
    x = np.arange(40, dtype=np.float32).reshape(40, 1)
    y = np.arange(40) % 3
    clients = [np.arange(0, 9), np.arange(9, 30), np.arange(30, 40)]
    both = packing.pack_cohort(x, y, clients, batch_size=4, num_steps=6, local_epochs=1.0, seed=3,
                               client_keys=[11, 12, 13])
    alone = packing.pack_cohort(x, y, clients[2:], batch_size=4, num_steps=6, local_epochs=1.0, seed=3,
                                client_keys=[13])
    for a, b in zip(both, alone):
        np.testing.assert_array_equal(a[2:], b)
    assert sorted(both.x[2][both.example_mask[2]].ravel()) == list(range(30, 40))  # one epoch: each once
