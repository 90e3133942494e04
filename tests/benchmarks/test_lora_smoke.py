"""benchmarks/lora.py at its smallest: pre-training, FLoRA with equal and heterogeneous ranks on an MLP (a micro ViT
took 2.5x its CPU seconds, and the language model below runs the transformer's adapters), a micro transformer
language model's token accuracy and perplexity, end to end."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import lora as bench

MICRO = dict(clients=3, rounds=1, steps=1, batch=8, pretrain_steps=50, rank=2, model_size="micro")


def test_a_tiny_run_writes_rows_and_checks(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.SIZES, "tiny", MICRO)
    assert bench.main(["--size", "tiny", "--model", "mlp", "--methods", "flora,hetlora_unknown",
                       "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "lora-mlp-tiny.json").read_text())
    assert report["model"] == "mlp" and "model_size" not in report["settings"]
    assert [(r["method"], r["ranks"]) for r in report["rows"]] == [("flora", None), ("flora", [1, 1, 2])]
    assert report["command"] and report["time"] and report["device"]
    assert report["checks"] == {}  # each check needs its two methods
    equal, ranked = report["rows"]
    assert ranked["upload_bytes_per_round"] < equal["upload_bytes_per_round"]  # rank 1 clients upload less
    assert equal["lora_aggregation_error_last"] < 1e-5 and 0 <= equal["global_accuracy"] <= 1
    assert "global_perplexity" not in equal  # a classifier: accuracy only
    assert (tmp_path / "lora-mlp-tiny.png").exists()


def test_a_language_model_reports_token_accuracy_and_perplexity(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.SIZES, "tiny", MICRO)
    assert bench.main(["--size", "tiny", "--model", "transformer_lm", "--dataset", "synthetic_lm",
                       "--methods", "fedsa_lora", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "lora-transformer_lm-tiny.json").read_text())
    (row,) = report["rows"]
    assert report["language_model"] and report["pretrained_perplexity"] > 1
    assert report["settings"]["model_size"]["layers"] == 1  # the size's micro transformer
    assert 0 <= row["global_accuracy"] <= 1 and 0 <= row["personal_accuracy"] <= 1
    assert 1 < row["global_perplexity"] < 64 and 1 < row["personal_perplexity"] < 64  # below uniform over 64 words


class _Fixed:
    """A model whose logits are given: example ``i`` (its input is ``[i, ...]``) gets ``logits[i]``."""

    def __init__(self, logits):
        self.logits = np.asarray(logits, np.float32)

    def apply(self, variables, x, train):
        return (jnp.asarray(self.logits)[x[:, 0].astype(jnp.int32)],)


def test_scores_count_every_real_token_and_no_padding(monkeypatch):
    monkeypatch.setattr(bench, "EVAL_BATCH", 2)  # three sequences: the second batch is padded
    # vocabulary 2, three positions; -1 marks padded targets
    logits = np.log(np.array([[[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]],
                              [[0.3, 0.7], [0.6, 0.4], [0.1, 0.9]],
                              [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]], np.float32))
    labels = np.array([[0, 0, -1], [1, 1, -1], [1, -1, -1]])
    ids = np.arange(3)[:, None].repeat(3, 1)
    accuracy, loss = bench.Scorer(_Fixed(logits))({}, ids, labels)
    # real targets: (0, p 0.9, right), (0, p 0.2, wrong), (1, p 0.7, right), (1, p 0.4, wrong), (1, p 0.5, a tie:
    # arg-max picks 0, wrong)
    assert accuracy == pytest.approx(2 / 5)
    expected = -(np.log(0.9) + np.log(0.2) + np.log(0.7) + np.log(0.4) + np.log(0.5)) / 5
    assert loss == pytest.approx(expected, rel=1e-5)
    # one label per example: a classifier
    acc, _ = bench.Scorer(_Fixed(logits[:, 0]))({}, ids, np.array([0, 0, 1]))
    assert acc == pytest.approx(1 / 3)
