"""Small files in the real formats of naturally federated data, written by the tests themselves: LEAF's JSON
(FEMNIST, Shakespeare, Sent140) and Hugging Face datasets (``save_to_disk``, parquet).

The data is learnable: a FEMNIST-like writer's image of class c is dark (ink, 0) on rows 7(c % 4) to 7(c % 4) + 6
and white (1.0, LEAF's background) elsewhere, with noise; a Shakespeare-like role speaks a repeated phrase in
which each character fixes the next; a Sent140-like tweet holds "good" or "bad" among filler words.
"""

from __future__ import annotations

import json
import os

import numpy as np

PHRASE = "abcdefgh "


def write_leaf(folder, split: str, files: list[dict]) -> None:
    """``files``: per file, ``{user: (x, y)}``; written as LEAF's split writes them."""
    os.makedirs(os.path.join(folder, split), exist_ok=True)
    for i, users in enumerate(files):
        data = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
                "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
        with open(os.path.join(folder, split, f"all_data_{i}_niid_0_keep_0_{split}_9.json"), "w") as f:
            json.dump(data, f)


def femnist_examples(rng, n: int, classes: int = 4):
    y = rng.integers(0, classes, n)
    x = np.clip(1.0 - 0.1 * rng.random((n, 28, 28)), 0, 1)
    for i, c in enumerate(y):
        x[i, 7 * (c % 4):7 * (c % 4) + 7, :] = 0.0
    return np.round(x.reshape(n, 784), 4).tolist(), y.tolist()


def shakespeare_examples(rng, n: int, length: int = 80):
    text = PHRASE * (2 + (n + length) // len(PHRASE))
    starts = rng.integers(0, len(PHRASE), n)
    return [text[s:s + length] for s in starts], [text[s + length] for s in starts]


def sent140_examples(rng, n: int):
    y = rng.integers(0, 2, n)
    fillers = ["i", "am", "so", "today", "the", "game", "was", "really"]
    tweets = [" ".join(rng.choice(fillers, 5).tolist() + ["good!" if v else "bad..."]) for v in y]
    return [[f"{1000 + i}", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "someone", t] for i, t in enumerate(tweets)], \
        y.tolist()


def leaf_folder(folder, kind: str, sizes: dict[str, tuple[int, int]], seed: int = 0, per_file: int = 2,
                length: int = 80):
    """LEAF files of ``kind`` (femnist, shakespeare, sent140): ``sizes[user] = (train, test)`` examples,
    ``per_file`` users a file, Shakespeare's strings ``length`` characters long (LEAF's: 80). Returns
    ``{split: {user: (x, y)}}`` as written."""
    make = {"femnist": femnist_examples, "sent140": sent140_examples,
            "shakespeare": lambda rng, n: shakespeare_examples(rng, n, length)}[kind]
    rng = np.random.default_rng(seed)
    written = {"train": {}, "test": {}}
    for user, (n_train, n_test) in sizes.items():
        for split, n in (("train", n_train), ("test", n_test)):
            if n:
                written[split][user] = make(rng, n)
    for split, users in written.items():
        names = list(users)
        write_leaf(folder, split, [{u: users[u] for u in names[i:i + per_file]}
                                   for i in range(0, len(names), per_file)] or [{}])
    return written
