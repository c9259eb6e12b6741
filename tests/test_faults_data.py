"""Issue 36, bad data and config files (items 8, 9, 11): a LEAF folder is checked while read, a generated
population's overflow is named as the data's, and a config file's repeated keys, quoted numbers and alias
bombs are refused -- each in one line naming the file or value, within seconds. Issue 55 (item 3): the
converter refuses a folder holding files it did not write."""

import json
import os
import signal

import numpy as np
import pytest

from fedjax_sparse.data.mapped import WRITING, read_manifest
from fedjax_sparse.data.synthetic import Synthetic
from fedjax_sparse.run.cli import main
from test_faults import TINY, cli, one_line


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDJAX_SPARSE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def deadline():
    """Ends a test that blocks (reading a FIFO) with an error after 60 s, rather than hanging the suite."""
    def expired(signum, frame):
        raise TimeoutError("blocked for 60 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def pixels(n, seed=0):
    return (np.random.default_rng(seed).integers(0, 256, (n, 784)) / 255.0).tolist()


def write_split(folder, users):
    folder.mkdir(parents=True, exist_ok=True)
    body = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
    (folder / "a.json").write_text(json.dumps(body))  # NaN is written as JSON's NaN, which json reads back


def leaf_folder(root, change):
    """Four FEMNIST writers of 6 training and 2 test examples and one of none (valid, as in LEAF's files);
    `change(train, test)` spoils them."""
    train = {f"w{i}": (pixels(6, i), [i] * 6) for i in range(4)} | {"w4": ([], [])}
    test = {f"w{i}": (pixels(2, 10 + i), [i] * 2) for i in range(4)} | {"w4": ([], [])}
    change(train, test)
    write_split(root / "train", train)
    write_split(root / "test", test)
    return root


def _set(split, user, x=None, y=None, row=None, value=None):
    def change(train, test):
        users = train if split == "train" else test
        xs, ys = users[user]
        if row is not None:
            xs[row] = value
        users[user] = (xs if x is None else x, ys if y is None else y)
    return change


def _nan_pixel(train, test):
    train["w2"][0][3][5] = float("nan")


BAD_LEAF = {
    "empty x": (lambda train, test: train.update({u: ([], []) for u in train}), "train", None, None,
                "no train examples"),
    "NaN pixel": (_nan_pixel, "train", "w2", "x", "example 3, pixel 5 is nan"),
    "label 3.7": (_set("train", "w1", y=[1, 1, 3.7, 1, 1, 1]), "train", "w1", "y", "example 2's label is 3.7"),
    "700 values": (_set("train", "w3", row=4, value=[0.5] * 700), "train", "w3", "x",
                   "example 4 is a list of 700 values, not a list of 784 pixel values"),
    "strings in test": (_set("test", "w0", x=["a" * 80] * 2, y=["b"] * 2), "test", "w0", "x",
                        "example 0 is a string of 80 characters"),
    "string labels": (_set("train", "w0", y=["A"] * 6), "train", "w0", "y",
                      "example 0's label is a string of 1 character"),
}


@pytest.mark.parametrize("case", list(BAD_LEAF))
def test_36_8_leaf_folders_are_checked_while_read(tmp_path, capsys, case):
    """The review: every training user with "x": [] gave a StopIteration traceback; NaN pixels became 0 and a
    label of 3.7 became 3, silently; a 700-value row, strings in the wrong split and string labels gave a line
    naming no file or user. Now each is one line naming the file, the user and the field."""
    change, split, user, field, words = BAD_LEAF[case]
    root = leaf_folder(tmp_path / "leaf", change)
    code, err = cli(capsys, "--dataset", f"leaf:{root}", "--model", "mlp", *TINY, "--rounds", "1",
                    "--out", str(tmp_path / "run"))
    assert code == 2
    if user is None:
        one_line(err, f"{root / split}", words)
    else:
        one_line(err, f"LEAF file {root / split / 'a.json'}, user \"{user}\", field {field}: {words}")


def test_36_8_a_fifo_among_leaf_files_is_refused_not_read(tmp_path, capsys, deadline):
    """The review: a FIFO named train/a.json hung the run (its contents were read for the cache key)."""
    root = leaf_folder(tmp_path / "leaf", lambda train, test: None)
    (root / "train" / "a.json").unlink()
    os.mkfifo(root / "train" / "a.json")
    code, err = cli(capsys, "--dataset", f"leaf:{root}", "--model", "mlp", *TINY, "--rounds", "1",
                    "--out", str(tmp_path / "run"))
    assert code == 2
    one_line(err, f"LEAF file {root / 'train' / 'a.json'} is a FIFO, not a regular file")


def test_36_9_a_generated_population_that_overflows_is_named_not_blamed_on_the_learning_rate(tmp_path, capsys):
    """The review: synthetic:1e308,1e308 ran and ended 'the training loss is nan; the run diverged (try a
    smaller --lr ...)'. Its features are not finite in float32 (beta 1e308), and with alpha 1e308 alone the
    scores that pick the labels overflow float64: every label an argmax of NaN."""
    code, err = cli(capsys, "--dataset", "synthetic:1e308,1e308", "--model", "mlp", "--num-clients", "4",
                    "--clients-per-round", "2", "--local-epochs", "1", "--rounds", "1", "--no-progress",
                    "--no-tensorboard", "--out", str(tmp_path / "run"))
    assert code == 2
    one_line(err, "synthetic:1e+308,1e+308: client ", "features reach |x| = ", "alpha = 1e+308, beta = 1e+308")
    assert "--lr" not in err
    with pytest.raises(ValueError, match=r"class scores .* overflow float64 \(alpha = 1e\+308, beta = 0 "):
        Synthetic(1e308, 0.0, 0, 3).examples(0, "train")
    x, y = Synthetic(1.0, 1.0, 0, 3).examples(0, "train")  # the paper's values pass
    assert np.isfinite(x).all() and y.dtype == np.int32


# Seven nested aliases under `capacities:`: 343 bytes that expand to 9^7 (4.8 million) values.
ALIAS_BOMB = "capacities:\n  - - &a [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]\n" + "".join(
    f"    - &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdef", "bcdefg"))


