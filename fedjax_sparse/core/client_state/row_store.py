"""Client states as rows of bytes: in host memory (`HostStore`) or in a file under the run folder (`DiskStore`),
only the clients ever written, each checkpoint's rows kept until no kept checkpoint needs them (the
`store` module's docstring says how)."""


from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import chex
import jax
import numpy as np

from fedjax_sparse.core.client_state.rows import SlotMap
from fedjax_sparse.core.client_state.snapshots import (ClientRowsLost, SnapshotError, checkpoint_of, damaged,
                                                read_rows_snapshot, save_snapshot)

from fedjax_sparse.core.client_state.store import ClientStore

tree_map = jax.tree_util.tree_map


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
