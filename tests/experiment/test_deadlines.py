"""Deadlines, stragglers and over-selection: hand-computed decisions on tiny cohorts, the prediction against the
device model, and the decisions applied inside a real run (one compiled round per run)."""

import math

import jax
import numpy as np
import pytest

from fedpartial._src.costs import devices
from fedpartial._src.engine import metrics as engine_metrics
from fedpartial._src.experiment import deadlines
from fedpartial._src.experiment.availability import Availability
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.deadlines import ClientTimes, decide
from fedpartial._src.experiment.simulation import Simulation

TINY = dict(model="mlp", num_clients=8, cohort_size=3, rounds=3, local_steps=4, local_epochs=None, batch_size=8,
            out_dir=None)


def times(**kw):
    """Four clients: 1 s download, 1 s upload, 4 steps of 1, 2, 0.5 and 3 s (finish 6, 10, 4, 14 s); 100 bytes
    down, 50 up, 10 FLOPs a step."""
    base = dict(download_s=np.ones(4), step_s=np.array([1.0, 2.0, 0.5, 3.0]), upload_s=np.ones(4),
                steps=np.full(4, 4), download_bytes=np.full(4, 100.0), upload_bytes=np.full(4, 50.0),
                step_flops=np.full(4, 10.0))
    return ClientTimes(**{**base, **kw})


ALL = np.ones(4, bool)


def test_drop_loses_every_client_past_the_deadline_and_counts_its_work_until_then():
    out = decide(times(), ALL, deadline=9.0)
    assert out.kept.tolist() == [True, False, True, False] and out.steps.tolist() == [4, 0, 4, 0]
    assert (out.sampled, out.finished, out.dropped, out.end_s) == (4, 2, 2, 9.0)
    # by 9 s client 1 downloaded (100 B) and did its 4 steps of 2 s (40 FLOPs) but sent nothing; client 3 did
    # ⌊8 / 3⌋ = 2 steps
    assert (out.wasted_flops, out.wasted_bytes) == (60.0, 200.0)
    half = decide(times(), ALL, deadline=5.5)  # client 0 is half way through its upload: 25 B of 50 sent
    assert half.kept.tolist() == [False, False, True, False]
    assert half.wasted_flops == 40 + 20 + 10 and half.wasted_bytes == 3 * 100 + 25
    early = decide(times(), ALL, deadline=0.5)  # nobody finished downloading: half of each download
    assert early.finished == 0 and (early.wasted_flops, early.wasted_bytes) == (0.0, 200.0)


def test_nobody_cut_means_no_waste_and_no_deadline_time():
    out = decide(times(), ALL, deadline=14.0)
    assert out.kept.all() and out.end_s is None and out.wasted_flops == out.wasted_bytes == 0
    assert decide(times(), ALL).end_s is None  # no deadline, no over-selection


def test_partial_trains_the_steps_that_fit_after_the_transfers_are_reserved():
    out = decide(times(), ALL, deadline=9.0, policy="partial")
    # 7 s of room: client 1 ⌊7/2⌋ = 3 steps, client 3 ⌊7/3⌋ = 2; both report at 8 s ≤ 9
    assert out.kept.all() and out.steps.tolist() == [4, 3, 4, 2]
    assert out.end_s == 9.0 and out.wasted_flops == out.wasted_bytes == 0  # cut short: the round ran to 9 s
    tight = decide(times(), ALL, deadline=2.5, policy="partial")
    # 0.5 s of room: only client 2 (0.5 s steps) fits one; the others drop after their download, sending nothing
    assert tight.kept.tolist() == [False, False, True, False] and tight.steps.tolist() == [0, 0, 1, 0]
    assert (tight.wasted_flops, tight.wasted_bytes) == (0.0, 300.0)
    assert deadlines.steps_that_fit(times(), 1.5).tolist() == [0, 0, 0, 0]  # the transfers alone overrun


def test_over_selection_keeps_the_first_k_to_report_and_ends_with_the_kth():
    out = decide(times(), ALL, keep=2)
    assert out.kept.tolist() == [True, False, True, False] and out.end_s == 6.0  # finishes 6 and 4 s
    # by 6 s: client 1 did ⌊5/2⌋ = 2 steps, client 3 ⌊5/3⌋ = 1, both downloaded
    assert (out.wasted_flops, out.wasted_bytes) == (30.0, 200.0)
    # with a deadline of 5 only one reports: the round waits for the deadline
    late = decide(times(), ALL, deadline=5.0, keep=2)
    assert late.kept.tolist() == [False, False, True, False] and late.end_s == 5.0
    assert (late.wasted_flops, late.wasted_bytes) == (40 + 20 + 10, 300.0)
    # clients that are not valid (padding, unavailable fillers) are never sampled, kept or wasted
    valid = np.array([True, True, False, True])
    some = decide(times(), valid, keep=2)
    assert some.sampled == 3 and some.kept.tolist() == [True, True, False, False] and some.end_s == 10.0
    assert some.wasted_flops == 3 * 10  # client 3 by 10 s: ⌊9/3⌋ = 3 steps


