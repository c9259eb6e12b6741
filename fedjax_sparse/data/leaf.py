"""FEMNIST and Shakespeare (LEAF, Caldas et al. 2018) with their own clients: one per writer, one
per speaking role (a character of a play).

Two sources give one result, a `Dataset` whose `train_clients`/`test_clients` name every
example's client (`--partition natural`):
  * `leaf:PATH`: LEAF's JSON layout, PATH/train/*.json and PATH/test/*.json, each file
    {"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}, what
    LEAF's `preprocess.sh -t sample` writes. The data set follows from x: 784 pixel values in
    [0, 1] are FEMNIST (62 classes: digits, upper, lower case), 80-character strings are
    Shakespeare. Parsed once, then cached as arrays keyed on the files' contents
    (`data.array_cache`, like an image folder). Checked while read: each file must be a regular
    file (a FIFO would block the read forever), each listed user must have x and y lists of one
    length, and every example must be of the training split's kind -- 784 finite pixel values in
    [0, 1] and a whole-number label in [0, 62), or an 80-character string and a 1-character one;
    anything else (NaN pixels, a label of 3.7, a 700-value row, strings in the test split of a
    FEMNIST folder) is a one-line ValueError naming the file, the user, the field and the example,
    where a silent conversion would have trained on zeros or truncated labels.
  * `femnist`, `shakespeare`: the copies Flower publishes on Hugging Face (flwrlabs/femnist:
    image, writer_id, character; flwrlabs/shakespeare: character_id, x, y), prepared on first use
    through the `datasets` package (the [leaf] extra) into DIR/leaf/NAME (DIR: --data-dir, else
    $FEDJAX_SPARSE_CACHE, else ~/.cache/fedjax_sparse); later runs only read the arrays.
    `download=False` (--no-download) only reads; without the extra or without a network the
    run stops with one line naming what is missing and the two ways on, as for TFDS.

Readings where LEAF leaves a choice. The Hugging Face copies hold LEAF's data unsplit (a train
split only), so each user is split here as LEAF's `split_data.py --by_sample` splits one:
max(1, int(0.9 n)) training examples (1 of 2), users of fewer than 2 dropped. LEAF draws the
training examples at random; that is kept for FEMNIST (seeded, `SPLIT_SEED`), but Shakespeare's
examples are overlapping windows of one text, so a random split puts every test target in some
training window: its held-out examples are each role's last ones (Flower's card warns the data
are temporal). Shakespeare's characters map to LEAF's 80-symbol alphabet (`VOCABULARY`, its
`ALL_LETTERS`); LEAF's `find` gives -1 for any other, which its model cannot embed, so such a
character becomes a space (counted in the log). FEMNIST pixels are kept as LEAF's JSON stores
them (x in [0, 1] -> round(255 x), ink dark on white) and standardized like any image.

`fedjax-sparse convert` (`data.mapped`) loads LEAF whole and writes it from memory, where it streams an
image folder or TFDS: a folder's example order needs every file first. Examples are ordered by user,
users by first appearance, and a user spread over several files has all its examples together, so the
first rows of a split can come from its last file; the clients are numbered by the sorted names of
every user of both splits, and the kind (FEMNIST or Shakespeare) is the first training example's.
Streaming would parse every file twice (names and counts, then examples) and write rows out of order.
The Hugging Face copies are prepared arrays, read whole too (FEMNIST: 0.6 GB).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import numpy as np

from fedjax_sparse.data import tfds_build
from fedjax_sparse.data.array_cache import cache_base, channel_stats, content_key, load_arrays, save_arrays
from fedjax_sparse.data.dataset import Dataset

log = logging.getLogger(__name__)

VOCABULARY = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQUENCE = 80
FEMNIST_CLASSES = tuple("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
HUGGING_FACE = {"femnist": "flwrlabs/femnist", "shakespeare": "flwrlabs/shakespeare"}
EXTRA = 'pip install "fedjax-sparse[leaf]"'
LAYOUT = 'PATH/{train,test}/*.json of {"users", "num_samples", "user_data"}'
TRAIN_FRACTION = 0.9
SPLIT_SEED = 0
_FORMAT = 1
_FOLDER_FORMAT = 2  # 2: checked while read (a folder cached by version 1 may hold what the checks refuse)
_ARRAYS = ("x_train", "y_train", "x_test", "y_test", "train_clients", "test_clients")
_INDEX = np.full(0x110000, VOCABULARY.index(" "), np.int32)
_INDEX[[ord(c) for c in VOCABULARY]] = np.arange(len(VOCABULARY), dtype=np.int32)


def encode(texts: list[str]) -> np.ndarray:
    """Characters -> [len(texts), len(text)] int32 indices into `VOCABULARY` (any other: a space)."""
    codes = np.array([[ord(c) for c in t] for t in texts], np.int64).reshape(len(texts), -1)
    unknown = int(np.sum(~np.isin(codes, [ord(c) for c in VOCABULARY])))
    if unknown:
        log.info("%d characters outside LEAF's 80-symbol alphabet read as spaces", unknown)
    return _INDEX[codes]


def examples(kind: str, xs: list, ys: list) -> tuple[np.ndarray, np.ndarray]:
    """LEAF's x and y lists as arrays: FEMNIST uint8 [n, 28, 28, 1] and labels; Shakespeare int32 [n, 80]
    and the next character's index."""
    if kind == "femnist":
        x = np.round(np.asarray(xs, np.float64).reshape(-1, 28, 28, 1) * 255.0).clip(0, 255).astype(np.uint8)
        return x, np.asarray(ys, np.int32)
    return encode(xs), encode(ys).reshape(-1)


