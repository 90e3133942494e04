"""Text data: the weak tier's first part, tokenising and encoding, synthetic_text, imdb_reviews (mocked tfds)."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.data.sources import DATASETS, DataError, load_dataset
from fedpartial._src.data.text import (
    PAD,
    SIGNAL_WORDS,
    UNK,
    build_vocabulary,
    encode,
    first_part,
    make_synthetic_text,
    tokenize,
)

# ------------------------------------------------------------------ first_part


def test_first_part_by_hand():
    x = np.array([[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]], np.int32)
    np.testing.assert_array_equal(first_part(x), [[5, 6, 7, 0, 0], [1, 2, 0, 0, 0]])  # ceil(2.5) = 3 kept
    np.testing.assert_array_equal(first_part(x, truncate=True), [[5, 6, 7], [1, 2, 0]])
    np.testing.assert_array_equal(first_part(x, 0.2), [[5, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(first_part(x, 1.0), x)
    assert isinstance(first_part(x), np.ndarray) and first_part(x).dtype == np.int32


def test_first_part_on_embeddings_and_under_jit():
    emb = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3) + 1
    out = jax.jit(lambda e: first_part(e, 0.5, axis=-2))(emb)
    assert isinstance(out, jax.Array) and out.shape == (2, 4, 3)
    np.testing.assert_array_equal(np.asarray(out[:, :2]), np.asarray(emb[:, :2]))
    assert not np.any(np.asarray(out[:, 2:]))
    assert first_part(emb, 0.5, axis=-2, truncate=True).shape == (2, 2, 3)
    # a packed cohort [K, S, B, T] of token ids
    packed = np.ones((2, 3, 4, 9), np.int32)
    assert first_part(packed).sum() == 2 * 3 * 4 * 5


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.5, "half"])
def test_first_part_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="fraction"):
        first_part(np.ones((1, 4), np.int32), fraction)


# ------------------------------------------------------------------ tokenising


def test_tokenize_by_hand():
    text = "I didn't LIKE it.<br /><br />'Great' film, 10/10!"
    expected = ["i", "didn't", "like", "it", "great", "film", "10", "10"]
    assert tokenize(text) == expected
    assert tokenize(text.encode()) == expected
    assert tokenize("  ''  ") == []


def test_vocabulary_most_frequent_first_ties_alphabetical():
    docs = [["b", "a", "c"], ["a", "b"], ["d", "c", "e", "a"]]
    # counts: a 3, b 2, c 2, d 1, e 1
    assert build_vocabulary(docs, 5) == {"a": 2, "b": 3, "c": 4}
    assert build_vocabulary(docs, 3) == {"a": 2}
    assert build_vocabulary(docs, 100) == {"a": 2, "b": 3, "c": 4, "d": 5, "e": 6}
    with pytest.raises(DataError, match="vocab_size"):
        build_vocabulary(docs, 2)


def test_encode_truncates_pads_and_marks_unknown_words():
    vocabulary = {"a": 2, "b": 3}
    out = encode([["a", "x", "b"], ["b"], [], ["a", "a", "a", "a", "b"]], vocabulary, 4)
    np.testing.assert_array_equal(out, [[2, UNK, 3, PAD], [3, 0, 0, 0], [0, 0, 0, 0], [2, 2, 2, 2]])
    assert out.dtype == np.int32
    assert encode([], vocabulary, 4).shape == (0, 4)


# ------------------------------------------------------------------ synthetic_text


@pytest.fixture(scope="module")
def text2():
    return make_synthetic_text(seed=0)


def test_synthetic_text_shapes_balance_and_layout(text2):
    assert "synthetic_text" in DATASETS and text2.num_classes == 2
    assert text2.x_train.shape == (1600, 64) and text2.x_test.shape == (400, 64)
    assert text2.x_train.dtype == np.int32 and text2.y_train.dtype == np.int32
    assert np.bincount(text2.y_train).tolist() == [800, 800] and np.bincount(text2.y_test).tolist() == [200, 200]
    x = np.concatenate([text2.x_train, text2.x_test])
    assert x.min() == 0 and x.max() < 1000 and not np.any(x == UNK)
    lengths = (x != PAD).sum(1)
    assert lengths.min() >= 48 and lengths.max() == 64  # ceil(3T/4) .. T
    np.testing.assert_array_equal(x != PAD, np.arange(64)[None, :] < lengths[:, None])  # right-padded


def test_synthetic_text_signal_words_where_the_docstring_says(text2):
    """Per example: 3 anywhere + 2 late words of its class, 1 anywhere word of the other class."""
    for x, y in ((text2.x_train, text2.y_train), (text2.x_test, text2.y_test)):
        start = 2 + 2 * SIGNAL_WORDS * y[:, None]  # the class's first anywhere word
        anywhere = (x >= start) & (x < start + SIGNAL_WORDS)
        late = (x >= start + SIGNAL_WORDS) & (x < start + 2 * SIGNAL_WORDS)
        other = 2 + 2 * SIGNAL_WORDS * (1 - y[:, None])
        distractor = (x >= other) & (x < other + SIGNAL_WORDS)
        never = (x >= other + SIGNAL_WORDS) & (x < other + 2 * SIGNAL_WORDS)  # other class's late words
        assert (anywhere.sum(1) == 3).all() and (late.sum(1) == 2).all()
        assert (distractor.sum(1) == 1).all() and not never.any()
        assert not late[:, :32].any()  # late words only in the second half


def _naive_bayes_accuracy(ds, view=lambda x: x) -> float:
    """Multinomial naive Bayes on bag-of-words counts (Laplace smoothing), trained and tested on ``view(x)``."""
    vocab = int(max(ds.x_train.max(), ds.x_test.max())) + 1

    def bow(x):
        counts = np.zeros((len(x), vocab))
        np.add.at(counts, (np.repeat(np.arange(len(x)), x.shape[1]), x.reshape(-1)), 1)
        counts[:, PAD] = 0
        return counts

    train, test = bow(view(ds.x_train)), bow(view(ds.x_test))
    log_p = np.stack([np.log((train[ds.y_train == c].sum(0) + 1) / (train[ds.y_train == c].sum() + vocab))
                      for c in range(ds.num_classes)])
    return float(np.mean(np.argmax(test @ log_p.T, axis=1) == ds.y_test))


def test_synthetic_text_is_learnable_and_the_first_half_loses_signal(text2):
    full = _naive_bayes_accuracy(text2)
    half = _naive_bayes_accuracy(text2, lambda x: first_part(x, 0.5))
    assert full >= 0.97
    assert 0.6 < half < full - 0.1
    four = make_synthetic_text(seed=1, num_classes=4, num_examples=2000)
    assert np.bincount(four.y_train).tolist() == [400] * 4
    assert _naive_bayes_accuracy(four) >= 0.95  # chance is 0.25
    assert 0.4 < _naive_bayes_accuracy(four, lambda x: first_part(x, 0.5)) < 0.9


def test_synthetic_text_is_seeded():
    a = load_dataset("synthetic_text", seed=3, num_examples=100, seq_len=16, vocab_size=60)
    b = load_dataset("synthetic_text", seed=3, num_examples=100, seq_len=16, vocab_size=60)
    c = load_dataset("synthetic_text", seed=4, num_examples=100, seq_len=16, vocab_size=60)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.x_train, c.x_train)
    assert a.x_train.shape == (80, 16) and a.x_train.max() < 60


@pytest.mark.parametrize("kwargs, match", [
    ({"num_classes": 1}, "num_classes"),
    ({"seq_len": 4}, "seq_len"),
    ({"vocab_size": 41}, "vocab_size=41"),
    ({"test_fraction": 1.0}, "test_fraction"),
    ({"num_examples": 3}, "num_examples"),
    ({"colour": True}, "does not take the option"),
])
def test_synthetic_text_rejects_bad_options(kwargs, match):
    with pytest.raises(DataError, match=match):
        load_dataset("synthetic_text", **kwargs)


# ------------------------------------------------------------------ imdb_reviews


@contextlib.contextmanager
def mocked_tfds(num_examples: int):
    """`tfds.testing.mock_data` with its `__getitems__` repaired (see tests/data/test_sources.py)."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.testing import mocking

    def getitems(*args, generator, serialized=False):
        assert not serialized
        return [generator[key] for key in args[-1]]

    with mock.patch.object(mocking, "_getitems", getitems), tfds.testing.mock_data(
        num_examples=num_examples, policy=tfds.testing.MockPolicy.USE_CODE
    ):
        yield


