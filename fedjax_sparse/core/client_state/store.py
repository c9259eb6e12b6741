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

The host and disk stores are `row_store`'s, `choose_store` (`choice`) is the `auto` rule.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.client_state.rows import RowLayout
from fedjax_sparse.core.round.distributed import ProcessLayout
from fedjax_sparse.core.client_state.snapshots import (read_rows_snapshot, read_snapshot_meta, save_snapshot, verify_snapshot)

tree_map = jax.tree_util.tree_map


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
