"""The deadlines benchmark runs end to end on a tiny protocol: the reference, the deadline, and availability."""

import json

from benchmarks import deadlines


def test_deadlines_benchmark_quick(tmp_path):
    assert deadlines.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("deadlines-*-quick.json")).read_text())
    rows = {(r["method"], r["setting"]): r for r in result["summary"]}
    assert set(rows) == {("fedavg", "no deadline"), ("fedavg", "deadline"), ("fedavg", "deadline + availability")}
    assert rows["fedavg", "no deadline"]["reported"] == 1 and rows["fedavg", "no deadline"]["wasted_mb"] == 0
    # the deadline is the population's median full-model round: slow devices drop and waste what they did
    assert rows["fedavg", "deadline"]["reported"] < 1 and rows["fedavg", "deadline"]["wasted_mb"] > 0
    assert result["protocol"]["deadline_s"] > 0 and result["protocol"]["availability"].startswith("diurnal:")
    for run in result["runs"]:
        clocks = [r["simulated_clock_s"] for r in run["records"]]
        assert clocks == sorted(clocks)
    assert next(tmp_path.glob("deadlines-*-quick.png")).stat().st_size > 0
