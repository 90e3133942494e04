"""Smoke test of the LoRA speed benchmark: every runner timed, the engine's FedAvg equal to the plain loop, FLOPs
and the ratios it reports consistent with its own timings."""

import json

from benchmarks import lora_speed


def test_lora_speed_reports_every_runner(tmp_path):
    # one narrow block (--size micro): the smallest transformer that has every layer the adapters wrap
    assert lora_speed.main(["--size", "micro", "--clients", "2", "--steps", "1", "--batch", "2", "--rank", "2",
                            "--repeats", "1", "--strategies", "fused", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "lora-speed-cpu.json").read_text())
    by = {r["runner"]: r for r in report["rows"]}
    assert set(by) == {"plain_full", "engine_full[fused]", "plain_lora", "engine_lora[fused]"}
    assert report["checks"]["engine_fedavg_matches_plain_loop_max_abs"] < 1e-4
    # adapters train fewer parameters and skip the base's weight gradients
    assert report["trained_parameters"]["lora"] < report["trained_parameters"]["full"]
    assert 0 < report["step_flops"]["lora"] < report["step_flops"]["full"]
    lora = by["engine_lora[fused]"]
    assert lora["speedup_vs_plain_loop"] == by["plain_lora"]["round_s"] / lora["round_s"]
    assert lora["speedup_vs_full_finetuning"] == by["engine_full[fused]"]["round_s"] / lora["round_s"]
    assert report["time"] and report["command"] and report["matmul_flops_per_s"] > 0
