"""Hugging Face datasets saved to disk, or folders of parquet files, split into clients by a column's values.

``load_hf(folder, client_column=...)`` reads, with the ``datasets`` package (``pip install
'fedpartial[hf]'``; imported only here):

* a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (``datasets.load_from_disk``);
* a folder of ``.parquet`` files: ``train/*.parquet`` and ``test/*.parquet``, or files named
  ``train-*.parquet`` / ``test-*.parquet`` anywhere below the folder (the Hub's layout), or any other
  ``*.parquet`` files, all of them the train split. Features written by ``datasets`` (``to_parquet``) are
  kept, ``ClassLabel`` and ``Image`` included.

Every distinct value of ``client_column`` in the train split is a user (Flower's natural-id partitioning:
FEMNIST's ``writer_id``, Shakespeare's ``character_id``), in sorted order; the clients are chosen among them
as :func:`fedpartial._src.data.natural.choose_users` says. With a ``test`` split, a client's test examples are
that split's rows with its value, and rows of values that are in no training row join the test set too;
without one, each client keeps ``round(0.9 n)`` (at least one) of its examples, drawn with the seed, and the
rest is its test data (LEAF's own per-user 90/10 split).

What a column holds decides the examples (``feature``; by default the first of :data:`FEATURE_NAMES` there
is):

* images (``Image`` feature, or arrays of 2 or 3 axes): float32 ``[H, W, C]``, integer pixels divided by 255;
* numbers, one per example or a list (of lists) of them: float32 arrays;
* strings whose labels are single characters (next-character prediction, as LEAF's Shakespeare): token ids of
  LEAF's character vocabulary (:mod:`fedpartial._src.data.leaf`); the strings must have one length;
* other strings: words as LEAF's Sent140 finds them, lower-cased, the vocabulary of the chosen clients'
  training rows, the first 25 words of each (as :mod:`fedpartial._src.data.leaf` says for Sent140).

Labels (``label``; by default the first of :data:`LABEL_NAMES` there is): ``ClassLabel`` columns keep their
classes; other integers are classes ``0..max``; single characters are LEAF's character classes; other
strings are numbered in sorted order.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from fedpartial._src.data import leaf, text
from fedpartial._src.data.arrays import DataError
from fedpartial._src.data.natural import RaggedBuilder, choose_users, ragged_dataset
from fedpartial._src.data.partition import train_holdout_split

__all__ = ["FEATURE_NAMES", "LABEL_NAMES", "load_hf"]

FEATURE_NAMES = ("image", "img", "x", "text", "tweet", "sentence")
LABEL_NAMES = ("label", "labels", "y", "character", "target", "sentiment")
#: each client's training share when the dataset has no test split
TRAIN_SHARE = 0.9


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise DataError("--dataset hf needs the datasets package, which cannot be imported "
                        f"({type(e).__name__}); install it with `pip install 'fedpartial[hf]'`.") from None
    return datasets


def _parquet_splits(folder: str) -> dict[str, list[str]]:
    files = sorted(glob.glob(os.path.join(folder, "**", "*.parquet"), recursive=True))
    splits: dict[str, list[str]] = {}
    for path in files:
        rel = os.path.relpath(path, folder).replace(os.sep, "/")
        parts = rel.split("/")
        base = os.path.basename(path)
        split = next((s for s in ("train", "test") if s in parts[:-1] or base.startswith(s + "-")
                      or base == s + ".parquet"), None)
        splits.setdefault(split or "train", []).append(path)
    return splits


def _open(folder: str) -> dict:
    """The folder's splits as ``datasets.Dataset`` objects (``train`` and maybe ``test``)."""
    datasets = _datasets()
    if not os.path.isdir(folder):
        raise DataError(f"--data-dir {folder!r} is not a folder; give a dataset saved with save_to_disk or a "
                        "folder of parquet files.")
    saved = any(os.path.exists(os.path.join(folder, name)) for name in ("dataset_dict.json", "state.json"))
    if saved:
        try:
            loaded = datasets.load_from_disk(folder)
        except Exception as e:  # noqa: BLE001 - any failure of the reader is said in one sentence
            raise DataError(f"{folder} cannot be read as a saved Hugging Face dataset ({type(e).__name__}: "
                            f"{str(e)[:160]}).") from None
        splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    else:
        files = _parquet_splits(folder)
        if not files:
            raise DataError(f"{folder} holds neither a dataset saved with save_to_disk (dataset_dict.json or "
                            "state.json) nor .parquet files.")
        import pyarrow.parquet as pq

        splits = {}
        for split, paths in files.items():
            try:
                table = pq.read_table(paths[0]) if len(paths) == 1 else \
                    __import__("pyarrow").concat_tables([pq.read_table(p) for p in paths])
                splits[split] = datasets.Dataset(table)
            except Exception as e:  # noqa: BLE001
                raise DataError(f"the parquet files of split {split!r} in {folder} cannot be read "
                                f"({type(e).__name__}: {str(e)[:160]}).") from None
    if "train" not in splits:
        raise DataError(f"{folder} has the splits {', '.join(sorted(splits))} but no train split; the clients "
                        "are the train split's users.")
    return splits


