"""Run configs in TOML, the run record (config.toml, environment.json), metrics.csv and the progress modes."""

import csv
import dataclasses
import json
import math

import pytest

from fedpartial._src.cli import config_file
from fedpartial._src.cli.main import build_parser, config_from_args, main
from fedpartial._src.experiment import records as run_record
from fedpartial._src.experiment.preflight import check_synthetic_fits, preflight
from fedpartial._src.experiment.config import ConfigError, RunConfig

SMALL = ["--rounds", "2", "--clients", "6", "--cohort", "3", "--local-steps", "2", "--batch-size", "8",
         "--model", "mlp"]


def _run_parser():
    return build_parser().command("run")


def _config(tmp_path, text, argv=()):
    """The RunConfig of ``fedpartial run --config FILE *argv`` with FILE holding ``text``."""
    path = tmp_path / "exp.toml"
    path.write_text(text)
    tokens = ["--config", str(path), *argv]
    args = build_parser().parse_args(["run", *tokens])
    config_file.merge(args, _run_parser(), tokens, str(path))
    return config_from_args(args)


def _error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_file_values_and_command_line_override(tmp_path):
    config = _config(tmp_path, 'method = "fedprox"\nrounds = 20\nlr = 1\nbatch_size = 4\nmu = 0.5\nes = true\n'
                               "local-epochs = 3\n", ["--rounds", "5", "--local-steps", "7"])
    assert config.method == "fedprox" and config.batch_size == 4 and config.early_stopping
    assert config.client_lr == 1.0 and isinstance(config.client_lr, float)  # a TOML integer for a number
    assert config.options == {"mu": 0.5}
    assert config.rounds == 5  # the command line wins
    # --local-steps on the command line drops the file's --local-epochs (they exclude each other)
    assert (config.local_steps, config.local_epochs) == (7, None)
    config = _config(tmp_path, "local-epochs = 3\n")
    assert (config.local_steps, config.local_epochs) == (None, 3.0)


def test_list_options_take_a_string_or_an_array(tmp_path):
    assert _config(tmp_path, 'method = "fjord"\ntiers = [0.25, 0.5, 1]\n').options["tiers"] == (0.25, 0.5, 1.0)
    assert _config(tmp_path, 'method = "fjord"\ntiers = "0.5,1"\n').options["tiers"] == (0.5, 1.0)


@pytest.mark.parametrize("text, message", [
    ("clientz = 3\n", "exp.toml: key 'clientz' is not a run setting (did you mean 'clients'?)."),
    ("num_clients = 3\n", "exp.toml: key 'num_clients' is not a run setting (did you mean 'clients'?)."),
    ("resume = 'runs/x'\n", "exp.toml: key 'resume' is not a run setting; give --resume on the command line."),
    ('rounds = "x"\n', "exp.toml: rounds = 'x' is not allowed: it must be a whole number."),
    ("rounds = 2.5\n", "exp.toml: rounds = 2.5 is not allowed: it must be a whole number."),
    ("lr = true\n", "exp.toml: lr = true is not allowed: it must be a number."),
    ("es = 1\n", "exp.toml: es = 1 is not allowed: it must be true or false."),
    ("method = 3\n", "exp.toml: method = 3 is not allowed: it must be a string."),
    ("[options]\nn = 4\n", "exp.toml: [options] is a table, which run configs do not use; write every key at the "
                           "top level (method options too, e.g. n = 4)."),
    # values refused by RunConfig.validate: its sentence, naming the file's key instead of the flag
    ("lr = nan\n", "exp.toml: lr = nan is not allowed: it must be a finite number > 0."),
    ("rounds = 0\n", "exp.toml: rounds = 0 is not allowed: it must be a whole number ≥ 1."),
    ("method = 'fedsgd'\n", "exp.toml: method = 'fedsgd' is unknown; choose one of"),
    ("es = true\ntrain-fraction = 1\n", "--es needs each client's held-out split; use a --train-fraction below 1 "
                                        "(e.g. 0.7) (es, train-fraction set in"),
    ("n = 4\n", "--n is an option of fedldf, random, hdfl, not of method 'fedavg' (n set in"),
])
def test_bad_files_are_one_sentence_naming_file_and_key(tmp_path, capsys, text, message):
    path = tmp_path / "exp.toml"
    path.write_text(text)
    err = _error(capsys, ["run", "--config", str(path), "--out", str(tmp_path / "runs")])
    assert err.startswith("fedpartial: error: "), err
    assert message.replace("exp.toml", str(path)) in err, err
    assert not (tmp_path / "runs").exists()  # refused before any set-up


