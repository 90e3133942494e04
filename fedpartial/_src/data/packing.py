"""Pack a cohort's local data into the engine's fixed-shape input.

Clients hold different numbers of examples and therefore run different
numbers of local steps; the engine wants one array per cohort with a leading
client axis. :func:`pack_cohort` builds :class:`CohortBatches`, padded to
``num_steps`` steps of ``batch_size`` examples, with masks that say which
examples and steps are real (docs/decisions.md#engine, "Unequal client data"). Padded example
slots hold zeros in ``x`` and label 0; padded steps are entirely padding.

How many steps a client runs
----------------------------
Exactly one of ``local_steps`` and ``local_epochs`` is given.

``local_epochs=e``
    A client with ``n_k`` examples has ``ceil(n_k / B)`` batches per epoch and
    runs ``ceil(e * ceil(n_k / B))`` steps. Every epoch is a fresh random
    permutation of its examples cut into ``ceil(n_k / B)`` batches, of which
    the last is partial when ``B`` does not divide ``n_k`` (real examples
    first, then padding). A fractional ``e`` runs the first steps of the next
    epoch: ``e = 0.5`` is the first half of the batches of one permutation (about
    half the data, each example at most once), ``e = 1.5`` is one full epoch
    followed by half of another.
``local_steps=s``
    Every client runs exactly ``s`` steps. Its batches are cut from an endless
    stream of successive random permutations of its examples (like
    ``shuffle(...).repeat().batch(B)``): each batch holds ``min(B, n_k)`` real
    examples, so a client with fewer than ``B`` examples sees all of them, in a
    new order, in a partial batch every step. A batch that spans the boundary
    between two permutations may contain an example twice.

A client with no examples runs no steps (all padding, ``num_samples`` 0).
:func:`max_steps` gives the largest count over a whole population, so that
``num_steps`` - and with it the shapes the engine compiles for - can stay the
same in every round.

Randomness: ``seed`` is an ``int`` (fed to ``numpy.random.default_rng``) or a
``numpy.random.Generator``; clients draw from it one after the other in the
order given, so the same seed and the same arguments give identical batches.
A caller that wants different batches every round passes a per-round seed, e.g.
``np.random.default_rng([base_seed, round_index])``.

Dtypes: ``x`` keeps an integer dtype (e.g. token ids) and otherwise becomes
``float32``; ``y`` is ``int32``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fedpartial._src.core.fielddocs import document_fields
from fedpartial._src.data.sources import DataError

__all__ = ["CohortBatches", "steps_for_client", "max_steps", "pack_cohort"]


@document_fields
class CohortBatches(NamedTuple):
    """A cohort's local data, padded to a common shape (K clients, S steps, B examples).

    Attributes:
      x: ``[K, S, B, *feature_shape]`` float32 (integer features keep their dtype).
      y: ``[K, S, B]`` int32 labels.
      example_mask: ``[K, S, B]`` bool, False for padded examples.
      step_mask: ``[K, S]`` bool, False for padded steps.
      num_samples: ``[K]`` float32, ``n_k``, the client's number of training examples.
    """

    x: np.ndarray
    y: np.ndarray
    example_mask: np.ndarray
    step_mask: np.ndarray
    num_samples: np.ndarray


def _check_mode(local_steps: int | None, local_epochs: float | None) -> None:
    if (local_steps is None) == (local_epochs is None):
        raise DataError(
            f"Exactly one of local_steps and local_epochs must be given, got "
            f"local_steps={local_steps!r} and local_epochs={local_epochs!r}."
        )
    if local_steps is not None and (
        not isinstance(local_steps, (int, np.integer))
        or isinstance(local_steps, bool)
        or local_steps < 1
    ):
        raise DataError(f"local_steps={local_steps!r} is not allowed; it must be an integer >= 1.")
    if local_epochs is not None and (
        not isinstance(local_epochs, (int, float, np.integer, np.floating))
        or isinstance(local_epochs, bool)
        or not math.isfinite(local_epochs)
        or local_epochs <= 0
    ):
        raise DataError(
            f"local_epochs={local_epochs!r} is not allowed; it must be a finite number > 0."
        )


def _check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise DataError(f"{name}={value!r} is not allowed; it must be an integer >= 1.")
    return int(value)


def _steps(n: int, batch_size: int, local_steps: int | None, local_epochs: float | None) -> int:
    if n == 0:
        return 0
    if local_steps is not None:
        return int(local_steps)
    batches = -(-n // batch_size)
    # round() first so that e.g. 0.1 * 30 = 3.0000000000000004 counts as 3 steps
    return int(math.ceil(round(float(local_epochs) * batches, 9)))


def steps_for_client(
    num_examples: int,
    batch_size: int,
    *,
    local_steps: int | None,
    local_epochs: float | None,
) -> int:
    """Number of real local steps of a client with ``num_examples`` examples.

    Args:
      num_examples: the client's training examples.
      batch_size: examples per step.
      local_steps: a fixed number of local steps (or None).
      local_epochs: epochs of local data (or None); exactly one of the two is given.

    Returns:
      The number of steps.

    Examples:
      >>> from fedpartial import data
      >>> data.steps_for_client(100, 32, local_steps=None, local_epochs=1)
      4
    """
    _check_mode(local_steps, local_epochs)
    batch_size = _check_positive_int("batch_size", batch_size)
    if not isinstance(num_examples, (int, np.integer)) or num_examples < 0:
        raise DataError(f"num_examples={num_examples!r} is not allowed; it must be an integer >= 0.")
    return _steps(int(num_examples), batch_size, local_steps, local_epochs)


def max_steps(
    sizes: Sequence[int],
    batch_size: int,
    *,
    local_steps: int | None,
    local_epochs: float | None,
) -> int:
    """Largest :func:`steps_for_client` over a population of client sizes.

    Args:
      sizes: every client's training examples.
      batch_size: examples per step.
      local_steps: a fixed number of local steps (or None).
      local_epochs: epochs of local data (or None); exactly one of the two is given.

    Returns:
      The largest number of steps.
    """
    sizes = list(sizes)
    if not sizes:
        raise DataError("max_steps needs the size of at least one client.")
    return max(
        steps_for_client(n, batch_size, local_steps=local_steps, local_epochs=local_epochs)
        for n in sizes
    )


def pack_cohort(
    x: np.ndarray,
    y: np.ndarray,
    client_indices: Sequence[np.ndarray],
    *,
    batch_size: int,
    num_steps: int,
    local_steps: int | None = None,
    local_epochs: float | None = None,
    seed: int | np.random.Generator,
    client_keys: Sequence[int] | None = None,
) -> CohortBatches:
    """Pack the examples ``x[client_indices[k]]`` of each cohort member k (see module doc).

    ``client_keys``: one integer per client (e.g. its id); client k then draws from its
    own ``numpy.random.default_rng([seed, client_keys[k]])`` (``seed`` an int), so its
    batches do not depend on which other clients are packed with it — what packing a
    cohort a chunk at a time needs.  None: every client draws from ``seed`` in turn.

    Args:
      x: every training example's features.
      y: every training example's labels.
      client_indices: per cohort member, its indices into ``x``.
      batch_size: examples per step ``B``.
      num_steps: steps ``S`` every client is padded to.
      local_steps: a fixed number of local steps (or None).
      local_epochs: epochs of local data (or None); exactly one of the two is given.
      seed: the shuffling seed (or a numpy generator).
      client_keys: one integer per client (above), or None.

    Returns:
      The :class:`~fedpartial.data.CohortBatches`.
    """
    _check_mode(local_steps, local_epochs)
    batch = _check_positive_int("batch_size", batch_size)
    steps_cap = _check_positive_int("num_steps", num_steps)
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim < 1 or y.ndim < 1 or x.shape[0] != y.shape[0]:
        raise DataError(
            f"x and y must have the same number of examples along their first axis, got shapes "
            f"{x.shape} and {y.shape}."
        )
    num_clients = len(client_indices)
    if num_clients == 0:
        raise DataError("pack_cohort needs at least one client.")
    if client_keys is not None and (isinstance(seed, np.random.Generator) or len(client_keys) != len(client_indices)):
        raise DataError("client_keys needs an int seed and one key per client.")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n_total = x.shape[0]

    # Slot table: idx[k, s, b] is the example in that slot, -1 for padding.
    idx = np.full((num_clients, steps_cap, batch), -1, dtype=np.int64)
    num_samples = np.zeros(num_clients, dtype=np.float32)
    for k, members in enumerate(client_indices):
        members = np.asarray(members)
        if members.ndim != 1 or not (np.issubdtype(members.dtype, np.integer) or members.size == 0):
            raise DataError(
                f"Client {k}'s indices must be a 1-D integer array, got shape {members.shape} "
                f"and dtype {members.dtype}."
            )
        n = members.size
        num_samples[k] = n
        if n == 0:
            continue
        members = members.astype(np.int64, copy=False)
        if client_keys is not None:
            rng = np.random.default_rng([int(seed), int(client_keys[k])])
        if members.min() < 0 or members.max() >= n_total:
            raise DataError(
                f"Client {k} has example indices outside 0..{n_total - 1} (the dataset's size)."
            )
        steps = _steps(n, batch, local_steps, local_epochs)
        if steps > steps_cap:
            raise DataError(
                f"Client {k} with {n} examples needs {steps} local steps but num_steps is "
                f"{steps_cap}; pass num_steps >= {steps} (max_steps over the population gives it)."
            )
        if local_epochs is not None:
            per_epoch = -(-n // batch)
            epochs = -(-steps // per_epoch)
            slots = np.full((epochs, per_epoch * batch), -1, dtype=np.int64)
            slots[:, :n] = rng.permuted(np.broadcast_to(members, (epochs, n)), axis=1)
            idx[k, :steps] = slots.reshape(epochs * per_epoch, batch)[:steps]
        else:
            real = min(batch, n)
            need = steps * real
            epochs = -(-need // n)
            stream = rng.permuted(np.broadcast_to(members, (epochs, n)), axis=1).reshape(-1)
            idx[k, :steps, :real] = stream[:need].reshape(steps, real)

    example_mask = idx >= 0
    step_mask = example_mask.any(axis=2)
    flat_idx = idx.reshape(-1)
    flat_mask = example_mask.reshape(-1)
    real_pos = np.flatnonzero(flat_mask)
    total = flat_idx.size

    out_dtype = x.dtype if np.issubdtype(x.dtype, np.integer) else np.dtype(np.float32)
    if 2 * real_pos.size >= total:
        # Mostly real slots: gather every slot in one pass, then zero the padded ones.
        xb = np.take(x, np.where(flat_mask, flat_idx, 0), axis=0)
        if xb.dtype != out_dtype:
            xb = xb.astype(out_dtype)
        xb[np.flatnonzero(~flat_mask)] = 0
    else:
        # Mostly padding: start from zeros and write only the real slots.
        xb = np.zeros((total,) + x.shape[1:], dtype=out_dtype)
        xb[real_pos] = x[flat_idx[real_pos]]
    yb = np.zeros((total,) + y.shape[1:], dtype=np.int32)  # labels per example, or per position of a sequence
    yb[real_pos] = y[flat_idx[real_pos]]

    shape = (num_clients, steps_cap, batch)
    return CohortBatches(
        x=xb.reshape(shape + x.shape[1:]),
        y=yb.reshape(shape + y.shape[1:]),
        example_mask=example_mask,
        step_mask=step_mask,
        num_samples=num_samples,
    )
