"""LEAF's JSON files (FEMNIST, Shakespeare, Sent140), one LEAF user a client, with LEAF's own train/test split.

``load_leaf(folder)`` reads ``folder/train/*.json`` and ``folder/test/*.json`` as LEAF's ``split_data.py``
writes them: each file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y":
[...]}}}`` (a ``hierarchies`` key, where present, is ignored). Files are read in name order; the users of a
split are those of its files, in file order. Every user's ``x`` and ``y`` must have the same length, the
one ``num_samples`` gives.

Tasks (which one comes from the first example, or ``task`` where given):

``femnist``
    ``x`` is 784 numbers, a 28x28 image in row-major order, as LEAF writes it (the NIST scans, grey values
    divided by 255: **the background is 1.0 and the ink dark**, the opposite of tfds's MNIST/EMNIST; the
    values are kept as they are); examples ``[28, 28, 1]`` float32; ``y`` a class 0..61 (digits, upper case,
    lower case). Usual model ``femnist_cnn``.
``shakespeare``
    ``x`` is a string of 80 characters, ``y`` the character that follows. The vocabulary is LEAF's 80
    characters (:data:`LEAF_CHARACTERS`, from LEAF's ``models/utils/language_utils.py``); a character
    outside it is "other" (LEAF's reference code would look it up as -1). Token ids: 0 padding, ``1 + i``
    for the ``i``-th character of :data:`LEAF_CHARACTERS`, 81 other; classes: ``i`` for the ``i``-th
    character, 80 other (81 classes). Examples ``[80]`` int32. Usual model ``shakespeare_lstm``. The label
    is the token that follows ``x`` (its id the class + :data:`CHARACTER_ID_OFFSET`), so a language model
    reads the same data per position (:func:`fedpartial._src.data.language.next_token_view`).
``sent140``
    ``x`` is LEAF's list of tweet fields, of which ``x[4]`` is the tweet's text; ``y`` is 0 (negative) or 1
    (positive). Words are LEAF's (``[\\w']+`` runs and ``.,!?;``), lower-cased; instead of LEAF's GloVe
    vocabulary the vocabulary is the :data:`SENT140_VOCAB_SIZE` - 2 most frequent words of the chosen
    clients' training tweets (ties alphabetical; 0 padding, 1 unknown), and a tweet keeps its first
    :data:`SENT140_SEQ_LEN` (LEAF's 25) words, right-padded. Usual model ``sent140_lstm``.

The clients are chosen by :func:`fedpartial._src.data.natural.choose_users`; the test set is the chosen
clients' test examples followed by those of test users who are in no training file (LEAF's split by user).
Test examples of users who are not chosen are left out.
"""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np

from fedpartial._src.data import text
from fedpartial._src.data.arrays import DataError
from fedpartial._src.data.natural import RaggedBuilder, choose_users, ragged_dataset

__all__ = ["CHARACTER_ID_OFFSET", "LEAF_CHARACTERS", "LEAF_TASKS", "load_leaf"]

LEAF_TASKS = ("femnist", "shakespeare", "sent140")
#: LEAF's character vocabulary (``ALL_LETTERS`` of its ``models/utils/language_utils.py``), 80 characters
LEAF_CHARACTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SENT140_SEQ_LEN = 25
SENT140_VOCAB_SIZE = 10_000
FEMNIST_CLASSES = 62
#: the token id of character class ``c`` is ``c + CHARACTER_ID_OFFSET`` (id 0 is padding)
CHARACTER_ID_OFFSET = 1
USUAL_MODELS = {"femnist": "femnist_cnn", "shakespeare": "shakespeare_lstm", "sent140": "sent140_lstm"}

_CHAR_ID = {c: i for i, c in enumerate(LEAF_CHARACTERS)}
_OTHER = len(LEAF_CHARACTERS)  # the class of any other character; its token id is _OTHER + 1
_LEAF_WORD = re.compile(r"[\w']+|[.,!?;]")


def char_ids(strings, users_what: str) -> np.ndarray:
    """``[n, L]`` int32 token ids of equal-length strings (0 padding, 1..80 LEAF's characters, 81 other)."""
    if not strings:
        return np.zeros((0, 0), np.int32)
    length = len(strings[0])
    rows = np.empty((len(strings), length), np.int32)
    for i, s in enumerate(strings):
        if not isinstance(s, str) or len(s) != length:
            raise DataError(f"{users_what} has an x that is not a string of {length} characters like the others "
                            f"(example {i}: {str(s)[:40]!r}).")
        rows[i] = [_CHAR_ID.get(c, _OTHER) + CHARACTER_ID_OFFSET for c in s]
    return rows


def char_classes(chars, users_what: str) -> np.ndarray:
    """``[n]`` int32 classes of single characters (0..79 LEAF's characters, 80 other)."""
    out = np.empty(len(chars), np.int32)
    for i, c in enumerate(chars):
        if not isinstance(c, str) or len(c) != 1:
            raise DataError(f"{users_what} has a y that is not one character (example {i}: {str(c)[:40]!r}).")
        out[i] = _CHAR_ID.get(c, _OTHER)
    return out


