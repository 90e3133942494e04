"""benchmarks/fedrolex_scaler.py: its dead-channel count on hand-made weights, and a two-round row end to end."""

import json

import jax
import numpy as np

from benchmarks import fedrolex_scaler
from fedpartial._src.models import zoo


def test_a_channel_with_a_large_negative_bias_is_dead_and_the_others_are_not():
    module = zoo.CNN2C1F(3, features=(4, 6))
    x = np.random.default_rng(0).uniform(0, 1, (64, 8, 8, 1)).astype(np.float32)
    params = jax.tree.map(np.array, module.init(jax.random.key(0), x[:1])["params"])
    params["conv1"]["bias"][2] = -1e3
    params["conv2"]["bias"][5] = -1e3
    assert fedrolex_scaler.dead_channels(params, x) == {"conv1": [2], "conv2": [5]}


def test_a_row_end_to_end(tmp_path):
    argv = ["--cases", "5", "--rounds", "2", "--seeds", "0", "--variants", "no-scaler", "--methods", "fedrolex",
            "--out", str(tmp_path)]
    assert fedrolex_scaler.main(argv) == 0
    (path,) = tmp_path.glob("fedrolex-scaler-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["method"], row["variant"], row["scaler"], row["client_lr"]) == ("fedrolex", "no-scaler", False, 0.05)
    assert row["units"] == {"conv1": 32, "conv2": 64} and len(row["weak_train_loss"]) == 2
    assert 0 <= row["test_accuracy"] <= 1
