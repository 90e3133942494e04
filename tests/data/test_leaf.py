"""LEAF's JSON files read as clients: exact per-user counts and rows (ragged storage equal to a dense reference),
LEAF's own split per user, the vocabularies, the choice of clients, and one sentence for every bad file."""

import dataclasses
import json
import os

import numpy as np
import pytest

from fedpartial._src.data import text
from fedpartial._src.data.arrays import ArrayDataset, DataError
from fedpartial._src.data.language import next_token_view
from fedpartial._src.data.leaf import LEAF_CHARACTERS, SENT140_SEQ_LEN, load_leaf
from fedpartial._src.data.sources import load_dataset
from tests.data.natural_files import leaf_folder, write_leaf

SIZES = {"f0003_11": (5, 2), "f0001_07": (3, 1), "f0009_42": (7, 0), "f0002_03": (1, 1), "f0005_05": (4, 2)}


@pytest.fixture(scope="module")
def femnist(tmp_path_factory):
    folder = tmp_path_factory.mktemp("femnist")
    return folder, leaf_folder(folder, "femnist", SIZES)


def test_femnist_users_are_clients_in_file_order_with_leafs_split(femnist):
    folder, written = femnist
    ds = load_leaf(folder)
    assert ds.name == "femnist" and ds.num_classes == 62 and ds.usual_model == "femnist_cnn"
    assert ds.label_token_offset is None  # its labels are no tokens: no language model's view
    assert ds.client_names == tuple(SIZES)  # files in name order, users in file order
    assert [len(p) for p in ds.natural_partition] == [n for n, _ in SIZES.values()]
    assert [len(p) for p in ds.natural_test_partition] == [n for _, n in SIZES.values()]
    assert ds.x_train.shape == (20, 28, 28, 1) and ds.x_train.dtype == np.float32
    for k, user in enumerate(SIZES):  # the ragged rows equal each user's examples as the file holds them
        x, y = written["train"][user]
        dense = np.asarray(x, np.float32).reshape(-1, 28, 28, 1)
        np.testing.assert_array_equal(ds.x_train[ds.natural_partition[k]], dense)
        np.testing.assert_array_equal(ds.y_train[ds.natural_partition[k]], y)
        if user in written["test"]:
            np.testing.assert_array_equal(ds.x_test[ds.natural_test_partition[k]],
                                          np.asarray(written["test"][user][0], np.float32).reshape(-1, 28, 28, 1))
    assert ds.x_test.shape[0] == 6
    # LEAF's pixels as they are (the background light, the ink dark): the same values as written, not inverted
    written_pixels = np.concatenate([np.asarray(x, np.float32) for x, _ in written["train"].values()])
    assert ds.x_train.max() == written_pixels.max() and ds.x_train.min() == written_pixels.min() < 0.5


def test_clients_are_chosen_deterministically_for_a_seed(femnist):
    folder, _ = femnist
    a = load_leaf(folder, max_clients=3, seed=4)
    assert a.client_names == load_leaf(folder, max_clients=3, seed=4).client_names
    assert len(a.client_names) == 3 and list(a.client_names) == [u for u in SIZES if u in a.client_names]
    drawn = {load_leaf(folder, max_clients=3, seed=s).client_names for s in range(6)}
    assert len(drawn) > 1
    assert load_leaf(folder, min_examples=4).client_names == ("f0003_11", "f0009_42", "f0005_05")
    assert len(load_leaf(folder, num_clients=2, seed=1).client_names) == 2
    # only the chosen clients' test examples are the test set
    b = load_leaf(folder, min_examples=4)
    assert len(b.y_test) == 4 and [len(p) for p in b.natural_test_partition] == [2, 0, 2]
    with pytest.raises(DataError, match=r"^--clients 6 asks for more clients than .* has users \(5\); leave "
                                        r"--clients out to use all of them\.$"):
        load_leaf(folder, num_clients=6)


def test_test_users_in_no_training_file_join_the_test_set(tmp_path):
    leaf_folder(tmp_path, "femnist", {"a": (2, 0), "b": (3, 0)})
    write_leaf(tmp_path, "test", [{"held": ([[0.5] * 784] * 3, [1, 2, 3])}])
    ds = load_leaf(tmp_path)
    assert ds.client_names == ("a", "b") and len(ds.y_test) == 3
    assert [len(p) for p in ds.natural_test_partition] == [0, 0]


