"""The conv probe times one cohort step four ways and finds the grouped convolutions vmap makes."""

import json

import pytest

from benchmarks import conv_probe


def test_probe_times_every_variant_and_counts_the_grouped_convs(tmp_path):
    out = tmp_path / "probe.json"
    assert conv_probe.main(["--models", "cnn2c1f", "--cohorts", "3", "--batch-size", "2", "--repeats", "1",
                            "--input-size", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"]["matmul_flops_per_s"] > 0 and report["argv"][:2] == ["--models", "cnn2c1f"]
    [record] = report["results"]
    assert (record["model"], record["cohort_size"], record["input_shape"]) == ("cnn2c1f", 3, [8, 8, 1])
    assert set(record["variants"]) == set(conv_probe.VARIANTS)
    for name, v in record["variants"].items():
        assert v["seconds"] > 0 and v["flops_per_s"] == pytest.approx(record["training_flops_per_step"] / v["seconds"])
        assert v["speedup_over_plain"] == pytest.approx(record["variants"]["plain"]["seconds"] / v["seconds"])
    # each client's own conv weights: XLA lowers the vmapped conv to a grouped one
    assert sum(record["vmapped_grouped_convolutions"].values()) > 0


def test_grouped_convolutions_counts_only_groups_above_one():
    hlo = ("convolution(a, b), feature_group_count=3\nconvolution(a, b), feature_group_count=1\n"
           "convolution(a, b), batch_group_count=2")
    assert conv_probe.grouped_convolutions(hlo) == {"feature_group_count": 1, "batch_group_count": 1}