def _column(split, name: str | None, defaults: tuple[str, ...], what: str, flag: str, folder: str,
            exclude: tuple) -> str:
    columns = list(split.column_names)
    if name is not None:
        if name not in columns:
            raise DataError(f"{flag} {name!r} is not a column of {folder}; its columns are {', '.join(columns)}.")
        return name
    found = next((c for c in defaults if c in columns and c not in exclude), None)
    if found is None:
        raise DataError(f"{folder} has none of the usual {what} columns ({', '.join(defaults)}); name it with "
                        f"{flag} (its columns are {', '.join(columns)}).")
    return found


def _values(split, column: str) -> np.ndarray:
    """A column as numpy (images decoded and stacked, lists as arrays where they are regular)."""
    try:
        values = split.with_format("numpy")[column]
    except Exception:  # noqa: BLE001 - ragged lists: fall back to Python objects
        values = split[column]
    if isinstance(values, list):  # rows of different shapes
        try:
            values = np.stack([np.asarray(v) for v in values])
        except ValueError:
            raise DataError(f"the column {column!r} holds examples of different shapes; every example must have "
                            "one shape.") from None
    return np.asarray(values)


def _features(values: np.ndarray, column: str) -> np.ndarray:
    if values.dtype.kind in "iub" and values.ndim in (3, 4):  # images
        x = values.astype(np.float32) / np.float32(255.0)
        return x[..., None] if x.ndim == 3 else x
    if values.dtype.kind in "iufb":
        return values.astype(np.float32)
    raise DataError(f"the column {column!r} holds {values.dtype} values, not images, numbers or text.")


def load_hf(folder: str, *, client_column: str | None = None, feature: str | None = None, label: str | None = None,
            seed: int = 0, max_clients: int | None = None, min_examples: int | None = None,
            num_clients: int | None = None):
    """The :class:`~fedpartial.data.ArrayDataset` of a saved Hugging Face dataset or parquet folder (module doc).

    Raises:
      DataError: the datasets package missing, a folder it cannot read, a column that does not exist, a client
        with no examples, or more clients asked for than there are.
    """
    folder = os.fspath(folder)
    if not client_column:
        raise DataError("--dataset hf needs --client-column, the column whose values are the clients.")
    splits = _open(folder)
    train_split = splits["train"]
    if client_column not in train_split.column_names:
        raise DataError(f"--client-column {client_column!r} is not a column of {folder}; its columns are "
                        f"{', '.join(train_split.column_names)}.")
    feature = _column(train_split, feature, FEATURE_NAMES, "example", "--feature", folder, (client_column,))
    label = _column(train_split, label, LABEL_NAMES, "label", "--label", folder, (client_column, feature))
    test_split = splits.get("test")
    if test_split is not None:
        for name, flag in ((client_column, "--client-column"), (feature, "--feature"), (label, "--label")):
            if name not in test_split.column_names:
                raise DataError(f"{flag} {name!r} is not a column of the test split of {folder}.")

    owners = np.asarray([str(v) for v in train_split[client_column]])
    names, owner_of, counts = np.unique(owners, return_inverse=True, return_counts=True)
    has_test = test_split is not None
    shares = counts if has_test else np.maximum(1, np.minimum(counts, np.floor(TRAIN_SHARE * counts + 0.5)))
    chosen = choose_users(list(names), shares.astype(np.int64), what=f"{folder}", seed=seed,
                          max_clients=max_clients, min_examples=min_examples, num_clients=num_clients)
    rows = _rows_by_owner(owner_of, chosen)

    x_all, y_all, kind, num_classes, classes = _examples(train_split, feature, label, folder, None)
    if has_test:
        train_rows = rows
        t_owners = np.asarray([str(v) for v in test_split[client_column]])
        index = {str(n): k for k, n in enumerate(names[chosen])}
        known = set(names.tolist())
        t_client = np.asarray([index.get(o, -1 if o in known else len(chosen)) for o in t_owners], np.int64)
        test_rows = [np.flatnonzero(t_client == k) for k in range(len(chosen))] + [np.flatnonzero(t_client ==
                                                                                              len(chosen))]
        x_t, y_t, _, _, _ = _examples(test_split, feature, label, folder, classes)
    else:
        train_rows, held = train_holdout_split(rows, TRAIN_SHARE, seed=np.random.default_rng([seed, 0x7E57]))
        test_rows, x_t, y_t = held, x_all, y_all

    if kind == "words":  # the vocabulary of the chosen clients' training rows
        vocabulary = text.build_vocabulary((x_all[i] for r in train_rows for i in r), leaf.SENT140_VOCAB_SIZE)
        x_all = _encode_words(x_all, vocabulary)
        x_t = x_all if x_t is None or not has_test else _encode_words(x_t, vocabulary)
    train = RaggedBuilder(sum(len(r) for r in train_rows))
    for r in train_rows:
        train.add(x_all[r], y_all[r])
    test = RaggedBuilder(sum(len(r) for r in test_rows))
    for r in test_rows:
        test.add(x_t[r], y_t[r])
    usual = {"chars": "shakespeare_lstm", "words": "sent140_lstm"}.get(kind)
    if kind == "images":
        usual = "femnist_cnn" if x_all.shape[1:3] == (28, 28) else "cnn2c1f"
    return ragged_dataset("hf", train, test, num_clients=len(chosen), num_classes=num_classes,
                          client_names=[str(n) for n in names[chosen]], usual_model=usual or "mlp",
                          label_token_offset=leaf.CHARACTER_ID_OFFSET if kind == "chars" else None)