def test_the_quantile_deadline_is_over_the_valid_clients_finish_times():
    assert deadlines.quantile_deadline(times(), ALL, 0.5) == 8.0  # of 4, 6, 10, 14
    assert deadlines.quantile_deadline(times(), np.array([True, True, True, False]), 0.5) == 6.0
    assert deadlines.quantile_deadline(times(), ALL, 1.0) == 14.0
    assert deadlines.quantile_deadline(times(), np.zeros(4, bool), 0.5) == math.inf


@pytest.mark.parametrize("kw, words", [
    (dict(round_deadline=3.0, deadline_quantile=0.5), "only one"),
    (dict(round_deadline=0.0), "--round-deadline 0"),
    (dict(deadline_quantile=1.5), "--deadline-quantile 1.5"),
    (dict(straggler_policy="partial"), "needs a deadline"),
    (dict(round_deadline=1.0, straggler_policy="late"), "drop or partial"),
    (dict(over_select=0.5), "≥ 1"),
    (dict(over_select=3.0), "at most 2.66667"),
    (dict(over_select=2.0, strategy="stream:2"), "cannot be streamed"),
])
def test_bad_deadline_settings_are_one_sentence(kw, words):
    with pytest.raises(ConfigError, match=words):
        RunConfig(**{**TINY, **kw}).validate()


@pytest.fixture(scope="module")
def timed():
    """FedAvg with a deadline far away (nobody is cut), its initial state and progress."""
    sim = Simulation(RunConfig(**TINY, round_deadline=1e9))
    return sim, sim.state, dict(sim.progress), sim.devices


def reset(timed, **clock):
    """``timed``'s simulation back at round 0 with its own devices and the ``clock`` settings given."""
    sim, state, progress, profiles = timed
    sim.state, sim.progress, sim.clock.profiles = state, dict(progress), profiles
    sim.clock.deadline_s, sim.clock.policy = clock.get("deadline", 1e9), clock.get("policy", "drop")
    sim.clock.availability = Availability(clock.get("availability", "always"), 8, 0)
    return sim


def test_the_prediction_is_the_device_model_s_time_for_fedavg(timed):
    """Download, steps and upload predicted from the plan equal what the device model counts after the round."""
    sim = reset(timed)
    prepared = sim.prepare_round(0)
    predicted = sim.clock.predict(sim.state, prepared.cohort, prepared.key)
    metrics = jax.device_get(sim.run_round(prepared))
    metrics.update(engine_metrics.traffic_totals(metrics))
    flops = sim.costs.client_flops(prepared.cohort, metrics["client_steps_per_client"])
    seconds = devices.client_times(sim.devices, prepared.ids, flops, metrics["download_bytes_per_client"],
                                   metrics["upload_bytes_per_client"])
    assert prepared.timing.outcome.end_s is None and prepared.valid.all()
    np.testing.assert_allclose(predicted.finish(), seconds, rtol=1e-12)
    assert predicted.steps.tolist() == [4, 4, 4] and (predicted.upload_bytes == 55_210 * 4).all()


def uncut(sim, t):
    """Round ``t``'s sampled cohort before any cut, and every client's predicted times."""
    ids, valid, key, pack_seed = sim.sample_cohort(t)
    return ids, sim.clock.predict(sim.state, sim.cohort(ids, pack_seed, np.ones_like(valid)), key)


def test_a_deadline_cuts_steps_inside_the_compiled_round(timed):
    """Compute-bound devices (transfers all but free) of 1, 2 and 4 MFLOP/s: the partial policy's step counts go
    into the cohort's step mask and the round trains exactly those; the drop policy loses every client and
    counts the steps each did by the deadline as wasted."""
    n = TINY["num_clients"]
    slow = devices.DeviceProfiles(np.array([1e6, 2e6, 4e6] * 3)[:n], np.full(n, 1e15), np.full(n, 1e15))
    traces = None
    for policy in ("partial", "drop"):
        sim = reset(timed, policy=policy)
        sim.clock.profiles = slow  # sim.devices reads the clock's
        ids, predicted = uncut(sim, 0)
        deadline = 2.5 * float(predicted.step_s.min())  # the fastest sampled device fits 2 of its 4 steps
        sim.clock.deadline_s = deadline
        fit = np.floor(deadline / predicted.step_s).astype(int)
        prepared = sim.prepare_round(0)
        outcome = prepared.timing.outcome
        record = sim.finish_round(prepared, sim.run_round(prepared))
        if policy == "partial":
            assert outcome.steps.tolist() == fit.tolist() and prepared.valid.tolist() == (fit > 0).tolist()
            assert record["client_steps"] == fit.sum() and record["simulated_time_s"] == deadline
            assert record["wasted_flops"] == 0
        else:
            assert record["clients"] == record["client_steps"] == 0 and record["clients_dropped"] == 3
            assert record["wasted_flops"] == round(float((fit * predicted.step_flops).sum()))
        assert record["clients_finished"] + record["clients_dropped"] == record["clients_sampled"] == 3
        # values in the cohort, not shapes: the second cut round compiles nothing (run alone, the first compiles)
        traces = sim.round.trace_count if traces is None else traces
        assert sim.round.trace_count == traces > 0