def leaf_words(line: str) -> list[str]:
    """A tweet's words as LEAF's ``split_line`` finds them, lower-cased."""
    return _LEAF_WORD.findall(line.lower())


def _header(path: str) -> dict:
    """A file's ``users`` and ``num_samples`` without decoding its examples where the keys come first (as
    LEAF writes them); otherwise the whole file."""
    with open(path, encoding="utf-8") as f:
        content = f.read()
    at = content.find('"user_data"')
    if at > 0:
        try:
            head = json.loads(content[:at].rstrip().rstrip(",") + "}")
            if "users" in head and "num_samples" in head:
                return head
        except json.JSONDecodeError:
            pass
    return _read_json(path, content)


def _read_json(path: str, content: str | None = None) -> dict:
    try:
        if content is None:
            with open(path, encoding="utf-8") as f:
                content = f.read()
        data = json.loads(content)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"LEAF file {path} cannot be read as JSON ({type(e).__name__}: {str(e)[:120]}).") from None
    if not isinstance(data, dict) or not {"users", "num_samples", "user_data"} <= set(data):
        raise DataError(f"LEAF file {path} is not in LEAF's format: it needs the keys users, num_samples and "
                        "user_data.")
    return data


def _split_files(folder: str, split: str) -> list[str]:
    where = os.path.join(folder, split)
    if not os.path.isdir(where):
        raise DataError(f"--data-dir {folder!r} has no {split}/ folder; LEAF's data folder holds train/ and test/ "
                        "folders of .json files (data/<task>/data after LEAF's preprocess.sh).")
    files = sorted(glob.glob(os.path.join(where, "*.json")))
    if not files:
        raise DataError(f"{where} holds no .json files; LEAF's split writes its users there.")
    return files


def _users(files: list[str]) -> tuple[list[str], list[int], list[str]]:
    """Every user of ``files``, its count and its file, in order; a user in two files is refused."""
    names, counts, where, seen = [], [], [], {}
    for path in files:
        head = _header(path)
        users, num = head["users"], head["num_samples"]
        if not isinstance(users, list) or not isinstance(num, list) or len(users) != len(num):
            raise DataError(f"LEAF file {path} lists {len(users)} users but {len(num)} num_samples; they must "
                            "match one to one.")
        for user, n in zip(users, num):
            user = str(user)
            if user in seen:
                raise DataError(f"user {user!r} appears in both {seen[user]} and {path}; each user belongs to one "
                                "file of a split.")
            seen[user] = path
            names.append(user)
            counts.append(int(n))
            where.append(path)
    return names, counts, where


def detect_task(x0, path: str) -> str:
    """The task an example ``x`` belongs to (module doc), or a sentence asking for ``--leaf-task``."""
    if isinstance(x0, str):
        return "shakespeare"
    if isinstance(x0, list) and len(x0) == 784 and all(isinstance(v, (int, float)) for v in x0[:8]):
        return "femnist"
    if isinstance(x0, list) and len(x0) >= 5 and isinstance(x0[4], str):
        return "sent140"
    raise DataError(f"the examples of {path} are not FEMNIST's 784 pixels, Shakespeare's strings or Sent140's "
                    "tweet fields; give --leaf-task femnist, shakespeare or sent140 if they are one of these.")


def _convert(task: str, xs, ys, what: str, vocabulary) -> tuple[np.ndarray, np.ndarray]:
    """One user's ``x``, ``y`` as arrays of ``task`` (sent140 ``x`` as word lists until ``vocabulary``)."""
    if task == "femnist":
        try:
            x = np.asarray(xs, np.float32)
            y = np.asarray(ys, np.int64)
        except (ValueError, TypeError):
            raise DataError(f"{what} has an x that is not 784 numbers or a y that is not a class number.") from None
        if x.ndim != 2 or x.shape[1] != 784:
            raise DataError(f"{what} has examples of {x.shape[1:] if x.ndim > 1 else 'no'} values; FEMNIST's are "
                            "784 (28x28).")
        if y.ndim != 1 or (y.size and (y.min() < 0 or y.max() >= FEMNIST_CLASSES)):
            raise DataError(f"{what} has a label outside FEMNIST's classes 0..{FEMNIST_CLASSES - 1}.")
        return x.reshape(-1, 28, 28, 1), y.astype(np.int32)
    if task == "shakespeare":
        return char_ids(xs, what), char_classes(ys, what)
    words = []
    for i, fields in enumerate(xs):
        if not isinstance(fields, list) or len(fields) < 5 or not isinstance(fields[4], str):
            raise DataError(f"{what} has an x that is not Sent140's list of tweet fields with the text at x[4] "
                            f"(example {i}).")
        words.append(leaf_words(fields[4]))
    y = np.asarray([_sentiment(v, what) for v in ys], np.int32)
    if vocabulary is None:
        return words, y
    return text.encode(words, vocabulary, SENT140_SEQ_LEN), y


def _sentiment(value, what: str) -> int:
    try:
        label = int(float(value))
    except (TypeError, ValueError):
        label = -1
    if label not in (0, 1):
        raise DataError(f"{what} has the label {value!r}; Sent140's labels are 0 (negative) and 1 (positive).")
    return label


