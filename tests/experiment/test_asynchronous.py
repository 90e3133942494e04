"""Asynchronous runs (``--mode async``) on the simulated clock: the synchronous run when nothing is stale, FedAsync
with two clients of known speeds by hand, determinism and bit-exact resume between server steps, refusals."""

import copy
import dataclasses
import json
import os
import signal

import jax
import numpy as np
import pytest

from fedpartial._src.analysis.plots import plot_runs
from fedpartial._src.cli.main import main
from fedpartial._src.core import memory
from fedpartial._src.costs import devices
from fedpartial._src.experiment import asynchronous, checkpoint, population, signals
from fedpartial._src.experiment.asynchronous import AsyncSimulation
from fedpartial._src.experiment.availability import Availability
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.preflight import preflight
from fedpartial._src.experiment.runs import run
from fedpartial._src.experiment.simulation import Simulation

TINY = dict(dataset="synthetic", max_samples=40, num_clients=6, cohort_size=3, rounds=3, local_steps=2,
            batch_size=8, out_dir=None)
SPREAD = dict(compute_speed="lognormal:1e9:1.0", download_bandwidth="1e7", upload_bandwidth="1e7")
WALL_CLOCK = ("round_time_s", "wall_time_s", "host_time_s")


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_buffer_equal_to_concurrency_and_cohort_is_the_synchronous_run_bit_for_bit():
    """M = C = K, constant staleness, devices of different speeds: every server step is the synchronous round
    (state, loss, accuracy, traffic, FLOPs and the clock) — the same draws, keys and packing, nothing stale, and the
    arrivals aggregated in the cohort's order whatever order they arrived in."""
    sync = Simulation(RunConfig(**TINY, **SPREAD))
    asyn = AsyncSimulation(RunConfig(**TINY, **SPREAD, mode="async", staleness="constant"))
    sync_records, async_records = list(sync.rounds()), list(asyn.rounds())
    _same(asyn.state, sync.state)
    assert len(async_records) == len(sync_records) == 3
    for a, s in zip(async_records, sync_records):
        for field in ("train_loss", "test_accuracy", "test_loss", "upload_bytes", "download_bytes", "client_steps",
                      "client_flops", "simulated_clock_s"):
            assert a[field] == s[field], field
        assert a["staleness_max"] == 0 and a["clients_arrived"] == 3 and a["clients_in_flight"] == 3


def test_fedasync_with_two_clients_of_known_speeds_matches_a_hand_computation(tmp_path):
    """M = 1, C = 2, client 1 2.5x slower than client 0: client 0 arrives at a, 2a (fresh each time), client 1 at
    b (dispatched at version 0, aggregated at version 2: τ = 2), then client 0 at 3a (dispatched at version 2: τ =
    1); a = 2D/β + 2F/s, b = 2D/β + 5F/s (D model bytes, β bandwidth, F one step's FLOPs, s client 0's speed)."""
    speed, beta = 1e9, 1e9  # compute dominates: 2a < b < 3a
    profiles = tmp_path / "devices.csv"
    profiles.write_text("compute_flops_per_s,download_bytes_per_s,upload_bytes_per_s\n"
                        f"{speed},{beta},{beta}\n{speed / 2.5},{beta},{beta}\n")
    sim = AsyncSimulation(RunConfig(**{**TINY, "num_clients": 2, "cohort_size": 1, "rounds": 4}, mode="async",
                                    concurrency=2, device_profiles=str(profiles), eval_every=4))
    records = list(sim.rounds())
    model_bytes = records[0]["upload_bytes"]
    flops = records[0]["client_flops"] / 2  # one client, two local steps
    a = 2 * model_bytes / beta + 2 * flops / speed
    b = 2 * model_bytes / beta + 2 * flops * 2.5 / speed
    assert [r["arrived_client_ids"] for r in records] == [[0], [0], [1], [0]]
    assert [r["arrived_staleness"] for r in records] == [[0], [0], [2], [1]]
    np.testing.assert_allclose([r["simulated_clock_s"] for r in records], [a, 2 * a, b, 3 * a], rtol=1e-12)
    assert [r["staleness_max"] for r in records] == [0, 0, 2, 1]
    assert all(r["clients_in_flight"] == 2 and r["clients_arrived"] == 1 for r in records)
    assert devices.load_profiles(str(profiles), 2).compute_flops_per_s[1] == speed / 2.5


