"""The FedLDF reproduction benchmark runs end to end on a tiny protocol and reports every method."""

import json

from benchmarks import fedldf


def test_fedldf_benchmark_quick(tmp_path):
    assert fedldf.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("fedldf-*-quick.json")).read_text())
    rows = {r["method"]: r for r in result["summary"]}
    assert set(rows) == set(fedldf.METHODS)
    # Equal upload budget: n/K of FedAvg (+ FedLDF's L divergence scalars per client).
    assert rows["hdfl"]["upload_vs_fedavg"] == rows["random"]["upload_vs_fedavg"] == 2 / 5
    assert 2 / 5 < rows["fedldf"]["upload_vs_fedavg"] < 2 / 5 + 0.01
    assert rows["fedadp"]["upload_vs_fedavg"] < 0.5
    assert next(tmp_path.glob("fedldf-*-quick.png")).stat().st_size > 0
