"""Labels per position (language models): the loss, accuracy and evaluation count every real target, padding
excluded; the data pipeline carries them; ``synthetic_lm`` and its next-token targets."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.losses import (IGNORED_LABEL, count_correct, count_labels, label_weights,
                                         masked_cross_entropy, mutual_distillation)
from fedpartial._src.data import packing
from fedpartial._src.data.language import make_synthetic_lm, next_token_targets
from fedpartial._src.data.sources import load_dataset
from fedpartial._src.experiment import population
from fedpartial._src.experiment.evaluation import labels_per_client, pad_holdouts

RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(3, 4, 5)).astype(np.float32)
LABELS = np.array([[1, 2, -1, -1], [0, 4, 3, -1], [2, 2, 2, 2]], np.int32)
MASK = np.array([True, True, False])  # the third example is padding


def reference_ce():
    """numpy: the mean of -log softmax at the label over the 5 real targets."""
    logp = LOGITS - np.log(np.exp(LOGITS).sum(-1, keepdims=True))
    terms = [-logp[b, t, LABELS[b, t]] for b in range(2) for t in range(4) if LABELS[b, t] >= 0]
    return np.mean(terms), len(terms)


def test_cross_entropy_and_accuracy_over_real_positions():
    expected, n = reference_ce()
    np.testing.assert_allclose(masked_cross_entropy(LOGITS, LABELS, MASK), expected, rtol=1e-6)
    assert float(count_labels(LABELS, MASK)) == n == 5
    hits = sum(int(np.argmax(LOGITS[b, t]) == LABELS[b, t]) for b in range(2) for t in range(4) if LABELS[b, t] >= 0)
    assert int(count_correct(LOGITS, LABELS, MASK)) == hits
    np.testing.assert_array_equal(label_weights(LABELS, MASK), [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])


def test_one_label_per_example_is_unchanged():
    logits, labels = LOGITS[:, 0], np.array([1, 0, 3], np.int32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(masked_cross_entropy(logits, labels, MASK), -(logp[0, 1] + logp[1, 0]) / 2, rtol=1e-6)


def test_mutual_distillation_takes_positions():
    two_exits = jnp.stack([LOGITS, LOGITS * 0.5])
    per_position = float(mutual_distillation(two_exits, jnp.asarray(MASK)))
    assert per_position > 0 and np.isfinite(per_position)


def test_next_token_targets():
    x = np.array([[5, 6, 7, 0, 0], [2, 3, 4, 5, 6]], np.int32)
    np.testing.assert_array_equal(next_token_targets(x), [[6, 7, -1, -1, -1], [3, 4, 5, 6, -1]])
    assert IGNORED_LABEL == -1


def test_synthetic_lm_is_seeded_padded_and_grouped():
    a = make_synthetic_lm(num_examples=200, seq_len=12, vocab_size=20, seed=3)
    b = load_dataset("synthetic_lm", seed=3, num_examples=200, seq_len=12, vocab_size=20)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.x_train.dtype == np.int32 and a.x_train.shape[1] == 12 and a.num_classes == 20
    assert len(a.x_train) + len(a.x_test) == 200 and len(a.x_test) == 40
    np.testing.assert_array_equal(a.y_train, next_token_targets(a.x_train))
    lengths = (a.x_train != 0).sum(1)
    assert lengths.min() >= 6 and np.all(a.x_train[np.arange(12)[None] >= lengths[:, None]] == 0)  # right-padded
    assert a.x_train[a.x_train != 0].min() >= 2 and a.x_train.max() < 20
    np.testing.assert_array_equal(np.bincount(a.groups), [40] * 4)  # topics, balanced, what partitions read
    # within a topic, each word has at most `branching` successors
    x, topic = a.x_train, a.groups
    for t in range(4):
        pairs = {(u, v) for row in x[topic == t] for u, v in zip(row[:-1], row[1:]) if v}
        per_word = np.bincount([u for u, _ in pairs])
        assert per_word.max() <= 3


def test_pipeline_carries_labels_per_position():
    data = make_synthetic_lm(num_examples=100, seq_len=8, vocab_size=16, seed=0)
    clients = [np.arange(0, 30), np.arange(30, 50)]
    packed = packing.pack_cohort(data.x_train, data.y_train, clients, batch_size=4, num_steps=3, local_steps=3,
                                 seed=0)
    assert packed.y.shape == (2, 3, 4, 8)
    real = packed.example_mask
    assert np.all(packed.y[~real] == 0) and np.all(packed.x[~real] == 0)
    counts = population.label_counts(data.y_train, clients, data.num_classes)
    y0 = data.y_train[clients[0]]
    np.testing.assert_array_equal(counts[0], np.bincount(y0[y0 >= 0], minlength=16))
    x, y, mask = pad_holdouts([(data.x_test[:3], data.y_test[:3]), (data.x_test[3:4], data.y_test[3:4])])
    assert y.shape == (2, 3, 8)
    np.testing.assert_array_equal(labels_per_client(y, mask),
                                  [(data.y_test[:3] >= 0).sum(), (data.y_test[3] >= 0).sum()])


@pytest.mark.parametrize("bad, message", [({"vocab_size": 3}, "vocab_size=3 for 'synthetic_lm' must be an integer"),
                                          ({"test_fraction": 1.0}, "test_fraction=1.0 for 'synthetic_lm'")])
def test_synthetic_lm_refuses_bad_options(bad, message):
    with pytest.raises(Exception, match=message):
        make_synthetic_lm(**bad)
