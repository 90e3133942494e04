"""Hugging Face datasets (``save_to_disk`` folders and parquet folders, written here with the datasets package)
read as clients by a column's values. Skipped where the optional datasets package is not installed."""

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from fedpartial._src.data.arrays import DataError  # noqa: E402
from fedpartial._src.data.hf import load_hf  # noqa: E402
from fedpartial._src.data.leaf import LEAF_CHARACTERS  # noqa: E402
from fedpartial._src.data.language import next_token_view  # noqa: E402

WRITERS = np.random.default_rng(1).permutation(["w1"] * 11 + ["w2"] * 2 + ["w3"] * 7).tolist()


def image_dataset():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (len(WRITERS), 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 62, len(WRITERS))
    features = datasets.Features({"writer_id": datasets.Value("string"), "image": datasets.Image(),
                                  "character": datasets.ClassLabel(num_classes=62)})
    ds = datasets.Dataset.from_dict({"writer_id": WRITERS, "image": list(images), "character": labels.tolist()},
                                    features=features)
    return ds, images, labels


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_saved")
    ds, images, labels = image_dataset()
    ds.save_to_disk(str(folder))
    return folder, images, labels


def test_saved_images_one_writer_a_client_with_a_seeded_90_10_split(saved):
    folder, images, labels = saved
    ds = load_hf(folder, client_column="writer_id", seed=3)
    assert ds.client_names == ("w1", "w2", "w3") and ds.num_classes == 62 and ds.usual_model == "femnist_cnn"
    # round(0.9 n), at least one, trains (11 -> 10, 2 -> 2, 7 -> 6); the rest is the client's test data
    assert [len(p) for p in ds.natural_partition] == [10, 2, 6]
    assert [len(p) for p in ds.natural_test_partition] == [1, 0, 1]
    assert ds.x_train.shape == (18, 28, 28, 1) and ds.x_test.shape == (2, 28, 28, 1)
    for k, w in enumerate(ds.client_names):  # a client's train and test rows are its writer's images, /255
        mine = [i for i, v in enumerate(WRITERS) if v == w]
        got = np.concatenate([ds.x_train[ds.natural_partition[k]], ds.x_test[ds.natural_test_partition[k]]])
        want = images[mine].astype(np.float32)[..., None] / 255
        assert sorted(map(bytes, got)) == sorted(map(bytes, want))
        got_y = np.concatenate([ds.y_train[ds.natural_partition[k]], ds.y_test[ds.natural_test_partition[k]]])
        assert sorted(got_y) == sorted(labels[mine])
    assert load_hf(folder, client_column="writer_id", seed=3).x_test.tobytes() == ds.x_test.tobytes()
    assert load_hf(folder, client_column="writer_id", seed=4).x_test.tobytes() != ds.x_test.tobytes()
    assert ds.x_train.shape[0] + ds.x_test.shape[0] == len(WRITERS)


def test_parquet_folder_and_a_test_split_of_characters(tmp_path):
    train = datasets.Dataset.from_dict({"character_id": ["b", "a", "b"], "x": ["ab}", "Zq~", "abc"],
                                        "y": ["c", "~", "d"]})
    test = datasets.Dataset.from_dict({"character_id": ["a", "c"], "x": ["xyz", "aaa"], "y": ["a", "b"]})
    (tmp_path / "data").mkdir()
    train.to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    test.to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    ds = load_hf(tmp_path, client_column="character_id")
    idx = LEAF_CHARACTERS.index
    assert ds.client_names == ("a", "b") and ds.num_classes == 81 and ds.usual_model == "shakespeare_lstm"
    np.testing.assert_array_equal(ds.x_train, [[idx("Z") + 1, idx("q") + 1, 81],
                                               [idx("a") + 1, idx("b") + 1, idx("}") + 1],
                                               [idx("a") + 1, idx("b") + 1, idx("c") + 1]])
    np.testing.assert_array_equal(ds.y_train, [80, idx("c"), idx("d")])
    # the labels are the next characters, so a language model reads it per position as LEAF's Shakespeare
    assert ds.label_token_offset == 1
    np.testing.assert_array_equal(next_token_view(ds).y_train, [[idx("q") + 1, 81, 81],
                                                                [idx("b") + 1, idx("}") + 1, idx("c") + 1],
                                                                [idx("b") + 1, idx("c") + 1, idx("d") + 1]])
    # a's test row is a's; c is in no training row, so its row joins the test set without a client
    assert [len(p) for p in ds.natural_test_partition] == [1, 0] and len(ds.y_test) == 2


def test_words_and_named_labels(tmp_path):
    train = datasets.Dataset.from_dict({"user": ["u", "u", "v"], "text": ["Good day", "bad day", "good"],
                                        "sentiment": ["pos", "neg", "pos"]})
    datasets.DatasetDict({"train": train, "test": train.select([2])}).save_to_disk(str(tmp_path))
    ds = load_hf(tmp_path, client_column="user")
    assert ds.num_classes == 2 and ds.usual_model == "sent140_lstm" and ds.label_token_offset is None
    np.testing.assert_array_equal(ds.y_train, [1, 0, 1])  # neg 0, pos 1 (sorted)
    np.testing.assert_array_equal(ds.x_train[:, :3], [[3, 2, 0], [4, 2, 0], [3, 0, 0]])  # day 2, good 3, bad 4


def test_bad_columns_are_one_sentence(saved):
    folder, _, _ = saved
    with pytest.raises(DataError, match=r"^--client-column 'author' is not a column of .*; its columns are "
                                        r"writer_id, image, character\.$"):
        load_hf(folder, client_column="author")
    with pytest.raises(DataError, match=r"^--label 'digit' is not a column of "):
        load_hf(folder, client_column="writer_id", label="digit")
    with pytest.raises(DataError, match=r"^--clients 4 asks for more clients than"):
        load_hf(folder, client_column="writer_id", num_clients=4)
    assert load_hf(folder, client_column="writer_id", min_examples=4).client_names == ("w1", "w3")
    with pytest.raises(DataError, match=r"^--data-dir '.*nowhere' is not a folder"):
        load_hf(str(folder) + "/nowhere", client_column="writer_id")
