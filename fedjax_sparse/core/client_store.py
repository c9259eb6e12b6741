"""Where client states live: on the device, in host memory or in files, and their checkpoints.

- `DeviceStore`: every client's state on the device ([N, ...] arrays), gathered and scattered
  inside the jitted round (`core.round.build_round`): the fastest layout, for when it fits.
- `HostStore`: rows of bytes in host memory; `DiskStore`: rows in a file under the run folder,
  read and written with pread/pwrite (no memory map, so the rows never count in the process's
  resident memory). Both hold only clients that were ever written: a client never sampled
  has its algorithm's initial state (`FederatedAlgorithm.init_clients`, computed on the
  device when sampled), so 10^6 clients cost nothing until they train.

A client's state travels as one row of bytes (`RowLayout`): its leaves' bytes one after the
other, packed and unpacked inside the jitted round, so a round moves one [K, row_bytes]
block each way, and the blocks of several processes combine exactly (`core.distributed`).

Crash safety without copying the disk store at each checkpoint: a row that a kept
checkpoint refers to is never overwritten (`SlotMap`). A client written after a checkpoint
gets a fresh slot (or a freed one) and its old slot is freed once no kept checkpoint
refers to it, so the file holds about (clients ever written + K x rounds between
checkpoints) rows. `snapshot(directory)` flushes the rows (fsync) and writes the slot map
(the host and device stores write their rows themselves); `restore(directory)` reads it back.

`choose_store` is the `auto` rule.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.algorithm import FederatedAlgorithm
from fedjax_sparse.core.distributed import ProcessLayout

tree_map = jax.tree_util.tree_map
BACKENDS = ("device", "host", "disk")
AUTO_FRACTION = 0.5


# ------------------------------------------------------------------ one client's state as bytes

@dataclasses.dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]       # of one client's leaf
    dtype: Any                   # the leaf's dtype (a PRNG key dtype for keys)
    stored: Any                  # the numpy dtype its bytes are read as
    stored_shape: tuple[int, ...]
    offset: int
    nbytes: int


class RowLayout:
    """How one client's state (a pytree) is laid out as a row of bytes, and back (traceable)."""

    def __init__(self, one_client: Any):
        leaves, self.treedef = jax.tree_util.tree_flatten(one_client)
        specs, offset = [], 0
        for leaf in leaves:
            shape, dtype = tuple(leaf.shape), leaf.dtype
            if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
                data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
                stored, stored_shape = np.dtype(data.dtype), tuple(data.shape)
            else:
                stored = np.dtype(np.uint8) if dtype == np.bool_ else np.dtype(dtype)
                stored_shape = shape
            nbytes = int(np.prod(stored_shape, dtype=np.int64)) * stored.itemsize
            specs.append(_Leaf(shape, dtype, stored, stored_shape, offset, nbytes))
            offset += nbytes
        self.leaves = tuple(specs)
        self.row_bytes = offset

    def __eq__(self, other):
        return isinstance(other, RowLayout) and (self.treedef, self.leaves) == (other.treedef, other.leaves)

    def __hash__(self):
        return hash((self.treedef, self.leaves))

    @classmethod
    def of_states(cls, states: Any) -> "RowLayout":
        """The layout of states with a leading clients axis (arrays or shape structs)."""
        return cls(tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), states))

    def signature(self) -> list:
        """What a snapshot records to refuse rows written with another layout."""
        return [[list(l.shape), str(l.dtype), l.offset, l.nbytes] for l in self.leaves]

    def pack(self, states: Any, num_rows: int) -> jax.Array:
        """[M, ...] states -> uint8 [M, row_bytes]."""
        parts = []
        for spec, x in zip(self.leaves, self.treedef.flatten_up_to(states)):
            if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            x = x.astype(spec.stored).reshape(num_rows, -1)
            if spec.stored.itemsize > 1:
                x = jax.lax.bitcast_convert_type(x, jnp.uint8)
            parts.append(x.reshape(num_rows, spec.nbytes))
        return jnp.concatenate(parts, axis=1) if parts else jnp.zeros((num_rows, 0), jnp.uint8)

    def unpack(self, rows: jax.Array) -> Any:
        """uint8 [M, row_bytes] -> [M, ...] states."""
        m = rows.shape[0]
        leaves = []
        for spec in self.leaves:
            x = rows[:, spec.offset:spec.offset + spec.nbytes]
            if spec.stored.itemsize > 1:
                x = jax.lax.bitcast_convert_type(x.reshape(m, -1, spec.stored.itemsize), spec.stored)
            x = x.reshape(m, *spec.stored_shape)
            if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
                x = jax.random.wrap_key_data(x, impl=spec.dtype._impl)
            elif spec.dtype == np.bool_:
                x = x != 0
            leaves.append(x)
        return self.treedef.unflatten(leaves)


