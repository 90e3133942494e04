"""Tests for fedpartial._src.data.sources and fedpartial._src.data.synthetic (offline)."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest

from fedpartial._src.data.sources import DATASETS, ArrayDataset, DataError, load_dataset
from fedpartial._src.data.synthetic import make_synthetic

# ------------------------------------------------------------------ digits


def test_digits_shapes_dtypes_range():
    ds = load_dataset("digits")
    assert isinstance(ds, ArrayDataset)
    assert ds.num_classes == 10
    assert ds.x_train.shape[1:] == (8, 8, 1) and ds.x_test.shape[1:] == (8, 8, 1)
    assert len(ds.x_train) + len(ds.x_test) == 1797
    assert len(ds.x_train) == len(ds.y_train) and len(ds.x_test) == len(ds.y_test)
    assert ds.x_train.dtype == np.float32 and ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == np.int32 and ds.y_test.dtype == np.int32
    assert ds.x_train.min() >= 0.0 and ds.x_train.max() == 1.0
    assert set(np.unique(ds.y_train)) == set(range(10)) == set(np.unique(ds.y_test))
    # stratified 80/20: every class is about 20% test
    counts_test = np.bincount(ds.y_test, minlength=10)
    counts_all = counts_test + np.bincount(ds.y_train, minlength=10)
    assert np.all(np.abs(counts_test - 0.2 * counts_all) <= 0.5 + 1e-9)
    assert ds.natural_partition is None


def test_digits_split_is_deterministic_and_seeded():
    a = load_dataset("digits", seed=3)
    b = load_dataset("digits", seed=3)
    c = load_dataset("digits", seed=4)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert a.x_train.shape == c.x_train.shape
    assert not np.array_equal(a.x_test, c.x_test)


def test_digits_split_is_a_partition_of_the_originals():
    from sklearn.datasets import load_digits

    ds = load_dataset("digits", test_fraction=0.3)
    original = load_digits().images.reshape(-1, 64) / 16.0
    ours = np.concatenate([ds.x_train, ds.x_test]).reshape(-1, 64).astype(np.float64)
    # same multiset of rows
    key = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
    np.testing.assert_allclose(key(ours), key(original), atol=1e-7)
    assert abs(len(ds.x_test) - 0.3 * 1797) <= 10


def test_unknown_dataset_and_option():
    with pytest.raises(DataError, match="Unknown dataset 'nope'.*digits.*cifar10"):
        load_dataset("nope")
    with pytest.raises(DataError, match="does not take the option"):
        load_dataset("digits", colour=True)
    with pytest.raises(DataError, match="test_fraction"):
        load_dataset("digits", test_fraction=1.5)
    assert set(DATASETS) == {
        "digits", "mnist5k", "synthetic", "mnist", "fashion_mnist", "emnist", "cifar10", "cifar100",
        "svhn_cropped", "synthetic_text", "imdb_reviews", "synthetic_lm", "leaf", "hf",
    }


# -------------------------------------------------------------------- tfds


@contextlib.contextmanager
def mocked_tfds(num_examples: int):
    """`tfds.testing.mock_data`, with its broken `__getitems__` repaired.

    tfds 4.9.10's mock assigns a ``functools.partial(_getitems, ...)`` to the
    ``__getitems__`` attribute of a MagicMock *instance*; MagicMock does not
    treat ``__getitems__`` as a magic method, so the partial is called without
    ``self`` and fails with "missing 1 required positional argument:
    'record_keys'" (``__getitem__`` works because MagicMock installs that one on
    the class). The ``policy`` argument does not change this. Replacing the
    module-level ``_getitems`` the mock binds with one that does not need
    ``self`` makes batched reads work; a real array_record source is not
    affected. USE_CODE makes the mock independent of metadata files.
    """
    import tensorflow_datasets as tfds
    from tensorflow_datasets.testing import mocking

    def getitems(*args, generator, serialized=False):
        assert not serialized
        keys = args[-1]
        return [generator[key] for key in keys]

    with mock.patch.object(mocking, "_getitems", getitems), tfds.testing.mock_data(
        num_examples=num_examples, policy=tfds.testing.MockPolicy.USE_CODE
    ):
        yield


def test_tfds_mock_getitems_is_broken_upstream():
    """Documents why `mocked_tfds` exists; if this starts failing, the fix can go."""
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
        source = tfds.data_source("mnist", split="train", download=False)
        assert source[0]["image"].shape == (28, 28, 1)
        with pytest.raises(TypeError, match="record_keys"):
            source.__getitems__([0, 1])


@pytest.mark.parametrize(
    "name, shape, classes",
    [("mnist", (28, 28, 1), 10), ("cifar10", (32, 32, 3), 10)],
)
def test_tfds_mocked(name, shape, classes, tmp_path):
    with mocked_tfds(num_examples=37):
        ds = load_dataset(name, data_dir=str(tmp_path))
    assert ds.name == name
    assert ds.num_classes == classes
    for x, y in ((ds.x_train, ds.y_train), (ds.x_test, ds.y_test)):
        assert x.shape == (37, *shape) and x.dtype == np.float32
        assert y.shape == (37,) and y.dtype == np.int32
        assert 0.0 <= x.min() and x.max() <= 1.0
        assert 0 <= y.min() and y.max() < classes
    # /255 scaling: values are multiples of 1/255 and not all tiny
    np.testing.assert_allclose(ds.x_train * 255, np.round(ds.x_train * 255), atol=1e-3)
    assert ds.x_train.max() > 0.5


def test_tfds_mocked_read_across_chunks(monkeypatch):
    from fedpartial._src.data import sources

    monkeypatch.setattr(sources, "_READ_CHUNK", 4)
    with mocked_tfds(num_examples=10):
        small = load_dataset("fashion_mnist")
    monkeypatch.setattr(sources, "_READ_CHUNK", 4096)
    with mocked_tfds(num_examples=10):
        big = load_dataset("fashion_mnist")
    np.testing.assert_array_equal(small.x_train, big.x_train)
    np.testing.assert_array_equal(small.y_test, big.y_test)


def test_tfds_mocked_emnist_defaults_to_byclass():
    with mocked_tfds(num_examples=5):
        ds = load_dataset("emnist")
        letters = load_dataset("emnist", config="letters")
    assert ds.name == "emnist" and ds.num_classes == 62
    assert letters.name == "emnist/letters" and letters.num_classes == 37
    assert ds.x_train.shape == (5, 28, 28, 1)


def test_tfds_mocked_svhn_and_cifar100():
    with mocked_tfds(num_examples=4):
        svhn = load_dataset("svhn_cropped")
        c100 = load_dataset("cifar100")
    assert svhn.num_classes == 10 and svhn.x_train.shape == (4, 32, 32, 3)
    assert c100.num_classes == 100 and c100.x_test.shape == (4, 32, 32, 3)


def test_tfds_bad_option_and_config():
    with pytest.raises(DataError, match="does not take the option"):
        load_dataset("mnist", colour=True)
    with mocked_tfds(num_examples=2), pytest.raises(DataError, match="emnist/nonsense"):
        load_dataset("emnist", config="nonsense")


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_missing_dataset_says_how_to_prepare(name, tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset(name, data_dir=str(tmp_path))
    message = str(info.value)
    assert repr(name) in message
    assert str(tmp_path) in message
    assert "not prepared" in message
    assert f"tfds.builder('{name}', file_format='array_record').download_and_prepare()" in message
    assert f"~/tensorflow_datasets/{name}" in message
    assert "--data-dir" in message
    assert "\n" not in message


# --------------------------------------------------------------- synthetic


def _label_tv_from_pooled(ds: ArrayDataset) -> float:
    """Mean total-variation distance between each client's label mix and the pooled one."""
    pooled = np.bincount(ds.y_train, minlength=ds.num_classes) / len(ds.y_train)
    dists = []
    for part in ds.natural_partition:
        own = np.bincount(ds.y_train[part], minlength=ds.num_classes) / len(part)
        dists.append(0.5 * np.abs(own - pooled).sum())
    return float(np.mean(dists))