ASYNC = dict(TINY, rounds=4, cohort_size=2, mode="async", concurrency=4, compute_speed="lognormal:1e9:1.0")


@pytest.fixture(scope="module")
def compiled():
    """One asynchronous simulation (M = 2, C = 4, heterogeneous speeds) and its starting point, to reset it."""
    sim = AsyncSimulation(RunConfig(**ASYNC))
    return sim, jax.device_get((sim.state, sim.pool)), copy.deepcopy(sim.progress)


def fresh(compiled, out_dir, name):
    sim, (state, pool), progress = compiled
    sim.state, sim.pool, sim.progress = jax.device_put(state), jax.device_put(pool), copy.deepcopy(progress)
    sim.config = dataclasses.replace(sim.config, out_dir=str(out_dir), run_name=name)
    return sim


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK} for line in f]


def test_stopped_between_server_steps_resumes_bit_exact(compiled, tmp_path):
    """The same seed gives the same run; a run stopped after server step 2 and resumed from its checkpoint (the
    pool, arrival times, versions and dispatch numbers in it) ends with the uninterrupted run's state, pool and
    records."""
    sim = fresh(compiled, tmp_path, "base")
    base = run(sim.config, sim=sim)
    base_state, base_pool, base_progress = jax.device_get((sim.state, sim.pool)) + (copy.deepcopy(sim.progress),)
    records = _records(base["run_dir"])
    assert max(r["staleness_max"] for r in records) >= 1  # something was stale
    assert all(r["clients_in_flight"] == 4 for r in records)

    sim = fresh(compiled, tmp_path, "stopped")

    def on_round(record):
        if record["round"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(signals.RunInterrupted) as stopped:
        run(sim.config, sim=sim, on_round=on_round)
    run_dir = stopped.value.summary["run_dir"]
    assert checkpoint.latest_round(run_dir) == 2
    sim = fresh(compiled, tmp_path, "unused")
    result = run(sim.config, sim=sim, resume=run_dir)
    assert result["resumed_from_round"] == 2
    _same((sim.state, sim.pool), (base_state, base_pool))
    assert sim.progress == base_progress
    assert _records(run_dir) == records
    # fedpartial plot takes asynchronous runs (accuracy against the simulated clock among its figures)
    paths = plot_runs([run_dir], str(tmp_path / "figures"))
    assert any(p.endswith("accuracy_vs_simulated_time.png") for p in paths), paths


#: every strategy an asynchronous run takes besides the stepwise one of ``compiled`` (the streamed one is refused):
#: a runner each by default; the same runners in chunks (``stepwise:2``, ``fused:1``: another chunk size of a
#: strategy run here, through the same asynchronous code) with ``-m slow``
STRATEGIES = ("fused", "fused-unrolled", "debug")
CHUNKED = ("stepwise:2", "fused:1")
#: the record's fields that are counts, ids or the clock: the same under every strategy, exactly
DISCRETE = ("server_step", "arrived_client_ids", "arrived_staleness", "simulated_clock_s", "clients_in_flight",
            "upload_bytes", "download_bytes", "client_flops", "client_steps")


def test_the_same_seed_gives_the_same_run_under_every_strategy(compiled, tmp_path):
    """The whole run (records and final parameters) under each strategy an asynchronous run takes (the fused one
    run twice: the same bit for bit; the stepwise one's rerun is the resume test's).  Against the stepwise run the
    arrivals, staleness, clock, traffic and FLOPs are the same exactly, and the losses, accuracy and parameters
    within float rounding: the synchronous round is not bit for bit across strategies either (the unrolled and
    debug rounds sum in another order).  On this CPU stepwise:2, fused and fused:1 came out bit for bit,
    fused-unrolled 3e-8 and debug 1.2e-7 apart."""
    _same_run_under(STRATEGIES, compiled, tmp_path)


@pytest.mark.slow  # test_the_same_seed_gives_the_same_run_under_every_strategy runs these runners unchunked
def test_the_same_seed_gives_the_same_run_under_the_chunked_strategies(compiled, tmp_path):
    """``stepwise:2`` and ``fused:1``: the runners of the default test (the stepwise one and the fused one) in
    other chunk sizes, through the same asynchronous code."""
    _same_run_under(CHUNKED, compiled, tmp_path)


def _same_run_under(strategies, compiled, tmp_path):
    """The whole run under each of ``strategies`` against the stepwise run of ``compiled``."""
    def whole_run(sim):
        records = [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in sim.rounds()]
        return records, jax.device_get(sim.state.variables)

    reference = whole_run(fresh(compiled, tmp_path, "unused"))
    assert max(r["staleness_max"] for r in reference[0]) >= 1
    for strategy in strategies:
        sim = AsyncSimulation(RunConfig(**ASYNC, strategy=strategy))
        state, pool, progress = jax.device_get((sim.state, sim.pool)) + (copy.deepcopy(sim.progress),)
        records, params = whole_run(sim)
        if strategy == "fused":  # run again: the same, bit for bit
            sim.state, sim.pool, sim.progress = jax.device_put(state), jax.device_put(pool), progress
            assert whole_run(sim)[0] == records
            _same(jax.device_get(sim.state.variables), params)
        for got, ref in zip(records, reference[0], strict=True):
            assert {k: got[k] for k in DISCRETE} == {k: ref[k] for k in DISCRETE}, strategy
            for k in ("train_loss", "test_accuracy", "test_loss"):
                if k in ref:
                    assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (strategy, k)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference[1]), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=strategy)


