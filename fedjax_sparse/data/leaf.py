"""FEMNIST and Shakespeare (LEAF, Caldas et al. 2018) with their own clients: one per writer, one
per speaking role (a character of a play).

Two sources give one result, a `Dataset` whose `train_clients`/`test_clients` name every
example's client (`--partition natural`):
  * `leaf:PATH`: LEAF's JSON layout, PATH/train/*.json and PATH/test/*.json, each file
    {"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}, what
    LEAF's `preprocess.sh -t sample` writes. The data set follows from x: 784 pixel values in
    [0, 1] are FEMNIST (62 classes: digits, upper, lower case), 80-character strings are
    Shakespeare. Parsed once, then cached as arrays keyed on the files' contents
    (`data.array_cache`, like an image folder).
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
"""

from __future__ import annotations

import json
import logging
import os
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


def _kind_of(x0) -> str:
    if isinstance(x0, str):
        if len(x0) != SEQUENCE:
            raise ValueError(f"a Shakespeare example is {SEQUENCE} characters, got {len(x0)}")
        return "shakespeare"
    if isinstance(x0, list) and len(x0) == 784:
        return "femnist"
    raise ValueError(f"LEAF examples must be 784 FEMNIST pixels or {SEQUENCE}-character Shakespeare strings, "
                     f"got {type(x0).__name__} of length {len(x0) if hasattr(x0, '__len__') else '-'}")


def _read_split(root: Path, split: str) -> dict[str, tuple[list, list]]:
    folder = root / split
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no LEAF files in {folder}; expected layout {LAYOUT}")
    users: dict[str, tuple[list, list]] = {}
    for path in files:
        try:
            content = json.loads(path.read_text())
            for user in content["users"]:
                data = content["user_data"][user]
                xs, ys = users.setdefault(user, ([], []))
                if len(data["x"]) != len(data["y"]):
                    raise ValueError(f"user {user!r} has {len(data['x'])} x but {len(data['y'])} y")
                xs.extend(data["x"])
                ys.extend(data["y"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"LEAF file {path} is not {{'users', 'num_samples', 'user_data'}} JSON: {err}") from None
    return users


def read_leaf(root: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Dataset:
    """A LEAF folder (module docstring): clients are its users in sorted order, each holding its examples
    of both splits (a user of one split only is a client without test or training examples)."""
    root = Path(root).expanduser().resolve()
    relative = [str(p.relative_to(root)) for split in ("train", "test") for p in sorted((root / split).glob("*.json"))]
    key = content_key(root, relative, _FORMAT) if relative else None
    directory = cache_base(cache_dir, "leaf") / f"folder-{key}"
    cached = load_arrays(directory, key, _FORMAT, _ARRAYS) if key else None
    if cached is None:
        splits = {split: _read_split(root, split) for split in ("train", "test")}
        names = sorted(set(splits["train"]) | set(splits["test"]))
        first = next(xs[0] for xs, _ in splits["train"].values() if xs)
        kind = _kind_of(first)
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
