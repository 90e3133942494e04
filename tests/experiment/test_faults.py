"""The faults table of docs/validation.md: each command on a tiny run folder exits as the table says, with its
one sentence and no traceback, and leaves every file already written byte for byte as it was."""

import json
import pathlib
import shlex

import pytest

from fedpartial._src.cli.main import main
from fedpartial._src.experiment import run_files

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "validation.md"


def _rows():
    text = DOC.read_text().split("## Faults, and results already written", 1)[1]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")] if line.startswith("| ") else []
        if len(cells) == 4 and cells[1].startswith("`"):
            command = cells[1].strip("`")
            rows.append(pytest.param(command, int(cells[2]), cells[3], id=f"{cells[0]}: {command}"))
    return rows


ROWS = _rows()


@pytest.fixture
def sandbox(tmp_path):
    """A completed 2-round run folder (as far as these commands read it), an existing file, an empty folder."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"method": "fedavg", "dataset": "digits", "rounds": 2}))
    (run / "metrics.jsonl").write_text('{"round": 1, "train_loss": 1.0}\n{"round": 2, "train_loss": 0.5}\n')
    (run / "summary.json").write_text('{"status": "complete", "rounds": 2}')
    run_files.write_status(str(run), "complete", round=2, message="2 rounds", checkpoint_round=2)
    (tmp_path / "result.json").write_text('{"mine": 1}')
    (tmp_path / "empty").mkdir()
    return tmp_path, {"{run}": str(run), "{file}": str(tmp_path / "result.json"), "{dir}": str(tmp_path / "empty")}


def _fill(text, places):
    for name, value in places.items():
        text = text.replace(name, value)
    return text


def _files(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_table_covers_every_class_of_fault():
    assert {p.id.split(":")[0] for p in ROWS} == {"overwrite", "ignored input", "damaged folder", "unwritable path",
                                                  "memory"}
    assert len(ROWS) >= 12


@pytest.mark.parametrize("command, code, says", ROWS)
def test_each_fault_is_one_sentence_and_nothing_written_changes(command, code, says, sandbox, capsys):
    root, places = sandbox
    before = _files(root)
    assert main(shlex.split(_fill(command, places))) == code
    out, err = capsys.readouterr()
    said = (out if code == 0 else err).strip()
    assert "Traceback" not in out + err and len(said.splitlines()) == 1, out + err
    expected = _fill(says, places)
    parts = expected.split(" … ")
    assert said.removeprefix("fedpartial: error: ").startswith(parts[0]) and said.endswith(parts[-1]), said
    if len(parts) == 1:
        assert said.removeprefix("fedpartial: error: ") == expected
    assert _files(root) == before
