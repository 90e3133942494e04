"""The peer benchmark's fedpartial side on its tiny row, and how the driver turns the sides' rounds into a row."""

import jax
import numpy as np
import pytest

from benchmarks import peers, peers_fedpartial
from benchmarks.peers_rows import ROWS


@pytest.fixture
def two_cores(monkeypatch):
    """The split over 2 cores is considered; what its timing process measures is set per test."""
    monkeypatch.setattr(peers_fedpartial.core_split, "cores", lambda: 2)
    monkeypatch.setattr(peers_fedpartial.jax, "device_count", lambda: 1)

    def measured(seconds):
        monkeypatch.setattr(peers_fedpartial.core_split, "split_seconds", lambda *a, **k: dict(seconds))
    return measured


def test_the_fedpartial_side_times_every_configuration_on_the_same_cohorts(two_cores):
    two_cores({})  # the split's process failed: one device
    got = peers_fedpartial.main(1, {"quick": ["auto", "plain", "lax/fused:1"]})["rows"]["quick"]
    # auto (a dense model on a CPU: its three layouts timed) is timed as the configuration it names, added to the
    # row's when it is not one of them
    chosen = got["auto"]["config"]
    assert chosen in ("lax/stepwise:1", "lax/fused", "lax/fused:1") and got["auto"]["conv_impl"] == "lax"
    assert set(got["round_s"]) == {"plain", "lax/fused:1", chosen, "auto"}
    assert got["round_s"]["auto"] is got["round_s"][chosen]
    assert all(len(t) == 2 and min(t) > 0 for t in got["round_s"].values())  # the compiling round and one more


def test_auto_names_the_split_when_it_measured_faster_and_leaves_its_timing_to_the_split_process(two_cores):
    two_cores({"lax/loop": 1.0, "lax/map": 1e-9})
    got = peers_fedpartial.auto_choice("quick")
    assert got["config"] == "lax/fused:1@2" and got["split_seconds"]["lax/map"] == 1e-9
    two_cores({"lax/loop": 1e3, "lax/map": 1e3})  # slower than one device: kept there
    assert "@" not in peers_fedpartial.auto_choice("quick")["config"]


def test_a_row_is_the_median_of_every_runs_timed_rounds_and_the_ratios_follow():
    def side(seconds):  # a process's result for the row 'quick'
        return {"rows": {"quick": {"round_s": seconds}}, "loadavg_before": (1.0, 1.0, 1.0)}

    runs = [{"flower": side([9.0, 2.0, 4.0]), "fedpartial": side({"plain": [9.0, 1.0, 1.0], "lax/x": [9.0, 0.5, 1.5]}),
             "split": side({"lax/x@2": [9.0, 0.4, 0.6]})},
            {"flower": side([9.0, 3.0, 5.0]), "fedpartial": side({"plain": [9.0, 1.0, 3.0], "lax/x": [9.0, 0.5, 0.5]}),
             "split": side({"lax/x@2": [9.0, 0.5, 0.5]})}]
    runs[1]["fedpartial"]["rows"]["quick"]["auto"] = {"config": "lax/x"}
    runs[1]["fedpartial"]["rows"]["quick"]["round_s"]["auto"] = [9.0, 0.5, 0.5]
    (row,) = peers.gather(["quick"], runs, {"quick": ["auto", "plain", "lax/x"]}, {"quick": ["lax/x@2"]})
    assert row["median_round_s"] == {"flower": 3.5, "plain": 1.0, "lax/x": 0.5, "lax/x@2": 0.5, "auto": 0.5}
    s = row["summary"]
    assert s["best"] in ("lax/x", "lax/x@2") and s["best_s"] == 0.5 and s["best_speedup_vs_flower"] == 7.0
    assert s["auto_vs_best"] == 1.0 and s["auto_speedup_vs_plain"] == 2.0 and row["auto"] == {"config": "lax/x"}
    assert "| quick | 3.500 s | 0.500 s" in peers.table([row])


@pytest.mark.parametrize("row", ["mlp:10", "cnn:10", "cnn2c1f:10", "digits"])
def test_both_sides_train_the_same_layers(row):
    torch = pytest.importorskip("torch")  # the peers extra
    from benchmarks.peers_flower import torch_model

    spec = ROWS[row]
    variables = jax.eval_shape(peers_fedpartial.engine_model(spec).init_variables, jax.random.key(0))
    ours = sorted(int(np.prod(a.shape)) for a in jax.tree.leaves(variables["params"]))
    theirs = sorted(p.numel() for p in torch_model(spec.model, spec.side).parameters())
    assert ours == theirs and isinstance(torch.__version__, str)


def test_the_profile_times_every_piece_of_a_step_on_the_jax_side():
    from benchmarks import peers_profile

    got = peers_profile.jax_side("cnn", batch=2, side=8, repeats=1)
    assert set(got) == {"step_s", "conv1_s", "conv2_s", "dense_s", "versions"}
    assert all(got[k] > 0 for k in ("step_s", "conv1_s", "conv2_s", "dense_s"))


def test_the_profile_times_clients_side_by_side_on_the_jax_side():
    """One client's local training alone, then one per device at once (here the one CPU device twice: the same
    code path as one per core)."""
    from benchmarks import peers_profile

    device = jax.local_devices()[0]
    got = peers_profile.jax_side_by_side("cnn", batch=2, side=8, steps=2, window=0.0, devices=[device, device])
    assert got["clients_at_once"] == 2 and got["steps"] == 2 and got["impl"] == "mapped" and got["timed"] == [3, 3]
    assert got["alone_step_s"] > 0 and got["side_by_side_step_s"] > 0


def test_the_rendered_profile_bounds_a_round_by_its_steps_side_by_side():
    from benchmarks.render_docs import side_by_side_lines

    # timed over 5 steps: the bound still counts each row's own 10 local steps
    pair = {"steps": 5, "clients_at_once": 2, "alone_step_s": 0.008, "side_by_side_step_s": 0.010, "throughput": 1.6}
    d = {"settings": {"model": "cnn", "impl": "mapped", "side": 28, "batch": 32},
         "side_by_side": {"jax": pair, "torch": {**pair, "side_by_side_step_s": 0.012}}}
    text = "\n".join(side_by_side_lines(d))
    # cnn:50: 50 clients x 10 steps x 10 ms / 2 cores = 2.5 s; PyTorch's 12 ms: 3.0 s
    assert "| cnn:10's steps | cnn:50's steps |" in text
    assert "| 8.00 ms | 10.00 ms | 1.60× | 0.50 s | 2.50 s |" in text and "3.00 s |" in text
    assert side_by_side_lines({"settings": {}, "side_by_side": {"jax": {"error": "x"}}}) == []


def test_the_profile_times_a_torch_client_for_its_window():
    pytest.importorskip("torch")  # the peers extra
    from benchmarks import peers_profile

    got = peers_profile.torch_local_training("cnn", batch=2, side=8, steps=2, window=0.0)
    assert got["timed"] == 3 and got["step_s"] > 0
