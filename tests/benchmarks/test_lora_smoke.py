"""benchmarks/lora.py at its smallest: pre-training, FLoRA with equal and heterogeneous ranks, end to end."""

import json

from benchmarks import lora as bench


def test_a_tiny_run_writes_rows_and_checks(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.SIZES, "tiny", dict(clients=3, rounds=1, steps=1, batch=8, pretrain_steps=50, rank=2))
    assert bench.main(["--size", "tiny", "--methods", "flora,hetlora_unknown", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "lora-tiny-cpu.json").read_text())
    assert [(r["method"], r["ranks"]) for r in report["rows"]] == [("flora", None), ("flora", [1, 1, 2])]
    assert report["command"] and report["time"] and report["device"]
    assert report["checks"] == {}  # each check needs its two methods
    equal, ranked = report["rows"]
    assert ranked["upload_bytes_per_round"] < equal["upload_bytes_per_round"]  # rank 1 clients upload less
    assert equal["lora_aggregation_error_last"] < 1e-5 and 0 <= equal["global_accuracy"] <= 1
    assert (tmp_path / "lora-tiny-cpu.png").exists()
