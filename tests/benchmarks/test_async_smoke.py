"""The asynchronous benchmark runs end to end on a tiny protocol: synchronous FedAvg and FedBuff."""

import importlib
import json


def test_async_benchmark_quick(tmp_path):
    bench = importlib.import_module("benchmarks.async")  # ('async' is a keyword: no plain import)
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("async-*-quick.json")).read_text())
    rows = {r["run"]: r for r in result["summary"]}
    assert set(rows) == {"sync", "fedbuff"}
    runs = {r["run"]: r for r in result["runs"]}
    # FedBuff runs until its clock passes the synchronous run's last (at most twice its 8 client updates)
    fedbuff, end = runs["fedbuff"], runs["sync"]["records"][-1]["simulated_clock_s"]
    assert runs["sync"]["client_updates"] == 8
    assert fedbuff["records"][-1]["simulated_clock_s"] >= end or fedbuff["client_updates"] == 16
    assert "test_accuracy" in fedbuff["records"][-1]
    assert max(r["staleness_max"] for r in runs["fedbuff"]["records"]) >= 1
    for run in result["runs"]:
        clocks = [r["simulated_clock_s"] for r in run["records"]]
        assert clocks == sorted(clocks)
    assert next(tmp_path.glob("async-*-quick.png")).stat().st_size > 0