def _rows_by_owner(owner_of: np.ndarray, chosen: np.ndarray) -> list[np.ndarray]:
    order = np.argsort(owner_of, kind="stable")
    bounds = np.searchsorted(owner_of[order], np.stack([chosen, chosen + 1]))
    return [order[a:b] for a, b in zip(*bounds)]


def _encode_words(words, vocabulary) -> np.ndarray:
    return text.encode(list(words), vocabulary, leaf.SENT140_SEQ_LEN)


def _examples(split, feature: str, label: str, folder: str, classes):
    """``(x, y, kind, num_classes, classes)`` of a split; ``classes`` from the train split decode the test
    split's labels the same way (None: read them here)."""
    label_type = split.features.get(label)
    raw_labels = split[label]
    if classes is None:
        if type(label_type).__name__ == "ClassLabel":
            classes = ("classlabel", int(label_type.num_classes))
        elif raw_labels and all(isinstance(v, str) for v in raw_labels[:100]):
            single = all(len(v) == 1 for v in raw_labels)
            classes = ("chars", len(leaf.LEAF_CHARACTERS) + 1) if single else \
                ("names", sorted(set(raw_labels)))
        else:
            classes = ("ints", None)
    y = _labels(raw_labels, classes, label)
    if classes == ("ints", None):
        classes = ("ints", int(y.max()) + 1 if y.size else 1)
    num_classes = classes[1] if classes[0] != "names" else len(classes[1])
    first = split[0][feature] if len(split) else None
    if isinstance(first, str):
        strings = split[feature]
        if classes[0] == "chars":
            return leaf.char_ids(strings, f"the column {feature!r} of {folder}"), y, "chars", num_classes, classes
        return [leaf.leaf_words(s) for s in strings], y, "words", num_classes, classes
    x = _features(_values(split, feature), feature)
    kind = "images" if x.ndim == 4 else "numbers"
    return x, y, kind, num_classes, classes


def _labels(values, classes, column: str) -> np.ndarray:
    kind, info = classes
    if kind == "chars":
        return leaf.char_classes(values, f"the column {column!r}")
    if kind == "names":
        index = {n: i for i, n in enumerate(info)}
        missing = next((v for v in values if v not in index), None)
        if missing is not None:
            raise DataError(f"the test split's label {missing!r} in column {column!r} is no label of the train split.")
        return np.asarray([index[v] for v in values], np.int32)
    try:
        y = np.asarray(values, np.int64)
    except (TypeError, ValueError):
        raise DataError(f"the column {column!r} holds labels that are not classes (numbers or names).") from None
    if y.ndim != 1 or (y.size and y.min() < 0):
        raise DataError(f"the column {column!r} holds negative or nested labels; labels are classes 0, 1, ...")
    if info is not None and y.size and y.max() >= info:
        raise DataError(f"the column {column!r} holds the label {int(y.max())}, outside its {info} classes.")
    return y.astype(np.int32)
