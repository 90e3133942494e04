"""Naturally federated datasets: which of the files' users become clients, and their examples in ragged storage.

A naturally partitioned dataset (LEAF's files, :mod:`fedpartial._src.data.leaf`; a Hugging Face dataset split
by a column, :mod:`fedpartial._src.data.hf`) arrives as users, each with its own training examples and its
own test examples. :func:`choose_users` decides which users are the clients; :class:`RaggedBuilder` stores
the chosen users' examples one after the other in a single ``[n, ...]`` array per split, so client ``k``'s
examples are the contiguous rows ``offsets[k]:offsets[k + 1]``. No array is padded to the largest client:
FEMNIST's clients differ in size by 100x, and a padded ``[N, max_examples, 784]`` array would be several
times the data. The cohort packer (:mod:`fedpartial._src.data.packing`) gathers from these rows as from any
other dataset, so a natural dataset runs through the same cohort packing as a partitioned one.

Choosing the clients (deterministic for a seed):

1. users with fewer than ``min_examples`` training examples are left out (None: no user is left out, and
   a user with no training example is refused, since it cannot be a client);
2. of the rest (in the files' order), ``count`` users are drawn without replacement by
   ``numpy.random.default_rng([seed, 0x1EAF])`` when ``count`` is below their number, and kept in the
   files' order; ``count`` is ``num_clients`` when given, else ``max_clients``, else all of them. Asking for
   more users than there are is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedpartial._src.data.arrays import ArrayDataset, DataError

__all__ = ["RaggedBuilder", "choose_users", "ragged_dataset"]


def choose_users(names: Sequence[str], train_counts: Sequence[int], *, what: str, seed: int,
                 max_clients: int | None = None, min_examples: int | None = None,
                 num_clients: int | None = None) -> np.ndarray:
    """The positions (into ``names``) of the users that become clients, in the files' order (module doc).

    ``what`` names the data in messages (e.g. ``"the LEAF files in data/femnist"``).
    """
    counts = np.asarray(train_counts, np.int64)
    for flag, value in (("--max-clients", max_clients), ("--min-examples", min_examples),
                        ("--clients", num_clients)):
        if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1):
            raise DataError(f"{flag} {value!r} is not allowed: it must be a whole number ≥ 1.")
    if min_examples is None:
        empty = np.flatnonzero(counts == 0)
        if empty.size:
            raise DataError(f"user {names[int(empty[0])]!r} of {what} has no training examples, so it cannot be a "
                            "client; leave such users out with --min-examples 1.")
        eligible = np.arange(len(counts))
    else:
        eligible = np.flatnonzero(counts >= min_examples)
    if eligible.size == 0:
        raise DataError(f"no user of {what} has at least {min_examples or 1} training examples; lower "
                        "--min-examples.")
    if num_clients is not None and max_clients is not None and num_clients > max_clients:
        raise DataError(f"--clients {num_clients} asks for more clients than --max-clients {max_clients}; leave "
                        "--clients out or raise --max-clients.")
    count = num_clients if num_clients is not None else max_clients
    if count is None:
        return eligible
    if num_clients is not None and num_clients > eligible.size:
        kept = "" if min_examples is None else f" with at least {min_examples} training examples"
        raise DataError(f"--clients {num_clients} asks for more clients than {what} has users{kept} "
                        f"({eligible.size}); leave --clients out to use all of them.")
    if count >= eligible.size:
        return eligible
    picked = np.random.default_rng([seed, 0x1EAF]).choice(eligible.size, int(count), replace=False)
    return eligible[np.sort(picked)]


class RaggedBuilder:
    """One split's examples, written user by user into arrays allocated once for the total count.

    ``add(x, y)`` appends one user's examples (``x`` ``[n, *feature_shape]``); the arrays are made on the
    first ``add`` from its shape and dtype, for ``total`` examples (known beforehand from the files'
    counts), so peak memory is the data itself and not twice it.
    """

    def __init__(self, total: int):
        self.total = int(total)
        self.x: np.ndarray | None = None
        self.y = np.empty(self.total, np.int32)
        self.filled = 0
        self.offsets = [0]

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        n = len(y)
        if self.x is None:
            self.x = np.empty((self.total, *x.shape[1:]), x.dtype)
        if self.filled + n > self.total:
            raise DataError(f"the files hold more examples than their counts say ({self.total}).")
        self.x[self.filled:self.filled + n] = x
        self.y[self.filled:self.filled + n] = y
        self.filled += n
        self.offsets.append(self.filled)

    def arrays(self, feature_shape: tuple[int, ...], dtype) -> tuple[np.ndarray, np.ndarray]:
        """The filled ``(x, y)`` (empty arrays of ``feature_shape`` when nothing was added)."""
        if self.x is None:
            return np.zeros((0, *feature_shape), dtype), self.y[:0]
        return self.x[:self.filled], self.y[:self.filled]

    def ranges(self, count: int | None = None) -> tuple[np.ndarray, ...]:
        """Per added user (the first ``count``), its row indices."""
        ends = self.offsets if count is None else self.offsets[:count + 1]
        return tuple(np.arange(a, b, dtype=np.int64) for a, b in zip(ends[:-1], ends[1:]))


def ragged_dataset(name: str, train: RaggedBuilder, test: RaggedBuilder, *, num_clients: int, num_classes: int,
                   client_names: Sequence[str], usual_model: str | None,
                   label_token_offset: int | None = None) -> ArrayDataset:
    """The :class:`ArrayDataset` of the clients' rows: client ``k`` is the ``k``-th user added to ``train``
    and to ``test`` (test rows after the clients' are the test examples of users who are no client);
    ``label_token_offset`` as :class:`ArrayDataset` says (next-character data)."""
    x_train, y_train = train.arrays((), np.float32)
    x_test, y_test = test.arrays(x_train.shape[1:], x_train.dtype)
    return ArrayDataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                        num_classes=num_classes, natural_partition=train.ranges(),
                        natural_test_partition=test.ranges(num_clients), client_names=tuple(client_names),
                        usual_model=usual_model, label_token_offset=label_token_offset)