def test_only_available_clients_are_dispatched_and_the_run_ends_when_nobody_is_left(compiled, tmp_path):
    """An availability trace: clients 0-3 online from 0 s (client 3 until 1e9 s), nobody else ever; with C = 4
    every arrival is one of them.  Then a trace whose only client goes offline at once: after its one update
    nobody is in flight or may be drawn, and the run ends early."""
    sim = fresh(compiled, tmp_path, "unused")
    trace = tmp_path / "trace.csv"
    trace.write_text("client_id,start_s,end_s\n0,0,1e12\n1,0,1e12\n2,0,1e12\n3,0,1e9\n")
    sim.clock.availability = Availability(str(trace), sim.config.num_clients, sim.config.seed)
    records = list(sim.rounds())
    assert len(records) == sim.config.rounds
    assert {i for r in records for i in r["arrived_client_ids"]} <= {0, 1, 2, 3}
    sim = fresh(compiled, tmp_path, "unused")
    trace.write_text("client_id,start_s,end_s\n5,0,1e-9\n")
    sim.clock.availability = Availability(str(trace), sim.config.num_clients, sim.config.seed)
    records = list(sim.rounds())
    assert [r["arrived_client_ids"] for r in records] == [[5]] and records[0]["clients_in_flight"] == 0


def test_a_pool_that_does_not_fit_is_refused_before_it_is_built(compiled, monkeypatch):
    """The pool (two copies of the model per in-flight client) is in the memory estimate: with room on the device for
    the round but not the pool, the pool is kept in host memory (the run and its records are the same:
    tests/test_contract_async.py); with no room there either, the run is refused in one sentence naming
    --concurrency."""
    sim = compiled[0]
    assert sim.pool_bytes == sum(a.nbytes for a in jax.tree.leaves((sim.pool.trained, sim.pool.start))) + 20 * 4
    room = int((sim.memory.total - sim.pool_bytes) / memory.HEADROOM) + 2  # the round fits, the pool does not
    assert asynchronous.pool_place(sim.pool_bytes, sim.memory.total, room, "RAM") == "device"  # a CPU: nowhere else
    host = {"room": 2 * sim.pool_bytes}
    monkeypatch.setattr(memory, "available_bytes",
                        lambda device=None: (room, "test memory") if device is None else (host["room"], "RAM"))
    assert asynchronous.pool_place(sim.pool_bytes, sim.memory.total, room, "test memory") == "host"
    host["room"] = sim.pool_bytes  # the pool does not fit there either
    assert asynchronous.pool_place(sim.pool_bytes, sim.memory.total, room, "test memory") == "device"
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (room, "test memory"))
    monkeypatch.setattr(asynchronous, "pool_place", lambda *a: "device")  # (the decision just checked)
    with pytest.raises(ConfigError, match=r"--concurrency 4 keeps .* of in-flight updates.*lower --concurrency"):
        AsyncSimulation(RunConfig(**ASYNC))


