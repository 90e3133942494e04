"""The FedDHAD reproduction benchmark: a tiny end-to-end run and its claims computed by hand."""

import json

from benchmarks import feddhad


def test_feddhad_benchmark_quick(tmp_path):
    # synthetic's MLP and 2 local steps: 34 CPU seconds, where --quick's LeNet-5 on digits took 47
    assert feddhad.main(["--quick", "--datasets", "synthetic", "--local-steps", "2", "--methods", "fedavg,feddhad",
                         "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("feddhad-*-quick.json")).read_text())
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"fedavg", "feddhad"}
    assert runs["fedavg"]["partition_digest"] == runs["feddhad"]["partition_digest"]
    assert runs["feddhad"]["options"] == feddhad.feddh.DH_RATES["lenet"]
    record = runs["feddhad"]["records"][0]
    assert {"global_dropout_rate", "target_dropout_rate", "mean_unit_dropout_rate", "rate_updates"} <= set(record)
    [claim] = result["claims"]
    assert claim["dataset"] == "synthetic" and claim["model"] == "mlp"
    assert next(tmp_path.glob("feddhad-*-quick.png")).stat().st_size > 0
    assert feddhad.method_options("feddrop", "lenet5") == {"tiers": (0.5,), "dense_only": True}
    assert feddhad.method_options("afd", "cnn2c1f") == {"dropout_rate": 0.25}


def _row(method, final, time, mflops):
    return {"dataset": "digits", "model": "lenet5", "method": method, "final_accuracy": final,
            "time_to_target_s": time, "mflops_per_round": mflops}


def test_claims_hand_computed():
    [c] = feddhad.claims([_row("fedavg", 0.80, 100.0, 10.0), _row("feddhad", 0.83, 50.0, 8.5),
                          _row("fedad", 0.84, 40.0, 8.0)])
    assert c["higher_accuracy"] and c["faster_to_target"] and c["fewer_flops"]
    assert abs(c["accuracy_gain"] - 0.03) < 1e-12 and c["time_speedup"] == 2.0
    assert abs(c["flops_saving"] - 0.15) < 1e-12 and c["best_method"] == "fedad"
    [c] = feddhad.claims([_row("fedavg", 0.80, None, 10.0), _row("feddhad", 0.79, 70.0, 10.0)])
    assert not c["higher_accuracy"] and c["faster_to_target"] and c["time_speedup"] is None and not c["fewer_flops"]
    assert feddhad.claims([_row("fedavg", 0.8, 1.0, 1.0)]) == []
