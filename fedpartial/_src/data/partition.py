"""Split a dataset's examples among clients.

:func:`partition` returns one index array per client into the labels it was
given. Common to every scheme:

* every example goes to at most one client, and every example is used, except
  by ``shards`` when ``num_clients * classes_per_client`` is smaller than the
  number of classes (the classes that get no shard are then left out);
* each array is ``int64`` and **sorted ascending**: the order carries no
  information (the packer shuffles each client's examples every epoch);
* every client receives at least ``min_size`` examples (default 1);
* the result is a deterministic function of the arguments (``seed`` seeds a
  ``numpy.random.default_rng``).

Schemes
-------
``iid``
    A random permutation cut into ``num_clients`` contiguous pieces whose sizes
    differ by at most one: with ``n = q * K + r``, the first ``r`` clients get
    ``q + 1`` examples and the others ``q`` (no example is left over).
``dirichlet`` (label skew, Hsu et al. 2019)
    For every class c (over the classes present in ``labels``) draw proportions
    ``p_c ~ Dir(alpha * 1_K)`` over the clients and give client k the share
    ``round(cumsum(p_c) * n_c)`` boundaries define, of a random permutation of
    class c's examples. Small ``alpha`` gives few classes per client, large
    ``alpha`` approaches IID. **Repair rule** (instead of redrawing until lucky,
    which may never end for small alpha and many clients): while some client
    holds fewer than ``min_size`` examples, the lowest-numbered such client
    (the receiver) picks a class - its own most common class, or, if it has
    nothing yet, the class most held by clients above ``min_size`` - and takes
    as many examples of that class as it still needs (at most what the donor
    holds of it and can spare without dropping below ``min_size``) from the
    client above ``min_size`` that holds the most of that class (if none holds
    any, from the largest client, of its most common class). Ties go to the
    lowest client number and the lowest class. Receivers thus stay close to
    single-class, as label skew intends, and only the missing number of
    examples moves. It always ends, because ``num_clients * min_size <= n``
    is checked first and every move shrinks the total shortfall.
``shards`` (pathological non-IID, McMahan et al. 2017)
    Every client gets examples of exactly ``classes_per_client`` (k) distinct
    classes. The ``num_clients * k`` shards are cut *within* classes so that no
    shard mixes two classes (cutting the label-sorted array into equal pieces,
    as the original does, can give a client a shard that straddles two classes
    or two shards of one class, i.e. not k classes). The shards are allotted
    to classes in proportion to class size by the D'Hondt rule (each next shard
    goes to the class whose shards would then be largest), after one shard for
    every class when there are at least as many shards as classes (otherwise
    the largest classes get them, ties broken at random), so shard sizes are as
    equal as possible, with no class holding more shards than it has examples or
    than there are clients. Clients, in random order, then each take k
    distinct classes among those with the most unassigned shards (random
    tie-breaking), which always succeeds; class c's examples, shuffled, are
    cut into its shards (sizes differing by at most one) and handed to its
    holders. With balanced classes all clients get (almost) the same number of
    examples.

:func:`train_holdout_split` splits every client's examples into a training and
a held-out part (personalised evaluation).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from fedpartial._src.data.arrays import DataError

__all__ = ["SCHEMES", "partition", "train_holdout_split"]

#: the partition schemes :func:`partition` takes
SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "shards")

SeedLike = int | np.random.Generator


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    *,
    alpha: float | None = None,
    classes_per_client: int | None = None,
    seed: int = 0,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Split ``range(len(labels))`` among ``num_clients`` clients (see module doc).

    ``alpha`` is required by (and only accepted with) ``dirichlet``,
    ``classes_per_client`` by (and only with) ``shards``. Bad arguments raise
    :class:`~fedpartial.data.DataError`.

    Args:
      labels: every training example's label.
      num_clients: the population.
      scheme: one of :data:`~fedpartial.data.SCHEMES` (e.g. ``iid``, ``dirichlet``, ``shards``).
      alpha: the Dirichlet concentration (``dirichlet`` only).
      classes_per_client: classes per client (``shards`` only).
      seed: the partition's seed.
      min_size: the fewest examples a client gets.

    Returns:
      Per client, a sorted array of example indices.

    Raises:
      DataError: bad arguments.

    Examples:
      >>> import numpy as np
      >>> from fedpartial import data
      >>> parts = data.partition(np.arange(100) % 10, 4, "iid")
      >>> sum(len(p) for p in parts)
      100
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer) or labels.size == 0):
        raise DataError(
            f"labels must be a 1-D integer array, got shape {labels.shape} and dtype {labels.dtype}."
        )
    n = int(labels.shape[0])
    if scheme not in SCHEMES:
        raise DataError(f"Unknown partition scheme {scheme!r}; the schemes are: {', '.join(SCHEMES)}.")
    if not _is_int(num_clients) or not 1 <= num_clients <= n:
        raise DataError(
            f"num_clients={num_clients!r} is not allowed; it must be an integer between 1 and "
            f"the number of examples ({n})."
        )
    num_clients = int(num_clients)
    if not _is_int(min_size) or min_size < 1 or num_clients * min_size > n:
        raise DataError(
            f"min_size={min_size!r} is not allowed; it must be an integer >= 1 with "
            f"num_clients * min_size <= {n} (the number of examples)."
        )
    min_size = int(min_size)
    if alpha is not None and scheme != "dirichlet":
        raise DataError(f"alpha={alpha!r} is only used by the 'dirichlet' scheme, not by {scheme!r}.")
    if classes_per_client is not None and scheme != "shards":
        raise DataError(
            f"classes_per_client={classes_per_client!r} is only used by the 'shards' scheme, "
            f"not by {scheme!r}."
        )
    rng = np.random.default_rng(seed)

    if scheme == "iid":
        parts = np.array_split(rng.permutation(n), num_clients)
    elif scheme == "dirichlet":
        if alpha is None or not _is_real(alpha) or not (math.isfinite(alpha) and alpha > 0):
            raise DataError(
                f"alpha={alpha!r} is not allowed for the 'dirichlet' scheme; it must be a "
                f"finite number > 0."
            )
        parts = _dirichlet(labels, num_clients, float(alpha), min_size, rng)
    else:
        num_classes = len(np.unique(labels))
        if (
            classes_per_client is None
            or not _is_int(classes_per_client)
            or not 1 <= classes_per_client <= num_classes
        ):
            raise DataError(
                f"classes_per_client={classes_per_client!r} is not allowed for the 'shards' "
                f"scheme; it must be an integer between 1 and {num_classes} (the number of "
                f"distinct labels)."
            )
        parts = _shards(labels, num_clients, int(classes_per_client), rng)
        smallest = min(len(p) for p in parts)
        if smallest < min_size:
            raise DataError(
                f"The 'shards' scheme gives some client only {smallest} examples, fewer than "
                f"min_size={min_size}; use fewer clients or a smaller min_size."
            )
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def train_holdout_split(
    indices: Sequence[np.ndarray], train_fraction: float, seed: SeedLike = 0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split every client's examples into (train, holdout), e.g. ``train_fraction=0.7``.

    Client k keeps ``round(train_fraction * n_k)`` randomly chosen examples for
    training, clipped to ``[1, n_k]`` so every client keeps at least one; the
    rest is held out (possibly none for a client with one example). Both parts
    are sorted ``int64`` arrays. Deterministic given ``seed``.

    Args:
      indices: per client, its example indices.
      train_fraction: each client's share kept for training.
      seed: the split's seed.

    Returns:
      ``(train, holdout)``: per client, sorted index arrays.
    """
    if not _is_real(train_fraction) or not 0.0 < train_fraction <= 1.0:
        raise DataError(
            f"train_fraction={train_fraction!r} is not allowed; it must lie in (0, 1]."
        )
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    train, holdout = [], []
    for k, idx in enumerate(indices):
        idx = np.asarray(idx)
        if idx.ndim != 1 or idx.size == 0:
            raise DataError(f"Client {k} has no examples, so it cannot keep one for training.")
        n = idx.size
        n_train = min(n, max(1, int(math.floor(train_fraction * n + 0.5))))
        perm = rng.permutation(idx).astype(np.int64)
        train.append(np.sort(perm[:n_train]))
        holdout.append(np.sort(perm[n_train:]))
    return train, holdout


