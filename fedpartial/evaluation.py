"""Evaluation of a global model on a held-out set (jitted, fixed batch shape)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial.client import masked_cross_entropy
from fedpartial.models.adapter import Model


@functools.partial(jax.jit, static_argnums=(0, 4))
def _eval_batch(model: Model, variables, x, y_mask, batch_statistics: bool):
    y, mask = y_mask
    # 'static' BatchNorm: normalise with statistics of the evaluation batch itself.
    logits, _ = model.apply(variables, x, batch_statistics, mask if batch_statistics else None)
    correct = jnp.sum((jnp.argmax(logits, -1) == y) & mask)
    loss = masked_cross_entropy(logits, y, mask) * jnp.sum(mask)
    return correct, loss


def evaluate(model: Model, variables: dict, x: np.ndarray, y: np.ndarray, *, batch_size: int = 512,
             batch_statistics: bool = False) -> dict:
    """Accuracy and mean loss of ``variables`` on ``(x, y)``.

    The last batch is padded to ``batch_size`` with masked examples, so the whole
    set compiles once.  ``batch_statistics=True`` evaluates BatchNorm with the
    statistics of each evaluation batch (the 'static' policy, as HeteroFL's sBN).
    """
    n = len(y)
    if n == 0:
        return {"accuracy": float("nan"), "loss": float("nan")}
    batch_size = min(batch_size, n)
    correct = loss = 0.0
    for start in range(0, n, batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        mask = np.ones(batch_size, bool)
        if len(yb) < batch_size:
            pad = batch_size - len(yb)
            mask[len(yb):] = False
            xb = np.concatenate([xb, np.zeros((pad, *xb.shape[1:]), xb.dtype)])
            yb = np.concatenate([yb, np.zeros((pad,), yb.dtype)])
        c, l = _eval_batch(model, variables, xb, (yb, mask), batch_statistics)
        correct += float(c)
        loss += float(l)
    return {"accuracy": correct / n, "loss": loss / n}
