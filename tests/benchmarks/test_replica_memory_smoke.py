"""Smoke test of the replica memory benchmark: each axis in its own process, with its estimate and peak RSS."""

import json

from benchmarks import replica_memory
from fedpartial._src.core import memory


def test_quick_benchmark_records_each_axis_estimate_and_peak(tmp_path):
    out = tmp_path / "r.json"
    assert replica_memory.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["axis"] for r in report["results"]] == ["vmap", "map"] and report["device"]["backend"]
    for r in report["results"]:
        assert r["axis_used"][0] == r["axis"] and len(r["rss_after_round"]) == 1
        # two replicas' stacked state: their 60 personal models each, and the estimate counts it twice
        assert r["estimate"]["server"] - memory.RUNTIME_BYTES > 2 * r["stacked_state_bytes"] > 0
        assert r["rss_after_round"][0] >= r["rss_after_build"] > 0
        assert r["device_peak_after_round"] == [None] and r["device_peak_after_build"] is None  # CPU: the RSS
        assert r["peak_over_estimate"] == r["rss_after_round"][0] / r["estimate_bytes"]