def make_dataset(kind: str, name: str, arrays: dict, client_names: tuple[str, ...]) -> Dataset:
    if kind == "femnist":
        mean, std = channel_stats(arrays["x_train"])
        classes = FEMNIST_CLASSES
    else:
        mean, std, classes = (), (), tuple(VOCABULARY)
    return Dataset(name=name, x_train=arrays["x_train"], y_train=arrays["y_train"], x_test=arrays["x_test"],
                   y_test=arrays["y_test"], num_classes=len(classes), class_names=classes, mean=mean, std=std,
                   train_clients=arrays["train_clients"], test_clients=arrays["test_clients"],
                   client_names=tuple(client_names))


def _what(value) -> str:
    """A JSON value described in a few words (never quoted whole: an example is 784 values)."""
    if isinstance(value, str):
        return f"a string of {len(value)} character{'' if len(value) == 1 else 's'}"
    if isinstance(value, list):
        return f"a list of {len(value)} values"
    if isinstance(value, dict):
        return "an object"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _kind_of(x0) -> str:
    if isinstance(x0, str):
        if len(x0) != SEQUENCE:
            raise ValueError(f"a Shakespeare example is {SEQUENCE} characters, got {len(x0)}")
        return "shakespeare"
    if isinstance(x0, list) and len(x0) == 784:
        return "femnist"
    raise ValueError(f"LEAF examples must be 784 FEMNIST pixels or {SEQUENCE}-character Shakespeare strings, "
                     f"got {_what(x0)}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _first_bad_pixel(xs: list) -> str:
    """What is wrong with the first bad example of `xs` (the slow path, taken once a check has failed)."""
    for i, row in enumerate(xs):
        if not isinstance(row, list) or len(row) != 784:
            mixed = " (the folder's first training example makes it FEMNIST)" if isinstance(row, str) else ""
            return f"example {i} is {_what(row)}, not a list of 784 pixel values{mixed}"
        for j, v in enumerate(row):
            if not (_is_number(v) and 0 <= v <= 1):  # NaN fails both comparisons
                return f"example {i}, pixel {j} is {_what(v)}; FEMNIST pixels are numbers in [0, 1]"
    return "not a list of examples of 784 numbers in [0, 1]"


def _first_bad_label(ys: list) -> str:
    classes = len(FEMNIST_CLASSES)
    for i, v in enumerate(ys):
        if not (_is_number(v) and 0 <= v < classes and float(v).is_integer()):
            return f"example {i}'s label is {_what(v)}; FEMNIST labels are whole numbers in [0, {classes})"
    return f"not a list of whole numbers in [0, {classes})"


def _check_femnist(xs: list, ys: list) -> None:
    """Raises ValueError('field x: ...') for the first example that is not 784 pixels in [0, 1] with a
    whole-number label in [0, 62); vectorized where every example is good."""
    if not xs:  # a user without examples in this file
        return
    try:
        x = np.asarray(xs)
    except ValueError:  # ragged rows
        x = None
    if x is None or x.shape != (len(xs), 784) or x.dtype.kind not in "iuf" or not np.all((x >= 0) & (x <= 1)):
        raise ValueError(f"field x: {_first_bad_pixel(xs)}")
    try:
        y = np.asarray(ys)
    except ValueError:
        y = None
    if y is None or y.shape != (len(ys),) or y.dtype.kind not in "iuf" or not np.all(
            (y >= 0) & (y < len(FEMNIST_CLASSES)) & (np.floor(y) == y)):
        raise ValueError(f"field y: {_first_bad_label(ys)}")


def _check_shakespeare(xs: list, ys: list) -> None:
    for field, values, length in (("x", xs, SEQUENCE), ("y", ys, 1)):
        for i, v in enumerate(values):
            if not isinstance(v, str) or len(v) != length:
                mixed = " (the folder's first training example makes it Shakespeare)" if isinstance(v, list) else ""
                raise ValueError(f"field {field}: example {i} is {_what(v)}; Shakespeare's {field} are strings of "
                                 f"{length} character{'s' if length > 1 else ''}{mixed}")


def _user_name(user) -> str:
    shown = json.dumps(user)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _split_files(root: Path, split: str) -> list[Path]:
    """The split's JSON files, each a regular file (reading a FIFO or a device would block or never end)."""
    folder = root / split
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no LEAF files in {folder}; expected layout {LAYOUT}")
    for path in files:
        try:
            mode = path.stat().st_mode
        except OSError as err:
            raise ValueError(f"LEAF file {path} cannot be read ({err.strerror or err}); expected layout "
                             f"{LAYOUT}") from None
        if not stat.S_ISREG(mode):
            what = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "a device")
            raise ValueError(f"LEAF file {path} is {what}, not a regular file; expected layout {LAYOUT}")
    return files


