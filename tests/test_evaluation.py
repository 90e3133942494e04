"""Evaluation: padding of the last batch changes nothing; the static-BN path uses batch statistics."""

import jax
import numpy as np

from fedpartial.evaluation import evaluate


def test_batch_size_does_not_change_the_result(mlp):
    v = mlp.init_variables(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(23, 4)).astype(np.float32)
    y = rng.integers(0, 3, 23).astype(np.int32)
    a = evaluate(mlp, v, x, y, batch_size=7)  # 3 full batches + one padded batch of 2
    b = evaluate(mlp, v, x, y, batch_size=64)
    np.testing.assert_allclose(a["accuracy"], b["accuracy"])
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4)  # GPU matmuls default to TF32
    logits, _ = mlp.apply(v, x, False)
    assert a["accuracy"] == np.mean(np.argmax(logits, -1) == y)


def test_static_policy_normalises_with_batch_statistics(mlp):
    v = mlp.init_variables(jax.random.key(0))
    x = np.random.default_rng(1).normal(5.0, 3.0, size=(16, 4)).astype(np.float32)
    y = np.zeros(16, np.int32)
    running = evaluate(mlp, v, x, y)
    batch = evaluate(mlp, v, x, y, batch_statistics=True)
    logits, _ = mlp.apply(v, x, True)
    expected = -np.mean(jax.nn.log_softmax(logits)[:, 0])
    np.testing.assert_allclose(batch["loss"], expected, rtol=1e-5)
    assert not np.isclose(running["loss"], batch["loss"])