def test_synthetic_shapes_and_partition():
    ds = make_synthetic(1.0, 1.0, 12, seed=0)
    assert ds.num_classes == 10
    assert ds.x_train.dtype == np.float32 and ds.x_train.shape[1] == 60
    assert ds.x_test.dtype == np.float32 and ds.x_test.shape[1] == 60
    assert ds.y_train.dtype == np.int32 and ds.y_train.max() < 10 and ds.y_train.min() >= 0
    assert len(ds.natural_partition) == 12 == len(ds.natural_test_partition)
    for parts, n in ((ds.natural_partition, len(ds.y_train)), (ds.natural_test_partition, len(ds.y_test))):
        joined = np.concatenate(parts)
        assert joined.dtype == np.int64
        np.testing.assert_array_equal(np.sort(joined), np.arange(n))  # each example exactly once
    for tr, te in zip(ds.natural_partition, ds.natural_test_partition):
        total = len(tr) + len(te)
        assert total >= 50  # min_samples
        assert len(tr) >= 1
        assert len(te) == round(0.2 * total) or abs(len(te) - 0.2 * total) <= 0.5


def test_synthetic_deterministic_and_seeded():
    a = make_synthetic(0.5, 0.5, 5, seed=7)
    b = make_synthetic(0.5, 0.5, 5, seed=7)
    c = make_synthetic(0.5, 0.5, 5, seed=8)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert a.x_train.shape != c.x_train.shape or not np.array_equal(a.x_train, c.x_train)