def _file_users(path: Path) -> list[tuple[str, list, list]]:
    """(user, x, y) of every user a LEAF file lists, in its order, each user's x and y lists of one length."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"LEAF file {path} is not JSON: {' '.join(str(err).split())[:200]}") from None
    if not (isinstance(content, dict) and isinstance(content.get("users"), list)
            and isinstance(content.get("user_data"), dict)):
        raise ValueError(f"LEAF file {path} is not {{'users', 'num_samples', 'user_data'}} JSON: it needs a "
                         f"'users' list and a 'user_data' object")
    out = []
    for user in content["users"]:
        where = f"LEAF file {path}, user {_user_name(user)}"
        if not isinstance(user, str):
            raise ValueError(f"{where}: a user is named by a string, not {_what(user)}")
        data = content["user_data"].get(user)
        if not isinstance(data, dict):
            raise ValueError(f"{where}: user_data holds {'nothing' if data is None else _what(data)} for this "
                             f"user, where an object of 'x' and 'y' lists is expected")
        for field in ("x", "y"):
            if not isinstance(data.get(field), list):
                raise ValueError(f"{where}, field {field}: "
                                 f"{'missing' if field not in data else _what(data[field])}, where a list is expected")
        if len(data["x"]) != len(data["y"]):
            raise ValueError(f"{where}, fields x and y: {len(data['x'])} examples but {len(data['y'])} labels")
        out.append((user, data["x"], data["y"]))
    return out


def _read_splits(root: Path, files: dict[str, list[Path]]) -> tuple[str, dict[str, dict[str, tuple[list, list]]]]:
    """(kind, {split: {user: (x, y)}}): every file's users merged (a user may be spread over files, in
    file order), every example checked against the kind of the first training example."""
    chunks = {split: [(path, *u) for path in paths for u in _file_users(path)] for split, paths in files.items()}
    for split, parts in chunks.items():
        if not any(xs for _, _, xs, _ in parts):
            raise ValueError(f"LEAF folder {root}: no {split} examples (every user's x in {root / split}/*.json is "
                             f"empty)")
    first = next((path, user, xs[0]) for path, user, xs, _ in chunks["train"] if xs)
    try:
        kind = _kind_of(first[2])
    except ValueError as err:
        raise ValueError(f"LEAF file {first[0]}, user {_user_name(first[1])}, field x: example 0: {err}") from None
    check = _check_femnist if kind == "femnist" else _check_shakespeare
    splits: dict[str, dict[str, tuple[list, list]]] = {}
    for split, parts in chunks.items():
        users = splits[split] = {}
        for path, user, xs, ys in parts:
            try:
                check(xs, ys)
            except ValueError as err:
                raise ValueError(f"LEAF file {path}, user {_user_name(user)}, {err}") from None
            merged_x, merged_y = users.setdefault(user, ([], []))
            merged_x.extend(xs)
            merged_y.extend(ys)
    return kind, splits


def read_leaf(root: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Dataset:
    """A LEAF folder (module docstring): clients are its users in sorted order, each holding its examples
    of both splits (a user of one split only is a client without test or training examples)."""
    root = Path(root).expanduser().resolve()
    files = {split: _split_files(root, split) for split in ("train", "test")}
    relative = [str(p.relative_to(root)) for paths in files.values() for p in paths]
    key = content_key(root, relative, _FOLDER_FORMAT)
    directory = cache_base(cache_dir, "leaf") / f"folder-{key}"
    cached = load_arrays(directory, key, _FORMAT, _ARRAYS)
    if cached is None:
        kind, splits = _read_splits(root, files)
        names = sorted(set(splits["train"]) | set(splits["test"]))
        arrays, ids = {}, {u: i for i, u in enumerate(names)}
        for split, users in splits.items():
            parts = [examples(kind, xs, ys) for xs, ys in users.values() if xs]
            arrays[f"x_{split}"] = np.concatenate([p[0] for p in parts])
            arrays[f"y_{split}"] = np.concatenate([p[1] for p in parts])
            arrays[f"{split}_clients"] = np.concatenate([np.full(len(ys), ids[u], np.int32)
                                                         for u, (xs, ys) in users.items() if xs])
        meta = {"format": _FORMAT, "key": key, "kind": kind, "root": str(root), "client_names": names}
        try:
            save_arrays(directory, arrays, meta, _FORMAT)
        except OSError as err:  # a read-only cache location must not stop training
            log.warning("could not write the LEAF cache %s: %s", directory, err)
    else:
        arrays, meta = cached
    return make_dataset(meta["kind"], f"leaf:{root}", arrays, tuple(meta["client_names"]))


# ------------------------------------------------------------------ Flower's Hugging Face copies


def split_users(users: np.ndarray, temporal: bool, seed: int = SPLIT_SEED) -> np.ndarray:
    """[n] bool, True for a training example: LEAF's per-user split (module docstring) of examples
    whose users are `users` (in their order within each user); a user of one example has none
    (the caller leaves it out of the test split too)."""
    rng = np.random.default_rng(seed)
    train = np.zeros(len(users), bool)
    order = np.argsort(users, kind="stable")
    bounds = np.flatnonzero(np.diff(users[order])) + 1
    for members in np.split(order, bounds):
        n = len(members)
        if n < 2:
            continue
        k = 1 if n == 2 else max(1, int(TRAIN_FRACTION * n))
        train[members[:k] if temporal else rng.choice(members, k, replace=False)] = True
    return train


def prepared_dir(name: str, data_dir: str | os.PathLike | None) -> Path:
    return cache_base(data_dir, "leaf") / name


def _ways_on(directory: Path) -> str:
    return (f"either prepare it where there is a network (a fedjax-sparse run of it with the [leaf] extra installed, "
            f"{EXTRA}) and copy {directory} here (or point --data-dir at the folder holding leaf/), or use --dataset "
            f"leaf:PATH with LEAF's own preprocessed JSON ({LAYOUT})")


def load_hugging_face(name: str, data_dir: str | os.PathLike | None = None, *, download: bool = True) -> Dataset:
    """`femnist` or `shakespeare` prepared from Flower's Hugging Face copy (module docstring)."""
    directory = prepared_dir(name, data_dir)
    cached = load_arrays(directory, HUGGING_FACE[name], _FORMAT, _ARRAYS)
    if cached is None:
        where = f"{name} is not prepared under {directory}"
        if not download:
            raise FileNotFoundError(f"{where} (--no-download: nothing is downloaded); " + _ways_on(directory))
        try:
            import datasets
        except ImportError:
            raise ImportError(f"{where}, and preparing it needs the datasets package ({EXTRA}); "
                              + _ways_on(directory)) from None
        unreachable = tfds_build.unreachable_hosts(["https://huggingface.co"])
        if unreachable and not os.environ.get("HF_DATASETS_OFFLINE"):
            raise ConnectionError(f"{where}, and this machine cannot reach {', '.join(unreachable)} to download it; "
                                  + _ways_on(directory))
        log.info("preparing %s from %s into %s", name, HUGGING_FACE[name], directory)
        arrays, names = _convert(name, datasets.load_dataset(HUGGING_FACE[name], split="train"))
        save_arrays(directory, arrays, {"format": _FORMAT, "key": HUGGING_FACE[name], "client_names": names}, _FORMAT)
        cached = load_arrays(directory, HUGGING_FACE[name], _FORMAT, _ARRAYS)
    arrays, meta = cached
    return make_dataset(name, name, arrays, tuple(meta["client_names"]))