def _mock_texts(split: str) -> tuple[list, np.ndarray]:
    import tensorflow_datasets as tfds

    source = tfds.data_source("imdb_reviews", split=split, download=False)
    records = [source[i] for i in range(len(source))]
    return [r["text"] for r in records], np.array([r["label"] for r in records])


def test_imdb_mocked_tokenised_with_the_training_vocabulary(monkeypatch):
    from fedpartial._src.data import sources

    monkeypatch.setattr(sources, "_READ_CHUNK", 7)  # several chunks
    with mocked_tfds(num_examples=23):
        ds = load_dataset("imdb_reviews", vocab_size=12, seq_len=5)
        texts, labels = {}, {}
        for split in ("train", "test"):
            texts[split], labels[split] = _mock_texts(split)
    assert ds.name == "imdb_reviews" and ds.num_classes == 2
    assert ds.x_train.shape == (23, 5) and ds.x_test.shape == (23, 5) and ds.x_train.dtype == np.int32
    assert ds.y_train.dtype == np.int32 and set(np.unique(ds.y_train)) <= {0, 1}
    # plain-Python reference: count the training words, keep the 10 most frequent, encode both splits
    counts = {}
    for t in texts["train"]:
        for w in tokenize(t):
            counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], w))[:10]
    vocabulary = {w: i + 2 for i, w in enumerate(ranked)}
    for split, x, y in (("train", ds.x_train, ds.y_train), ("test", ds.x_test, ds.y_test)):
        np.testing.assert_array_equal(y, labels[split])
        for row, t in zip(x, texts[split], strict=True):
            ids = [vocabulary.get(w, UNK) for w in tokenize(t)][:5]
            assert row.tolist() == ids + [PAD] * (5 - len(ids))
    assert ds.x_train.max() <= 11


def test_imdb_defaults_and_bad_options():
    with mocked_tfds(num_examples=3):
        ds = load_dataset("imdb_reviews")
    assert ds.x_train.shape == (3, 256) and ds.x_train.max() < 10_000
    with pytest.raises(DataError, match="does not take the option"):
        load_dataset("imdb_reviews", config="plain_text")
    with pytest.raises(DataError, match="seq_len"):
        load_dataset("imdb_reviews", seq_len=0)
    with pytest.raises(DataError, match="vocab_size"):
        load_dataset("imdb_reviews", vocab_size=1)


def test_imdb_not_prepared_says_how_to_prepare(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("imdb_reviews", data_dir=str(tmp_path))
    message = str(info.value)
    assert "'imdb_reviews'" in message and "not prepared" in message and str(tmp_path) in message
    assert "tfds.builder('imdb_reviews', file_format='array_record').download_and_prepare()" in message
    assert "\n" not in message
