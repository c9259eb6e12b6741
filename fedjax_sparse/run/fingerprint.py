"""A fingerprint of a run's data: what was loaded and how it was split, kept with every checkpoint.

A resumed run must train on the data the run started on: an image folder edited between the two
processes, another TFDS version, or another partition would otherwise go on silently. The
fingerprint holds a content hash (BLAKE2b) of the training and test arrays as loaded, their
shapes, and a hash of the partition (each client's training and local test examples); `--resume`
compares it with the data it loads now (`data_changes`).
"""

from __future__ import annotations

import hashlib
import numpy as np

from fedjax_sparse.data.clients import Federation, GeneratedFederation
from fedjax_sparse.data.mapped import MappedDataset


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def data_fingerprint(federation: Federation | GeneratedFederation) -> dict:
    """{'train', 'test': content hashes of the loaded examples and labels, 'partition': of the split,
    'examples': [train, test] counts}. A generated population (`data.synthetic`) is hashed by what
    identifies it without generating every client: its name, seed and clients' sizes, and the
    content of its global test set (which a change of the generator changes)."""
    if isinstance(federation, GeneratedFederation):
        p = federation.population
        train, test = p.counts["train"], p.counts["test"]
        return {"train": _digest(np.frombuffer(p.name.encode(), np.uint8), np.atleast_1d(p.seed), train),
                "test": _digest(*p.global_test), "partition": _digest(train, test),
                "examples": [int(train.sum()), int(test.sum())]}
    dataset, client_indices, test_indices = federation.dataset, federation.train_indices, federation.test_indices
    sizes = np.asarray([len(ix) for ix in client_indices] + [len(ix) for ix in test_indices], np.int64)
    flat = [np.asarray(ix, np.int64) for ix in (*client_indices, *test_indices)]
    if isinstance(dataset, MappedDataset):  # the same digests, computed as the folder was written: none read now
        train, test = dataset.digests["train"], dataset.digests["test"]
    else:
        train, test = _digest(dataset.x_train, dataset.y_train), _digest(dataset.x_test, dataset.y_test)
    return {"train": train, "test": test,
            "partition": _digest(sizes, *flat),
            "examples": [int(len(dataset.y_train)), int(len(dataset.y_test))]}


def data_changes(saved: dict | None, current: dict) -> str:
    """What differs between a checkpoint's fingerprint and the current one, in words ('' when nothing
    does, or when the checkpoint, from an older version, holds none)."""
    if not saved:
        return ""
    words = {"train": "the training examples' content", "test": "the test examples' content",
             "partition": "the clients' split", "examples": "the numbers of examples"}
    changed = [f"{words[k]}: {saved.get(k)} then, {current.get(k)} now" for k in words if saved.get(k) != current.get(k)]
    return "; ".join(changed)
