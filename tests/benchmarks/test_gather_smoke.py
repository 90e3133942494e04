"""Smoke test of the gather benchmark: both populations timed, the ratio is theirs, and the large client is there."""

import json

from benchmarks import gather


def test_quick_benchmark_times_the_gather_with_and_without_a_large_client(tmp_path):
    out = tmp_path / "g.json"
    assert gather.main(["--quick", "--large", "5000", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert results["one_large_client"]["largest_client"] == 5000 and results["as_is"]["largest_client"] < 400
    assert all(len(r["times_s"]) == 3 and r["median_s"] > 0 for r in results.values())
    assert report["large_over_as_is"] == results["one_large_client"]["median_s"] / results["as_is"]["median_s"]
    assert report["config"]["cohort"] == 50 and report["device"]["backend"]