# ------------------------------------------------------------------ initial states

def client_state_shapes(algorithm: FederatedAlgorithm, key: jax.Array, variables: Any, num_clients: int) -> Any:
    """One client's state shapes (no allocation), checking the algorithm declares its per-client init."""
    if algorithm.init_clients is not None:
        states = jax.eval_shape(algorithm.init_clients, key, variables, jax.ShapeDtypeStruct((1,), jnp.int32))
    else:
        states = jax.eval_shape(lambda k, v: algorithm.init(k, v, num_clients)[1], key, variables)
        if jax.tree_util.tree_leaves(states):
            raise ValueError(f"algorithm {algorithm.name!r} keeps per-client state but declares no init_clients; "
                             f"only the device client store can hold its clients")
    return tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), states)


def initial_server_state(algorithm: FederatedAlgorithm, key: jax.Array, variables: Any, num_clients: int) -> Any:
    """`algorithm.init`'s server state without materializing N client states."""
    if algorithm.init_clients is None:
        return algorithm.init(key, variables, num_clients)[0]
    return server_init(algorithm, num_clients)(key, variables)


def server_init(algorithm: FederatedAlgorithm, num_clients: int):
    """Jitted `(key, variables) -> server state`: under jit the unused client states are dead code
    that XLA never computes."""
    return jax.jit(lambda k, v: algorithm.init(k, v, num_clients)[0])


def materialize(algorithm: FederatedAlgorithm, layout: RowLayout, rows: jax.Array, held: jax.Array,
                ids: jax.Array, key: jax.Array, variables: Any) -> Any:
    """States [K, ...] of clients `ids` from their rows where `held`, else their initial states
    (traceable). The merge happens on the bytes, so it is exact for every leaf type."""
    if algorithm.init_clients is not None:
        initial = layout.pack(algorithm.init_clients(key, variables, ids), ids.shape[0])
        rows = jnp.where(held[:, None], rows, initial)
    return layout.unpack(rows)


@functools.lru_cache(maxsize=64)
def _merge_fn(algorithm: FederatedAlgorithm, layout: RowLayout, key_impl: str):
    """One compiled merge per (algorithm, layout), shared by every store of them."""
    def merge(rows, held, ids, key_data, variables):
        key = jax.random.wrap_key_data(key_data, impl=key_impl)
        return materialize(algorithm, layout, rows, held, jnp.asarray(ids, jnp.int32), key, variables)

    return jax.jit(merge)


# ------------------------------------------------------------------ slots

