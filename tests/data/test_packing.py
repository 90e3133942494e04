"""Tests for fedpartial._src.data.packing."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpartial._src.data.packing import CohortBatches, max_steps, pack_cohort, steps_for_client
from fedpartial._src.data.sources import DataError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def toy(n: int, num_classes: int = 5):
    """Features that name their example: x[i] = (i + 1, -(i + 1)); y[i] = i % num_classes.

    No example has zero features, so a padded slot filled with a real example's
    features instead of zeros is noticed.
    """
    ids = np.arange(1, n + 1, dtype=np.float32)
    x = np.stack([ids, -ids], axis=1)
    y = (np.arange(n) % num_classes).astype(np.int32)
    return x, y


def clients_from_sizes(sizes):
    offsets = np.cumsum([0, *sizes])
    return [np.arange(offsets[i], offsets[i + 1]) for i in range(len(sizes))]


def real_ids(cb: CohortBatches, k: int, steps=slice(None)):
    """Example ids of client k's real slots, step by step, in batch order."""
    ids = cb.x[k, steps, :, 0]
    mask = cb.example_mask[k, steps]
    return ids[mask].astype(np.int64) - 1


def check_padding(cb: CohortBatches, y_data: np.ndarray):
    k, s, b = cb.example_mask.shape
    assert cb.y.shape == (k, s, b) and cb.step_mask.shape == (k, s)
    assert cb.x.dtype == np.float32 and cb.y.dtype == np.int32
    assert cb.example_mask.dtype == bool and cb.step_mask.dtype == bool
    assert cb.num_samples.dtype == np.float32 and cb.num_samples.shape == (k,)
    pad = ~cb.example_mask
    assert np.all(cb.x[pad] == 0) and np.all(cb.y[pad] == 0)
    np.testing.assert_array_equal(cb.step_mask, cb.example_mask.any(axis=2))
    # padded steps are all-False and come after the real ones
    for row in cb.step_mask:
        n_real = int(row.sum())
        assert row[:n_real].all() and not row[n_real:].any()
    # labels travel with their examples
    ids = cb.x[..., 0][cb.example_mask].astype(np.int64) - 1
    np.testing.assert_array_equal(cb.y[cb.example_mask], y_data[ids])
    np.testing.assert_array_equal(cb.x[..., 1][cb.example_mask], -(ids + 1).astype(np.float32))


# -------------------------------------------------------------- hand-checked


def test_tiny_case_by_hand():
    x, y = toy(13)
    clients = [np.array([0]), np.arange(1, 6), np.arange(6, 13)]
    assert [steps_for_client(len(c), 4, local_steps=None, local_epochs=1) for c in clients] == [1, 2, 2]
    assert max_steps([1, 5, 7], 4, local_steps=None, local_epochs=1) == 2
    cb = pack_cohort(x, y, clients, batch_size=4, num_steps=3, local_epochs=1, seed=0)
    T, F = True, False
    expected_examples = np.array(
        [
            [[T, F, F, F], [F, F, F, F], [F, F, F, F]],
            [[T, T, T, T], [T, F, F, F], [F, F, F, F]],
            [[T, T, T, T], [T, T, T, F], [F, F, F, F]],
        ]
    )
    np.testing.assert_array_equal(cb.example_mask, expected_examples)
    np.testing.assert_array_equal(cb.step_mask, [[T, F, F], [T, T, F], [T, T, F]])
    np.testing.assert_array_equal(cb.num_samples, [1, 5, 7])
    assert cb.x.shape == (3, 3, 4, 2)
    for k, c in enumerate(clients):
        np.testing.assert_array_equal(np.sort(real_ids(cb, k)), c)
    check_padding(cb, y)


def test_steps_rules():
    s = lambda n, b, **kw: steps_for_client(n, b, **{"local_steps": None, "local_epochs": None, **kw})  # noqa: E731
    assert s(10, 4, local_epochs=1) == 3
    assert s(10, 4, local_epochs=2) == 6
    assert s(100, 10, local_epochs=0.5) == 5
    assert s(300, 10, local_epochs=0.1) == 3  # 0.1 * 30 is 3.0000000000000004 in floats
    assert s(30, 10, local_epochs=1.5) == 5  # ceil(4.5)
    assert s(3, 10, local_epochs=0.01) == 1
    assert s(10, 4, local_steps=7) == 7
    assert s(1, 4, local_steps=7) == 7
    assert s(0, 4, local_steps=7) == 0 and s(0, 4, local_epochs=3) == 0
    assert max_steps([1, 50, 7], 8, local_steps=None, local_epochs=2) == 14
    assert max_steps([1, 50, 7], 8, local_steps=3, local_epochs=None) == 3


