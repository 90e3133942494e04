"""Every row of docs/validation.md: the bad input exits 2 with exactly its sentence, fast, creating nothing."""

import os
import pathlib
import shlex

import pytest

from fedpartial._src.cli.main import main
from fedpartial._src.experiment import population
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.preflight import preflight
from fedpartial._src.models import registry

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "validation.md"


def _rows():
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")] if line.startswith("| ") else []
        if len(cells) == 3 and cells[1].startswith("`"):
            rows.append(pytest.param(cells[1].strip("`"), cells[2].replace("\\|", "|"), id=cells[1].strip("`")))
    return rows


ROWS = _rows()


def test_the_table_covers_every_kind_of_input():
    assert len(ROWS) >= 60
    text = DOC.read_text()
    for flag in ("--lr nan", "--weight-decay nan", "--out ''", "--name a/b", "--model resnet20", "--model vgg9",
                 "--mu inf", "--tiers 0.5,nan", "--seed -1"):
        assert flag in text, flag


@pytest.mark.parametrize("args, message", ROWS)
def test_each_row_is_refused_in_one_sentence(tmp_path, capsys, monkeypatch, args, message):
    # refused from names and numbers alone: loading the data or building a model would fail the test
    # (what an earlier version timed, and a busy machine made flaky)
    def forbidden(*_, **__):
        raise AssertionError("a refused run must not load data or build a model")
    monkeypatch.setattr(population, "load_dataset", forbidden)
    monkeypatch.setattr(registry, "build_model", forbidden)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    argv = shlex.split(args.replace("{file}", str(afile)))
    out = tmp_path / "out"
    if "--out" not in argv:
        argv = ["--out", str(out)] + argv
    assert main(["run"] + argv) == 2
    err = capsys.readouterr().err
    assert err == f"fedpartial: error: {message.replace('{file}', str(afile))}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing created
    assert afile.read_text() == "not a directory"


def test_unwritable_out_directory(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: chmod does not stop writes (the /proc row covers the probe instead)")
        for out, words in ((locked, "is not writable"), (locked / "sub", f"cannot be made: {locked} is not writable")):
            assert main(["run", "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert f"--out '{out}' {words}; choose a directory you may write to." in err
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_a_good_out_directory_is_left_as_it_was(tmp_path):
    """The writability probe leaves nothing behind, in an existing directory or above a missing one."""
    preflight(RunConfig(out_dir=str(tmp_path)))
    preflight(RunConfig(out_dir=str(tmp_path / "new" / "deeper"), run_name="ok"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("field, value, words", [
    ("client_lr", float("nan"), "--lr nan is not allowed"),
    ("server_lr", float("inf"), "--server-lr inf is not allowed"),
    ("momentum", float("-inf"), "--momentum -inf is not allowed"),
    ("alpha", float("inf"), "--alpha inf is not allowed"),
    ("rounds", 2.0, "--rounds 2 is not allowed: it must be a whole number ≥ 1"),
    ("batch_size", True, "--batch-size True is not allowed"),
    ("out_dir", "", "--out '' is not allowed"),
    ("run_name", "../x", "--name '../x' is not allowed"),
    ("options", {"mu": float("inf")}, "--mu inf is not allowed: it must be a finite number"),
])
def test_python_callers_get_the_same_sentences(tmp_path, field, value, words):
    base = dict(method="fedprox", out_dir=str(tmp_path))
    with pytest.raises(ConfigError) as e:
        RunConfig(**{**base, field: value}).validate()
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1


def test_model_checks_are_opt_in_for_python_callers():
    """A caller bringing its own dataset or model is not judged by the names alone."""
    config = RunConfig(method="feddrop", model="resnet20", out_dir=None)
    config.validate()
    with pytest.raises(ConfigError, match="--model resnet20 has residual connections"):
        config.validate(check_model=True)
    RunConfig(method="fedadp", model="resnet20", out_dir=None).validate(check_model=True)  # upload masks only
    RunConfig(method="feddrop", dataset="cifar10", out_dir=None).validate(check_model=True)  # auto: vgg9


def test_neuron_level_methods_say_so_in_their_capabilities():
    """The driver refuses residual models from the capability record, not from a list of names."""
    from fedpartial._src.methods.catalog import METHODS
    neuron = {n for n, spec in METHODS.items() if spec.build().capabilities.neuron_masks}
    assert neuron == {"fedspu", "feddrop", "fjord", "hermes", "fedmp", "prunefl", "afd", "fedselect", "fedad",
                      "feddhad"}


def test_a_run_name_too_long_for_a_folder_is_refused_before_anything_is_made(tmp_path, capsys):
    """A 300-character --name would fail as ENAMETOOLONG after folders were made: refused up front."""
    name = "a" * 300
    assert main(["run", "--out", str(tmp_path / "out"), "--name", name]) == 2
    err = capsys.readouterr().err
    assert err == (f"fedpartial: error: --name {name!r} is not allowed: it must be a folder name of at most 240 bytes "
                   f"(file systems allow 255, and a taken name gets a suffix).\n")
    assert list(tmp_path.iterdir()) == []
