"""The device model: profiles, distributions, simulated round time, and a simulation's time records."""

import dataclasses
import json
import math

import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.costs import devices
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.run_summary import summarize
from fedpartial._src.experiment.simulation import Simulation, run

# ------------------------------------------------------------------ simulated time


def _profiles(compute, down, up):
    return devices.DeviceProfiles(*(np.asarray(v, np.float64) for v in (compute, down, up)))


def test_round_time_hand_computed_three_clients():
    population = _profiles(compute=[2e9, 1e9, 4e9, 1e9], down=[1e6, 2e6, 4e6, 1e6], up=[5e5, 1e6, 1e6, 1e5])
    ids, valid = np.array([2, 0, 3]), np.array([True, True, False])
    flops, down, up = [8e9, 4e9, 1e12], [4e6, 3e6, 5e7], [1e6, 1e6, 1e7]
    times = devices.client_times(population, ids, flops, down, up)
    # client 2: 8e9/4e9 + 4e6/4e6 + 1e6/1e6 = 2 + 1 + 1; client 0: 4e9/2e9 + 3e6/1e6 + 1e6/5e5 = 2 + 3 + 2;
    # client 3 is padding: 1e12/1e9 + 5e7/1e6 + 1e7/1e5 = 1150 s, which never counts.
    np.testing.assert_allclose(times, [4.0, 7.0, 1150.0])
    assert devices.round_time(times, valid) == 7.0
    assert devices.round_time(times, [False, False, False]) == 0.0
    # Expected execution time of the same work on every device (FedAD's ET_k): ids 0..3.
    np.testing.assert_allclose(devices.expected_execution_time(population, 4e9, 2e6, 1e6),
                               [2 + 2 + 2, 4 + 1 + 1, 1 + 0.5 + 1, 4 + 2 + 10])


# ------------------------------------------------------------------ profiles


def test_profiles_are_seeded_and_each_quantity_has_its_own_stream():
    a = devices.sample_profiles(50, seed=3)
    b = devices.sample_profiles(50, seed=3)
    c = devices.sample_profiles(50, seed=4)
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(x, y)
        assert x.shape == (50,) and np.all(x > 0) and np.all(np.isfinite(x))
        assert not np.array_equal(x, z)
    # Another upload distribution leaves compute and download draws as they were.
    d = devices.sample_profiles(50, seed=3, upload="uniform:1e5:2e5")
    np.testing.assert_array_equal(d.compute_flops_per_s, a.compute_flops_per_s)
    np.testing.assert_array_equal(d.download_bytes_per_s, a.download_bytes_per_s)
    assert np.all((d.upload_bytes_per_s >= 1e5) & (d.upload_bytes_per_s <= 2e5))
    assert np.all(devices.sample_profiles(4, 0, compute="3e9").compute_flops_per_s == 3e9)


def test_default_distributions_have_their_stated_medians():
    p = devices.sample_profiles(20_000, seed=0)
    assert np.median(p.compute_flops_per_s) == pytest.approx(5e9, rel=0.03)
    assert np.median(p.download_bytes_per_s) == pytest.approx(2.5e6, rel=0.03)
    assert np.median(p.upload_bytes_per_s) == pytest.approx(6.25e5, rel=0.03)
    # σ = 0.7 of the log: 10th to 90th percentile ≈ 2.0 to 12.3 GFLOP/s.
    lo, hi = np.percentile(p.compute_flops_per_s, [10, 90])
    assert lo == pytest.approx(5e9 * math.exp(-1.2816 * 0.7), rel=0.05)
    assert hi == pytest.approx(5e9 * math.exp(1.2816 * 0.7), rel=0.05)


@pytest.mark.parametrize("text, words", [
    ("fast", "is not a positive number"),
    ("0", "positive finite"),
    ("nan", "positive finite"),
    ("-2e9", "positive finite"),
    ("lognormal:-1:0.5", "positive finite median"),
    ("lognormal:1e9", "is not a positive number"),
    ("lognormal:1e9:inf", "finite σ"),
    ("uniform:5:1", "0 < LOW ≤ HIGH"),
    ("gamma:1:2", "is not a positive number"),
])
def test_bad_distribution_is_one_sentence(text, words):
    with pytest.raises(UserError, match="compute speed") as e:
        devices.parse_distribution(text, "compute speed")
    assert words in str(e.value) and str(e.value).count(".") <= 3


def test_csv_round_trip_and_rows_cycled_by_id(tmp_path):
    profiles = devices.sample_profiles(7, seed=1)
    path = tmp_path / "devices.csv"
    devices.save_profiles(path, profiles)
    loaded = devices.load_profiles(path, 7)
    for x, y in zip(profiles, loaded):
        np.testing.assert_array_equal(x, y)  # exact: floats are written with repr
    # Two device kinds, extra column and another column order: client i gets row i mod 2.
    path.write_text("name,upload_bytes_per_s,compute_flops_per_s,download_bytes_per_s\n"
                    "phone,1e5,1e9,2e6\nboard,4e5,8e9,1e7\n")
    cycled = devices.load_profiles(path, 5)
    np.testing.assert_array_equal(cycled.compute_flops_per_s, [1e9, 8e9, 1e9, 8e9, 1e9])
    np.testing.assert_array_equal(cycled.upload_bytes_per_s, [1e5, 4e5, 1e5, 4e5, 1e5])
    np.testing.assert_array_equal(cycled.download_bytes_per_s, [2e6, 1e7, 2e6, 1e7, 2e6])