# ------------------------------------------------------------- internals


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _materialise(
    labels: np.ndarray, classes: np.ndarray, counts: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Hand out ``counts[k, j]`` shuffled examples of class ``classes[j]`` to client k."""
    num_clients = counts.shape[0]
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for j, c in enumerate(classes):
        members = rng.permutation(np.flatnonzero(labels == c))
        ends = np.cumsum(counts[:, j])  # ends[-1] < len(members) leaves the rest unused
        for k, chunk in enumerate(np.split(members[: ends[-1]], ends[:-1])):
            if chunk.size:
                pieces[k].append(chunk)
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in pieces]


def _dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, min_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    classes, class_sizes = np.unique(labels, return_counts=True)
    counts = np.zeros((num_clients, len(classes)), dtype=np.int64)
    for j, n_c in enumerate(class_sizes):
        p = rng.dirichlet(np.full(num_clients, alpha))
        if not np.all(np.isfinite(p)) or p.sum() <= 0:  # defensive: underflow
            p = np.zeros(num_clients)
            p[rng.integers(num_clients)] = 1.0
        bounds = np.minimum(np.rint(np.cumsum(p) * n_c), n_c).astype(np.int64)
        bounds[-1] = n_c
        counts[:, j] = np.diff(bounds, prepend=0)

    # Repair (see module docstring): short clients take examples of one class from a
    # client that can spare them, until every client has min_size.
    sizes = counts.sum(axis=1)
    while True:
        short = np.flatnonzero(sizes < min_size)
        if short.size == 0:
            break
        receiver = int(short[0])
        spare = sizes > min_size  # never empty while someone is short
        if sizes[receiver] > 0:
            cls = int(np.argmax(counts[receiver]))
        else:
            cls = int(np.argmax(counts[spare].sum(axis=0)))
        holding = np.where(spare, counts[:, cls], 0)
        if holding.max() == 0:  # no spare client has that class: largest client's main class
            donor = int(np.argmax(sizes))
            cls = int(np.argmax(counts[donor]))
        else:
            donor = int(np.argmax(holding))
        moved = int(min(min_size - sizes[receiver], counts[donor, cls], sizes[donor] - min_size))
        counts[donor, cls] -= moved
        counts[receiver, cls] += moved
        sizes[donor] -= moved
        sizes[receiver] += moved
    return _materialise(labels, classes, counts, rng)


def _shards(
    labels: np.ndarray, num_clients: int, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    classes, class_sizes = np.unique(labels, return_counts=True)
    num_classes = len(classes)
    total = num_clients * k
    caps = np.minimum(class_sizes, num_clients)
    if caps.sum() < total:
        raise DataError(
            f"The 'shards' scheme cannot give {num_clients} clients {k} classes each: the "
            f"classes have too few examples; use fewer clients or fewer classes_per_client."
        )

    # D'Hondt allotment of shards to classes (random tie-break among equal quotients).
    tie = rng.permutation(num_classes)
    shards = np.zeros(num_classes, dtype=np.int64)
    if total >= num_classes:  # every class gets a first shard, so every example is used
        shards[:] = 1
        heap = [
            (-float(class_sizes[j]) / 2, int(tie[j]), j)
            for j in range(num_classes)
            if caps[j] > 1
        ]
    else:
        heap = [(-float(class_sizes[j]), int(tie[j]), j) for j in range(num_classes)]
    heapq.heapify(heap)
    for _ in range(total - int(shards.sum())):
        _, t, j = heapq.heappop(heap)
        shards[j] += 1
        if shards[j] < caps[j]:
            heapq.heappush(heap, (-float(class_sizes[j]) / (shards[j] + 1), t, j))

    # Clients (random order) take k distinct classes with the most shards left.
    remaining = shards.copy()
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for client in rng.permutation(num_clients):
        order = np.lexsort((rng.random(num_classes), -remaining))
        chosen = order[:k]
        if np.any(remaining[chosen] <= 0):  # cannot happen (Gale-Ryser); guard anyway
            raise AssertionError("shard assignment failed")
        remaining[chosen] -= 1
        for j in chosen:
            holders[j].append(int(client))

    counts = np.zeros((num_clients, num_classes), dtype=np.int64)
    for j in np.flatnonzero(shards):
        # shard sizes differ by at most one and are >= 1 (shards[j] <= class size)
        q, r = divmod(int(class_sizes[j]), int(shards[j]))
        sizes = q + (np.arange(shards[j]) < r)
        for client, size in zip(holders[j], sizes):
            counts[client, j] += size
    return _materialise(labels, classes, counts, rng)