# --------------------------------------------------------------- invariants


@SETTINGS
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=6),
    st.integers(1, 9),
    st.sampled_from([0.3, 1, 1.5, 2, 3]),
    st.integers(0, 2**31 - 1),
)
def test_epochs_mode_each_example_once_per_epoch(sizes, batch, epochs, seed):
    x, y = toy(sum(sizes))
    clients = clients_from_sizes(sizes)
    steps = max(1, max_steps(sizes, batch, local_steps=None, local_epochs=epochs))
    cb = pack_cohort(x, y, clients, batch_size=batch, num_steps=steps + 1, local_epochs=epochs, seed=seed)
    check_padding(cb, y)
    for k, (n, members) in enumerate(zip(sizes, clients)):
        own = steps_for_client(n, batch, local_steps=None, local_epochs=epochs)
        assert cb.step_mask[k].sum() == own
        assert cb.num_samples[k] == n
        if n == 0:
            continue
        per_epoch = math.ceil(n / batch)
        for start in range(0, own, per_epoch):
            stop = min(own, start + per_epoch)
            got = real_ids(cb, k, slice(start, stop))
            if stop - start == per_epoch:  # a full epoch: a permutation of the client's data
                np.testing.assert_array_equal(np.sort(got), members)
            else:  # a fractional epoch: distinct examples of the client
                assert len(np.unique(got)) == len(got) and np.isin(got, members).all()
            # only an epoch's last batch may be partial; a fractional epoch never reaches it
            counts = cb.example_mask[k, start:stop].sum(axis=1)
            if stop - start == per_epoch:
                assert np.all(counts[:-1] == batch) and counts[-1] == n - (per_epoch - 1) * batch
            else:
                assert np.all(counts == batch)


@SETTINGS
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=6),
    st.integers(1, 9),
    st.integers(1, 12),
    st.integers(0, 2**31 - 1),
)
def test_steps_mode_cycles_through_epochs(sizes, batch, local_steps, seed):
    x, y = toy(sum(sizes))
    clients = clients_from_sizes(sizes)
    cb = pack_cohort(x, y, clients, batch_size=batch, num_steps=local_steps + 2, local_steps=local_steps, seed=seed)
    check_padding(cb, y)
    for k, (n, members) in enumerate(zip(sizes, clients)):
        assert cb.step_mask[k].sum() == local_steps
        counts = cb.example_mask[k, :local_steps].sum(axis=1)
        assert np.all(counts == min(batch, n))
        # real slots are the first min(B, n) of each batch
        assert np.all(cb.example_mask[k, :local_steps, : min(batch, n)])
        stream = real_ids(cb, k)
        assert len(stream) == local_steps * min(batch, n)
        for start in range(0, len(stream) - n + 1, n):  # every complete pass is a permutation
            np.testing.assert_array_equal(np.sort(stream[start : start + n]), members)
        assert np.isin(stream, members).all()


def test_steps_mode_small_client_sees_all_each_step():
    x, y = toy(3)
    cb = pack_cohort(x, y, [np.arange(3)], batch_size=8, num_steps=4, local_steps=4, seed=1)
    for s in range(4):
        np.testing.assert_array_equal(np.sort(cb.x[0, s, :3, 0]), [1, 2, 3])
        assert not cb.example_mask[0, s, 3:].any()
    orders = {tuple(cb.x[0, s, :3, 0]) for s in range(4)}
    assert len(orders) > 1  # reshuffled between steps (6 orders; 4 equal ones is 1/216)


