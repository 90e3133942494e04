"""The stream-conv benchmark runs both strategies in their own processes and compares their models."""

import json

from benchmarks import stream_conv


def test_both_strategies_run_alone_and_agree(tmp_path):
    out = tmp_path / "stream-conv.json"
    assert stream_conv.main(["--model", "mlp", "--cohort", "3", "--rounds", "1", "--local-steps", "2",
                             "--batch-size", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = {r["strategy"]: r for r in report["runs"]}
    assert set(runs) == {"stepwise:1", "stream-stepwise:1"}
    for r in runs.values():
        assert "error" not in r, r.get("error")
        assert len(r["round_s"]) == 1 and r["peak_rss"] >= r["rss_ready"] > 0
    assert runs["stepwise:1"]["train_loss"] == runs["stream-stepwise:1"]["train_loss"]
    assert report["max_abs_param_diff"] < 1e-5
    assert runs["stream-stepwise:1"]["max_abs_param_diff_to_first"] == report["max_abs_param_diff"]
    assert not list(tmp_path.glob("*.npz"))  # the workers' parameter files are removed
