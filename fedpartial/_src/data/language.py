"""Language-model data: next-token targets, the per-position view of next-character data, and ``synthetic_lm``,
an offline corpus with learnable structure.

A language-model dataset's features are int32 token ids ``[n, T]``, right-padded with 0 (the layout of
:mod:`fedpartial._src.data.text`: 0 padding, 1 unknown, real tokens from 2), and its labels are the *next
tokens* ``[n, T]`` (:func:`next_token_targets`): ``y[:, t] = x[:, t + 1]``, with
:data:`~fedpartial._src.core.losses.IGNORED_LABEL` (-1) where the next token is padding or past the end, so
loss and accuracy count every real target and nothing else.  ``num_classes`` is the vocabulary size.  The
labels have no class per example, so partitioning reads ``group_train`` instead (:attr:`ArrayDataset.groups`).

Next-character data (LEAF's Shakespeare: token ids ``[n, T]`` and one label, the character that follows) has
a language model's view (:func:`next_token_view`): the labels of position ``t`` are the token at ``t + 1``,
the last real position's label is the example's own label as a token id, and padding positions are ignored.
Its classes are the token ids themselves, so the inputs and the outputs share one vocabulary (``num_classes``
is the number of token ids; padding, id 0, is never a label).

``synthetic_lm`` (:func:`make_synthetic_lm`) draws every sequence from one of ``num_topics`` first-order
Markov chains over the ``vocab_size - 2`` words: in each topic every word has ``branching`` possible
successors (drawn uniformly among the words) with Dirichlet(1) probabilities, and a sequence starts at a
uniform word.  So a model that knows the topic predicts the next token among ``branching`` choices (a
perplexity of about 2 with the defaults), a bigram model that ignores the topic among up to
``branching x num_topics``, and a unigram model among all the words: the topic has to be read from the
sequence so far, which is what attention over the context learns.  Lengths are uniform in
``ceil(T/2) .. T``, padding after them.  The topic is each example's group (a Dirichlet partition gives
clients different topic mixes: non-IID).  Topics are balanced (``arange(n) % topics``, shuffled); the test
split is stratified by topic (:func:`~fedpartial._src.data.arrays.stratified_test_indices`); everything comes
from ``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from fedpartial._src.core.losses import IGNORED_LABEL
from fedpartial._src.data.arrays import ArrayDataset, DataError, stratified_test_indices
from fedpartial._src.data.text import PAD

__all__ = ["make_synthetic_lm", "next_token_targets", "next_token_view"]

_FIRST_WORD = 2  # ids 0 (padding) and 1 (unknown) are reserved


def next_token_targets(x: np.ndarray) -> np.ndarray:
    """``[n, T]`` int32 next-token labels of right-padded token ids ``x`` ``[n, T]``: ``x[:, t + 1]``, or
    :data:`~fedpartial._src.core.losses.IGNORED_LABEL` where that is padding (0) or past the end."""
    x = np.asarray(x)
    y = np.full(x.shape, IGNORED_LABEL, np.int32)
    following = x[:, 1:]
    y[:, :-1] = np.where(following == PAD, IGNORED_LABEL, following)
    return y


def next_token_view(dataset: ArrayDataset) -> ArrayDataset:
    """``dataset`` (next-character data: :attr:`ArrayDataset.label_token_offset` set) with labels per position.

    For right-padded token ids ``x`` ``[n, T]`` and labels ``y`` ``[n]``: position ``t``'s label is
    ``x[t + 1]``; the last real (non-padding) position's is ``y + label_token_offset``, the token ``y``
    names; padding positions get :data:`~fedpartial._src.core.losses.IGNORED_LABEL`. ``num_classes`` becomes
    the number of token ids (``num_classes + label_token_offset``: LEAF's 81 classes are 82 ids), the old
    labels become ``group_train`` (what a label-skewed partition splits by), and the clients and the rest stay.

    Raises:
      DataError: labels that are not next tokens (``label_token_offset`` None), in one sentence.
    """
    offset = dataset.label_token_offset
    if offset is None or np.ndim(dataset.y_train) != 1:
        raise DataError(f"{dataset.name}'s labels are not the tokens that follow its examples, so it has no "
                        "per-position view; a language model needs next-character data such as LEAF's Shakespeare.")

    def per_position(x, y):
        targets = next_token_targets(x)
        real = x != PAD
        last = x.shape[1] - 1 - np.argmax(real[:, ::-1], axis=1)  # the last real position of each row
        rows = np.flatnonzero(real.any(axis=1))  # a row of padding alone has nothing to predict
        targets[rows, last[rows]] = np.asarray(y)[rows] + offset
        targets[~real] = IGNORED_LABEL
        return targets

    return dataclasses.replace(
        dataset, y_train=per_position(dataset.x_train, dataset.y_train),
        y_test=per_position(dataset.x_test, dataset.y_test), num_classes=int(dataset.num_classes + offset),
        group_train=np.asarray(dataset.y_train, np.int32), label_token_offset=None, usual_model="transformer_lm")


def make_synthetic_lm(num_examples: int = 2000, seq_len: int = 32, vocab_size: int = 64, num_topics: int = 4,
                      branching: int = 3, test_fraction: float = 0.2, *, seed: int = 0) -> ArrayDataset:
    """The ``synthetic_lm`` dataset (see the module docstring).

    Args:
      num_examples: sequences in all (train and test).
      seq_len: ``T``, the padded length.
      vocab_size: token ids ``0 … vocab_size - 1`` (0 padding, 1 unknown, never drawn); ``num_classes``.
      num_topics: Markov chains the sequences are drawn from.
      branching: successors of each word in a topic.
      test_fraction: the share of each topic's sequences in the test split.
      seed: drives every draw.

    Raises:
      DataError: a value out of range, in one sentence.
    """
    _validate(num_examples, seq_len, vocab_size, num_topics, branching, test_fraction)
    rng = np.random.default_rng(seed)
    words = vocab_size - _FIRST_WORD
    successors = rng.integers(0, words, size=(num_topics, words, branching))
    cumulative = np.cumsum(rng.dirichlet(np.ones(branching), size=(num_topics, words)), axis=-1)
    topics = rng.permutation(np.arange(num_examples) % num_topics)
    lengths = rng.integers(-(-seq_len // 2), seq_len + 1, size=num_examples)
    tokens = np.zeros((num_examples, seq_len), np.int64)
    tokens[:, 0] = rng.integers(0, words, size=num_examples)
    for t in range(1, seq_len):
        u = rng.random(num_examples)[:, None]
        choice = np.minimum(np.sum(u > cumulative[topics, tokens[:, t - 1]], axis=-1), branching - 1)
        tokens[:, t] = successors[topics, tokens[:, t - 1], choice]
    x = np.where(np.arange(seq_len)[None, :] < lengths[:, None], tokens + _FIRST_WORD, PAD).astype(np.int32)
    y = next_token_targets(x)
    is_test = np.zeros(num_examples, bool)
    is_test[stratified_test_indices(topics, test_fraction, seed)] = True
    return ArrayDataset(name="synthetic_lm", x_train=np.ascontiguousarray(x[~is_test]), y_train=y[~is_test],
                        x_test=np.ascontiguousarray(x[is_test]), y_test=y[is_test], num_classes=int(vocab_size),
                        group_train=topics[~is_test].astype(np.int32))


def _validate(num_examples, seq_len, vocab_size, num_topics, branching, test_fraction) -> None:
    def integer(value, least):
        return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least

    for name, value, least in (("num_examples", num_examples, 2), ("seq_len", seq_len, 2),
                               ("vocab_size", vocab_size, _FIRST_WORD + 2), ("num_topics", num_topics, 1),
                               ("branching", branching, 1)):
        if not integer(value, least):
            raise DataError(f"{name}={value!r} for 'synthetic_lm' must be an integer of at least {least}.")
    if not 0.0 < float(test_fraction) < 1.0:
        raise DataError(f"test_fraction={test_fraction!r} for 'synthetic_lm' must lie strictly between 0 and 1.")