def _convert(name: str, table) -> tuple[dict, list[str]]:
    """A Hugging Face split (rows read in batches with `.iter`) as the cached arrays and client names."""
    xs, ys, users = [], [], []
    user_column, x_column, y_column = (("writer_id", "image", "character") if name == "femnist"
                                       else ("character_id", "x", "y"))
    for batch in table.iter(batch_size=10_000):
        users.extend(batch[user_column])
        if name == "femnist":
            xs.append(np.stack([np.asarray(image.convert("L"), np.uint8) for image in batch[x_column]])[..., None])
            ys.append(np.asarray(batch[y_column], np.int32))
        else:
            xs.append(encode(batch[x_column]))
            ys.append(encode(batch[y_column]).reshape(-1))
    x, y = np.concatenate(xs), np.concatenate(ys)
    names, clients = np.unique(np.asarray(users), return_inverse=True)
    clients = clients.astype(np.int32)
    train = split_users(clients, temporal=name == "shakespeare")
    held = np.isin(clients, np.flatnonzero(np.bincount(clients) >= 2))
    test = held & ~train
    arrays = {"x_train": x[train], "y_train": y[train], "x_test": x[test], "y_test": y[test],
              "train_clients": clients[train], "test_clients": clients[test]}
    return arrays, [str(n) for n in names]
