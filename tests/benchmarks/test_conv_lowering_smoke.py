"""benchmarks/conv_lowering.py --quick: a row's cells are timed against the plain loop, agree with it, and the JSON
names the device, date, command and revision."""

import json

from benchmarks import conv_lowering


def test_quick_run_times_a_lowering_against_the_plain_loop(tmp_path):
    out = tmp_path / "conv.json"
    assert conv_lowering.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"]["matmul_flops_per_s"] > 0 and report["time"] and "--quick" in report["command"]
    assert "git_revision" in report
    (row,) = report["results"]
    plain, cell = row["cells"]["plain_loop"], row["cells"]["im2col/fused"]
    assert plain["rounds_per_s"] > 0 and cell["gflops_per_s"] > 0 and 0 < cell["share_of_matmul"]
    assert cell["max_abs_diff_vs_plain"] < 1e-4 and cell["speedup_vs_plain"] == plain["round_s"] / cell["round_s"]