@pytest.mark.parametrize("name,text,words", [
    ("bomb.yaml", ALIAS_BOMB, "key 'capacities': more than 10,000 values (YAML's aliases written out)"),
    ("twice.yaml", "rounds: 2\nrounds: 3\n", "key 'rounds' is given twice (lines 1 and 2); give it once"),
    ("twice.json", '{"rounds": 2, "lr": 0.1, "rounds": 3}', "key 'rounds' is given twice; give it once"),
    ("spelled.yaml", "num-clients: 4\nnum_clients: 5\n",
     "keys 'num-clients' and 'num_clients' both set --num-clients; give it once"),
    ("quoted.toml", 'rounds = "6"\n', "key 'rounds': --rounds: '6' is text, not a number; write 6 without quotes"),
    ("quoted.json", '{"lr": "1e-3"}', "key 'lr': --lr: '1e-3' is text, not a number; write 1e-3 without quotes"),
])
def test_36_11_config_files_refuse_repeated_keys_quoted_numbers_and_alias_bombs(tmp_path, capsys, name, text,
                                                                               words):
    """The review: a 340-byte YAML of nested aliases under `capacities:` gave a 25 MB error line (one level
    deeper exhausted memory); `rounds` twice, `num-clients` beside `num_clients` and TOML's `rounds = "6"`
    were taken silently (the last key won; the text was parsed as a flag's)."""
    path = tmp_path / name
    path.write_text(text)
    code, err = cli(capsys, "--config", str(path), "--out", str(tmp_path / "run"))
    assert code == 2
    one_line(err, f"--config {path}", words)
    assert len(err) < 300 and not (tmp_path / "run").exists()


def test_36_11_a_quoted_value_is_cut_to_a_line_and_yaml_exponents_are_numbers(tmp_path, capsys):
    """What a message quotes is bounded however large the value; refusing text where a number is meant must
    not refuse YAML's `1e-3`, which PyYAML alone reads as text."""
    from fedjax_sparse.run.config_file import read_config_file
    path = tmp_path / "long.yaml"
    path.write_text(f"lr: \"{'1' * 100_000}x\"\n")
    code, err = cli(capsys, "--config", str(path), "--out", str(tmp_path / "run"))
    assert code == 2
    one_line(err, f"--config {path}, key 'lr': --lr: '111", "' is not a valid float")
    assert len(err) < 300
    (tmp_path / "e.yaml").write_text("lr: 1e-3\nserver_lr: 5E+1\nrounds: 3\n")
    assert read_config_file(tmp_path / "e.yaml") == {"lr": 0.001, "server_lr": 50.0, "rounds": 3}


def test_55_3b_convert_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    """The review: `fedjax-sparse convert digits d` overwrote the user's d/train_x.npy and d/test_y.npy (exit 0),
    though its help says "an empty or new folder". A folder a conversion cut short left is converted again."""
    users = tmp_path / "d"
    users.mkdir()
    (users / "train_x.npy").write_bytes(b"mine")
    (users / "test_y.npy").write_bytes(b"mine too")
    assert main(["convert", "digits", str(users)]) == 2
    one_line(capsys.readouterr().err, f"{users} is not empty (test_y.npy, train_x.npy) and fedjax-sparse convert "
                                      f"did not write it", "choose an empty or new folder")
    assert {p.name: p.read_bytes() for p in users.iterdir()} == {"train_x.npy": b"mine", "test_y.npy": b"mine too"}
    cut = tmp_path / "cut"  # what a conversion killed half-way leaves: its mark, part of its files
    cut.mkdir()
    (cut / WRITING).touch()
    (cut / "train_x.npy").write_bytes(b"half")
    assert main(["convert", "digits", str(cut)]) == 0
    assert read_manifest(cut)["name"] == "digits" and not (cut / WRITING).exists()