def test_shakespeare_uses_leafs_80_characters(tmp_path):
    assert len(LEAF_CHARACTERS) == 80 and len(set(LEAF_CHARACTERS)) == 80
    write_leaf(tmp_path, "train", [{"HAMLET": (["ab}\n", "Z~ a"], [" ", "~"])}])
    write_leaf(tmp_path, "test", [{"HAMLET": (["abc!"], ["d"])}])
    ds = load_leaf(tmp_path)
    ids = {c: LEAF_CHARACTERS.index(c) for c in "ab}\n Z!cd"}
    assert ds.name == "shakespeare" and ds.num_classes == 81 and ds.usual_model == "shakespeare_lstm"
    # token ids: 1 + the character's place in LEAF's vocabulary, 81 any other character; classes without the 1
    np.testing.assert_array_equal(ds.x_train, [[ids["a"] + 1, ids["b"] + 1, ids["}"] + 1, ids["\n"] + 1],
                                               [ids["Z"] + 1, 81, ids[" "] + 1, ids["a"] + 1]])
    np.testing.assert_array_equal(ds.y_train, [ids[" "], 80])
    np.testing.assert_array_equal(ds.y_test, [ids["d"]])


def test_shakespeare_per_position_view_predicts_every_next_character(tmp_path):
    write_leaf(tmp_path, "train", [{"HAMLET": (["ab}\n", "Z~ a"], [" ", "~"])}])
    write_leaf(tmp_path, "test", [{"HAMLET": (["abc!"], ["d"])}])
    ds = load_leaf(tmp_path)
    assert ds.label_token_offset == 1
    view = next_token_view(ds)
    tok = {c: LEAF_CHARACTERS.index(c) + 1 for c in "ab}\n Z!cd"}  # token ids; 81 any other character
    # position t's label is the token at t + 1; the last position's is the example's label, as a token id
    np.testing.assert_array_equal(view.y_train, [[tok["b"], tok["}"], tok["\n"], tok[" "]],
                                                 [81, tok[" "], tok["a"], 81]])
    np.testing.assert_array_equal(view.y_test, [[tok["b"], tok["c"], tok["!"], tok["d"]]])
    np.testing.assert_array_equal(view.x_train, ds.x_train)
    # one vocabulary for inputs and outputs: 82 token ids (padding, LEAF's 80 characters, other)
    assert view.num_classes == 82 and view.label_token_offset is None and view.usual_model == "transformer_lm"
    np.testing.assert_array_equal(view.group_train, [LEAF_CHARACTERS.index(" "), 80])  # the next characters
    assert [list(p) for p in view.natural_partition] == [[0, 1]] and view.client_names == ("HAMLET",)


