"""``--strategy auto`` on a CPU of several cores: the split over them chosen by measurement, the command run
again on them (:mod:`fedpartial._src.experiment.core_split`).  The split's rounds themselves (bit for bit one
device's for ``stepwise:1``) are tested on 4 fake devices in ``tests/engine/test_sharding.py``."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from fedpartial._src.engine import conv_choice
from fedpartial._src.experiment import core_split, parts, population
from fedpartial._src.experiment.config import RunConfig

BASE = dict(dataset="synthetic", model="mlp", num_clients=4, cohort_size=2, rounds=1, local_steps=1, batch_size=4)


@pytest.mark.parametrize("split, chosen", [
    ({"lax/loop": 0.095, "lax/map": 0.080}, "lax/map"),  # the faster split
    ({"lax/loop": 0.105}, "lax/loop"),  # one device 5 % faster: within the margin, the split kept
    ({"lax/loop": 0.111}, "lax/loop"),  # 0.100 against 0.9 x 0.111 = 0.0999: 0.1 % short of the margin
    ({"lax/loop": 0.112}, None),  # 0.100 < 0.9 x 0.112 = 0.1008: one device faster by more than the margin
    ({}, None),  # the probe failed
])
def test_the_split_is_kept_unless_one_device_is_faster_by_the_margin(split, chosen):
    got = core_split.decide({"im2col/map": 0.100}, split, 2)
    assert (got and f"{got.impl}/{got.layout}") == chosen
    if got:
        assert got.devices == 2 and got.speedup == pytest.approx(0.100 / split[chosen])
        assert got.describe().startswith("the cohort split over the 2 CPU cores")
        assert got.describe().endswith("the split is the default)") == (got.speedup < 1)


def test_only_auto_on_one_cpu_device_is_considered(monkeypatch):
    monkeypatch.delenv("FEDPARTIAL_CONV_IMPL", raising=False)
    monkeypatch.delenv(core_split.ENV, raising=False)
    monkeypatch.setattr(core_split, "cores", lambda: 2)
    config = RunConfig(**BASE)
    assert core_split.skip_reason(config) is None
    for changed in ({"strategy": "stepwise:1"}, {"devices": 1}, {"mode": "async"}, {"cohort_size": 1}):
        assert core_split.skip_reason(dataclasses.replace(config, **changed)) is not None, changed
    monkeypatch.setattr(core_split, "cores", lambda: 1)
    assert core_split.skip_reason(config) is not None
    monkeypatch.setattr(core_split, "cores", lambda: 2)
    monkeypatch.setenv("FEDPARTIAL_CONV_IMPL", "lax")  # as the test suite runs: nothing measured
    assert core_split.skip_reason(config) is not None


def test_a_split_whose_devices_are_not_there_is_not_active(monkeypatch):
    split = core_split.CoreSplit(2, "lax", "loop", {"lax/loop": 0.05}, {"lax/loop": 0.1})
    monkeypatch.setenv(core_split.ENV, json.dumps(dataclasses.asdict(split)))
    assert core_split.active() is None  # this process has one device
    monkeypatch.setenv(core_split.ENV, "{not json")
    assert core_split.active() is None


def test_candidates_follow_the_model_the_lowering_and_the_method():
    assert core_split.candidates("auto", True, False) == conv_choice.SPLIT_CANDIDATES["conv"]
    assert ("mapped", "map") not in core_split.candidates("auto", True, True)  # differentiates twice
    assert core_split.candidates("auto", False, False) == (("lax", "loop"), ("lax", "map"))
    assert core_split.candidates("im2col", True, False) == (("im2col", "loop"),)


def test_a_probe_that_fails_leaves_the_run_on_one_device():
    assert core_split.split_seconds(("no_such_module:build", {}), parts.timing_spec(RunConfig(**BASE)),
                                    [("lax", "loop")], devices=2, batch_size=4, cohort_size=2, local_steps=1) == {}


def test_auto_runs_the_command_again_on_the_cores_when_the_split_measured_faster(tmp_path):
    """The kept measurements say the split is 2x faster: ``fedpartial run`` (auto) says so, starts again with
    two single-threaded devices and trains there (``stepwise:1``, the lax lowering); nothing is measured."""
    config = RunConfig(**BASE, out_dir=None)
    with_population, dataset = population.run_dataset(config)
    model = parts.build_model(config.model, dataset)
    cache = tmp_path / "cache" / "fedpartial"
    key = conv_choice.cache_key(model, config.batch_size, config.cohort_size, config.local_steps, "float32",
                                optimizer=parts.timing(config, dataset)["optimizer"])
    conv_choice.write_entry(str(cache), conv_choice.CACHE_FILE, key,
                            {"impl": "lax", "layout": "vmap", "seconds": {"lax/vmap": 0.02}})
    pairs = core_split.candidates("auto", False, False)
    split_key = "|".join([key, "lax/vmap", ",".join("/".join(p) for p in pairs), "cores=2"])
    conv_choice.write_entry(str(cache), core_split.CACHE_FILE, split_key,
                            {"split": {"lax/loop": 0.01, "lax/map": 0.015}, "one_device": {"lax/vmap": 0.02}})
    env = {k: v for k, v in os.environ.items() if k not in ("FEDPARTIAL_CONV_IMPL", core_split.ENV)}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "fedpartial", "run", "--dataset", "synthetic", "--model", "mlp",
                           "--clients", "4", "--cohort", "2", "--rounds", "1", "--local-steps", "1", "--batch-size",
                           "4", "--out", str(tmp_path / "runs"), "--name", "split", "--no-compile-cache"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "split" / "summary.json").read_text())
    if core_split.cores() < 2:
        assert summary["devices"] == 1
        return
    assert "note: --strategy auto runs the cohort split over the 2 CPU cores" in " ".join(proc.stdout.split())
    assert summary["devices"] == 2 and summary["strategy"] == "stepwise:1"
    assert "0.01 s a round against 0.02 s on one device" in summary["strategy_note"]
    assert json.loads((tmp_path / "runs" / "split" / "config.json").read_text())["strategy"] == "auto"
