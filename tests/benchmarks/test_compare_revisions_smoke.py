"""Smoke test of the revision comparison: HEAD against HEAD, tiny sizes, two strategies, one repeat."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import compare_revisions

ROOT = Path(compare_revisions.__file__).resolve().parents[1]
MEASURED = ("plain_loop", "fused")
SKIPPED = "fused_chunk,fused_unrolled,stepwise_1,stepwise_chunk"


def worktrees() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "worktree", "list", "--porcelain"],
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_head_against_head(tmp_path, capsys):
    out = tmp_path / "compare.json"
    args = ["--before", "HEAD", "--after", "HEAD", "--repeats", "1", "--out", str(out),
            "--quick", "--models", "mlp", "--cohorts", "4", "--skip", SKIPPED]
    assert compare_revisions.main(args) == 0
    assert "after/before" in capsys.readouterr().out

    report = json.loads(out.read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    for side in ("before", "after"):
        tree = Path(report[side]["path"])
        assert report[side]["commit"] == head
        # each run imported its own tree's package, not the installed (editable) one
        assert Path(report[side]["fedpartial_file"]).resolve().is_relative_to(tree.resolve())
        assert not tree.exists(), f"{side} worktree left at {tree}"
        assert str(tree) not in worktrees()
        [run] = report["runs"][side]
        assert run["returncode"] == 0 and run["report"]["complete"]
    assert report["repeats"] == 1 and "--quick" in report["passthrough_args"]
    assert report["measurement_code"]["copied_into_before"] is False

    rows = {r["strategy"]: r for r in report["comparison"]}
    assert set(rows) == set(MEASURED)
    for name, row in rows.items():
        assert row["model"] == "mlp" and row["cohort_size"] == 4
        assert row["before_rounds_per_s_median"] > 0 and row["after_rounds_per_s_median"] > 0, name
        assert row["after_over_before"] > 0, name
        assert row["before_speedup_vs_plain_median"] > 0 and row["after_speedup_vs_plain_median"] > 0, name
    assert rows["plain_loop"]["after_speedup_vs_plain_median"] == 1.0
