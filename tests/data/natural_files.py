"""Small files in the real formats of naturally federated data, written by the tests themselves: LEAF's JSON
(FEMNIST, Shakespeare, Sent140) and Hugging Face datasets (``save_to_disk``, parquet).

The data is learnable but not at once, so a short run shows a curve: a FEMNIST-like writer's image of class c is
greyer (ink about 0.45-0.85) on rows 7(c % 4) to 7(c % 4) + 6 than elsewhere (0.65-1.0, LEAF's white
background), and one label in ten is drawn at random (best accuracy about 0.93); a Shakespeare-like role's text
walks over the 9 characters of :data:`PHRASE`, each followed by the next one (3 times in 4) or the one three
further on (best accuracy 0.75); a Sent140-like tweet ends in "good!" or "bad..." after filler words, one in five holds the
other word too, and one label in ten is drawn at random (best accuracy about 0.95).
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


def noisy_labels(rng, y, classes: int, share: float = 0.1):
    """``y`` with a ``share`` of its labels drawn again uniformly (so no model is right on all of them)."""
    y = np.asarray(y).copy()
    redrawn = rng.random(len(y)) < share
    y[redrawn] = rng.integers(0, classes, int(redrawn.sum()))
    return y


def femnist_examples(rng, n: int, classes: int = 4):
    y = rng.integers(0, classes, n)
    x = 1.0 - 0.3 * rng.random((n, 28, 28))
    for i, c in enumerate(y):
        x[i, 7 * (c % 4):7 * (c % 4) + 7, :] = 0.25 + 0.45 * rng.random((7, 28))
    return np.round(x.reshape(n, 784), 4).tolist(), noisy_labels(rng, y, classes).tolist()


def _walk(rng, length: int) -> str:
    """``length`` characters of :data:`PHRASE`, each followed by the next (p = 3/4) or the one 3 further on."""
    place, out = int(rng.integers(len(PHRASE))), []
    for _ in range(length):
        out.append(PHRASE[place])
        place = (place + (1 if rng.random() < 0.75 else 3)) % len(PHRASE)
    return "".join(out)


def shakespeare_examples(rng, n: int, length: int = 80):
    texts = [_walk(rng, length + 1) for _ in range(n)]
    return [t[:length] for t in texts], [t[length] for t in texts]


def sent140_examples(rng, n: int):
    y = rng.integers(0, 2, n)
    fillers = ["i", "am", "so", "today", "the", "game", "was", "really"]
    words = (["bad..."], ["good!"])
    tweets = []
    for v in y:
        said = rng.choice(fillers, 5).tolist() + [str(rng.choice(words[v]))]
        if rng.random() < 0.2:  # the word of the other sentiment too
            said.insert(int(rng.integers(len(said))), str(rng.choice(words[1 - v])))
        tweets.append(" ".join(said))
    return [[f"{1000 + i}", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "someone", t] for i, t in enumerate(tweets)], \
        noisy_labels(rng, y, 2).tolist()


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
