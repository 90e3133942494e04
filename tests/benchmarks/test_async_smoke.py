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
    assert runs["sync"]["client_updates"] == runs["fedbuff"]["client_updates"] == 8  # the same work
    assert max(r["staleness_max"] for r in runs["fedbuff"]["records"]) >= 1
    for run in result["runs"]:
        clocks = [r["simulated_clock_s"] for r in run["records"]]
        assert clocks == sorted(clocks)
    assert next(tmp_path.glob("async-*-quick.png")).stat().st_size > 0
