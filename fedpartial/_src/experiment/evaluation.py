"""Evaluation: a global model on a test set, and every client's own model on its held-out split.

Both are jitted with fixed shapes (padded, masked examples), so a run compiles once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import memory
from fedpartial._src.core.losses import count_correct, count_labels, masked_cross_entropy, model_loss
from fedpartial._src.core.structure import FROZEN, with_frozen, without_frozen
from fedpartial._src.methods.base import PersonalModels
from fedpartial._src.models import exits
from fedpartial._src.models.adapter import Model
from fedpartial._src.models.exits import MultiExitModel


@functools.partial(jax.jit, static_argnums=(0, 4))
def _eval_batch(model: Model, variables, x, y_mask, batch_statistics: bool):
    y, mask = y_mask
    # 'static' BatchNorm: normalise with statistics of the evaluation batch itself.
    stats_mask = mask if batch_statistics else None
    if isinstance(model, MultiExitModel):  # every exit, their ensemble and the model's output, from one pass
        every, _ = model.exit_logits(variables, x, train=batch_statistics, example_mask=stats_mask)
        logits = exits.combine(every, model.output)
        extra = jnp.stack([*every, exits.combine(every, "mean")])  # [E + 1, B, C]
    else:
        logits, _ = model.apply(variables, x, batch_statistics, stats_mask)
        extra = jnp.zeros((0, *logits.shape), logits.dtype)
    count = count_labels(y, mask)
    loss = masked_cross_entropy(logits, y, mask) * count
    every_exit = jax.vmap(count_correct, in_axes=(0, None, None))(extra, y, mask)
    return count_correct(logits, y, mask), loss, every_exit, count


def evaluate(model: Model, variables: dict, x: np.ndarray, y: np.ndarray, *, batch_size: int = 512,
             batch_statistics: bool = False) -> dict:
    """Accuracy and mean loss of ``variables`` on ``(x, y)``.

    The last batch is padded to ``batch_size`` with masked examples, so the whole
    set compiles once.  ``batch_statistics=True`` evaluates BatchNorm with the
    statistics of each evaluation batch (the 'static' policy, as HeteroFL's sBN).
    A model with exits (:class:`~fedpartial.models.MultiExitModel`) also gives
    ``exit_accuracy``, every exit's accuracy (shallow to deep), and ``ensemble_accuracy``, that
    of the mean of their logits; ``accuracy`` is its ``apply``'s output.  With labels per position
    (``y`` ``[n, T]``, a language model's next tokens, -1 where nothing follows) accuracy and loss are over
    every real target and the result adds ``perplexity``, ``exp(loss)``.

    Args:
      model: the :class:`~fedpartial.models.Model`.
      variables: its variables.
      x: inputs ``[n, ...]``.
      y: int labels ``[n]``, or ``[n, T]`` per position.
      batch_size: examples per evaluation batch.
      batch_statistics: evaluate BatchNorm with each batch's statistics.

    Returns:
      ``{'accuracy', 'loss', ...}``.
    """
    n = len(y)
    if n == 0:
        return {"accuracy": float("nan"), "loss": float("nan")}
    batch_size = min(batch_size, n)
    correct = loss = count = 0.0
    extra = 0.0
    for start in range(0, n, batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        mask = np.ones(batch_size, bool)
        if len(yb) < batch_size:
            pad = batch_size - len(yb)
            mask[len(yb):] = False
            xb = np.concatenate([xb, np.zeros((pad, *xb.shape[1:]), xb.dtype)])
            yb = np.concatenate([yb, np.zeros((pad, *yb.shape[1:]), yb.dtype)])
        c, l, e, m = _eval_batch(model, variables, xb, (yb, mask), batch_statistics)
        correct += float(c)
        loss += float(l)
        count += float(m)
        extra = extra + np.asarray(e, np.float64)  # [E + 1] correct per exit and the ensemble ([0] without exits)
    count = max(count, 1.0)
    out = {"accuracy": correct / count, "loss": loss / count}
    if np.ndim(y) > 1:
        out["perplexity"] = float(np.exp(out["loss"]))
    if np.size(extra):
        out.update(exit_accuracy=[float(a) for a in extra[:-1] / count], ensemble_accuracy=float(extra[-1] / count))
    return out


def record_fields(result: dict) -> dict:
    """A metrics record's fields from :func:`evaluate`'s ``result``: ``test_accuracy``, ``test_loss`` and, for a
    model with exits, ``test_accuracy_exit1`` … (shallow to deep) and ``test_accuracy_ensemble``; with labels
    per position (a language model), ``perplexity``."""
    record = {"test_accuracy": result["accuracy"], "test_loss": result["loss"]}
    if "perplexity" in result:
        record["perplexity"] = result["perplexity"]
    for i, accuracy in enumerate(result.get("exit_accuracy", ()), 1):
        record[f"test_accuracy_exit{i}"] = accuracy
    if "ensemble_accuracy" in result:
        record["test_accuracy_ensemble"] = result["ensemble_accuracy"]
    return record


def pad_holdouts(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stacks every client's held-out ``(x, y)`` into ``[N, H, ...]`` arrays plus an example mask."""
    h = max(1, max(len(y) for _, y in parts))
    x0 = parts[0][0]
    x = np.zeros((len(parts), h, *x0.shape[1:]), np.float32 if x0.dtype.kind == "f" else x0.dtype)
    y = np.zeros((len(parts), h, *parts[0][1].shape[1:]), np.int32)
    mask = np.zeros((len(parts), h), bool)
    for i, (xi, yi) in enumerate(parts):
        x[i, :len(yi)], y[i, :len(yi)], mask[i, :len(yi)] = xi, yi, True
    return x, y, mask


# Bytes of personal models and held-out examples evaluated per call: a few hundred clients of a dense model,
# and a bound that a host store much larger than the device (per-client state off the device) never exceeds.
CHUNK_BYTES_CPU = 64 * 2**20
CHUNK_BYTES_MAX = 2 * 2**30
CPU_FLAT_BATCH = 512  # examples a shared model evaluates per call on CPU
ACCELERATOR_EXAMPLES = 8192  # examples per call on a GPU/TPU (personal or shared models)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _eval_clients(model: Model, size: int, stacked: bool, batch_statistics: bool, loop: str, variables, submodel,
                  start, x, y, mask):
    """Loss sum and correct count of ``size`` clients on their own data: rows ``start …`` of device-resident
    stacked ``variables`` / ``submodel`` (host rows arrive already cut, with ``start`` 0), and ``x, y, mask``
    (always cut on the host).  ``loop``: 'vmap' (every client at once) or 'map' (one after another in XLA)."""
    def rows(a):
        return jax.lax.dynamic_slice_in_dim(a, start, size, 0)

    base = variables if not stacked else {FROZEN: variables[FROZEN]} if FROZEN in variables else None
    if stacked:  # a LoRA model's frozen base is one copy (not [N]) beside the stacked personal parts
        variables = without_frozen(variables)

    def one(variables_k, submodel_k, x_k, y_k, m_k):
        variables_k = with_frozen(variables_k, base) if stacked else variables_k
        loss, correct = model_loss(model, variables_k, x_k, y_k, m_k, train=batch_statistics, submodel=submodel_k)
        return loss * count_labels(y_k, m_k), correct

    if not stacked and not batch_statistics:  # one shared model: the clients' examples are one flat batch
        logits, _ = model.apply(variables, x.reshape(-1, *x.shape[2:]), False, None)
        logits = logits.reshape(*y.shape, -1)
        loss = jax.vmap(masked_cross_entropy)(logits, y, mask) * jax.vmap(count_labels)(y, mask)
        return loss, jax.vmap(count_correct)(logits, y, mask)
    if not stacked:  # ... normalised with each client's own batch statistics ('static' BatchNorm)
        return jax.vmap(lambda *d: one(variables, None, *d))(x, y, mask)
    variables = jax.tree.map(rows, variables)
    submodel = None if submodel is None else jax.tree.map(rows, submodel)
    if loop == "map":
        return jax.lax.map(lambda a: one(*a), (variables, submodel, x, y, mask))
    return jax.vmap(one)(variables, submodel, x, y, mask)


def _client_loop_and_chunk(personal: PersonalModels, x: np.ndarray, y: np.ndarray, n: int) -> tuple[str, int]:
    """How the clients of one call run, and how many per call.

    Measured on 2 CPU cores (ms per client, 16 held-out examples each):
    personal conv models vmapped over a chunk ran 11x slower than one client per call (cnn2c1f 45 vs 4.0), while
    ``lax.map`` over a chunk of 64 ran faster than one per call (2.7; LeNet5 1.2 vs 1.4), and dense models were
    within noise either way; so CPU maps over the clients of a chunk and other platforms vmap them.  A shared
    model evaluates the chunk's examples as one flat batch, best at about 512 examples on CPU (cnn2c1f 3.8 ms
    per client against 4.4 one client per call and 7.7-10 vmapped).  The chunk is also bounded in bytes (models
    plus examples), so a population held on the host or on disk never travels to the device whole.
    """
    per_client = x[:1].nbytes + y[:1].nbytes + x.shape[1]
    if personal.stacked:
        per_client += sum(a.nbytes // a.shape[0] for a in jax.tree.leaves(without_frozen(personal.variables)))
    if jax.default_backend() == "cpu":
        loop, budget = "map", CHUNK_BYTES_CPU
        most = 64 if personal.stacked else max(1, CPU_FLAT_BATCH // x.shape[1])
    else:  # activations grow with the examples in flight, which the byte budget does not see
        available, _ = memory.available_bytes()
        loop, budget = "vmap", min(CHUNK_BYTES_MAX, (available or CHUNK_BYTES_MAX) // 8)
        most = max(1, ACCELERATOR_EXAMPLES // x.shape[1])
    return loop, max(1, min(n, most, budget // max(per_client, 1)))


def evaluate_clients(model: Model, personal: PersonalModels, x: np.ndarray, y: np.ndarray, mask: np.ndarray, *,
                     batch_statistics: bool = False, chunk_size: int | None = None,
                     client_loop: str | None = None) -> dict:
    """Every client's own model on its own held-out split (personalised evaluation).

    Args:
      model: the model.
      personal: every client's model (:meth:`fedpartial._src.methods.base.Method.personal`);
        unstacked variables evaluate one shared model on every client's data.  Stacked
        variables may live on the device or on the host (numpy, memory-mapped).
      x, y, mask: ``[N, H, ...]`` held-out examples (:func:`pad_holdouts`), on the host.
      batch_statistics: evaluate BatchNorm with batch statistics ('static' policy).
      chunk_size: clients evaluated per call; default: as many as fit a byte budget
        (64 MiB on CPU; on an accelerator an eighth of its free memory, at most 2 GiB),
        and at most 64 personal models or 512 examples of a shared model on CPU, 8,192
        examples on an accelerator.
      client_loop: 'map' (clients one after another inside the call) or 'vmap'
        (batched); default 'map' on CPU, where vmapped per-client convolutions are
        slow, and 'vmap' elsewhere.  A shared model always evaluates as one batch.

    Returns:
      ``accuracy`` and ``loss`` per client (``[N]``, NaN for a client without
      held-out data), their ``mean`` / ``std`` / ``min`` / ``max`` accuracy over
      clients that have data, and ``pooled`` accuracy over all held-out examples.
    """
    n = x.shape[0]
    default_loop, default_chunk = _client_loop_and_chunk(personal, x, y, n)
    loop = client_loop or default_loop
    if loop not in ("map", "vmap"):
        raise ValueError(f"client_loop {loop!r} is unknown; choose 'map' or 'vmap'.")
    chunk_size = min(chunk_size or default_chunk, n)
    # Personal models held on the host (per-client state off the device, numpy or memory-mapped): each
    # chunk's rows are cut on the host, so only they travel (the jitted slice then starts at 0); so are the
    # examples, always.  Device-resident models are sliced inside the call.
    on_host = personal.stacked and not any(isinstance(a, jax.Array)
                                           for a in jax.tree.leaves(without_frozen(personal.variables)))
    losses, corrects, done = [], [], 0
    while done < n:
        start = min(done, n - chunk_size)  # the last chunk overlaps instead of changing shape
        rows = lambda t: jax.tree.map(lambda a: np.asarray(a[start:start + chunk_size]), t)  # noqa: E731
        variables, submodel, first = personal.variables, personal.submodel, start
        if on_host:
            variables = with_frozen(rows(without_frozen(variables)), variables)
            submodel, first = rows(submodel), 0
        loss, correct = _eval_clients(model, chunk_size, personal.stacked, batch_statistics, loop,
                                      variables, submodel, first, *rows((x, y, mask)))
        losses.append(np.asarray(loss)[done - start:])
        corrects.append(np.asarray(correct)[done - start:])
        done = start + chunk_size
    return summarize_clients(np.concatenate(losses), np.concatenate(corrects), labels_per_client(y, mask))


def labels_per_client(y: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``[N]`` every client's real held-out labels (examples, or targets of sequences): what its accuracy
    and loss are over."""
    weights = mask.reshape(mask.shape + (1,) * (y.ndim - mask.ndim)) & (y >= 0)
    return weights.reshape(len(y), -1).sum(axis=1)


def summarize_clients(loss_sum: np.ndarray, correct: np.ndarray, count: np.ndarray) -> dict:
    """:func:`evaluate_clients`' result from every client's loss sum, correct count and held-out count ``[N]``."""
    correct = np.asarray(correct, np.float64)
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
