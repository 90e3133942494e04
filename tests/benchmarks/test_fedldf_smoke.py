"""The FedLDF reproduction benchmark runs end to end on a tiny protocol and reports each method it ran."""

import json

import pytest

from benchmarks import fedldf


def test_fedldf_benchmark_quick(tmp_path):
    # Every method but Random: it uploads n of K a layer as HDFL does (each run is a simulation of its own to compile);
    # on synthetic's MLP, which compiles in half digits' CNN's time
    methods = ("fedavg", "fedldf", "hdfl", "fedadp")
    assert fedldf.main(["--quick", "--datasets", "synthetic", "--methods", ",".join(methods),
                        "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("fedldf-*-quick.json")).read_text())
    rows = {r["method"]: r for r in result["summary"]}
    assert set(rows) == set(methods) and result["protocol"]["methods"] == ",".join(methods)
    # Equal upload budget: n/K of FedAvg (+ FedLDF's L divergence scalars per client).
    assert rows["hdfl"]["upload_vs_fedavg"] == 2 / 5
    assert 2 / 5 < rows["fedldf"]["upload_vs_fedavg"] < 2 / 5 + 0.01
    assert rows["fedadp"]["upload_vs_fedavg"] < 0.5
    assert next(tmp_path.glob("fedldf-*-quick.png")).stat().st_size > 0


def test_methods_must_be_known_and_include_fedavg(capsys):
    for methods in ("fedldf,hdfl", "fedavg,nope"):
        with pytest.raises(SystemExit):
            fedldf.main(["--quick", "--methods", methods])
        assert "--methods" in capsys.readouterr().err
