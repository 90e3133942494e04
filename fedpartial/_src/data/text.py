"""Text data: tokenising and encoding reviews, an offline synthetic text task, and the weak tier's view.

Token ids are int32; id ``0`` is padding and id ``1`` an unknown word
(:data:`PAD`, :data:`UNK`), real words start at 2. Sequences are right-padded:
the real tokens come first, padding fills the rest (the layout
:class:`fedpartial._src.models.text.BiLSTM` expects).

``imdb_reviews`` (read in :mod:`fedpartial._src.data.sources`) goes through
:func:`tokenize`, :func:`build_vocabulary` and :func:`encode`: text lower-cased,
HTML line breaks ``<br />`` turned into spaces, words are the runs of
``[a-z0-9']`` with apostrophes at either end stripped (``'great'`` is
``great``, ``don't`` stays one word); the vocabulary is the ``vocab_size - 2``
most frequent words of the training split (ties broken alphabetically), numbered
2, 3, ... in that order; a review keeps its first ``seq_len`` words.

``synthetic_text`` (:func:`make_synthetic_text`) is an offline stand-in with the
property that matters for EmbracingFL's weak clients (who see only the first half
of each sequence): part of the signal is in the second half only. Each class
``c`` owns :data:`SIGNAL_WORDS` *anywhere* words and :data:`SIGNAL_WORDS` *late*
words (ids ``2 + 2 * SIGNAL_WORDS * c`` onward); every other id from 2 up is a
noise word. An example of class ``y``:

* has a length ``L`` drawn uniformly from ``ceil(3T/4) .. T`` (``T`` =
  ``seq_len``), padding after it;
* is noise words (uniform over the noise ids) at every position, then gets
  3 anywhere words of class ``y`` at random positions in ``[0, L)``, 2 late words
  of class ``y`` at random positions in ``[ceil(T/2), L)``, and 1 *distractor*:
  an anywhere word of another class (drawn uniformly among the others) at a
  random position in ``[0, L)``; the 6 positions are distinct, the words drawn
  with replacement from their sets.

So the signal words of the whole sequence identify the class (5 of the true
class against 1 of another, and late words never appear as distractors), while
the first half holds on average fewer than 2 of the true class's anywhere words
against about 0.6 distractors and no late word: a client that sees only the
first half loses part of the signal (a naive-Bayes bag of words trained on whole
sequences gets all of the test split right with 2 classes, and about 80% from
the first halves). "Learnable but not trivial" means the classifier has to find
the 10 words of each class among hundreds of noise words, and weigh the
anywhere words against the distractors.
Labels are balanced (``arange(n) % C``, shuffled); the test split is the
stratified seeded split of :func:`fedpartial._src.data.sources.stratified_test_indices`.
Everything comes from ``numpy.random.default_rng(seed)``: same seed, same data.
"""

from __future__ import annotations

import collections
import math
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.data.arrays import ArrayDataset, DataError, stratified_split

__all__ = [
    "PAD", "SIGNAL_WORDS", "UNK", "build_vocabulary", "encode", "first_part", "make_synthetic_text", "tokenize",
]

PAD = 0
UNK = 1
#: anywhere words and late words per class in ``synthetic_text``
SIGNAL_WORDS = 5
_ANYWHERE_PER_EXAMPLE = 3
_LATE_PER_EXAMPLE = 2
_DISTRACTORS = 1

_WORD = re.compile(r"[a-z0-9']+")


# ------------------------------------------------------------------ the weak tier's view


def first_part(x, fraction: float = 0.5, *, axis: int = -1, truncate: bool = False):
    """The first ``ceil(fraction * T)`` positions of every sequence along ``axis``.

    ``truncate=False`` keeps the shape: later positions become padding (0), so a
    batch keeps its static shape and the model reads those sequences as shorter
    (:class:`fedpartial._src.models.text.BiLSTM` stops at the last non-padding
    position). ``truncate=True`` slices them off instead (the shape changes
    statically, ``T`` -> ``ceil(fraction * T)``): the LSTM then runs fewer steps,
    which is where a weak client's compute and activation saving comes from.
    Works on token ids ``[..., T]`` (``axis=-1``) and on embeddings
    ``[..., T, E]`` (``axis=-2``), numpy or JAX arrays (the result has the
    input's kind), inside ``jit`` (``fraction``, ``axis`` and ``truncate`` are
    static).

    Raises:
      ValueError: ``fraction`` not in ``(0, 1]``.
    """
    if not isinstance(fraction, numbers.Real) or not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"first_part needs a fraction in (0, 1], got {fraction!r}.")
    length = x.shape[axis]
    keep = math.ceil(float(fraction) * length)
    if truncate:
        index = [slice(None)] * x.ndim
        index[axis] = slice(0, keep)
        return x[tuple(index)]
    xp = jnp if isinstance(x, jax.Array) else np
    shape = [1] * x.ndim
    shape[axis] = length
    inside = (xp.arange(length) < keep).reshape(shape)
    return xp.where(inside, x, xp.zeros((), x.dtype))


# ------------------------------------------------------------------ tokenising