def test_without_a_cut_the_timed_round_trains_as_before(timed):
    """A deadline nobody misses, the partial policy and availability 1 change nothing the round computes."""
    plain = Simulation(RunConfig(**TINY))
    before = list(plain.rounds())
    sim = reset(timed, policy="partial", availability="1")
    after = list(sim.rounds())
    for a, b in zip(jax.tree.leaves(plain.state.variables), jax.tree.leaves(sim.state.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    same = ("train_loss", "client_steps", "upload_bytes", "client_flops", "simulated_time_s", "test_accuracy",
            "clients_sampled", "clients_finished", "wasted_flops", "simulated_clock_s")
    assert [{k: r[k] for k in same} for r in before] == [{k: r[k] for k in same} for r in after]
    assert before[-1]["simulated_clock_s"] == before[-1]["cumulative_simulated_time_s"]


def test_over_selection_samples_more_and_keeps_the_k_fastest():
    sim = Simulation(RunConfig(**{**TINY, "rounds": 2}, over_select=1.5))  # ⌈1.5 · 3⌉ = 5 sampled
    assert sim.round.ctx.cohort_size == 5
    for t in range(2):
        _, predicted = uncut(sim, t)
        finish = predicted.finish()
        prepared = sim.prepare_round(t)
        assert np.flatnonzero(prepared.valid).tolist() == np.sort(np.argsort(finish, kind="stable")[:3]).tolist()
        record = sim.finish_round(prepared, sim.run_round(prepared))
        assert (record["clients_sampled"], record["clients_finished"], record["clients"]) == (5, 3, 3)
        assert record["simulated_time_s"] == np.sort(finish)[2]  # the round ends when the third reports
        assert record["wasted_flops"] > 0 and record["wasted_bytes"] > 0


def test_a_private_run_accounts_the_draw_it_made(tmp_path):
    """DP's accountant is given ⌈F·K⌉ of the clients online: 5 of the 6 a trace keeps online."""
    trace = tmp_path / "trace.csv"
    trace.write_text("client_id,start_s,end_s\n" + "".join(f"{i},0,1e9\n" for i in range(6)))
    sim = Simulation(RunConfig(**{**TINY, "rounds": 2}, over_select=1.5, availability=str(trace), dp_clip=1.0,
                               dp_noise_multiplier=1.0))
    records = list(sim.rounds())
    assert sim.progress["dp_rounds"] == {"6:5": 2} and all(r["clients_sampled"] == 5 for r in records)


def test_replicas_cut_and_draw_as_their_own_runs_would():
    """--seeds: each replica's deadline and availability decisions are its own run's (the same host halves)."""
    from fedpartial._src.experiment import replicas

    config = RunConfig(**{**TINY, "rounds": 2}, deadline_quantile=0.5, availability="0.7")
    together = replicas.run_seeds(config, [0, 1])["results"]
    keys = ("clients", "clients_sampled", "client_steps", "wasted_bytes", "simulated_clock_s")
    for seed, result in zip((0, 1), together):
        alone = list(Simulation(RunConfig(**{**TINY, "rounds": 2, "seed": seed}, deadline_quantile=0.5,
                                          availability="0.7")).rounds())
        assert [{k: r[k] for k in keys} for r in result["records"]] == [{k: r[k] for k in keys} for r in alone]


def test_the_prediction_credits_sparse_clients_as_the_device_model_does():
    """--sparse-flops: a FedDST client's predicted step FLOPs are the device model's count of its trained share,
    below the dense count; without the flag the prediction stays dense."""
    predicted = {}
    for sparse in (False, True):
        sim = Simulation(RunConfig(**{**TINY, "method": "feddst"}, round_deadline=1e9, sparse_flops=sparse))
        prepared = sim.prepare_round(0)
        predicted[sparse] = sim.clock.predict(sim.state, prepared.cohort, prepared.key).step_flops
        metrics = jax.device_get(sim.run_round(prepared))
        counted = sim.costs.client_flops(prepared.cohort, np.ones(len(prepared.ids)), None,
                                         metrics["trained_density"] if sparse else None)
        np.testing.assert_allclose(predicted[sparse], counted, rtol=1e-12)
    assert np.all(predicted[True] < 0.6 * predicted[False])