def test_a_pool_that_cannot_fit_is_refused_from_the_config_before_the_data_is_loaded(monkeypatch):
    """The preflight sizes the pool from the config alone (the model's registry entry on the dataset's example
    shape): with room for less than the pool, the run is refused in one sentence naming --concurrency before any
    data is loaded; with room for it, the preflight passes."""
    config = RunConfig(**{**ASYNC, "dataset": "digits", "max_samples": None, "model": "cnn2c1f", "concurrency": 1000,
                          "num_clients": 1000})
    pool = 1000 * 2 * 4 * 52_610  # float32 cnn2c1f on 8x8 with two classes: a lower bound of the pool
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (pool, "test memory"))
    monkeypatch.setattr(population, "run_dataset", lambda *a: pytest.fail("the data was loaded"))
    with pytest.raises(ConfigError, match=r"^--concurrency 1000 keeps at least 401 MiB of in-flight updates .*"
                                          r"more than the 401 MiB available \(test memory\); lower --concurrency\.$"):
        AsyncSimulation(config)
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (2 * pool, "test memory"))
    preflight(config)


@pytest.mark.parametrize("changes, message", [
    (dict(mode="async", buffer=4, concurrency=3), "--buffer 4 is larger than --concurrency 3"),
    (dict(mode="async", concurrency=7), "--concurrency 7 is not allowed: it must be at most --clients"),
    (dict(mode="async", method="fednova"), "--mode async is not allowed: method fednova"),
    (dict(mode="async", method="scaffold"), "--mode async is not allowed: method scaffold"),
    (dict(mode="async", round_deadline=5.0), "--mode async cannot run with a deadline"),
    (dict(mode="async", staleness="poly:-1"), "--staleness 'poly:-1' is not allowed"),
    (dict(buffer=2), "--buffer needs --mode async"),
    (dict(mode="asynchronous"), "--mode 'asynchronous' is not allowed: it must be sync or async"),
])
def test_bad_combinations_are_one_sentence(changes, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**{**TINY, **changes}).validate()


def test_the_command_line_takes_the_flags_and_refuses_in_one_sentence(capsys):
    code = main(["run", "--dataset", "synthetic", "--clients", "6", "--cohort", "3", "--mode", "async",
                 "--concurrency", "2", "--buffer", "3", "--staleness", "hinge:1:2", "--quiet"])
    assert code == 2
    assert "--buffer 3 is larger than --concurrency 2" in capsys.readouterr().err


@pytest.mark.slow  # (its own compile: ~15 s; the tiers and DP also ran by hand, docs/async.md#methods)
def test_tiers_and_dp_run_asynchronously_on_stale_updates():
    """DP-FedAvg around HeteroFL tiers, C = 6, M = 3: stale updates arrive, each step's noise is accounted (ε grows
    step by step) and the narrow tiers upload less than the whole model (a client's tier travels with its plan)."""
    sim = AsyncSimulation(RunConfig(**{**ASYNC, "num_clients": 9, "cohort_size": 3, "concurrency": 6},
                                    method="heterofl", options={"tier_mix": (3, 3, 3)}, dp_clip=1.0,
                                    dp_noise_multiplier=1.0))
    records = list(sim.rounds())
    assert max(r["staleness_max"] for r in records) >= 1
    epsilons = [r["dp_epsilon"] for r in records]
    assert all(b > a for a, b in zip(epsilons, epsilons[1:]))
    whole = 4 * sim.num_params  # float32, no BatchNorm
    assert all(r["upload_bytes"] <= r["clients"] * whole for r in records)
    assert sum(r["upload_bytes"] for r in records) < sum(r["clients"] for r in records) * whole
