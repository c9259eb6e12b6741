"""Client data off the device: each process holds its own clients' examples on the host
(in memory, or memory-mapped .npy files), and a round gathers the K sampled clients' windows.

The gathered windows form a small `FederatedSplit` ([K x max_count] examples, client k at
offset k x max_count) that the jitted round indexes exactly as it indexes the whole
population's split on the device. `max_count` is the whole population's largest client,
which fixes the scan lengths and shuffles, so a client trains identically either way.
Several processes: each holds the clients it owns (`ProcessLayout`: id % P == p, local
index id // P) and fills only their windows; the others stay zero (combined in the round).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from fedjax_sparse.data.dataset import example_kind
from fedjax_sparse.data.federated import FederatedSplit
from fedjax_sparse.data.process_layout import ProcessLayout


@dataclasses.dataclass(frozen=True)
class Windows:
    """The sampled clients' examples: x [K x max_count, ...] (the data set's examples, `data.dataset`),
    y [K x max_count] int32, counts [K]."""

    x: np.ndarray
    y: np.ndarray
    counts: np.ndarray


def window_split(x, y, counts, mean, std, max_count: int, augment: bool = False) -> FederatedSplit:
    """K gathered windows ([K x max_count] examples, `Windows`) as a `FederatedSplit` whose client k is
    window k (traceable)."""
    offsets = jnp.arange(counts.shape[0], dtype=jnp.int32) * max_count
    return FederatedSplit(x=x, y=y, offsets=offsets, counts=counts, mean=mean, std=std, max_count=max_count,
                          augment=augment)


class ClientWindows:
    """What a round and an evaluation read of this process's clients: `windows(ids)`, and the
    `mean`, `std`, `max_count`, `num_clients`, `augment`, `process_index`, `process_count` and
    `nbytes` (examples held) of the data. Held rows (`HostData`) or generated on demand
    (`data.synthetic`): the round takes either."""

    def windows(self, ids: np.ndarray) -> Windows:
        raise NotImplementedError


def fill_windows(ids: np.ndarray, max_count: int, example_shape: tuple, dtype, process: ProcessLayout,
                 examples) -> Windows:
    """The windows of the sampled `ids` that `process` owns, client k's `examples(client) -> (x, y)` at
    [k x max_count, k x max_count + n); zeros at the other positions (another process's clients)."""
    ids = np.asarray(ids)
    m = max_count
    x = np.zeros((len(ids) * m, *example_shape), dtype)
    y = np.zeros(len(ids) * m, np.int32)
    counts = np.zeros(len(ids), np.int32)
    for k, client in enumerate(ids.tolist()):
        if client % process.count != process.index:
            continue
        cx, cy = examples(client)
        n = len(cy)
        x[k * m:k * m + n] = cx
        y[k * m:k * m + n] = cy
        counts[k] = n
    return Windows(x, y, counts)


@dataclasses.dataclass(frozen=True)
class HostData(ClientWindows):
    """This process's clients' examples, client after client (offsets, counts: by local index)."""

    x: np.ndarray
    y: np.ndarray
    offsets: np.ndarray
    counts: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    max_count: int
    num_clients: int
    augment: bool = False
    process_index: int = 0
    process_count: int = 1

    @property
    def nbytes(self) -> int:
        """Bytes of examples this process holds (on disk for memory-mapped data)."""
        return int(self.x.nbytes + self.y.nbytes)

    def windows(self, ids: np.ndarray) -> Windows:
        """The windows of the sampled `ids` this process owns; zeros at the other positions."""
        process = ProcessLayout(self.process_index, self.process_count)

        def examples(client):
            local = client // self.process_count
            start, n = int(self.offsets[local]), int(self.counts[local])
            return self.x[start:start + n], self.y[start:start + n]

        return fill_windows(ids, self.max_count, self.x.shape[1:], self.x.dtype, process, examples)


def host_data(x: np.ndarray, y: np.ndarray, client_indices: Sequence[np.ndarray], mean: Sequence[float],
              std: Sequence[float], augment: bool = False, process: ProcessLayout | None = None) -> HostData:
    """The clients of `client_indices` that this process owns, laid out like `federated_split`."""
    example_kind(x)  # uint8 images, float32 features or int32 tokens
    index, count = (process.index, process.count) if process is not None else (0, 1)
    sizes = np.array([len(ix) for ix in client_indices], np.int64)
    if len(sizes) == 0 or sizes.min() < 1:
        raise ValueError("every client needs at least one example")
    own = [np.asarray(client_indices[i], np.int64) for i in range(index, len(client_indices), count)]
    counts = sizes[index::count].astype(np.int32)
    order = np.concatenate(own) if own else np.zeros(0, np.int64)
    return HostData(x=np.ascontiguousarray(x[order]), y=np.asarray(y[order], np.int32),
                    offsets=np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64), counts=counts,
                    mean=np.asarray(mean, np.float32), std=np.asarray(std, np.float32),
                    max_count=int(sizes.max()), num_clients=len(client_indices), augment=augment,
                    process_index=index, process_count=count)


def save_host_data(data: HostData, directory: str | Path) -> Path:
    """Writes `data` as .npy files (x, y, offsets, counts) and meta.json, to open memory-mapped."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("x", "y", "offsets", "counts"):
        np.save(directory / f"{name}.npy", getattr(data, name))
    meta = {"mean": data.mean.tolist(), "std": data.std.tolist(), "max_count": data.max_count,
            "num_clients": data.num_clients, "augment": data.augment, "process_index": data.process_index,
            "process_count": data.process_count}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def open_host_data(directory: str | Path, mmap: bool = True) -> HostData:
    """Data written by `save_host_data` (or built file by file with the same names); memory-mapped by
    default, so only the windows a round reads come into memory."""
    directory = Path(directory)
    if not (directory / "meta.json").exists():
        raise FileNotFoundError(f"no client data under {directory} (meta.json missing)")
    meta = json.loads((directory / "meta.json").read_text())
    arrays = {name: np.load(directory / f"{name}.npy", mmap_mode="r" if mmap else None)
              for name in ("x", "y", "offsets", "counts")}
    return HostData(**arrays, mean=np.asarray(meta["mean"], np.float32), std=np.asarray(meta["std"], np.float32),
                    max_count=meta["max_count"], num_clients=meta["num_clients"], augment=meta["augment"],
                    process_index=meta["process_index"], process_count=meta["process_count"])
