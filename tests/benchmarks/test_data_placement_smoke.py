"""Smoke test of the data-placement benchmark: one tiny case, one round per placement, every phase timed."""

import json

from benchmarks import data_placement


def test_quick_benchmark_times_every_phase_for_both_placements(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert data_placement.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"]["backend"] and report["device"]["jax_version"] and report["rounds"] == 1
    assert report["complete"] is True
    [case] = report["cases"]
    assert case["case"] == "tiny" and case["data_bytes"] > 0
    for placement in data_placement.PLACEMENTS:
        entry = case[placement]
        assert len(entry["split_rounds"]) == 1 and len(entry["end_to_end_round_s"]) == 1
        for phase in data_placement.PHASES:
            assert entry[f"{phase}_median"] > 0, (placement, phase)
        assert entry["end_to_end_rounds_per_s"] > 0
    ratio = case["device"]["end_to_end_rounds_per_s"] / case["host"]["end_to_end_rounds_per_s"]
    assert abs(case["device_over_host_end_to_end_rounds_per_s"] - ratio) < 1e-12
    assert "device/host end-to-end rounds/s" in capsys.readouterr().out


def test_unknown_case_is_refused(capsys):
    assert data_placement.main(["--cases", "cifar"]) == 2
    assert "--cases cifar is unknown" in capsys.readouterr().err