def test_the_per_position_view_ignores_padding_and_needs_next_token_labels():
    x = np.array([[5, 6, 7, 0, 0], [9, 0, 0, 0, 0], [0, 0, 0, 0, 0]], np.int32)
    data = ArrayDataset(name="chars", x_train=x, y_train=np.array([3, 4, 2], np.int32), x_test=x[:1],
                        y_test=np.array([8], np.int32), num_classes=10, label_token_offset=1)
    view = next_token_view(data)
    # the label after the last real token (y + 1) sits at that token; padding positions are ignored (-1)
    np.testing.assert_array_equal(view.y_train, [[6, 7, 4, -1, -1], [5, -1, -1, -1, -1], [-1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(view.y_test, [[6, 7, 9, -1, -1]])
    assert view.num_classes == 11
    with pytest.raises(DataError, match=r"^chars's labels are not the tokens that follow its examples, so it has "
                                        r"no per-position view; .*\.$"):
        next_token_view(dataclasses.replace(data, label_token_offset=None))


def test_sent140_vocabulary_comes_from_the_training_tweets(tmp_path):
    def tweet(words):
        return ["1", "date", "NO_QUERY", "user", words]
    write_leaf(tmp_path, "train", [{"u1": ([tweet("Good day, good!"), tweet("bad day")], [1, 0])},
                                   {"u2": ([tweet("so good")], [1])}])
    write_leaf(tmp_path, "test", [{"u1": ([tweet("good night")], [1])}])
    ds = load_leaf(tmp_path)
    assert ds.name == "sent140" and ds.num_classes == 2 and ds.usual_model == "sent140_lstm"
    # counts: good 3, day 2, then ',', '!', bad, so once each (ties alphabetical); ids from 2
    vocab = {"good": 2, "day": 3, "!": 4, ",": 5, "bad": 6, "so": 7}
    row = lambda words: [vocab.get(w, text.UNK) for w in words] + [0] * (SENT140_SEQ_LEN - len(words))
    np.testing.assert_array_equal(ds.x_train, [row(["good", "day", ",", "good", "!"]), row(["bad", "day"]),
                                               row(["so", "good"])])
    np.testing.assert_array_equal(ds.x_test, [row(["good", "night"])])
    np.testing.assert_array_equal(ds.y_train, [1, 0, 1])


def test_load_dataset_names_leaf_and_needs_a_folder(femnist):
    folder, _ = femnist
    assert load_dataset("leaf", data_dir=str(folder), max_clients=2).client_names is not None
    with pytest.raises(DataError, match="give data_dir"):
        load_dataset("leaf")


def _json(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.mark.parametrize("case, message", [
    ("no_test", r"^--data-dir '.*' has no test/ folder; LEAF's data folder holds train/ and test/ folders"),
    ("lengths", r"^user 'u' of .*a\.json has 2 x but 1 y; every example needs both\.$"),
    ("count", r"^user 'u' of .*a\.json has 2 examples but num_samples says 3\.$"),
    ("empty_user", r"^user 'v' of the LEAF files in .* has no training examples, so it cannot be a client; leave "
                   r"such users out with --min-examples 1\.$"),
    ("not_json", r"^LEAF file .*a\.json cannot be read as JSON"),
    ("keys", r"^LEAF file .*a\.json is not in LEAF's format: it needs the keys users, num_samples and user_data\.$"),
    ("twice", r"^user 'u' appears in both .*a\.json and .*b\.json; each user belongs to one file of a split\.$"),
    ("unknown", r"^the examples of .*a\.json are not FEMNIST's 784 pixels, Shakespeare's strings or Sent140's tweet "
                r"fields; give --leaf-task"),
    ("label", r"^user 'u' of .*a\.json has a label outside FEMNIST's classes 0\.\.61\.$"),
])
def test_bad_files_are_one_sentence(tmp_path, case, message):
    train, test = tmp_path / "train", tmp_path / "test"
    good = {"users": ["u"], "num_samples": [2], "user_data": {"u": {"x": [[0.0] * 784] * 2, "y": [1, 2]}}}
    if case != "no_test":
        _json(str(test / "a.json"), good)
    body = {
        "no_test": good,
        "lengths": {**good, "user_data": {"u": {"x": [[0.0] * 784] * 2, "y": [1]}}},
        "count": {**good, "num_samples": [3]},
        "empty_user": {"users": ["u", "v"], "num_samples": [2, 0],
                       "user_data": {"u": good["user_data"]["u"], "v": {"x": [], "y": []}}},
        "keys": {"users": ["u"]},
        "twice": good,
        "unknown": {**good, "user_data": {"u": {"x": [[1, 2], [3, 4]], "y": [0, 1]}}},
        "label": {**good, "user_data": {"u": {"x": [[0.0] * 784] * 2, "y": [1, 62]}}},
    }.get(case)
    if case == "not_json":
        os.makedirs(train)
        (train / "a.json").write_text("{not json")
    else:
        _json(str(train / "a.json"), body)
    if case == "twice":
        _json(str(train / "b.json"), good)
    with pytest.raises(DataError, match=message):
        load_leaf(tmp_path)


def test_a_task_given_is_checked(femnist):
    folder, _ = femnist
    with pytest.raises(DataError, match=r"^--leaf-task 'celeba' is unknown; choose one of femnist, shakespeare, "
                                        r"sent140\.$"):
        load_leaf(folder, task="celeba")
    with pytest.raises(DataError, match=r"has an x that is not a string of"):
        load_leaf(folder, task="shakespeare")