def test_padded_steps_and_empty_client():
    x, y = toy(10)
    cb = pack_cohort(x, y, [np.arange(2), np.zeros(0, np.int64), np.arange(2, 10)],
                     batch_size=4, num_steps=5, local_epochs=1, seed=0)
    np.testing.assert_array_equal(cb.step_mask, [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    assert not cb.example_mask[:, 2:].any()
    assert np.all(cb.x[:, 2:] == 0) and np.all(cb.y[:, 2:] == 0)
    assert not cb.example_mask[1].any() and cb.num_samples[1] == 0
    check_padding(cb, y)


def test_deterministic_and_seeded():
    x, y = toy(60)
    clients = clients_from_sizes([7, 20, 33])
    kw = dict(batch_size=5, num_steps=8, local_steps=8)
    a = pack_cohort(x, y, clients, seed=3, **kw)
    b = pack_cohort(x, y, clients, seed=3, **kw)
    c = pack_cohort(x, y, clients, seed=4, **kw)
    d = pack_cohort(x, y, clients, seed=np.random.default_rng(3), **kw)
    for f in CohortBatches._fields:
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        np.testing.assert_array_equal(getattr(a, f), getattr(d, f))
    assert not np.array_equal(a.x, c.x)


def test_dtypes_and_feature_shapes():
    rng = np.random.default_rng(0)
    images = rng.random((20, 4, 4, 3))  # float64 in -> float32 out
    labels = rng.integers(0, 3, 20)  # int64 in -> int32 out
    cb = pack_cohort(images, labels, [np.arange(20)], batch_size=6, num_steps=4, local_epochs=1, seed=0)
    assert cb.x.shape == (1, 4, 6, 4, 4, 3) and cb.x.dtype == np.float32
    assert cb.y.dtype == np.int32
    tokens = rng.integers(1, 100, (20, 7)).astype(np.int32)  # token ids keep their dtype
    cb = pack_cohort(tokens, labels, [np.arange(20)], batch_size=6, num_steps=4, local_epochs=1, seed=0)
    assert cb.x.dtype == np.int32 and np.all(cb.x[~cb.example_mask] == 0)


# ------------------------------------------------------------------- errors


def test_errors():
    x, y = toy(10)
    clients = [np.arange(10)]
    with pytest.raises(DataError, match="needs 3 local steps but num_steps is 2"):
        pack_cohort(x, y, clients, batch_size=4, num_steps=2, local_epochs=1, seed=0)
    with pytest.raises(DataError, match="needs 5 local steps"):
        pack_cohort(x, y, clients, batch_size=4, num_steps=4, local_steps=5, seed=0)
    with pytest.raises(DataError, match="Exactly one of local_steps and local_epochs"):
        pack_cohort(x, y, clients, batch_size=4, num_steps=4, seed=0)
    with pytest.raises(DataError, match="Exactly one of local_steps and local_epochs"):
        pack_cohort(x, y, clients, batch_size=4, num_steps=4, local_steps=1, local_epochs=1, seed=0)
    with pytest.raises(DataError, match="local_epochs=0"):
        steps_for_client(3, 2, local_steps=None, local_epochs=0)
    with pytest.raises(DataError, match="local_steps=0"):
        steps_for_client(3, 2, local_steps=0, local_epochs=None)
    with pytest.raises(DataError, match="batch_size=0"):
        pack_cohort(x, y, clients, batch_size=0, num_steps=4, local_steps=1, seed=0)
    with pytest.raises(DataError, match="num_steps=0"):
        pack_cohort(x, y, clients, batch_size=2, num_steps=0, local_steps=1, seed=0)
    with pytest.raises(DataError, match="outside 0..9"):
        pack_cohort(x, y, [np.array([3, 10])], batch_size=2, num_steps=4, local_steps=1, seed=0)
    with pytest.raises(DataError, match="same number of examples"):
        pack_cohort(x, y[:5], clients, batch_size=2, num_steps=4, local_steps=1, seed=0)
    with pytest.raises(DataError, match="at least one client"):
        pack_cohort(x, y, [], batch_size=2, num_steps=4, local_steps=1, seed=0)
    with pytest.raises(DataError, match="at least one client"):
        max_steps([], 2, local_steps=1, local_epochs=None)


# ------------------------------------------------------------------- speed


def test_packing_is_fast_enough():
    """200 clients x 50 steps x 32 examples of 8x8 images, all slots real (worst case)."""
    rng = np.random.default_rng(0)
    x = rng.random((200 * 40, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    clients = clients_from_sizes([40] * 200)
    pack_cohort(x, y, clients, batch_size=32, num_steps=50, local_steps=50, seed=0)
    best = min(
        _timed(lambda: pack_cohort(x, y, clients, batch_size=32, num_steps=50, local_steps=50, seed=s))
        for s in range(3)
    )
    assert best < 0.5  # measured ~0.03 s; generous bound against slow machines


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
