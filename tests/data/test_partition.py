"""Tests for fedpartial._src.data.partition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpartial._src.data.partition import SCHEMES, partition, train_holdout_split
from fedpartial._src.data.sources import DataError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def labels_and_clients(draw, max_n=300, max_classes=12):
    num_classes = draw(st.integers(1, max_classes))
    n = draw(st.integers(1, max_n))
    labels = np.array(draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n)))
    num_clients = draw(st.integers(1, n))
    return labels, num_clients


def check_common(parts, labels, num_clients, min_size=1, covers_all=True):
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64
        assert p.ndim == 1
        assert len(p) >= min_size
        assert np.all(np.diff(p) > 0)  # sorted, no repeats within a client
        assert p.min() >= 0 and p.max() < len(labels)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)  # disjoint
    if covers_all:
        assert len(joined) == len(labels)


def entropy_per_client(parts, labels, num_classes):
    out = []
    for p in parts:
        q = np.bincount(labels[p], minlength=num_classes) / len(p)
        q = q[q > 0]
        out.append(-(q * np.log(q)).sum())
    return float(np.mean(out))


# --------------------------------------------------------------------- iid


@SETTINGS
@given(labels_and_clients(), st.integers(0, 2**31 - 1))
def test_iid_invariants(data, seed):
    labels, k = data
    parts = partition(labels, k, "iid", seed=seed)
    check_common(parts, labels, k)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    # the leftover n % k examples go one each to the first clients
    assert sizes == sorted(sizes, reverse=True)


def test_iid_deterministic_and_seeded():
    labels = np.arange(100) % 7
    a = partition(labels, 6, "iid", seed=5)
    b = partition(labels, 6, "iid", seed=5)
    c = partition(labels, 6, "iid", seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


# --------------------------------------------------------------- dirichlet


@SETTINGS
@given(
    labels_and_clients(),
    st.floats(0.01, 100.0),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
)
def test_dirichlet_invariants(data, alpha, min_size, seed):
    labels, k = data
    if k * min_size > len(labels):
        with pytest.raises(DataError, match="min_size"):
            partition(labels, k, "dirichlet", alpha=alpha, min_size=min_size, seed=seed)
        return
    parts = partition(labels, k, "dirichlet", alpha=alpha, min_size=min_size, seed=seed)
    check_common(parts, labels, k, min_size=min_size)
    again = partition(labels, k, "dirichlet", alpha=alpha, min_size=min_size, seed=seed)
    assert all(np.array_equal(x, y) for x, y in zip(parts, again))


def test_dirichlet_small_alpha_is_more_skewed():
    labels = np.repeat(np.arange(10), 100)
    for seed in range(3):
        skewed = partition(labels, 20, "dirichlet", alpha=0.1, seed=seed)
        mixed = partition(labels, 20, "dirichlet", alpha=100.0, seed=seed)
        h_skewed = entropy_per_client(skewed, labels, 10)
        h_mixed = entropy_per_client(mixed, labels, 10)
        assert h_skewed < 0.6 * h_mixed
        assert h_mixed > 0.9 * np.log(10)


def test_dirichlet_repair_reaches_min_size():
    # alpha tiny and many clients: most clients get nothing from the draw itself
    labels = np.repeat(np.arange(3), 40)
    parts = partition(labels, 30, "dirichlet", alpha=0.001, min_size=4, seed=0)
    check_common(parts, labels, 30, min_size=4)
    # repair moves single examples of the donor's majority class: clients stay near single-class
    assert entropy_per_client(parts, labels, 3) < 0.3


# ------------------------------------------------------------------ shards


@SETTINGS
@given(labels_and_clients(), st.data(), st.integers(0, 2**31 - 1))
def test_shards_invariants(data, draw, seed):
    labels, k = data
    num_classes = len(np.unique(labels))
    # mostly valid values, sometimes one too many
    k_classes = draw.draw(st.integers(1, num_classes + 1), label="classes_per_client")
    if k_classes > num_classes:
        with pytest.raises(DataError, match="classes_per_client"):
            partition(labels, k, "shards", classes_per_client=k_classes, seed=seed)
        return
    class_sizes = np.unique(labels, return_counts=True)[1]
    if np.minimum(class_sizes, k).sum() < k * k_classes:
        with pytest.raises(DataError, match="too few examples"):
            partition(labels, k, "shards", classes_per_client=k_classes, seed=seed)
        return
    parts = partition(labels, k, "shards", classes_per_client=k_classes, seed=seed)
    # all examples are used whenever there are at least as many shards as classes
    check_common(parts, labels, k, covers_all=k * k_classes >= num_classes)
    for p in parts:
        assert len(np.unique(labels[p])) == k_classes


def test_shards_balanced_classes_give_equal_clients():
    labels = np.repeat(np.arange(10), 60)
    parts = partition(labels, 100, "shards", classes_per_client=2, seed=1)
    sizes = [len(p) for p in parts]
    assert set(sizes) == {6}
    holders = np.zeros(10, int)
    for p in parts:
        assert len(np.unique(labels[p])) == 2
        holders[np.unique(labels[p])] += 1
    assert set(holders) == {20}  # every class split among the same number of clients


def test_shards_noncontiguous_labels():
    labels = np.array([3, 3, 3, 7, 7, 7, 42, 42, 42, 42])
    parts = partition(labels, 3, "shards", classes_per_client=2, seed=0)
    check_common(parts, labels, 3)
    assert all(len(np.unique(labels[p])) == 2 for p in parts)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((np.arange(10), 3, "iidd"), {}, "Unknown partition scheme 'iidd'.*iid, dirichlet, shards"),
        ((np.arange(10), 0, "iid"), {}, "num_clients=0.*between 1 and .*10"),
        ((np.arange(10), 11, "iid"), {}, "num_clients=11"),
        ((np.arange(10), 2, "dirichlet"), {"alpha": 0.0}, "alpha=0.0.*> 0"),
        ((np.arange(10), 2, "dirichlet"), {"alpha": -1}, "alpha=-1"),
        ((np.arange(10), 2, "dirichlet"), {}, "alpha=None"),
        ((np.arange(10), 2, "iid"), {"alpha": 0.5}, "only used by the 'dirichlet'"),
        ((np.arange(10), 2, "shards"), {"classes_per_client": 0}, "classes_per_client=0.*between 1 and 10"),
        ((np.arange(10) % 3, 2, "shards"), {"classes_per_client": 4}, "classes_per_client=4.*between 1 and 3"),
        ((np.arange(10), 2, "shards"), {}, "classes_per_client=None"),
        ((np.arange(10), 2, "iid"), {"classes_per_client": 2}, "only used by the 'shards'"),
        ((np.arange(10), 4, "iid"), {"min_size": 3}, "min_size=3"),
        ((np.zeros((2, 5), int), 2, "iid"), {}, "1-D integer"),
        ((np.linspace(0, 1, 5), 2, "iid"), {}, "1-D integer"),
    ],
)
def test_errors(args, kwargs, match):
    with pytest.raises(DataError, match=match):
        partition(*args, **kwargs)


def test_schemes_constant():
    assert SCHEMES == ("iid", "dirichlet", "shards")


# ---------------------------------------------------------- train/holdout


@SETTINGS
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=12),
    st.floats(0.05, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_train_holdout_split(sizes, fraction, seed):
    offsets = np.cumsum([0] + sizes)
    clients = [np.arange(offsets[i], offsets[i + 1]) * 3 for i in range(len(sizes))]
    train, hold = train_holdout_split(clients, fraction, seed)
    assert len(train) == len(hold) == len(clients)
    for c, tr, ho in zip(clients, train, hold):
        assert len(tr) >= 1
        assert tr.dtype == np.int64 and ho.dtype == np.int64
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, ho])), c)
        assert abs(len(tr) - fraction * len(c)) <= 0.5 or len(tr) == 1
    train2, hold2 = train_holdout_split(clients, fraction, seed)
    assert all(np.array_equal(a, b) for a, b in zip(train + hold, train2 + hold2))


def test_train_holdout_errors():
    with pytest.raises(DataError, match="train_fraction=0"):
        train_holdout_split([np.arange(3)], 0, 0)
    with pytest.raises(DataError, match="train_fraction=1.5"):
        train_holdout_split([np.arange(3)], 1.5, 0)
    with pytest.raises(DataError, match="Client 1 has no examples"):
        train_holdout_split([np.arange(3), np.zeros(0, int)], 0.7, 0)
