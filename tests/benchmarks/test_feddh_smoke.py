"""The FedDH reproduction benchmark runs end to end on a tiny protocol, every method on one partition and cohort."""

import json

from benchmarks import feddh


def test_feddh_benchmark_quick(tmp_path):
    # synthetic's MLP and 2 local steps: 22 CPU seconds, where --quick's LeNet-5 on digits took 39
    assert feddh.main(["--quick", "--datasets", "synthetic", "--local-steps", "2", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("feddh-*-quick.json")).read_text())
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"fedavg", "feddh"}
    # Same seed: the same partition and the same cohorts, so the same local work and the same simulated
    # time round by round (FedDH changes only the aggregation weights).
    assert runs["fedavg"]["partition_digest"] == runs["feddh"]["partition_digest"]
    for key in ("client_flops", "cumulative_simulated_time_s", "upload_bytes"):
        assert [r[key] for r in runs["fedavg"]["records"]] == [r[key] for r in runs["feddh"]["records"]]
    assert runs["feddh"]["options"] == feddh.DH_RATES["lenet"]
    assert runs["feddh"]["diagnostics"]["clients_known"] == 10 and runs["fedavg"]["diagnostics"] == {}
    rows = {r["method"]: r for r in result["summary"]}
    assert rows["fedavg"]["gap_to_fedavg"] == 0 and rows["fedavg"]["mflops_per_round"] > 0
    assert rows["feddh"]["mflops_per_round"] == rows["fedavg"]["mflops_per_round"]
    best = max(r["test_accuracy"] for r in runs["fedavg"]["records"])
    assert rows["fedavg"]["target_accuracy"] == 0.9 * best and rows["fedavg"]["time_to_target_s"] is not None
    assert result["claims"] == []  # the claims compare FedDH, FedJS and FedAvg; --quick runs no FedJS
    assert next(tmp_path.glob("feddh-*-quick.png")).stat().st_size > 0


def _run(method, accuracies, flops=1e6):
    records = [{"round": t + 1, "test_accuracy": a, "cumulative_simulated_time_s": 10.0 * (t + 1),
                "client_flops": flops} for t, a in enumerate(accuracies)]
    return {"dataset": "digits", "model": "lenet5", "method": method, "seed": 0, "records": records}


def test_summary_and_claims_hand_computed():
    runs = [_run("fedavg", [0.2, 0.5, 0.6, 0.5, 0.4]),  # best 0.6: target 0.9 × 0.6 = 0.54, reached at 30 s
            _run("fedjs", [0.3, 0.55, 0.5, 0.5, 0.52], flops=2e6),  # reached at 20 s
            _run("feddh", [0.1, 0.2, 0.3, 0.4, 0.45])]  # never
    rows = {r["method"]: r for r in feddh.summarize(runs, 0.9)}
    assert abs(rows["fedavg"]["target_accuracy"] - 0.54) < 1e-12
    assert rows["fedavg"]["time_to_target_s"] == 30.0 and rows["fedjs"]["time_to_target_s"] == 20.0
    assert rows["feddh"]["time_to_target_s"] is None and rows["feddh"]["speedup_vs_fedavg"] is None
    assert rows["fedjs"]["speedup_vs_fedavg"] == 1.5
    assert abs(rows["fedavg"]["final_accuracy"] - 0.5) < 1e-12  # mean of the last three evaluations
    assert abs(rows["feddh"]["gap_to_fedavg"] - ((0.3 + 0.4 + 0.45) / 3 - 0.5)) < 1e-12
    assert rows["fedjs"]["mflops_per_round"] == 2.0 and rows["fedjs"]["best_accuracy"] == 0.55
    [claim] = feddh.claims(list(rows.values()))
    assert not claim["feddh_beats_fedavg"] and not claim["feddh_ge_fedjs_ge_fedavg"]
    assert claim["best_method"] == "fedjs"
