"""The FedSPU reproduction benchmark runs end to end on a tiny protocol and reports every table, a personal-layers
method next to the dropout baseline."""

import json
import math

from benchmarks import fedspu


def test_fedspu_benchmark_quick(tmp_path):
    # synthetic's MLP: 49 CPU seconds, where --quick's CNN on digits took 80
    assert fedspu.main(["--quick", "--datasets", "synthetic", "--methods", "fedspu,hermes,fedper,fedspu+es",
                        "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("fedspu-*-quick.json")).read_text())
    tables = result["tables"]
    assert {"table1_accuracy", "table2_accuracy_es", "table3_costs", "table4_rounds", "memory"} <= set(tables)

    runs = {r["label"]: r for r in result["runs"]}
    assert set(runs) == {"FedSPU", "Hermes", "FedPer", "FedSPU+ES"}
    for r in runs.values():
        assert math.isfinite(r["final_personal_accuracy"]) and 0 <= r["final_personal_accuracy"] <= 1
        assert "records" not in r and r["accuracy_curve"][-1][0] == r["rounds"]
    assert runs["FedSPU+ES"]["rounds"] <= runs["FedSPU"]["rounds"] == 2

    (t1,) = tables["table1_accuracy"]
    assert set(t1["methods"]) == {"fedspu", "hermes", "fedper"} and t1["best_baseline"] == "hermes"
    assert t1["best_personalised"] == "fedper" and math.isclose(
        t1["fedspu_minus_best_personalised"], t1["methods"]["fedspu"]["mean"] - t1["methods"]["fedper"]["mean"])
    assert math.isclose(t1["fedspu_minus_best_baseline"],
                        t1["methods"]["fedspu"]["mean"] - t1["methods"]["hermes"]["mean"])
    assert set(tables["table2_accuracy_es"][0]["methods"]) == {"fedspu"}
    assert {r["label"] for r in tables["table3_costs"]} == {"FedSPU", "Hermes", "FedPer", "FedSPU+ES"}
    assert all(r["transmitted_bytes"] > 0 and r["train_time_s"] > 0 for r in tables["table3_costs"])
    (t4,) = tables["table4_rounds"]
    assert t4["fedspu_es_rounds"] <= t4["fedspu_rounds"] and 0 <= t4["saved"] < 1

    memory = {r["p"]: r for r in tables["memory"]}
    assert set(memory) == {0.2, 0.4, 0.6, 0.8, 1.0}
    assert memory[1.0]["reduction"] == 0
    reductions = [memory[p]["reduction"] for p in (0.2, 0.4, 0.6, 0.8)]
    assert all(a > b for a, b in zip(reductions, reductions[1:])) and reductions[-1] > 0  # smaller p, less memory
    assert next(tmp_path.glob("fedspu-memory-*-quick.png")).stat().st_size > 0
