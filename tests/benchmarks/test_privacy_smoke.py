"""The privacy benchmark runs end to end on a tiny protocol: every variant, the calibrated budget reached."""

import json

from benchmarks import privacy


def test_privacy_benchmark_quick(tmp_path):
    assert privacy.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("privacy-*-quick.json")).read_text())
    rows = {(r["variant"], r["target_epsilon"]): r for r in result["summary"]}
    assert set(rows) == {("FedAvg", None), ("DP-FedAvg", 8.0), ("DP-FedLDF", 8.0)}
    for name in ("DP-FedAvg", "DP-FedLDF"):  # z calibrated for the run's rounds: ε reached, not exceeded
        assert 7.9 < rows[name, 8.0]["reached_epsilon"] <= 8.0
    assert rows["DP-FedLDF", 8.0]["upload_mb"] < rows["DP-FedAvg", 8.0]["upload_mb"]  # n = 2 of K = 10 a layer
    assert next(tmp_path.glob("privacy-*-quick.png")).stat().st_size > 0
