"""benchmarks/lora.py at its smallest: pre-training, two LoRA rows and the heterogeneous-rank row end to end."""

import json

from benchmarks import lora as bench


def test_a_tiny_run_writes_rows_and_checks(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.SIZES, "tiny", dict(clients=3, rounds=1, steps=1, batch=8, pretrain_steps=50, rank=2))
    assert bench.main(["--size", "tiny", "--methods", "fedit,flora,hetlora_unknown", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "lora-tiny-cpu.json").read_text())
    assert [(r["method"], r["ranks"]) for r in report["rows"]] == [("fedit", None), ("flora", None),
                                                                  ("fedit", [1, 1, 2]), ("flora", [1, 1, 2])]
    assert report["command"] and report["time"] and report["device"]
    assert set(report["checks"]) == {"flora_at_least_fedit_heterogeneous"}
    rows = {(r["method"], bool(r["ranks"])): r for r in report["rows"]}
    assert rows[("fedit", True)]["upload_bytes_per_round"] < rows[("fedit", False)]["upload_bytes_per_round"]
    assert rows[("flora", False)]["lora_aggregation_error_last"] < 1e-5
    assert (tmp_path / "lora-tiny-cpu.png").exists()
