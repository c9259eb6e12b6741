"""Where client states live: on the device, in host memory or in files, and their checkpoints.

- `DeviceStore`: every client's state on the device ([N, ...] arrays), gathered and scattered
  inside the jitted round (`core.round.step.build_round`): the fastest layout, for when it fits.
- `HostStore`: rows of bytes in host memory; `DiskStore`: rows in a file under the run folder,
  read and written with pread/pwrite (no memory map, so the rows never count in the process's
  resident memory). Both hold only clients that were ever written: a client never sampled
  has its algorithm's initial state (`FederatedAlgorithm.init_clients`, computed on the
  device when sampled), so 10^6 clients cost nothing until they train.

A client's state travels as one row of bytes (`core.client_state.rows.RowLayout`): its leaves' bytes
one after the other, packed and unpacked inside the jitted round, so a round moves one
[K, row_bytes] block each way, and the blocks of several processes combine exactly (`core.round.distributed`).

Crash safety without copying the disk store at each checkpoint: a row that a kept
checkpoint refers to is never overwritten (`SlotMap`). A client written after a checkpoint
gets a fresh slot (or a freed one) and its old slot is freed once no kept checkpoint
refers to it, so the file holds about (clients ever written + K x rounds between
checkpoints) rows. `snapshot(directory)` flushes the rows (fsync) and writes the slot map
(the host and device stores write their rows themselves, `core.client_state.snapshots`);
`restore(directory)` reads it back. Each snapshot is checksummed (`core.client_state.snapshots`), and
the disk store's records a CRC-32 of every row it refers to, so rows damaged in the file since
are refused rather than restored (`DiskStore`).

`choose_store` is the `auto` rule.
"""

from __future__ import annotations

import functools
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.client_state.rows import RowLayout, SlotMap
from fedjax_sparse.core.round.distributed import ProcessLayout
from fedjax_sparse.core.client_state.snapshots import (ClientRowsLost, SnapshotError, checkpoint_of, damaged,
                                                read_rows_snapshot, read_snapshot_meta, save_snapshot,
                                                verify_snapshot)

tree_map = jax.tree_util.tree_map
BACKENDS = ("device", "host", "disk")
AUTO_FRACTION = 0.5


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


# ------------------------------------------------------------------ the stores


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
        verify_snapshot(path, meta)
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
        return save_snapshot(Path(directory), self._snapshot_name(), self._meta(),
                              {"slots.npy": np.arange(self.num_clients, dtype=np.int64),
                               "rows.npy": np.asarray(pack(self.states))})

    def restore(self, directory: str | Path) -> None:
        path, meta = self._read_meta(directory)
        slots, rows = read_rows_snapshot(path, meta)
        held = slots >= 0
        dense = np.zeros((self.num_clients, self.row_bytes), np.uint8)
        dense[held] = rows[slots[held]]
        self.states = self._merge(dense, held, np.arange(self.num_clients, dtype=np.int32))
        self.generation += 1


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
        return save_snapshot(Path(directory), self._snapshot_name(), self._meta(),
                              {"slots.npy": slots, "rows.npy": rows})

    def restore(self, directory: str | Path) -> None:
        path, meta = self._read_meta(directory)
        slots, rows = read_rows_snapshot(path, meta)
        self._chunks = []
        self._load_rows(slots, rows)


