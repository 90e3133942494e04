"""Availability: the four models, CSV traces and their errors, the server's wait, and a run that samples only
available clients on a clock that advances by each round's time (and resumes bit for bit)."""

import json
import os
import re
import signal

import jax
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import availability, signals
from fedpartial._src.experiment.availability import Availability
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.simulation import Simulation, run

TINY = dict(model="mlp", num_clients=8, cohort_size=3, rounds=3, local_steps=2, local_epochs=None, batch_size=8)


def trace_file(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_values_are_parsed_with_their_defaults():
    assert availability.parse("always") == ("always", ())
    assert availability.parse("0.7") == ("probability", (0.7,))
    assert availability.parse("diurnal") == ("diurnal", (0.1, 0.9, 86_400.0))
    assert availability.parse("diurnal:0.2:0.6") == ("diurnal", (0.2, 0.6, 86_400.0))
    assert availability.parse("diurnal:0:1:3600") == ("diurnal", (0.0, 1.0, 3600.0))


@pytest.mark.parametrize("text, words", [
    ("1.5", "in (0, 1]"), ("0", "in (0, 1]"), ("nan", "in (0, 1]"), ("diurnal:0.9:0.1", "LOW ≤ HIGH"),
    ("diurnal:0.1", "diurnal:LOW:HIGH"), ("diurnal:a:b", "with numbers"), ("sometimes", "no such file"),
])
def test_bad_values_are_one_sentence(text, words):
    with pytest.raises(UserError, match=re.escape(words)) as e:
        availability.parse(text)
    assert str(e.value).count(". ") == 0 and str(e.value).startswith("--availability")


def test_a_probability_is_an_independent_seeded_draw_per_round():
    model = Availability("0.3", 20_000, seed=1)
    first = model.available(0.0, round=0)
    assert abs(first.mean() - 0.3) < 0.015  # 4.6 σ
    np.testing.assert_array_equal(first, Availability("0.3", 20_000, seed=1).available(123.0, round=0))
    assert (first != model.available(0.0, round=1)).any() and (first != model.available(0.0, 0, attempt=1)).any()


def test_diurnal_follows_each_client_s_sinusoid():
    phases = np.array([0.0, 6 * 3600.0, -3 * 3600.0])
    p = lambda t: availability.diurnal_probability(t, phases, 0.1, 0.9, 86_400.0)  # noqa: E731
    np.testing.assert_allclose(p(0.0), [0.9, 0.5, 0.1 + 0.8 * (1 + np.cos(np.pi / 4)) / 2])
    np.testing.assert_allclose(p(12 * 3600.0), [0.1, 0.5, 0.1 + 0.8 * (1 + np.cos(5 * np.pi / 4)) / 2])
    phases = availability.diurnal_phases(50_000, seed=0, period_s=86_400.0)
    assert abs(phases.std() - 4 * 3600) < 100  # peaks spread by 4 hours around midnight
    model = Availability("diurnal", 50_000, seed=0)
    day, night = model.available(0.0, round=0).mean(), model.available(43_200.0, round=0).mean()
    expect = lambda t: availability.diurnal_probability(t, model.phases, 0.1, 0.9, 86_400.0).mean()  # noqa: E731
    assert abs(day - expect(0.0)) < 0.01 and abs(night - expect(43_200.0)) < 0.01 and day > 0.7 > 0.3 > night


def test_a_trace_gives_the_clients_inside_an_interval(tmp_path):
    path = trace_file(tmp_path, "start_s,client_id,end_s,device\n0,0,10,a\n20,0,30,a\n5,2,25,b\n0,9,100,c\n")
    model = Availability(path, 4, seed=0)
    assert model.available(0.0, 0).tolist() == [True, False, False, False]  # client 9 is not in this population
    assert model.available(10.0, 0).tolist() == [False, False, True, False]  # an interval ends before end_s
    assert model.available(20.0, 0).tolist() == [True, False, True, False]
    everyone = np.ones(4, bool)
    assert model.wait(12.0, 0, everyone)[1] == 0.0
    assert model.wait(26.0, 0, np.array([False, True, True, True])) is None  # only client 0 has intervals left
    assert model.wait(30.0, 0, everyone) is None  # nobody has an interval left: the run ends
    assert model.next_start(10.5, everyone) == 20.0 and model.next_start(10.5, np.zeros(4, bool)) is None
    may, waited = Availability(path, 4, 0).wait(25.0, 3, np.array([True, False, True, False]))
    assert waited == 0.0 and may.tolist() == [True, False, False, False]


def test_the_server_waits_for_the_next_interval_or_polls_again(tmp_path):
    path = trace_file(tmp_path, "client_id,start_s,end_s\n1,50,60\n3,80,90\n")
    may, waited = Availability(path, 4, 0).wait(10.0, 0, np.ones(4, bool))
    assert waited == 40.0 and may.tolist() == [False, True, False, False]
    may, waited = Availability(path, 4, 0).wait(10.0, 0, np.array([True, False, True, True]))
    assert waited == 70.0 and may.tolist() == [False, False, False, True]
    may, waited = Availability("0.01", 3, seed=0).wait(0.0, 0, np.ones(3, bool))  # drawn again every minute
    assert may.any() and waited % availability.POLL_S == 0 and waited > 0


@pytest.mark.parametrize("text, words", [
    ("client,start_s,end_s\n0,0,1\n", "no column 'client_id'"),
    ("client_id,start_s,end_s\n", "no rows"),
    ("client_id,start_s,end_s\n0,0,1\n-1,0,1\n", "row 2 has client_id = '-1'"),
    ("client_id,start_s,end_s\n1.5,0,1\n", "row 1 has client_id = '1.5'"),
    ("client_id,start_s,end_s\n0,5,5\n", "row 1 has start_s = '5' and end_s = '5'"),
    ("client_id,start_s,end_s\n0,x,5\n", "row 1 has start_s = 'x'"),
    ("client_id,start_s,end_s\n0,0,inf\n", "finite numbers"),
])
def test_a_bad_trace_is_one_sentence_naming_the_file_and_row(tmp_path, text, words):
    path = trace_file(tmp_path, text)
    with pytest.raises(ConfigError, match=words) as e:
        RunConfig(**TINY, out_dir=None, availability=path).validate()
    assert path in str(e.value) and str(e.value).count(". ") == 0
    with pytest.raises(UserError, match="cannot be read"):
        availability.load_trace(str(tmp_path))  # a folder


def test_a_run_samples_only_available_clients_on_its_clock(tmp_path):
    """Clients 0–3 are there from 100 s on, 4–7 never: the server waits 100 s, then every sampled client is
    available; the clock advances by each round's simulated time."""
    rows = "".join(f"{i},100,1e9\n" for i in range(4))
    path = trace_file(tmp_path, "client_id,start_s,end_s\n" + rows)
    sim = Simulation(RunConfig(**TINY, out_dir=None, availability=path))
    clock = 0.0
    for t in range(TINY["rounds"]):
        prepared = sim.prepare_round(t)
        assert set(prepared.ids[prepared.valid].tolist()) <= {0, 1, 2, 3} and prepared.valid.sum() == 3
        record = sim.finish_round(prepared, sim.run_round(prepared))
        clock += prepared.timing.wait_s + record["simulated_time_s"]
        assert record["simulated_clock_s"] == clock and record["clients_sampled"] == 3
        assert prepared.timing.wait_s == (100.0 if t == 0 else 0.0)
    # the same sums added in another order
    assert sim.progress["simulated_clock_s"] == clock == pytest.approx(
        100.0 + sim.progress["cumulative_simulated_time_s"], rel=1e-12)


def test_a_run_with_availability_and_a_deadline_resumes_bit_for_bit(tmp_path):
    """Stopped after round 1 and resumed: the clock in the checkpoint's progress gives the same draws."""
    config = RunConfig(**{**TINY, "rounds": 3}, out_dir=str(tmp_path), availability="0.5", deadline_quantile=0.7)
    sim = Simulation(config)
    start = sim.state, dict(sim.progress)
    whole = run(config, sim=sim)
    final = sim.state
    sim.state, sim.progress = start[0], dict(start[1])

    def on_round(record):
        if record["round"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(signals.RunInterrupted) as stopped:
        run(config, sim=sim, on_round=on_round)
    run_dir = stopped.value.summary["run_dir"]
    sim.state, sim.progress = start[0], dict(start[1])
    resumed = run(config, sim=sim, resume=run_dir)
    assert resumed["resumed_from_round"] == 1
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(sim.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wall = ("round_time_s", "wall_time_s", "host_time_s")
    records = [{k: v for k, v in json.loads(line).items() if k not in wall}
               for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert records == [{k: v for k, v in r.items() if k not in wall} for r in whole["records"]]
    assert resumed["simulated_clock_s"] == whole["simulated_clock_s"] == records[-1]["simulated_clock_s"]
