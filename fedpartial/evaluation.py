"""Evaluation: a global model on a test set, and every client's own model on its held-out split.

Both are jitted with fixed shapes (padded, masked examples), so a run compiles once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial.losses import masked_cross_entropy, model_loss
from fedpartial.methods.base import PersonalModels
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


def pad_holdouts(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stacks every client's held-out ``(x, y)`` into ``[N, H, ...]`` arrays plus an example mask."""
    h = max(1, max(len(y) for _, y in parts))
    x0 = parts[0][0]
    x = np.zeros((len(parts), h, *x0.shape[1:]), np.float32 if x0.dtype.kind == "f" else x0.dtype)
    y = np.zeros((len(parts), h), np.int32)
    mask = np.zeros((len(parts), h), bool)
    for i, (xi, yi) in enumerate(parts):
        x[i, :len(yi)], y[i, :len(yi)], mask[i, :len(yi)] = xi, yi, True
    return x, y, mask


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _eval_clients(model: Model, size: int, stacked: bool, batch_statistics: bool, variables, submodel,
                  start, x, y, mask):
    """Loss sum and correct count of clients ``start … start+size-1`` on their own data."""
    def rows(a):
        return jax.lax.dynamic_slice_in_dim(a, start, size, 0)

    def one(variables_k, submodel_k, x_k, y_k, m_k):
        loss, correct = model_loss(model, variables_k, x_k, y_k, m_k, train=batch_statistics, submodel=submodel_k)
        return loss * jnp.sum(m_k), correct

    variables = jax.tree.map(rows, variables) if stacked else variables
    submodel = None if submodel is None else jax.tree.map(rows, submodel)
    return jax.vmap(one, in_axes=(0 if stacked else None, 0, 0, 0, 0))(
        variables, submodel, rows(x), rows(y), rows(mask))


def evaluate_clients(model: Model, personal: PersonalModels, x: np.ndarray, y: np.ndarray, mask: np.ndarray, *,
                     batch_statistics: bool = False, chunk_size: int | None = None) -> dict:
    """Every client's own model on its own held-out split (personalised evaluation).

    Args:
      model: the model.
      personal: every client's model (:meth:`fedpartial.methods.base.Method.personal`);
        unstacked variables evaluate one shared model on every client's data.
      x, y, mask: ``[N, H, ...]`` held-out examples (:func:`pad_holdouts`).
      batch_statistics: evaluate BatchNorm with batch statistics ('static' policy).
      chunk_size: clients evaluated per call (vmapped); default 1 on CPU, where
        vmapped per-client convolutions are slow, and all clients elsewhere.

    Returns:
      ``accuracy`` and ``loss`` per client (``[N]``, NaN for a client without
      held-out data), their ``mean`` / ``std`` / ``min`` / ``max`` accuracy over
      clients that have data, and ``pooled`` accuracy over all held-out examples.
    """
    n = x.shape[0]
    if chunk_size is None:
        chunk_size = 1 if jax.default_backend() == "cpu" else n
    chunk_size = min(chunk_size, n)
    # Personal models held on the host (per-client state off the device, numpy or memory-mapped): each
    # chunk's rows are cut on the host, so only they travel (the jitted slice then starts at 0).
    on_host = personal.stacked and not any(isinstance(a, jax.Array) for a in jax.tree.leaves(personal.variables))
    losses, corrects, done = [], [], 0
    while done < n:
        start = min(done, n - chunk_size)  # the last chunk overlaps instead of changing shape
        if on_host:
            rows = lambda t: jax.tree.map(lambda a: np.asarray(a[start:start + chunk_size]), t)  # noqa: E731
            loss, correct = _eval_clients(model, chunk_size, True, batch_statistics, rows(personal.variables),
                                          rows(personal.submodel), 0, *rows((x, y, mask)))
        else:
            loss, correct = _eval_clients(model, chunk_size, personal.stacked, batch_statistics,
                                          personal.variables, personal.submodel, start, x, y, mask)
        losses.append(np.asarray(loss)[done - start:])
        corrects.append(np.asarray(correct)[done - start:])
        done = start + chunk_size
    loss_sum, correct = np.concatenate(losses), np.concatenate(corrects).astype(np.float64)
    count = mask.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        accuracy = np.where(count > 0, correct / count, np.nan)
        loss = np.where(count > 0, loss_sum / count, np.nan)
    have = count > 0
    acc = accuracy[have]
    return {
        "accuracy": accuracy, "loss": loss,
        "mean": float(acc.mean()) if acc.size else float("nan"),
        "std": float(acc.std()) if acc.size else float("nan"),
        "min": float(acc.min()) if acc.size else float("nan"),
        "max": float(acc.max()) if acc.size else float("nan"),
        "pooled": float(correct.sum() / max(count.sum(), 1)),
    }