def test_synthetic_via_load_dataset_and_caps():
    ds = load_dataset("synthetic", seed=1, alpha=0.0, beta=0.0, num_clients=4, max_samples=60)
    assert ds.name == "synthetic(0,0)"
    sizes = [len(a) + len(b) for a, b in zip(ds.natural_partition, ds.natural_test_partition)]
    assert all(50 <= s <= 60 for s in sizes)
    with pytest.raises(DataError, match="does not take the option.*gamma.*accepts alpha, beta"):
        load_dataset("synthetic", gamma=1.0)


def test_synthetic_feature_covariance():
    ds = make_synthetic(0.0, 0.0, 1, seed=0, iid=True, min_samples=20000, max_samples=20000)
    var = ds.x_train.var(axis=0)
    expected = np.arange(1, 61) ** -1.2
    np.testing.assert_allclose(var, expected, rtol=0.1)
    np.testing.assert_allclose(ds.x_train.mean(axis=0), 0.0, atol=0.05)


def test_synthetic_iid_is_more_homogeneous_than_heterogeneous():
    for seed in range(3):
        iid = make_synthetic(0.0, 0.0, 20, seed=seed, iid=True)
        het = make_synthetic(1.0, 1.0, 20, seed=seed)
        assert _label_tv_from_pooled(iid) < 0.5 * _label_tv_from_pooled(het)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alpha=-0.1, beta=1.0, num_clients=3), "alpha=-0.1"),
        (dict(alpha=1.0, beta=-2, num_clients=3), "beta=-2"),
        (dict(alpha=1.0, beta=float("nan"), num_clients=3), "beta=nan"),
        (dict(alpha=1.0, beta=1.0, num_clients=0), "num_clients=0"),
        (dict(alpha=1.0, beta=1.0, num_clients=2, min_samples=0), "min_samples=0"),
        (dict(alpha=1.0, beta=1.0, num_clients=2, max_samples=3), "max_samples=3"),
    ],
)
def test_synthetic_validation(kwargs, match):
    with pytest.raises(DataError, match=match):
        make_synthetic(seed=0, **kwargs)


@pytest.mark.parametrize("cap", [None, 120])
def test_synthetic_expected_examples_is_what_the_generator_draws(cap):
    """The up-front count (RunConfig refuses a population too large to generate with it) is within 1% of the
    mean over 1,000 draws of 3,000 clients' sizes, with and without a --max-samples cap (one draw of 3,000 varies
    by ±15% uncapped: the sizes' lognormal has sigma 2); and those sizes are what the generator really draws."""
    from fedpartial._src.data.synthetic import client_sizes, expected_examples

    def sizes(seed, n):  # the generator's shared stream: the seed's first spawned child (whatever n)
        return client_sizes(np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0]), n,
                            min_samples=50, max_samples=cap)

    mean = np.mean([sizes(seed, 3000).sum() for seed in range(1000)])
    assert expected_examples(3000, min_samples=50, max_samples=cap) == pytest.approx(mean, rel=0.01)
    d = make_synthetic(1.0, 1.0, 40, seed=7, min_samples=50, max_samples=cap)
    assert len(d.y_train) + len(d.y_test) == sizes(7, 40).sum()
    np.testing.assert_array_equal([len(p) + len(q) for p, q in zip(d.natural_partition, d.natural_test_partition)],
                                  sizes(7, 40))
