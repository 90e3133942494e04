"""Smoke test of the LoRA memory benchmark: a round's peak grows with the cohort by the adapters, not the base."""

import json

from benchmarks import lora_memory


def test_the_base_held_once_grows_by_the_adapters_only(tmp_path):
    out = tmp_path / "m.json"
    report = lora_memory.main(["--cohorts", "2,6", "--width", "128", "--rank", "2", "--steps", "1", "--batch", "2",
                               "--run", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == report["rows"] and report["time"] and report["command"]
    once, stacked = (report["rows"][1][kind]["bytes_per_extra_client"] for kind in ("held_once", "stacked"))
    # each extra client adds its adapters (a few KB here); stacked, it adds at least one copy of the 136 KB base
    assert once < report["base_bytes"] / 2 < report["base_bytes"] < stacked
    assert report["rows"][0]["held_once"]["round_s"] > 0
