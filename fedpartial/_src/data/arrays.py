"""A dataset in host memory (:class:`ArrayDataset`), the data layer's error, and a stratified test split:
the pieces every source (tfds, digits, Synthetic, text) builds on."""

from __future__ import annotations

import dataclasses

import numpy as np

from fedpartial._src.core.errors import UserError


class DataError(UserError):
    """Bad or unavailable data; the message is one sentence for a person."""


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
    """A dataset held in host memory.

    Attributes:
      name: the dataset's name (``--dataset``).
      x_train: training features ``[n, ...]``.
      y_train: int training labels ``[n]``, or ``[n, T]`` one per position (a language model's next tokens,
        -1 where nothing is to be predicted, as ``synthetic_lm`` has them).
      x_test: test features ``[m, ...]``.
      y_test: int test labels ``[m]``.
      num_classes: the number of classes ``C``.
      natural_partition: per client, indices into the train split (e.g. Synthetic's per-client data),
        or None when clients are made by ``partition``.
      natural_test_partition: the same for the test split, or None.
      client_names: the natural clients' names in the files (LEAF's users, a column's values), or None.
      usual_model: the zoo model ``--model auto`` picks for this data (e.g. ``shakespeare_lstm``), or None:
        the one the dataset's name gives.
      group_train: per training example a group id (``[n]`` int) that partitioning reads when the labels are
        per position (e.g. ``synthetic_lm``'s topic), or None.
      label_token_offset: when each example's label is the token that follows its token ids (next-character
        prediction, LEAF's Shakespeare), the token id of class ``c`` is ``c + label_token_offset`` (1 there:
        id 0 is padding), so a run whose model is a language model reads it with a label per position;
        None: the labels are not tokens.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    natural_partition: tuple[np.ndarray, ...] | None = None
    natural_test_partition: tuple[np.ndarray, ...] | None = None
    client_names: tuple[str, ...] | None = None
    usual_model: str | None = None
    group_train: np.ndarray | None = None
    label_token_offset: int | None = None

    @property
    def groups(self) -> np.ndarray:
        """``[n]`` one label per training example, what a label-skewed partition splits by: the labels
        themselves, else ``group_train`` (labels per position), else one group for all."""
        if np.ndim(self.y_train) == 1:
            return self.y_train
        if self.group_train is not None:
            return self.group_train
        return np.zeros(len(self.y_train), np.int32)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one example's features."""
        return tuple(self.x_train.shape[1:])


def stratified_split(name: str, x: np.ndarray, y: np.ndarray, num_classes: int, test_fraction: float,
                     seed: int) -> ArrayDataset:
    """An :class:`ArrayDataset` of ``(x, y)`` with a stratified seeded test split (:func:`stratified_test_indices`)."""
    is_test = np.zeros(len(y), dtype=bool)
    is_test[stratified_test_indices(y, test_fraction, seed)] = True
    return ArrayDataset(name=name, x_train=np.ascontiguousarray(x[~is_test]), y_train=y[~is_test],
                        x_test=np.ascontiguousarray(x[is_test]), y_test=y[is_test], num_classes=num_classes)


def stratified_test_indices(labels: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of a stratified test split (see the module docstring)."""
    rng = np.random.default_rng(seed)
    picked = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        n_test = int(np.floor(test_fraction * len(members) + 0.5))
        picked.append(rng.permutation(members)[:n_test])
    return np.sort(np.concatenate(picked)).astype(np.int64)