class SlotMap:
    """Which row slot holds each (local) client, and which slots kept checkpoints still need.

    live[i]: client i's slot (-1: never written). Writing a client whose slot a kept
    checkpoint refers to moves it to a free (or new) slot; any other slot is overwritten in
    place. `commit` records a checkpoint's map: the last `keep` of them stay readable.
    """

    def __init__(self, num_local: int, keep: int):
        self.live = np.full(num_local, -1, np.int64)
        self.keep = keep
        self.num_slots = 0
        self._kept: list[np.ndarray] = []  # the slots each kept checkpoint refers to, oldest first
        self._pinned = np.zeros(0, bool)
        self._free: list[int] = []

    def assign(self, local: np.ndarray) -> np.ndarray:
        """Slots to write these (distinct) clients to; updates `live`."""
        slots = self.live[local].copy()
        for j, slot in enumerate(slots):
            if slot < 0 or (slot < len(self._pinned) and self._pinned[slot]):
                if self._free:
                    slots[j] = self._free.pop()
                else:
                    slots[j] = self.num_slots
                    self.num_slots += 1
        self.live[local] = slots
        return slots

    def commit(self) -> np.ndarray:
        """Pins the current map (a checkpoint's) and frees slots no kept map refers to."""
        saved = self.live.copy()
        self._kept = (self._kept + [saved[saved >= 0]])[-self.keep:] if self.keep else []
        self._refresh()
        return saved

    def older_pins(self) -> np.ndarray:
        """The slots the kept checkpoints before the latest refer to."""
        return np.unique(np.concatenate([np.zeros(0, np.int64), *self._kept[:-1]]))

    def load(self, live: np.ndarray, num_slots: int, older: np.ndarray | None = None) -> None:
        """Restores a checkpoint's map, its slots and `older` (those of the checkpoints kept before it,
        `older_pins`) pinned; other slots up to `num_slots` are free."""
        self.live = np.asarray(live, np.int64).copy()
        self.num_slots = max(int(num_slots), int(self.live.max(initial=-1)) + 1)
        kept = ([] if older is None else [np.asarray(older, np.int64)]) + [self.live[self.live >= 0]]
        self._kept = kept[-self.keep:] if self.keep else []
        self._refresh()

    def _refresh(self) -> None:
        self._pinned = np.zeros(self.num_slots, bool)
        for kept in self._kept:
            self._pinned[kept] = True
        used = self._pinned.copy()
        used[self.live[self.live >= 0]] = True
        self._free = np.flatnonzero(~used)[::-1].tolist()  # pop() takes the lowest


