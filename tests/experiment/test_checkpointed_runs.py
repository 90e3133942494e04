"""Run folders checkpointed by an earlier version (``tests/experiment/checkpointed/``, written at commit 465d6a3 by
``write_checkpointed_runs.py``) still resume, to what the uninterrupted run of that version gave."""

import json
import os
import shutil

import pytest

from fedpartial._src.cli.main import main

HERE = os.path.join(os.path.dirname(__file__), "checkpointed")
WALL_CLOCK = ("round_time_s", "wall_time_s", "host_time_s")


def _records(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK} for line in f]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_folder_checkpointed_by_an_earlier_version_resumes_to_its_uninterrupted_metrics(mode, tmp_path, capsys):
    run_dir = str(tmp_path / mode)
    shutil.copytree(os.path.join(HERE, mode), run_dir)
    assert len(_records(os.path.join(run_dir, "metrics.jsonl"))) == 2
    assert main(["run", "--resume", run_dir]) == 0
    assert _records(os.path.join(run_dir, "metrics.jsonl")) == _records(os.path.join(HERE, f"{mode}-uninterrupted.jsonl"))
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["status"] == "complete"
