"""Smoke test of the strategies benchmark: tiny sizes, every strategy measured and correct."""

import json

from benchmarks import strategies


def test_quick_benchmark_measures_every_strategy(tmp_path):
    out = tmp_path / "x.json"
    assert strategies.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True and report["config"]["quick"] is True
    assert report["device"]["backend"]
    assert {(r["model"], r["cohort_size"]) for r in report["results"]} == {("mlp", 4)}
    for record in report["results"]:
        by_name = {m["strategy"]: m for m in record["measurements"]}
        assert set(by_name) == set(strategies.STRATEGY_NAMES)
        for name, m in by_name.items():
            where = f"{record['model']} {name}"
            assert "error" not in m, f"{where}: {m.get('error')}"
            assert m["rounds_per_s"] > 0, where
            assert m["warmup_s"] > 0, where
            assert m["speedup_vs_plain"] > 0, where
            assert m["max_abs_diff_vs_plain"] <= 1e-4, where
            assert m["correct"], where
            if name != "plain_loop":
                assert m["initial_params_match"], where
                assert m["loss_diff_vs_plain"] <= 1e-4, where
                assert not m["retraced_while_timing"], where