# ------------------------------------------------------------------ the stores

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_snapshot(directory: Path, name: str, meta: dict, arrays: dict[str, np.ndarray]) -> Path:
    """Writes meta.json and the arrays into directory/name atomically (a temporary folder renamed)."""
    final = Path(directory) / name
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for filename, array in arrays.items():
        with open(tmp / filename, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


class ClientStore:
    """What every store shares: the clients this process owns, the row layout, the initial states."""

    backend = ""

    def __init__(self, algorithm: FederatedAlgorithm, key: jax.Array, variables: Any, num_clients: int, *,
                 process: ProcessLayout | None = None):
        self.algorithm = algorithm
        self.num_clients = num_clients
        self.process = process or ProcessLayout()
        self.init_key = key
        self.key_impl = str(jax.random.key_impl(key))
        self.init_variables = variables
        self.layout = RowLayout(client_state_shapes(algorithm, key, variables, num_clients))
        self.num_local = self.process.num_local(num_clients)
        self.generation = 0  # bumped by restore, so a prefetched round is not used across it

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    def close(self) -> None:
        """Releases what the store holds open (the disk store's file)."""

    def _merge(self, rows: np.ndarray, held: np.ndarray, ids: np.ndarray) -> Any:
        """States of clients `ids` on the device: their rows where held, else their initial states."""
        merge = _merge_fn(self.algorithm, self.layout, self.key_impl)
        return merge(rows, held, ids, jax.random.key_data(self.init_key), self.init_variables)

    def _snapshot_name(self) -> str:
        return f"client_states.{self.process.tag()}"

    def _meta(self) -> dict:
        return {"backend": self.backend, "num_clients": self.num_clients, "process": self.process.tag(),
                "row_bytes": self.row_bytes, "layout": self.layout.signature()}

    def _read_meta(self, directory: str | Path) -> tuple[Path, dict]:
        path = Path(directory) / self._snapshot_name()
        if not (path / "meta.json").exists():
            raise FileNotFoundError(f"no client-state snapshot of process {self.process.tag()} under {directory}")
        meta = read_snapshot_meta(path / "meta.json")
        expected = self._meta()
        for field in ("num_clients", "row_bytes", "layout"):
            if meta[field] != expected[field]:
                raise ValueError(f"the client-state snapshot in {path} was written for another run "
                                 f"({field}: {meta[field]!r} there, {expected[field]!r} here)")
        return path, meta


class DeviceStore(ClientStore):
    """Every client's state on the device, [N, ...]; the round gathers and scatters inside its jit."""

    backend = "device"

    def __init__(self, algorithm, key, variables, num_clients, *, process=None):
        super().__init__(algorithm, key, variables, num_clients, process=process)
        if self.process.count > 1:
            raise ValueError("the device client store keeps every client on one process's device; with several "
                             "processes use the host or disk store")
        self.states = algorithm.init(key, variables, num_clients)[1]

    @property
    def nbytes(self) -> int:
        return self.num_clients * self.row_bytes

    def client_states(self, ids) -> Any:
        ids = jnp.asarray(ids)
        return tree_map(lambda a: a[ids], self.states)

    def snapshot(self, directory: str | Path) -> Path:
        pack = jax.jit(lambda s: self.layout.pack(s, self.num_clients))
        return _save_snapshot(Path(directory), self._snapshot_name(), self._meta(),
                              {"slots.npy": np.arange(self.num_clients, dtype=np.int64),
                               "rows.npy": np.asarray(pack(self.states))})

    def restore(self, directory: str | Path) -> None:
        path, meta = self._read_meta(directory)
        slots, rows = _read_rows_snapshot(path, meta)
        held = slots >= 0
        dense = np.zeros((self.num_clients, self.row_bytes), np.uint8)
        dense[held] = rows[slots[held]]
        self.states = self._merge(dense, held, np.arange(self.num_clients, dtype=np.int32))
        self.generation += 1


def _read_rows_snapshot(path: Path, meta: dict) -> tuple[np.ndarray, np.ndarray]:
    if meta["backend"] not in ("device", "host"):
        raise ValueError(f"the client-state snapshot in {path} is a {meta['backend']} store's (rows kept in "
                         f"its folder); restore it with the {meta['backend']} store")
    return np.load(path / "slots.npy"), np.load(path / "rows.npy", mmap_mode="r")


class SnapshotError(ValueError):
    """A client-state snapshot cannot be used; the message names the file and what to do."""


class ClientRowsLost(SnapshotError):
    """The disk store's rows file, which every checkpoint's client states live in, is missing or cut short."""


def read_snapshot_meta(path: Path) -> dict:
    """A snapshot's meta.json, or a SnapshotError naming it (a truncated or garbled file)."""
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict) or "backend" not in meta:
            raise ValueError("it holds no snapshot description")
        return meta
    except (ValueError, UnicodeDecodeError) as err:
        raise SnapshotError(f"the client-state snapshot {path} cannot be read ({' '.join(str(err).split())}); "
                            f"delete its checkpoint folder {path.parents[1]} to resume from the one before, or "
                            f"start again with --overwrite") from None


def snapshot_backend(directory: str | Path, process: ProcessLayout) -> str | None:
    """The backend of the store whose snapshot of `process`'s clients is in `directory` (None: none there)."""
    meta = Path(directory) / f"client_states.{process.tag()}" / "meta.json"
    return read_snapshot_meta(meta)["backend"] if meta.exists() else None


