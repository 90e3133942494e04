"""The EmbracingFL benchmark's bookkeeping: nested populations, rounds to target, tables (no training)."""

import argparse

import numpy as np

from benchmarks import embracingfl as bench


def test_runs_share_their_first_clients_and_adding_clients_adds_data():
    args = argparse.Namespace(data_dir=None, seed=0)
    small = bench.population("digits", args, total=12, used=4)
    large = bench.population("digits", args, total=12, used=10)
    assert len(small.natural_partition) == 4 and len(large.natural_partition) == 10
    for a, b in zip(small.natural_partition, large.natural_partition[:4]):
        np.testing.assert_array_equal(a, b)
    held = np.concatenate(large.natural_partition)
    assert len(np.unique(held)) == len(held) < len(large.y_train)  # disjoint clients, part of the pool


def run(method, accs, **kw):
    records = [{"round": r + 1, "test_accuracy": a} for r, a in enumerate(accs)]
    return {"dataset": "toy", "model": "mlp", "method": method, "bn_policy": "global", "records": records,
            "time_s": 1.0, **kw}


def test_summary_and_tables():
    assert bench.summary(run("embracingfl", [0.2, 0.5, 0.9, 0.8]), 0.5) == {
        "final_accuracy": 0.8, "best_accuracy": 0.9, "rounds_to_target": 2}
    assert bench.summary(run("heterofl", [0.1, 0.2]), 0.5)["rounds_to_target"] is None
    runs = [run("embracingfl", [0.5, 1.0], experiment="cases", case=1, mix=[4, 0, 0]),
            run("embracingfl", [0.5, 0.96], experiment="cases", case=10, mix=[1, 1, 2]),
            run("heterofl", [0.3, 0.4], experiment="cases", case=10, mix=[1, 1, 2])]
    text, rows = bench.tables(runs, [], target=0.95)
    assert "target = 0.95 × all-strong best = 0.9500" in text
    assert [r["rounds_to_target"] for r in rows] == [2, 2, None]
    assert rows[2]["setting"] == "case 10 (1, 1, 2)" and "Width red." in text


def test_depth_and_rolling_rows_join_the_tables_and_the_plot(tmp_path):
    """DepthFL has an all-strong run of its own; the others stand on EmbracingFL's (FedAvg); width methods skip the
    BiLSTM."""
    args = argparse.Namespace(methods=list(bench.METHODS))
    assert bench.methods_for("synthetic_text", args) == ("embracingfl", "depthfl", "inclusivefl")
    assert bench.methods_for("synthetic", args, all_strong=True) == ("embracingfl", "depthfl")
    assert [bench.stands_for(m) for m in ("fedrolex", "depthfl", "inclusivefl")] == ["embracingfl", "depthfl",
                                                                                      "embracingfl"]
    runs = [run("embracingfl", [0.5, 0.8], experiment="cases", case=1, mix=[4, 0, 0]),
            run("depthfl", [0.6, 0.9], experiment="cases", case=1, mix=[4, 0, 0]),
            *(run(m, [0.3, a], experiment="cases", case=10, mix=[1, 1, 2])
              for m, a in (("embracingfl", 0.7), ("fedrolex", 0.5), ("depthfl", 0.76), ("inclusivefl", 0.6))),
            *(run(m, [0.4, 0.7], experiment="scaling", strong=4, weak=w) for m, w in (("embracingfl", 0),
                                                                                       ("depthfl", 0), ("depthfl", 4)))]
    text, rows = bench.tables(runs, [], target=0.95)
    assert "target = 0.95 × all-strong best = 0.7600" in text  # EmbracingFL's all-strong run, not DepthFL's
    assert [r["rounds_to_target"] for r in rows[:6]] == [2, 2, None, None, 2, None]
    assert all(label in text for label in ("FedRolex", "DepthFL", "InclusiveFL"))
    bench.plot(runs, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0
