"""The command line: a small end-to-end run, its files, and one-sentence errors with status 2."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from fedpartial._src.cli.main import main

SMALL = ["run", "--rounds", "2", "--clients", "6", "--cohort", "3", "--local-steps", "2", "--batch-size", "8",
         "--model", "mlp"]


def test_small_run_writes_results(tmp_path, capsys):
    """A small run's files; then existing results are never overwritten (one run fewer than a test of its own)."""
    assert main(SMALL + ["--out", str(tmp_path), "--name", "r"]) == 0
    run_dir = tmp_path / "r"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    first = records[0]
    for key in ("test_accuracy", "test_loss", "train_loss", "client_steps", "upload_bytes", "download_bytes",
                "cumulative_upload_bytes", "round_time_s", "wall_time_s", "simulated_time_s", "client_flops"):
        assert key in first, key
    assert first["client_steps"] == 3 * 2
    # FedAvg on the 55,210-parameter MLP: every client moves the whole float32 model both ways.
    assert first["upload_bytes"] == first["download_bytes"] == 3 * 55_210 * 4
    assert records[1]["cumulative_upload_bytes"] == 2 * first["upload_bytes"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and 0.0 <= summary["final_test_accuracy"] <= 1.0
    assert json.loads((run_dir / "config.json").read_text())["cohort_size"] == 3
    out = capsys.readouterr().out
    assert "final test accuracy" in out and "holds the rest out" not in out  # FedAvg holds nothing out
    # existing results are never overwritten: a second run of the same name (one round, another seed) goes to r-1
    before = (run_dir / "metrics.jsonl").read_bytes()
    assert main(SMALL + ["--rounds", "1", "--out", str(tmp_path), "--name", "r", "--seed", "1"]) == 0
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    assert (tmp_path / "r-1" / "metrics.jsonl").exists()


def test_a_held_out_split_the_run_did_not_ask_for_is_said(tmp_path, capsys):
    """A personalised method evaluates each client's model on its held-out data: the 70/30 default is printed,
    with the reason and the flag that changes it, never silent."""
    from fedpartial._src.experiment.config import RunConfig
    from fedpartial._src.experiment.simulation import Simulation

    sim = Simulation(RunConfig(method="fedspu", dataset="synthetic", num_clients=4, cohort_size=2, rounds=1,
                               local_steps=1, out_dir=None))
    assert sim.train_fraction == 0.7 and "fedspu is personalised" in sim.holdout_note
    assert "--train-fraction" in sim.holdout_note
    asked = Simulation(RunConfig(method="fedspu", dataset="synthetic", num_clients=4, cohort_size=2, rounds=1,
                                 local_steps=1, train_fraction=0.8, out_dir=None))
    assert asked.holdout_note is None


@pytest.mark.parametrize(
    "args, words",
    [
        (["--clients", "5", "--cohort", "6"], "--cohort 6 is not allowed"),
        (["--alpha", "0"], "--alpha 0 is not allowed"),
        (["--alpha", "-1"], "--alpha -1 is not allowed"),
        (["--method", "fedsgd"], "method 'fedsgd' is unknown"),
        (["--dataset", "imagenet"], "dataset 'imagenet' is unknown"),
        (["--model", "gpt"], "model 'gpt' is unknown"),
        (["--model", "vgg9"], "8x8"),  # digits are 8×8: too small for VGG-9's four poolings
        (["--strategy", "parallel"], "strategy 'parallel'"),
        (["--partition", "pathological"], "partition 'pathological' is unknown"),
        (["--lr", "0"], "--lr 0 is not allowed"),
        (["--bn-policy", "local"], "BatchNorm policy"),
        (["--target-accuracy", "1.5"], "--target-accuracy 1.5 is not allowed: it must be a finite number in (0, 1]"),
        (["--compute-speed", "lognormal:fast:1"], "--compute-speed 'lognormal:fast:1'"),
        (["--device-profiles", "/nonexistent/devices.csv"], "cannot be read"),
    ],
)
def test_invalid_input_exits_2_with_one_sentence(tmp_path, capsys, args, words):
    out = tmp_path / "out"
    assert main(["run", "--rounds", "1", "--out", str(out)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words.lower() in err.lower(), err
    assert not out.exists() or not any(out.iterdir())  # nothing written for a bad configuration


def test_unprepared_tfds_dataset_says_how_to_prepare(tmp_path, capsys):
    assert main(["run", "--dataset", "cifar10", "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "cifar10" in err and "download_and_prepare" in err and len(err.strip().splitlines()) == 1


def test_console_script_has_no_traceback(capsys):
    proc = subprocess.run([sys.executable, "-m", "fedpartial", "run", "--clients", "3", "--cohort", "4"],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "--cohort 4 is not allowed" in proc.stderr
    # argparse's own usage errors: the same function, in this process (a second interpreter and JAX start-up
    # showed nothing more)
    assert main(["run", "--local-steps", "1", "--local-epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and "Traceback" not in err


@pytest.mark.slow
def test_default_run_reaches_sensible_accuracy(tmp_path):
    """The bare `fedpartial run` (≈40 s on 2 cores). Covered lighter by test_small_run_writes_results."""
    assert main(["run", "--out", str(tmp_path), "--name", "default"]) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["final_test_accuracy"] > 0.9


def test_method_flags_come_from_the_methods(capsys, tmp_path):
    """Each method's options are flags; --help shows the named method's only, and points to them without one."""
    from fedpartial._src.cli.main import build_parser

    def run_help(*argv):
        return build_parser(["run", *argv, "--help"]).command("run").format_help()

    for method, flags in {"fedprox": ("--mu",), "fedldf": ("--n",), "fedadp": ("--adp-fraction",),
                          "fedspu": ("--tiers",), "fedselect": ("--select-start", "--select-end")}.items():
        text = run_help("--method", method)
        assert f"options of {method}" in text and all(flag in text for flag in flags)
        assert "--mu" not in text or method == "fedprox"  # another method's option is not shown
    plain = run_help()
    assert "--mu" not in plain and "--tiers" not in plain
    assert "fedpartial run --method NAME --help" in plain
    assert len(plain.splitlines()) < 250  # every method's options would add about 170 lines
    # The rarer groups name their flags; --help-all gives each its help too.
    assert "Flags: --dp-clip, --dp-noise-multiplier" in " ".join(plain.split())
    assert "noise std" not in plain and "C: clip each client's update" not in plain
    full = build_parser(["run", "--help-all"]).command("run").format_help()
    assert "C: clip each client's update" in " ".join(full.split()) and "Flags: --dp-clip" not in full
    # A flag of another method is refused in one sentence.
    assert main(["run", "--method", "fedavg", "--mu", "0.1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--mu is an option of fedprox" in err and len(err.strip().splitlines()) == 1


def test_unexpected_errors_keep_their_traceback(monkeypatch, tmp_path):
    """Only the project's own input errors become one sentence; a bug inside keeps its traceback."""
    from fedpartial._src.experiment import simulation

    def broken(self, *a, **k):
        raise ValueError("a bug deep inside a method")

    monkeypatch.setattr(simulation.Simulation, "__init__", broken)
    with pytest.raises(ValueError, match="a bug deep inside"):
        main(SMALL + ["--out", str(tmp_path)])


def test_record_decisions_writes_masks(tmp_path):
    import numpy as np
    assert main(SMALL + ["--method", "fedldf", "--n", "2", "--record-decisions", "--out", str(tmp_path),
                         "--name", "d"]) == 0
    files = sorted((tmp_path / "d" / "decisions").iterdir())
    assert [f.name for f in files] == ["round-00001.npz", "round-00002.npz"]
    saved = np.load(files[0])
    layers = saved["selection/upload/layers"]  # [K, L]: FedLDF's selection
    assert layers.shape == (3, 3) and (layers.sum(axis=0) == 2).all() and saved["client_ids"].shape == (3,)


def test_version_list_and_bare_command(capsys):
    from fedpartial._src.data.sources import DATASETS
    from fedpartial._src.methods.catalog import METHODS
    from fedpartial._src.models.registry import MODELS
    from fedpartial._src.version import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fedpartial {__version__}"
    for what, names in (("methods", METHODS), ("models", MODELS), ("datasets", DATASETS)):
        assert main(["list", what]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in lines] == list(names)  # one line each, name first
        assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # and a summary
    assert main(["list", "methods"]) == 0 and "feddhad" in capsys.readouterr().out
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("methods:\n") and "\nmodels:\n" in out and "\ndatasets:\n" in out
    assert main(["list", "gadgets"]) == 2
    assert "invalid choice: 'gadgets'" in capsys.readouterr().err
    # A bare `fedpartial` is a usage error: the usage on stderr, status 2.
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("usage: fedpartial") and "a command is required" in captured.err
    assert captured.out == ""


def test_every_flag_shows_its_default():
    from fedpartial._src.cli.main import build_parser
    commands = build_parser().subcommands.choices
    for name, sub in commands.items():
        for action in sub.flags:
            if action.option_strings and not action.dest.startswith("help") and action.help != argparse.SUPPRESS:
                assert "default" in sub._get_formatter()._get_help_string(action), (name, action.option_strings)
    text = commands["run"].format_help()
    for phrase in ("communication rounds (with --resume: extend the run to this many) [rounds] (default: 40)",
                   "the client batch size [examples] (default: 16)",
                   "(default: 0)", "(default: 2 when --local-steps"):
        assert phrase in " ".join(text.split()), phrase
    # --local-epochs has one default, said once.
    local_epochs = next(a for a in commands["run"].flags if "--local-epochs" in a.option_strings)
    assert commands["run"]._get_formatter()._get_help_string(local_epochs).count("default") == 1


def test_bad_input_is_refused_before_any_set_up(monkeypatch, tmp_path, capsys):
    """NaN, a bad --out and a residual model for a neuron method never reach the Simulation."""
    from fedpartial._src.experiment import simulation

    def never(*a, **k):
        raise AssertionError("set-up started")

    monkeypatch.setattr(simulation.Simulation, "__init__", never)
    for args in (["--lr", "inf"], ["--weight-decay", "nan"], ["--out", ""], ["--name", "/abs"],
                 ["--method", "fedspu", "--model", "resnet20"], ["--model", "vgg9"]):
        assert main(["run", "--out", str(tmp_path / "o")] + args) == 2, args
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_auto_streaming_is_shown_and_recorded(monkeypatch, tmp_path, capsys):
    from fedpartial._src.cli.main import build_parser, config_from_args
    from fedpartial._src.core import memory
    from fedpartial._src.experiment.simulation import Simulation

    est = Simulation(config_from_args(build_parser().parse_args(SMALL)), check_memory=False).memory
    room = (est.server + 1.5 * est.per_client) / memory.HEADROOM  # one client in flight fits, the cohort not
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (int(room), "RAM"))
    monkeypatch.setenv("COLUMNS", "300")  # the table on one line per row
    assert main(SMALL + ["--out", str(tmp_path), "--name", "r"]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["strategy"] == "stream-stepwise:1"
    assert summary["strategy_note"].startswith("auto streams the cohort: stepwise:1 would need about")
    assert "stream-stepwise:1 on cpu, data on the host (auto streams the cohort" in capsys.readouterr().out


#: the console script run with the command line's import slowed down (as on a slow or cold machine), so that a
#: Ctrl-C at any delay lands while it loads, whatever this machine's speed (a warm one loads in under 0.8 s)
SLOW_LOADING = """
import importlib.abc, sys, time
class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fedpartial._src.cli.main":
            time.sleep(5)
        return None
sys.meta_path.insert(0, Slow())
from fedpartial._src.cli.entry import main
sys.exit(main(["list", "methods"]))
"""


@pytest.mark.parametrize("after_s, slow", [(0.3, False), (0.8, True)], ids=["as-is", "slow-loading"])
def test_ctrl_c_while_the_command_line_loads_exits_130_with_one_sentence(after_s, slow):
    """The console script's guard (fedpartial._src.cli.entry): no import traceback, nothing written."""
    import signal
    import subprocess
    import sys
    import time

    args = ["-c", SLOW_LOADING] if slow else ["-m", "fedpartial", "list", "methods"]
    child = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)  # JAX alone takes longer than 0.3 s to import
    child.send_signal(signal.SIGINT)
    err = child.communicate(timeout=120)[1]
    assert child.returncode == 130 and err == "fedpartial: interrupted while starting; nothing was written.\n", err


def test_the_personalised_methods_flags_and_listing(capsys, tmp_path):
    """FedBABU's and Ditto's options are flags of their own (from their options), another method's flag is one
    sentence, and `fedpartial list methods` names them."""
    from fedpartial._src.cli.flags import config_from_args
    from fedpartial._src.cli.main import build_parser

    def options(*args):
        return config_from_args(build_parser().parse_args(["run", *args])).options

    assert options("--method", "fedbabu", "--head-layers", "2", "--finetune-epochs", "3") == {
        "head_layers": 2, "finetune_epochs": 3.0}
    assert options("--method", "ditto", "--lam", "0.5") == {"lam": 0.5}
    assert main(["run", "--method", "fedavg", "--lam", "0.5", "--out", str(tmp_path)]) == 2
    assert "--lam is an option of ditto" in capsys.readouterr().err
    assert main(["list", "methods"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"fedbabu", "ditto"} <= set(names)