def load_leaf(folder: str, *, task: str | None = None, seed: int = 0, max_clients: int | None = None,
              min_examples: int | None = None, num_clients: int | None = None):
    """The :class:`~fedpartial.data.ArrayDataset` of LEAF's files in ``folder`` (module doc).

    Args:
      folder: the folder holding LEAF's ``train/`` and ``test/``.
      task: ``femnist``, ``shakespeare`` or ``sent140``; None: read from the files.
      seed: the draw of the clients when fewer than all are taken.
      max_clients: take at most this many users.
      min_examples: leave out users with fewer training examples.
      num_clients: exactly this many clients (None: all the chosen users).

    Raises:
      DataError: a missing folder or file, a file not in LEAF's format, an unknown task, a user whose ``x``
        and ``y`` differ in length, or more clients asked for than there are users.
    """
    if task is not None and task not in LEAF_TASKS:
        raise DataError(f"--leaf-task {task!r} is unknown; choose one of {', '.join(LEAF_TASKS)}.")
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise DataError(f"--data-dir {folder!r} is not a folder; give the folder holding LEAF's train/ and test/.")
    train_files, test_files = _split_files(folder, "train"), _split_files(folder, "test")
    names, counts, _ = _users(train_files)
    test_names, test_counts, _ = _users(test_files)
    what = f"the LEAF files in {folder}"
    chosen = choose_users(names, counts, what=what, seed=seed, max_clients=max_clients,
                          min_examples=min_examples, num_clients=num_clients)
    client_of = {names[i]: k for k, i in enumerate(chosen)}
    train_names = set(names)
    test_only = [u for u in test_names if u not in train_names]
    test_total = sum(n for u, n in zip(test_names, test_counts) if u in client_of or u not in train_names)

    # Training examples go straight into the ragged arrays as each file is read (the files' order is the
    # clients' order), so the population is never held twice; Sent140's words wait for the vocabulary.
    train = RaggedBuilder(sum(counts[i] for i in chosen))
    sent140_words = []
    task_of = [task]  # the task as soon as the first example tells it

    def take_train(user, xy):
        if task_of[0] == "sent140":
            sent140_words.append(xy)
        else:
            train.add(*xy)

    task = _read_split(train_files, client_of, task, take_train, task_of)
    tests = {}
    _read_split(test_files, set(client_of) | set(test_only), task, tests.__setitem__, task_of)
    if task is None:
        raise DataError(f"the LEAF files in {folder} hold no examples.")
    if task == "sent140":  # the vocabulary of the chosen clients' training tweets
        vocabulary = text.build_vocabulary((w for words, _ in sent140_words for w in words), SENT140_VOCAB_SIZE)
        for words, y in sent140_words:
            train.add(text.encode(words, vocabulary, SENT140_SEQ_LEN), y)
        tests = {u: (text.encode(w, vocabulary, SENT140_SEQ_LEN), y) for u, (w, y) in tests.items()}
    test = RaggedBuilder(test_total)
    for user in [*client_of, *test_only]:
        if user in tests:
            test.add(*tests.pop(user))
        else:  # a client without test examples keeps an empty range
            test.offsets.append(test.filled)
    num_classes = {"femnist": FEMNIST_CLASSES, "shakespeare": _OTHER + 1, "sent140": 2}[task]
    return ragged_dataset(task, train, test, num_clients=len(chosen), num_classes=num_classes,
                          client_names=list(client_of), usual_model=USUAL_MODELS[task],
                          label_token_offset=CHARACTER_ID_OFFSET if task == "shakespeare" else None)


def _read_split(files: list[str], wanted, task: str | None, take, task_of: list) -> str | None:
    """Calls ``take(user, (x, y))`` for every ``wanted`` user of ``files``, in file order; returns the task
    (detected from the first example when ``task`` is None; ``task_of[0]`` follows it)."""
    for path in files:
        data = _read_json(path)
        if task is None:
            first = next((d for d in data["user_data"].values() if isinstance(d, dict) and d.get("x")), None)
            if first is not None:
                task = task_of[0] = detect_task(first["x"][0], path)
        for user, n in zip(data["users"], data["num_samples"]):
            user = str(user)
            if user in wanted:
                take(user, _user_examples(data, user, n, path, task))
        del data
    return task


def _user_examples(data: dict, user: str, n: int, path: str, task: str):
    entry = data["user_data"].get(user) if isinstance(data["user_data"], dict) else None
    what = f"user {user!r} of {path}"
    if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
        raise DataError(f"{what} has no x and y under user_data.")
    xs, ys = entry["x"], entry["y"]
    if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys):
        raise DataError(f"{what} has {len(xs) if isinstance(xs, list) else 'no list of'} x but "
                        f"{len(ys) if isinstance(ys, list) else 'no list of'} y; every example needs both.")
    if len(xs) != int(n):
        raise DataError(f"{what} has {len(xs)} examples but num_samples says {n}.")
    return _convert(task, xs, ys, what, None)