@pytest.mark.parametrize("text, words", [
    ("compute_flops_per_s,download_bytes_per_s\n1e9,1e6\n", "no column 'upload_bytes_per_s'"),
    ("compute_flops_per_s,download_bytes_per_s,upload_bytes_per_s\n1e9,1e6,1e5\n1e9,-3,1e5\n",
     "row 2 has download_bytes_per_s = '-3'"),
    ("compute_flops_per_s,download_bytes_per_s,upload_bytes_per_s\nnan,1e6,1e5\n", "row 1 has compute_flops_per_s"),
    ("compute_flops_per_s,download_bytes_per_s,upload_bytes_per_s\n1e9,1e6,inf\n", "upload_bytes_per_s = 'inf'"),
    ("compute_flops_per_s,download_bytes_per_s,upload_bytes_per_s\n1e9,fast,1e5\n", "= 'fast'"),
    ("compute_flops_per_s,download_bytes_per_s,upload_bytes_per_s\n1e9,1e6\n", "upload_bytes_per_s = ''"),
    ("compute_flops_per_s,download_bytes_per_s,upload_bytes_per_s\n", "no rows"),
    ("", "no column 'compute_flops_per_s'"),
])
def test_bad_csv_is_one_sentence_naming_row_and_value(tmp_path, text, words):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        devices.load_profiles(path, 3)
    message = str(e.value)
    assert words in message and str(path) in message and len(message.splitlines()) == 1, message


def test_missing_csv_is_one_sentence(tmp_path):
    with pytest.raises(UserError, match="cannot be read"):
        devices.load_profiles(tmp_path / "nope.csv", 3)


def test_a_binary_file_is_one_sentence(tmp_path):
    path = tmp_path / "devices.csv"
    path.write_bytes(b"\xff\xfe\x00compute\x81\n")
    with pytest.raises(UserError, match=f"device profiles file {path} is not a CSV text file"):
        devices.load_profiles(path, 3)


# ------------------------------------------------------------------ simulation


TINY = {"num_clients": 6, "cohort_size": 3, "rounds": 2, "local_steps": 2, "local_epochs": None, "batch_size": 8,
        "model": "mlp", "compute_speed": "1e9", "download_bandwidth": "2e6", "upload_bandwidth": "1e6"}


def test_simulation_records_time_and_flops_and_time_to_target(tmp_path):
    config = RunConfig(**TINY, out_dir=str(tmp_path), run_name="r", target_accuracy=0.01)
    sim = Simulation(config)
    summary = run(config, sim=sim)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        # FedAvg with 2 local steps each: every client does the same work and moves the same bytes,
        # so the slowest client's time is any client's (constant devices: 1 GFLOP/s, 2 MB/s down, 1 MB/s up).
        per_client = r["client_flops"] / 3 / 1e9 + r["download_bytes"] / 3 / 2e6 + r["upload_bytes"] / 3 / 1e6
        assert r["simulated_time_s"] == pytest.approx(per_client, rel=1e-9)
        assert r["client_flops"] > 3 * 2 * 8 * 2 * (64 * 200 + 200 * 200)  # at least the forward passes
    assert records[1]["client_flops"] == records[0]["client_flops"]
    assert records[1]["cumulative_simulated_time_s"] == pytest.approx(
        records[0]["simulated_time_s"] + records[1]["simulated_time_s"])
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    for s in (summary, saved):
        assert s["total_simulated_time_s"] == pytest.approx(records[1]["cumulative_simulated_time_s"])
        assert s["total_client_flops"] == 2 * records[0]["client_flops"]
        # Any model beats 1% accuracy: the target is reached after the first evaluated round.
        assert (s["target_accuracy"], s["round_to_target"]) == (0.01, 1)
        assert s["time_to_target_s"] == pytest.approx(records[0]["simulated_time_s"])
    # A target never reached is null (JSON null in summary.json); so is one not asked for.
    assert max(r["test_accuracy"] for r in records) < 1.0
    for target in (1.0, None):
        other = summarize(dataclasses.replace(config, target_accuracy=target), sim, summary["records"], 0.0)
        assert (other["target_accuracy"], other["time_to_target_s"], other["round_to_target"]) == (target, None, None)
        assert json.loads(json.dumps(other))["time_to_target_s"] is None


@pytest.mark.parametrize("kw, words", [
    ({"target_accuracy": 0.0}, "--target-accuracy"),  # messages name the flag as it is typed
    ({"target_accuracy": 1.5}, "--target-accuracy"),
    ({"target_accuracy": math.nan}, "--target-accuracy"),
    ({"compute_speed": "-1"}, "--compute-speed"),
    ({"upload_bandwidth": "lognormal:0:1"}, "--upload-bandwidth"),
    ({"device_profiles": "/nonexistent/devices.csv"}, "cannot be read"),
])
def test_bad_device_configuration_is_one_sentence(kw, words):
    with pytest.raises(ConfigError, match=words):
        RunConfig(**{**TINY, **kw}).validate()
