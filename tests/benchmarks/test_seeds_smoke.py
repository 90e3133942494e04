"""Smoke test of the seeds benchmark: tiny sizes, every variant measured, the vmapped run agrees."""

import json

from benchmarks import seeds


def test_quick_benchmark_measures_every_variant(tmp_path):
    out = tmp_path / "s.json"
    assert seeds.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["quick"] is True and report["device"]["jax_version"]
    (result,) = report["results"]
    assert result["model"] == "mlp" and result["vmapped_equals_sequential_fused"] is True
    by_name = {m["variant"]: m for m in result["measurements"]}
    assert set(by_name) == set(seeds.VARIANTS)
    assert all(m["wall_s"] > 0 and m["steady_s"] > 0 for m in by_name.values())
    for name in ("sequential_fused", "sequential_default"):
        assert by_name[name]["speedup_wall"] == by_name[name]["wall_s"] / by_name["vmapped"]["wall_s"]