def test_missing_unreadable_and_invalid_files(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    assert _error(capsys, ["run", "--config", str(missing)]) == \
        f"fedpartial: error: --config {str(missing)!r} does not exist; give a TOML file of run flags."
    assert "is a directory" in _error(capsys, ["run", "--config", str(tmp_path)])
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3\n")
    assert f"--config {str(bad)!r} is not valid TOML: " in _error(capsys, ["run", "--config", str(bad)])
    assert "cannot be combined with --resume" in _error(capsys, ["run", "--config", str(bad), "--resume", "x"])


def test_to_toml_reads_back_as_the_same_config(tmp_path):
    original = RunConfig(method="fjord", rounds=3, local_steps=4, client_lr=0.125, options={"tiers": (0.5, 1.0)},
                         alpha=1e-3, run_name='we"ird', target_accuracy=0.5, dp_clip=0.5, dp_noise_multiplier=1.1,
                         dp_clip_per_layer=True, dp_delta=1e-5, dp_target_quantile=0.5)
    text = run_record.to_toml(original)
    assert "local-epochs" not in text and 'name = "we\\"ird"' in text and "tiers = \"0.5,1.0\"" in text
    assert _config(tmp_path, text) == original
    full = run_record.resolved(RunConfig(method="fedprox"))
    assert full.options == {"mu": 0.01} and full.local_epochs == 2.0
    assert _config(tmp_path, run_record.to_toml(full)) == full


def test_metrics_csv_scalars_only_empty_cell_for_nan_and_late_columns(tmp_path):
    path = tmp_path / "metrics.csv"
    table = run_record.MetricsCSV(str(path))
    table.write({"round": 1, "train_loss": math.nan, "per_client": [1, 2], "ok": True})
    assert path.read_text().splitlines() == ["round,train_loss,ok", "1,,1"]
    table.write({"round": 2, "train_loss": 0.5, "per_client": [3, 4], "ok": False, "test_accuracy": 0.25})
    table.close()
    assert path.read_text().splitlines() == ["round,train_loss,ok,test_accuracy", "1,,1,", "2,0.5,0,0.25"]
    resumed = run_record.MetricsCSV(str(path), [{"round": 1, "x": 2.0}])  # a resumed run rewrites its rounds
    resumed.close()
    assert path.read_text().splitlines() == ["round,x", "1,2.0"]


def _metrics(run_dir):
    drop = {"round_time_s", "wall_time_s", "host_time_s"}
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_record_reproduces_and_progress_modes(tmp_path, capsys):
    """Two tiny runs: plain progress lines off a terminal, then --quiet from the first run's config.toml."""
    assert main(["run", *SMALL, "--method", "fedprox", "--mu", "0.1", "--out", str(tmp_path), "--name", "a"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"], out
    for word in ("acc 0.", "traffic ", " rounds/s", "ETA "):
        assert word in lines[-1], lines[-1]
    assert "final test accuracy" in out  # the summary table stays when not quiet
    first = tmp_path / "a"
    config = json.loads((first / "config.json").read_text())
    assert config["options"] == {"mu": 0.1} and config["local_steps"] == 2 and config["model"] == "mlp"
    assert config["train_fraction"] == 1.0
    env = json.loads((first / "environment.json").read_text())
    assert env["seed"] == 0 and env["backend"] and env["devices"] and env["packages"]["jax"]
    assert env["argv"] and env["time"] and env["fedpartial"]
    rows = list(csv.DictReader((first / "metrics.csv").open()))
    records = _metrics(first)
    assert [int(r["round"]) for r in rows] == [1, 2]
    assert float(rows[1]["test_accuracy"]) == records[1]["test_accuracy"]
    assert "nan" not in (first / "metrics.csv").read_text().lower()

    assert main(["run", "--config", str(first / "config.toml"), "--name", "b", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "b") and captured.err == ""  # quiet: only the run directory
    assert _metrics(tmp_path / "b") == records  # same seed and config: the same metrics
    again = json.loads((tmp_path / "b" / "config.json").read_text())
    assert {**again, "run_name": "a"} == config
    assert dataclasses.asdict(run_record.resolved(RunConfig(**config))) == config


@pytest.mark.parametrize("kw, match", [
    ({"options": "n=4"}, "options 'n=4' is not allowed: it must be a mapping of option names to values"),
    ({"options": {4: "n"}}, "options {4: 'n'} is not allowed"),
    ({"dataset": ["digits"]}, "--dataset \\['digits'\\] is not allowed: it must be a name \\(a string\\)"),
    ({"method": 3}, "--method 3 is not allowed: it must be a name"),
])
def test_a_value_of_the_wrong_type_is_one_sentence(kw, match):
    """From Python, where argparse does not stand guard (were a raw ValueError or TypeError)."""
    with pytest.raises(ConfigError, match=match):
        RunConfig(**kw).validate()


def test_synthetic_data_too_large_to_generate_is_refused_before_anything_is_drawn(monkeypatch):
    """--clients 5000000 on synthetic data used to grow until the kernel killed the process: refused up front,
    naming the examples, the memory and the fix; a cap that fits is accepted."""
    from fedpartial._src.core import memory

    monkeypatch.setattr(memory, "host_available", lambda: 24 * 2**30)
    config = RunConfig(dataset="synthetic", model="mlp", num_clients=5_000_000, cohort_size=100_000)
    with pytest.raises(ConfigError, match=r"^--dataset synthetic with --clients 5000000 draws about 2,264,\d{3},\d{3} "
                                          r"examples, which need about 10\d\d\.\d GiB of host memory to generate, but "
                                          r"24\.0 GiB is available; use fewer --clients or cap each client with "
                                          r"--max-samples\.$"):
        config.validate()  # the settings are fine: whether they fit this machine is the preflight's question
        preflight(config)
    check_synthetic_fits(dataclasses.replace(config, num_clients=50_000, cohort_size=10), 24 * 2**30)  # ~11 GiB