class DiskStore(RowStore):
    """Rows in one file per process under `directory`, read and written with pread/pwrite.

    `keep`: how many of the latest snapshots stay restorable (their rows are never
    overwritten); set it to the number of checkpoints the run keeps.

    The rows live outside the checkpoints, so a snapshot records a CRC-32 of each row it refers to,
    and a restore refuses rows that no longer match. A snapshot checksums only the rows written since
    the one before (read back from the file, most likely still in the page cache): a row not written
    since is the same bytes, a slot a kept snapshot refers to being never overwritten. The rounds in
    between pay nothing but noting which slots they wrote.
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
        self._row_crc = np.zeros(0, np.uint32)  # by slot: the CRC-32 of its row when last snapshotted
        self._written: set[int] = set()  # slots written since the last snapshot

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
            self._row_crc, self._written = np.zeros(0, np.uint32), set()
        self._written.update(slots.tolist())
        for slot, k in sorted(zip(slots.tolist(), positions.tolist())):
            view, offset = memoryview(np.ascontiguousarray(rows[k])), slot * self.row_bytes
            while len(view):
                n = os.pwrite(self._fd, view, offset)
                view, offset = view[n:], offset + n

    def _row_crcs(self, slots: np.ndarray, chunk_bytes: int = 16 << 20) -> np.ndarray:
        """The CRC-32 of each of these slots' rows in the file, read a chunk of rows at a time."""
        crcs = np.zeros(len(slots), np.uint32)
        per_chunk = max(1, chunk_bytes // max(self.row_bytes, 1))
        for start in range(0, len(slots), per_chunk):
            part = slots[start:start + per_chunk]
            rows = np.empty((len(part), self.row_bytes), np.uint8)
            self._read_rows(part, rows, np.arange(len(part)))
            crcs[start:start + len(part)] = [zlib.crc32(row) for row in rows]
        return crcs

    def snapshot(self, directory: str | Path) -> Path:
        """Flushes the rows to disk and writes the slot map, the slots of the older checkpoints kept
        (which a restore keeps intact too) and the CRC-32 of each row the map refers to; the rows
        themselves stay in the store's file."""
        os.fsync(self._fd)
        saved = self.slots.commit()
        self._row_crc = np.pad(self._row_crc, (0, max(0, self.slots.num_slots - len(self._row_crc))))
        fresh = np.array(sorted(self._written.intersection(saved[saved >= 0].tolist())), np.int64)
        self._row_crc[fresh] = self._row_crcs(fresh)
        self._written = set()
        row_crc = np.zeros(len(saved), np.uint32)  # by local client, as slots.npy
        row_crc[saved >= 0] = self._row_crc[saved[saved >= 0]]
        return save_snapshot(Path(directory), self._snapshot_name(),
                              {**self._meta(), "rows_file": self.path.name, "num_slots": self.slots.num_slots},
                              {"slots.npy": saved, "older_slots.npy": self.slots.older_pins(),
                               "row_crc32.npy": row_crc})

    def restore(self, directory: str | Path) -> None:
        """From this store's own snapshot (a slot map into its file), or a device or host store's (whose
        rows it writes into its file)."""
        path, meta = self._read_meta(directory)
        if meta["backend"] != "disk":
            self._stale = True  # the file's rows are not this snapshot's
            self._load_rows(*read_rows_snapshot(path, meta))
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
        held = slots >= 0
        # None: a snapshot written before the checksums, whose rows are taken as they are
        recorded = np.load(path / "row_crc32.npy") if (path / "row_crc32.npy").exists() else None
        if recorded is not None:
            bad = np.flatnonzero(held)[self._row_crcs(slots[held]) != recorded[held]]
            if len(bad):
                clients = bad * self.process.count + self.process.index
                shown = ", ".join(map(str, clients[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                raise SnapshotError(damaged(f"the rows of client{'s' if len(bad) > 1 else ''} {shown} in the disk "
                                            f"client store's file {self.path}", checkpoint_of(path)))
        self.slots.load(slots, size // max(self.row_bytes, 1), np.load(path / "older_slots.npy"))
        self._row_crc = np.zeros(self.slots.num_slots, np.uint32)
        if recorded is not None:
            self._row_crc[slots[held]] = recorded[held]
        self._written = set() if recorded is not None else set(slots[held].tolist())
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
                 fraction: float = AUTO_FRACTION, data_on_disk: bool = False) -> tuple[str, str]:
    """The `auto` rule: (backend, the reason in one line).

    Needed: every client's state (num_clients x row_bytes) plus the clients' training data.
    `device` when that fits in `fraction` (half) of the device's free memory (its allocator's
    limit minus what is in use; on a CPU the host's available memory, which is what the CPU
    device allocates from): the other half is left to the round's work and the evaluations.
    Else `host` when this process's share (1/processes of it) fits in half of the host's
    available memory (MemAvailable); else `disk`. Several processes never use the device
    store. The host store may end up holding less (only clients ever sampled); the rule
    assumes a long run samples them all. `row_bytes`: `RowLayout(client_state_shapes(...)).row_bytes`.
    `data_on_disk`: the clients' data is read from files a round at a time (`--dataset mmap:`), which
    the device store would load whole: it is never chosen then.
    """
    need = num_clients * row_bytes + data_bytes
    host_available = available_host_memory() if host_available is None else host_available
    if device_free is None:
        device_free = free_device_memory()
    on_cpu = device_free is None
    device_free = host_available if on_cpu else device_free
    gib = lambda b: f"{b / 2 ** 30:.2f} GiB"  # noqa: E731
    what = f"{gib(need)} of client states and data"
    if processes == 1 and not data_on_disk and need <= fraction * device_free:
        where = "available host memory (a CPU's device memory)" if on_cpu else "free device memory"
        return "device", f"device: {what} fit in {fraction:.0%} of the {gib(device_free)} of {where}"
    share = need / processes
    if share <= fraction * host_available:
        return "host", (f"host: {gib(share)} of client states and data per process fit in {fraction:.0%} of the "
                        f"{gib(host_available)} of available host memory"
                        + ("" if processes > 1 else ", the data read from its files" if data_on_disk else
                           f", but not in {fraction:.0%} of the device's {gib(device_free)}"))
    return "disk", (f"disk: {gib(share)} of client states and data per process exceed {fraction:.0%} of the "
                    f"{gib(host_available)} of available host memory")