def tokenize(text: str | bytes) -> list[str]:
    """The words of ``text`` (see the module docstring); bytes are decoded as UTF-8."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = text.lower().replace("<br />", " ")
    return [w for w in (m.strip("'") for m in _WORD.findall(text)) if w]


def build_vocabulary(documents: Iterable[Sequence[str]], vocab_size: int) -> dict[str, int]:
    """Word -> id for the ``vocab_size - 2`` most frequent words (ties alphabetical), ids from 2.

    Raises:
      DataError: ``vocab_size`` below 3.
    """
    if not isinstance(vocab_size, numbers.Integral) or vocab_size < 3:
        raise DataError(f"vocab_size={vocab_size!r} must be an integer of at least 3 (ids 0 and 1 are reserved).")
    counts = collections.Counter()
    for words in documents:
        counts.update(words)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[: int(vocab_size) - 2]
    return {word: 2 + i for i, (word, _) in enumerate(ranked)}


def encode(documents: Iterable[Sequence[str]], vocabulary: Mapping[str, int], seq_len: int) -> np.ndarray:
    """``[n, seq_len]`` int32: each document's first ``seq_len`` words as ids (unknown 1), right-padded with 0."""
    rows = []
    for words in documents:
        ids = [vocabulary.get(w, UNK) for w in words[:seq_len]]
        rows.append(ids + [PAD] * (seq_len - len(ids)))
    if not rows:
        return np.zeros((0, seq_len), np.int32)
    return np.asarray(rows, dtype=np.int32)


# ------------------------------------------------------------------ synthetic_text


def make_synthetic_text(
    *,
    seed: int,
    num_examples: int = 2000,
    seq_len: int = 64,
    vocab_size: int = 1000,
    num_classes: int = 2,
    test_fraction: float = 0.2,
) -> ArrayDataset:
    """The offline synthetic text task (see the module docstring).

    ``num_examples`` counts both splits; ``test_fraction`` of every class goes to
    the test split.

    Raises:
      DataError: a value out of range (one sentence naming it and what is allowed).
    """
    _validate(num_examples, seq_len, vocab_size, num_classes, test_fraction)
    n, t, c = int(num_examples), int(seq_len), int(num_classes)
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % c).astype(np.int32)
    lengths = rng.integers(math.ceil(3 * t / 4), t + 1, size=n)
    half = math.ceil(t / 2)
    positions = np.arange(t)[None, :]

    noise_start = 2 + 2 * SIGNAL_WORDS * c
    x = rng.integers(noise_start, vocab_size, size=(n, t))

    # Distinct random positions: the smallest random keys among the allowed positions.
    late_ok = (positions >= half) & (positions < lengths[:, None])
    late_pos = np.argsort(np.where(late_ok, rng.random((n, t)), np.inf), axis=1)[:, :_LATE_PER_EXAMPLE]
    any_ok = positions < lengths[:, None]
    any_ok[np.arange(n)[:, None], late_pos] = False
    any_pos = np.argsort(np.where(any_ok, rng.random((n, t)), np.inf), axis=1)
    any_pos = any_pos[:, :_ANYWHERE_PER_EXAMPLE + _DISTRACTORS]

    first_signal = 2 + 2 * SIGNAL_WORDS * labels  # [n]: class y's first anywhere word
    anywhere = first_signal[:, None] + rng.integers(0, SIGNAL_WORDS, (n, _ANYWHERE_PER_EXAMPLE))
    late = first_signal[:, None] + SIGNAL_WORDS + rng.integers(0, SIGNAL_WORDS, (n, _LATE_PER_EXAMPLE))
    other = (labels[:, None] + rng.integers(1, c, (n, _DISTRACTORS))) % c
    distractor = 2 + 2 * SIGNAL_WORDS * other + rng.integers(0, SIGNAL_WORDS, (n, _DISTRACTORS))
    rows = np.arange(n)[:, None]
    x[rows, late_pos] = late
    x[rows, any_pos[:, :_ANYWHERE_PER_EXAMPLE]] = anywhere
    x[rows, any_pos[:, _ANYWHERE_PER_EXAMPLE:]] = distractor
    x[positions >= lengths[:, None]] = PAD
    x = x.astype(np.int32)

    return stratified_split("synthetic_text", x, labels, c, test_fraction, seed)


def _validate(num_examples, seq_len, vocab_size, num_classes, test_fraction) -> None:
    def integer(value) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if not integer(num_classes) or num_classes < 2:
        raise DataError(f"num_classes={num_classes!r} for 'synthetic_text' must be an integer of at least 2.")
    if not integer(seq_len) or seq_len < 8:
        raise DataError(f"seq_len={seq_len!r} for 'synthetic_text' must be an integer of at least 8.")
    least = 2 + 4 * SIGNAL_WORDS * num_classes  # as many noise words as signal words, at least
    if not integer(vocab_size) or vocab_size < least:
        raise DataError(
            f"vocab_size={vocab_size!r} for 'synthetic_text' with {num_classes} classes must be an integer of "
            f"at least {least}."
        )
    if not isinstance(test_fraction, numbers.Real) or not 0.0 < float(test_fraction) < 1.0:
        raise DataError(f"test_fraction={test_fraction!r} for 'synthetic_text' must lie strictly between 0 and 1.")
    if not integer(num_examples) or num_examples < 2 * num_classes:
        raise DataError(
            f"num_examples={num_examples!r} for 'synthetic_text' must be an integer of at least "
            f"{2 * num_classes} (two per class)."
        )
