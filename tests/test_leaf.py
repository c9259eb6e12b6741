"""FEMNIST and Shakespeare with their own clients: LEAF's JSON layout read from fixture files written here,
Flower's Hugging Face copies prepared through a stand-in for `datasets` (no network: `no_network`), the
natural partition, and runs of both through the command line."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from fedjax_sparse import data
from fedjax_sparse.data import leaf, tfds_build


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDJAX_SPARSE_CACHE", str(tmp_path / "cache"))


def pixels(seed: int, n: int) -> list:
    """n FEMNIST images as LEAF stores them: 784 values k / 255 in [0, 1]."""
    return (np.random.default_rng(seed).integers(0, 256, (n, 784)) / 255.0).tolist()


# Three writers: f0 (4 train, 1 test), f1 (3 train, 2 test), f2 (1 train, 1 test); f0 and f1 spread over two
# training files, as LEAF writes a data set in several.
FEMNIST = {"train": [{"f1": (pixels(1, 3), [3, 61, 10]), "f0": (pixels(0, 2), [0, 1])},
                     {"f0": (pixels(2, 2), [2, 3]), "f2": (pixels(3, 1), [35])}],
           "test": [{"f0": (pixels(4, 1), [36]), "f1": (pixels(5, 2), [9, 9]), "f2": (pixels(6, 1), [0])}]}
LINE = "To be, or not to be: that is the question: Whether 'tis nobler in the mind to su"
SHAKESPEARE = {"train": [{"HAMLET": ([LINE, LINE[1:] + "f"], ["f", "e"]), "OPHELIA": ([LINE[::-1]] * 2, ["T", "~"])}],
               "test": [{"HAMLET": ([LINE[2:] + "fe"], ["r"]), "OPHELIA": ([LINE.upper()], ["!"])}]}


def write_leaf(root, files: dict):
    for split, contents in files.items():
        (root / split).mkdir(parents=True)
        for i, users in enumerate(contents):
            body = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
                    "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
            (root / split / f"part_{i}.json").write_text(json.dumps(body))
    return root


def test_leaf_femnist_json_is_read_writer_by_writer(tmp_path):
    ds = data.load_dataset(f"leaf:{write_leaf(tmp_path / 'femnist', FEMNIST)}")
    assert ds.client_names == ("f0", "f1", "f2") and ds.num_classes == 62 and ds.input_shape == (28, 28, 1)
    assert ds.class_names[10] == "A" and ds.class_names[36] == "a"
    # training examples file by file, user by user as first met: f1's, f0's (file 0), then f0's, f2's (file 1)
    np.testing.assert_array_equal(ds.train_clients, [1, 1, 1, 0, 0, 0, 0, 2])
    np.testing.assert_array_equal(ds.y_train, [3, 61, 10, 0, 1, 2, 3, 35])
    np.testing.assert_array_equal(ds.x_train[0].ravel(), np.round(np.asarray(pixels(1, 3)[0]) * 255))
    np.testing.assert_array_equal(ds.test_clients, [0, 1, 1, 2])
    assert ds.x_train.dtype == np.uint8 and ds.mean[0] == pytest.approx(ds.x_train.mean() / 255)
    # the natural partition: writers with >= 2 training examples and a test example, with their own tests
    train, test = data.natural_partition(ds.train_clients, ds.test_clients, 2, seed=0)
    assert [t.tolist() for t in train] == [[3, 4, 5, 6], [0, 1, 2]]
    assert [t.tolist() for t in test] == [[0], [1, 2]]
    one, _ = data.natural_partition(ds.train_clients, ds.test_clients, 1, seed=0)
    assert one[0].tolist() in ([3, 4, 5, 6], [0, 1, 2])
    with pytest.raises(ValueError, match=r"num_clients=3 exceeds the 2 clients .* min_examples=2"):
        data.natural_partition(ds.train_clients, ds.test_clients, 3, seed=0)
    # read again: from the cache of the parsed arrays, not the files
    (tmp_path / "femnist" / "train" / "part_0.json").touch()
    again = data.load_dataset(f"leaf:{tmp_path / 'femnist'}")
    np.testing.assert_array_equal(again.x_train, ds.x_train)


def test_leaf_shakespeare_json_becomes_character_indices(tmp_path):
    ds = data.load_dataset(f"leaf:{write_leaf(tmp_path / 'shakespeare', SHAKESPEARE)}")
    assert ds.num_classes == 80 and ds.input_shape == (80,) and ds.x_train.dtype == np.int32
    assert ds.client_names == ("HAMLET", "OPHELIA")
    # LEAF's alphabet: '\n' 0, ' ' 1, 'A' 25, 'T' 44, 'a' 53, 'e' 57, 'f' 58; '~' is not in it: a space
    assert ds.x_train[0, :3].tolist() == [44, 67, 1]  # "To "
    assert ds.y_train.tolist() == [58, 57, 44, 1]
    assert ds.y_test.tolist() == [70, 2]  # 'r', '!'
    assert "".join(leaf.VOCABULARY[i] for i in ds.x_test[0]) == LINE[2:] + "fe"


def test_a_bad_leaf_folder_is_one_line(tmp_path, capsys):
    from fedjax_sparse.run.cli import main

    (tmp_path / "bad" / "train").mkdir(parents=True)
    assert main(["run", "--dataset", f"leaf:{tmp_path / 'bad'}", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no LEAF files in" in err and "{train,test}/*.json" in err


# ---------------------------------------------------------------------------------------------
# Flower's Hugging Face copies, through a stand-in for the `datasets` package


class Table:
    """What `datasets.load_dataset(..., split='train')` gives that the preparation reads: `.iter`."""

    def __init__(self, columns: dict):
        self.columns = columns

    def iter(self, batch_size):
        n = len(next(iter(self.columns.values())))
        for start in range(0, n, batch_size):
            yield {k: v[start:start + batch_size] for k, v in self.columns.items()}


@pytest.fixture
def hub(monkeypatch):
    """A `datasets` module whose load_dataset serves small FEMNIST and Shakespeare tables (and counts its
    calls); the Hugging Face host counts as reachable."""
    from PIL import Image

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (13, 28, 28), dtype=np.uint8)
    tables = {
        # writer a: 10 examples, b: 2, c: 1 (dropped: LEAF splits users of 2 or more)
        "flwrlabs/femnist": Table({"writer_id": ["a"] * 10 + ["b"] * 2 + ["c"],
                                   "image": [Image.fromarray(im) for im in images],
                                   "character": list(range(13)), "hsf_id": [0] * 13}),
        # role R: 5 windows in order (its last is held out), role Q: 2
        "flwrlabs/shakespeare": Table({"character_id": ["R"] * 5 + ["Q"] * 2,
                                       "x": [LINE[i:] + LINE[:i] for i in range(7)], "y": list("abcdefg")}),
    }
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return tables[name]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(tfds_build, "unreachable_hosts", lambda urls, timeout=10.0: [])
    return calls, images


def test_femnist_is_prepared_once_from_the_hub_and_split_per_writer(tmp_path, no_network, hub):
    calls, images = hub
    ds = data.load_dataset("femnist", data_dir=tmp_path)
    assert calls == [("flwrlabs/femnist", "train")]
    assert (tmp_path / "leaf" / "femnist" / "meta.json").exists()
    assert ds.client_names == ("a", "b", "c")
    # a: int(0.9 x 10) = 9 train, 1 test; b: 1 and 1; c (one example) in neither
    assert np.bincount(ds.train_clients).tolist() == [9, 1] and np.bincount(ds.test_clients).tolist() == [1, 1]
    held = sorted(ds.y_train.tolist() + ds.y_test.tolist())
    assert held == list(range(12))
    for x, y in zip(ds.x_train, ds.y_train):  # each image kept with its label
        np.testing.assert_array_equal(x[..., 0], images[y])
    again = data.load_dataset("femnist", data_dir=tmp_path, download=False)
    assert len(calls) == 1
    np.testing.assert_array_equal(again.x_test, ds.x_test)


def test_shakespeare_holds_out_each_roles_last_windows(tmp_path, no_network, hub):
    ds = data.load_dataset("shakespeare", data_dir=tmp_path)
    assert ds.client_names == ("Q", "R")
    decoded = lambda ys: "".join(leaf.VOCABULARY[i] for i in ys)  # noqa: E731
    assert decoded(ds.y_train) == "abcdf" and decoded(ds.y_test) == "eg"  # R: a-d | e, Q: f | g, in order
    np.testing.assert_array_equal(ds.train_clients, [1, 1, 1, 1, 0])


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_without_data_the_extra_or_a_network_the_hub_copies_say_so_in_one_line(tmp_path, no_network, hub,
                                                                               monkeypatch):
    calls, _ = hub
    with pytest.raises(data.DataError) as err:
        data.load_dataset("femnist", data_dir=tmp_path, download=False)
    assert "femnist is not prepared under" in one_line(err) and "--no-download" in one_line(err)
    monkeypatch.setattr(tfds_build, "unreachable_hosts", lambda urls, timeout=10.0: ["huggingface.co"])
    with pytest.raises(data.DataError) as err:
        data.load_dataset("shakespeare", data_dir=tmp_path)
    message = one_line(err)
    assert "cannot reach huggingface.co" in message
    assert "where there is a network" in message and "leaf:PATH" in message
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(data.DataError) as err:
        data.load_dataset("shakespeare", data_dir=tmp_path)
    assert 'needs the datasets package (pip install "fedjax-sparse[leaf]")' in one_line(err)
    assert calls == []


# ---------------------------------------------------------------------------------------------
# Through the command line


def test_natural_clients_and_char_lstm_from_the_command_line(tmp_path):
    """A LEAF Shakespeare folder, its roles the clients (the default partition for it), LEAF's model; and
    a FEMNIST folder whose writers are the clients of a FedAvg run (each scored on its own test examples)."""
    from fedjax_sparse.run.cli import main

    root = write_leaf(tmp_path / "shakespeare", SHAKESPEARE)
    common = ["--num-clients", "2", "--clients-per-round", "2", "--rounds", "1", "--local-epochs", "1",
              "--no-progress", "--no-tensorboard"]
    assert main(["run", "--dataset", f"leaf:{root}", "--model", "char_lstm", "--min-examples", "1", *common,
                 "--out", str(tmp_path / "s")]) == 0
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summary["num_train_examples"] == 4 and summary["model"] == "char_lstm"
    assert [c["num_examples"] for c in json.loads((tmp_path / "s" / "partition.json").read_text())] == [2, 2]
    root = write_leaf(tmp_path / "femnist", FEMNIST)
    assert main(["run", "--dataset", f"leaf:{root}", "--partition", "natural", *common,
                 "--out", str(tmp_path / "f")]) == 0
    clients = json.loads((tmp_path / "f" / "partition.json").read_text())
    assert [c["num_examples"] for c in clients] == [4, 3]  # writers f0 and f1; f2 has one training example
    assert main(["run", "--dataset", f"leaf:{root}", "--model", "char_lstm", *common,
                 "--out", str(tmp_path / "x")]) == 2