class RowStore(ClientStore):
    """A store of byte rows in slots: only clients ever written hold a row (host and disk)."""

    keep = 0

    def __init__(self, algorithm, key, variables, num_clients, *, process=None):
        super().__init__(algorithm, key, variables, num_clients, process=process)
        self.slots = SlotMap(self.num_local, self.keep)

    @property
    def held_clients(self) -> np.ndarray:
        """Global ids of the clients this process holds a row for."""
        local = np.flatnonzero(self.slots.live >= 0)
        return local * self.process.count + self.process.index

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held: what the clients' states cost this process."""
        return int((self.slots.live >= 0).sum()) * self.row_bytes

    def read(self, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(rows uint8 [K, row_bytes], held bool [K]) for the sampled `ids`: this process's clients'
        rows where it holds one, zeros elsewhere (never-written clients and other processes').

        `out`: a [K, row_bytes] buffer to fill and return; reusing one saves faulting in fresh
        pages every round, which costs more than the copy itself (see `populated_rows`).
        """
        ids = np.asarray(ids)
        if out is None:
            rows = np.zeros((len(ids), self.row_bytes), np.uint8)
        else:
            chex.assert_shape(out, (len(ids), self.row_bytes))
            rows = out
            rows.fill(0)
        owned = self.process.owns(ids)
        slots = np.full(len(ids), -1, np.int64)
        slots[owned] = self.slots.live[self.process.local_index(ids[owned])]
        held = slots >= 0
        if self.row_bytes and held.any():
            self._read_rows(slots[held], rows, np.flatnonzero(held))
        return rows, held

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Stores the rows of this process's clients among `ids` ([K, row_bytes], in the order of ids)."""
        if not self.row_bytes:
            return
        ids = np.asarray(ids)
        chex.assert_shape(rows, (len(ids), self.row_bytes))
        chex.assert_type(rows, np.uint8)
        owned = np.flatnonzero(self.process.owns(ids))
        if len(owned):
            slots = self.slots.assign(self.process.local_index(ids[owned]))
            self._write_rows(slots, rows, owned)

    def _load_rows(self, slots: np.ndarray, rows: np.ndarray, chunk: int = 1024) -> None:
        """Makes a device or host snapshot's rows this store's only rows (`slots`: each local client's
        row in `rows`, -1: none), `chunk` rows at a time (`rows` may be memory-mapped)."""
        self.slots = SlotMap(self.num_local, self.keep)
        local = np.flatnonzero(slots >= 0)
        for start in range(0, len(local) if self.row_bytes else 0, chunk):
            part = local[start:start + chunk]
            self._write_rows(self.slots.assign(part), np.asarray(rows[slots[part]]), np.arange(len(part)))
        self.generation += 1

    def client_states(self, ids) -> Any:
        """These (own) clients' states on the device, initial states where never written."""
        ids = np.asarray(ids, np.int32)
        if not self.process.owns(ids).all():
            raise ValueError(f"process {self.process.tag()} holds only clients with id % {self.process.count} == "
                             f"{self.process.index}")
        rows, held = self.read(ids)
        return self._merge(rows, held, ids)

    def _read_rows(self, slots: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
        raise NotImplementedError

    def _write_rows(self, slots: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> None:
        raise NotImplementedError


def populated_rows(num_rows: int, row_bytes: int) -> np.ndarray:
    """A zeroed uint8 [num_rows, row_bytes] array whose pages the kernel maps in at once (MAP_POPULATE
    where there is one): faulting 34 MB of fresh pages in one by one took 175 ms on a VM, 5x the
    cost of populating them."""
    size = num_rows * row_bytes
    if size == 0:
        return np.zeros((num_rows, row_bytes), np.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, size, flags=flags), np.uint8).reshape(num_rows, row_bytes)


class HostStore(RowStore):
    """Rows in host memory, in chunks of about 64 MiB (growing the store never copies it)."""

    backend = "host"
    CHUNK_BYTES = 64 << 20

    def __init__(self, algorithm, key, variables, num_clients, *, process=None):
        super().__init__(algorithm, key, variables, num_clients, process=process)
        self._chunk_rows = max(1, self.CHUNK_BYTES // max(self.row_bytes, 1))
        self._chunks: list[np.ndarray] = []

    def _row(self, slot: int) -> np.ndarray:
        return self._chunks[slot // self._chunk_rows][slot % self._chunk_rows]

    def _read_rows(self, slots, out, positions):
        for slot, k in zip(slots, positions):
            out[k] = self._row(slot)

    def _write_rows(self, slots, rows, positions):
        while len(self._chunks) * self._chunk_rows < self.slots.num_slots:
            self._chunks.append(populated_rows(self._chunk_rows, self.row_bytes))
        for slot, k in zip(slots, positions):
            self._row(slot)[...] = rows[k]

    def snapshot(self, directory: str | Path) -> Path:
        """Writes the held rows (compacted) and which client each belongs to."""
        local = np.flatnonzero(self.slots.live >= 0)
        rows = np.empty((len(local), self.row_bytes), np.uint8)
        self._read_rows(self.slots.live[local], rows, np.arange(len(local)))
        slots = np.full(self.num_local, -1, np.int64)
        slots[local] = np.arange(len(local))
        return _save_snapshot(Path(directory), self._snapshot_name(), self._meta(),
                              {"slots.npy": slots, "rows.npy": rows})

    def restore(self, directory: str | Path) -> None:
        path, meta = self._read_meta(directory)
        slots, rows = _read_rows_snapshot(path, meta)
        self._chunks = []
        self._load_rows(slots, rows)


class DiskStore(RowStore):
    """Rows in one file per process under `directory`, read and written with pread/pwrite.

    `keep`: how many of the latest snapshots stay restorable (their rows are never
    overwritten); set it to the number of checkpoints the run keeps.
    """

    backend = "disk"

    def __init__(self, algorithm, key, variables, num_clients, *, directory: str | Path, process=None, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the snapshots whose rows stay intact), got {keep}")
        self.keep = keep
        super().__init__(algorithm, key, variables, num_clients, process=process)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"client_rows.{self.process.tag()}.bin"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._stale = True  # rows left by an earlier run: dropped at the first write unless restored

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    @property
    def disk_bytes(self) -> int:
        return os.fstat(self._fd).st_size

    def _read_rows(self, slots, out, positions):
        for slot, k in sorted(zip(slots.tolist(), positions.tolist())):
            view, offset = memoryview(out[k]), slot * self.row_bytes
            while len(view):
                n = os.preadv(self._fd, [view], offset)
                if n <= 0:
                    raise OSError(f"{self.path}: row {slot} is beyond the end of the file")
                view, offset = view[n:], offset + n

    def _write_rows(self, slots, rows, positions):
        if self._stale:
            os.ftruncate(self._fd, 0)
            self._stale = False
        for slot, k in sorted(zip(slots.tolist(), positions.tolist())):
            view, offset = memoryview(np.ascontiguousarray(rows[k])), slot * self.row_bytes
            while len(view):
                n = os.pwrite(self._fd, view, offset)
                view, offset = view[n:], offset + n

    def snapshot(self, directory: str | Path) -> Path:
        """Flushes the rows to disk and writes the slot map, and the slots of the older checkpoints kept
        (which a restore keeps intact too); the rows themselves stay in the store's file."""
        os.fsync(self._fd)
        saved = self.slots.commit()
        return _save_snapshot(Path(directory), self._snapshot_name(),
                              {**self._meta(), "rows_file": self.path.name, "num_slots": self.slots.num_slots},
                              {"slots.npy": saved, "older_slots.npy": self.slots.older_pins()})

    def restore(self, directory: str | Path) -> None:
        """From this store's own snapshot (a slot map into its file), or a device or host store's (whose
        rows it writes into its file)."""
        path, meta = self._read_meta(directory)
        if meta["backend"] != "disk":
            self._stale = True  # the file's rows are not this snapshot's
            self._load_rows(*_read_rows_snapshot(path, meta))
            return
        if meta["rows_file"] != self.path.name:
            raise ValueError(f"the client-state snapshot in {path} refers to rows in {meta['rows_file']}, but this "
                             f"store's rows are in {self.path.name}")
        slots = np.load(path / "slots.npy")
        size = os.fstat(self._fd).st_size
        if size < meta["num_slots"] * self.row_bytes:
            raise ClientRowsLost(
                f"the disk client store's rows file {self.path} holds {size} bytes, fewer than the "
                f"{meta['num_slots']} rows of {self.row_bytes} bytes its checkpoint refers to (missing or cut "
                f"short); every checkpoint keeps its client states in that file, so none can be resumed: start "
                f"the run again with --overwrite")
        self.slots.load(slots, size // max(self.row_bytes, 1), np.load(path / "older_slots.npy"))
        self._stale = False
        self.generation += 1


def make_store(backend: str, algorithm: FederatedAlgorithm, key: jax.Array, variables: Any, num_clients: int, *,
               directory: str | Path | None = None, process: ProcessLayout | None = None,
               keep: int = 2) -> ClientStore:
    """A store of `backend` (device, host or disk; disk needs `directory`, the run folder's store folder)."""
    if backend == "device":
        return DeviceStore(algorithm, key, variables, num_clients, process=process)
    if backend == "host":
        return HostStore(algorithm, key, variables, num_clients, process=process)
    if backend == "disk":
        if directory is None:
            raise ValueError("the disk client store needs a directory (under the run folder) for its rows")
        return DiskStore(algorithm, key, variables, num_clients, directory=directory, process=process, keep=keep)
    raise ValueError(f"unknown client store {backend!r}; valid: {', '.join(BACKENDS)} or auto")


def available_host_memory() -> int:
    """Bytes of host memory available to new allocations (MemAvailable; free pages without /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_device_memory(device=None) -> int | None:
    """Bytes the device can still allocate (its allocator's limit minus what is in use); None on a CPU,
    whose device memory is the host's."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def choose_store(num_clients: int, row_bytes: int, data_bytes: int, *, processes: int = 1,
                 device_free: int | None = None, host_available: int | None = None,
                 fraction: float = AUTO_FRACTION) -> tuple[str, str]:
    """The `auto` rule: (backend, the reason in one line).

    Needed: every client's state (num_clients x row_bytes) plus the clients' training data.
    `device` when that fits in `fraction` (half) of the device's free memory (its allocator's
    limit minus what is in use; on a CPU the host's available memory, which is what the CPU
    device allocates from): the other half is left to the round's work and the evaluations.
    Else `host` when this process's share (1/processes of it) fits in half of the host's
    available memory (MemAvailable); else `disk`. Several processes never use the device
    store. The host store may end up holding less (only clients ever sampled); the rule
    assumes a long run samples them all. `row_bytes`: `RowLayout(client_state_shapes(...)).row_bytes`.
    """
    need = num_clients * row_bytes + data_bytes
    host_available = available_host_memory() if host_available is None else host_available
    if device_free is None:
        device_free = free_device_memory()
    on_cpu = device_free is None
    device_free = host_available if on_cpu else device_free
    gib = lambda b: f"{b / 2 ** 30:.2f} GiB"  # noqa: E731
    what = f"{gib(need)} of client states and data"
    if processes == 1 and need <= fraction * device_free:
        where = "available host memory (a CPU's device memory)" if on_cpu else "free device memory"
        return "device", f"device: {what} fit in {fraction:.0%} of the {gib(device_free)} of {where}"
    share = need / processes
    if share <= fraction * host_available:
        return "host", (f"host: {gib(share)} of client states and data per process fit in {fraction:.0%} of the "
                        f"{gib(host_available)} of available host memory"
                        + ("" if processes > 1 else f", but not in {fraction:.0%} of the device's {gib(device_free)}"))
    return "disk", (f"disk: {gib(share)} of client states and data per process exceed {fraction:.0%} of the "
                    f"{gib(host_available)} of available host memory")
