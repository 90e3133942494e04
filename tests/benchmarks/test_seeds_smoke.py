"""Smoke test of the seeds benchmark: tiny sizes, every variant measured, the vmapped and mapped runs agree."""

import json

from benchmarks import seeds


def test_quick_benchmark_measures_every_variant(tmp_path):
    """With a client learning rate and two server learning rates: one seed × 2 server rates as replicas against
    the 2 runs one after another (each sequential variant runs every replica alone, so every replica more is two
    more simulations; several seeds and every client rate with every server rate: tests/experiment/test_replicas.py)."""
    out = tmp_path / "s.json"
    assert seeds.main(["--quick", "--seeds", "0", "--lrs", "0.05", "--server-lrs", "0.5,1.0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["quick"] is True and report["device"]["jax_version"]
    assert report["config"]["lrs"] == [0.05] and report["config"]["seeds"] == [0]
    assert report["config"]["server_lrs"] == [0.5, 1.0] and report["config"]["server_opt"] == "sgd"
    (result,) = report["results"]
    assert result["model"] == "mlp"
    assert result["vmapped_equals_sequential_fused"] is True and result["mapped_equals_sequential_fused"] is True
    by_name = {m["variant"]: m for m in result["measurements"]}
    assert set(by_name) == set(seeds.VARIANTS)
    assert all(m["wall_s"] > 0 and m["steady_s"] > 0 for m in by_name.values())
    for mine in ("vmapped", "mapped"):
        for name in ("sequential_fused", "sequential_default"):
            up = by_name[mine]["speedup"][name]
            assert up["wall"] == by_name[name]["wall_s"] / by_name[mine]["wall_s"]
            assert up["steady"] == by_name[name]["steady_s"] / by_name[mine]["steady_s"]
