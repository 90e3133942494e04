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
    resumed = _records(os.path.join(run_dir, "metrics.jsonl"))
    expected = _records(os.path.join(HERE, f"{mode}-uninterrupted.jsonl"))
    # within 1e-4: this version counts a step's FLOPs from its own compiled program and averages the test loss
    # per label in float64, which moves those values in their last digits
    assert [sorted(r) for r in resumed] == [sorted(r) for r in expected]
    assert resumed == [{k: pytest.approx(v, rel=1e-4) if isinstance(v, float | int) and not isinstance(v, bool) else v
                        for k, v in r.items()} for r in expected]
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["status"] == "complete"
