"""Rounds over a client store: the same round step, fed with the sampled clients' rows and windows.

    host: ids = sample(seed, r) -> read the K rows and data windows this process owns
    jit:  combine the processes' blocks -> initial states where never written -> round_step -> pack
    host: write the new rows of this process's clients

With the device store the whole round is `core.round.step.build_round`'s jit. With the host and
disk stores, round r+1's reads run in a background thread while round r computes (JAX
dispatches asynchronously); clients sampled in both rounds then take round r's new rows,
so the results are those of reading after the write. Several processes: each reads and
writes only its own clients; the server state, the round's outputs and the new rows come
back replicated, and each process keeps what it owns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.client_state.rows import RowLayout
from fedjax_sparse.core.client_state.row_store import RowStore, populated_rows
from fedjax_sparse.core.client_state.store import ClientStore, DeviceStore, materialize
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.round.cpu import CpuRound
from fedjax_sparse.core.round.distributed import combine_blocks, process_blocks, replicated, replicated_sharding
from fedjax_sparse.core.round.step import (RoundConditions, RoundOutput, check_clients_per_round, default_conditions,
                                      device_round, round_step)
from fedjax_sparse.data.federated import FederatedSplit
from fedjax_sparse.data.windows import ClientWindows, window_split


@dataclasses.dataclass
class _Inputs:
    """What the host prepares for one round: the ids, this process's rows and data windows."""

    round_index: int
    generation: int
    ids: np.ndarray
    dispatched: np.ndarray
    rows: np.ndarray
    held: np.ndarray
    x: np.ndarray
    y: np.ndarray
    counts: np.ndarray


@functools.lru_cache(maxsize=32)
def _device_round(algorithm: FederatedAlgorithm, clients_per_round: int, seed: int, mesh: Mesh | None,
                  client_chunk: int | None, conditions: RoundConditions):
    """The device store's jitted round, the data an argument (one per configuration)."""
    return jit(device_round(algorithm, clients_per_round, seed=seed, mesh=mesh, client_chunk=client_chunk,
                            conditions=conditions), donate_argnums=(1,))


@functools.lru_cache(maxsize=32)
def _row_round(algorithm: FederatedAlgorithm, layout: RowLayout, key_impl: str, clients_per_round: int,
               max_count: int, augment: bool, seed: int, mesh: Mesh | None, client_chunk: int | None,
               conditions: RoundConditions):
    """The jitted round of the row stores; one per configuration, shared by the host and disk stores."""
    k, m = conditions.sampler.slots, max_count
    step = round_step(algorithm, k, seed=seed, mesh=mesh, client_chunk=client_chunk, conditions=conditions)

    def row_round(server_state, key_data, variables, blocks, mean, std, ids, dispatched, round_index):
        rows, held, x, y, counts = combine_blocks(blocks)
        key = jax.random.wrap_key_data(key_data, impl=key_impl)
        sampled = materialize(algorithm, layout, rows, held, ids, key, variables)
        view = window_split(x, y, counts, mean, std, m, augment)
        server_state, new_states, out = step(server_state, sampled, view, jnp.arange(k), ids, round_index, dispatched)
        return server_state, layout.pack(new_states, k), out

    if mesh is None:
        return jit(row_round)
    return jit(row_round, out_shardings=replicated_sharding(mesh))


class StoreRound:
    """`round(server_state, round_index) -> (server_state, RoundOutput)` over `store` and `data`.

    store: a `DeviceStore` with `data` the population's `FederatedSplit` on the device, or a
      host/disk store with `data` this process's `ClientWindows` (`HostData`, or generated clients).
    mesh: shards the sampled clients (`core.round.distributed.process_mesh()`; required with
      several processes). prefetch: read round r+1's inputs while round r computes.
    cpu_devices: with the device store, several CPU devices sharing the sampled clients
      (`core.round.cpu`; `round_devices` chooses them).
    conditions: who is sampled, the clock and stragglers (`core.round.step.RoundConditions`; default: K of
      the clients uniformly, all returning); its sampler's slots are the round's K.
    """

    def __init__(self, algorithm: FederatedAlgorithm, store: ClientStore, data: FederatedSplit | ClientWindows,
                 clients_per_round: int, *, seed: int, mesh: Mesh | None = None, client_chunk: int | None = None,
                 prefetch: bool = True, cpu_devices: Sequence[Any] = (), conditions: RoundConditions | None = None):
        check_clients_per_round(clients_per_round, store.num_clients)
        conditions = conditions or default_conditions(store.num_clients, clients_per_round)
        self.conditions = conditions
        clients_per_round = conditions.sampler.slots
        if data.num_clients != store.num_clients:
            raise ValueError(f"the data hold {data.num_clients} clients but the store {store.num_clients}")
        if jax.process_count() > 1 and mesh is None:
            raise ValueError("with several processes the round needs the global mesh "
                             "(core.round.distributed.process_mesh())")
        self.store, self.data, self.seed, self.mesh = store, data, seed, mesh
        self.clients_per_round = clients_per_round
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._next: concurrent.futures.Future | None = None
        self._next_generation = 0
        if isinstance(store, DeviceStore):
            if not isinstance(data, FederatedSplit):
                raise ValueError("the device store trains on the population's FederatedSplit on the device")
            self.cpu_devices = list(cpu_devices) if len(cpu_devices) > 1 else []
            if self.cpu_devices:
                cpu_round = CpuRound(algorithm, data, clients_per_round, seed=seed, client_chunk=client_chunk,
                                     devices=self.cpu_devices, conditions=conditions)
                self._device_round = lambda server_state, states, _, round_index: cpu_round(server_state, states,
                                                                                           round_index)
            else:
                self._device_round = _device_round(algorithm, clients_per_round, seed, mesh, client_chunk, conditions)
            return
        if len(cpu_devices) > 1:
            raise ValueError("several CPU devices train the clients of the device store only")
        self.cpu_devices = []
        if not isinstance(store, RowStore) or not isinstance(data, ClientWindows):
            raise ValueError("the host and disk stores train on this process's ClientWindows (data.windows)")
        self._row_round = _row_round(algorithm, store.layout, store.key_impl, clients_per_round, data.max_count,
                                     data.augment, seed, mesh, client_chunk, conditions)
        self._constants = replicated((jax.random.key_data(store.init_key), store.init_variables, data.mean,
                                      data.std), mesh)
        if prefetch:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        # Two row buffers, used by alternate rounds: a round's buffer is filled again two rounds
        # later, when the round that copied it to the device has finished.
        self._buffers = [populated_rows(clients_per_round, store.row_bytes) for _ in range(2)]

    def __call__(self, server_state: Any, round_index: int, *, prefetch_next: bool = True) -> tuple[Any, RoundOutput]:
        """Runs round `round_index`; `prefetch_next=False` on the last round skips reading a next one."""
        if isinstance(self.store, DeviceStore):
            server_state, self.store.states, out = self._device_round(server_state, self.store.states, self.data,
                                                                      round_index)
            return server_state, out
        inputs = self._prefetched(round_index) or self._prepare(round_index)
        key_data, variables, mean, std = self._constants
        blocks = process_blocks((inputs.rows, inputs.held, inputs.x, inputs.y, inputs.counts), self.mesh)
        server_state, new_rows, out = self._row_round(replicated(server_state, self.mesh), key_data, variables,
                                                      blocks, mean, std, inputs.ids, inputs.dispatched,
                                                      np.int32(round_index))
        if self._pool is not None and prefetch_next:
            self._next_generation = self.store.generation
            self._next = self._pool.submit(self._prepare, round_index + 1)
        rows = np.asarray(new_rows)  # waits for the round; the next round's reads run meanwhile
        upcoming = self._next.result() if self._next is not None else None
        self.store.write(inputs.ids, rows)
        if upcoming is not None:
            self._take_new_rows(upcoming, inputs.ids, rows)
        # as the device store's round reports it (the host's draw was checked against the slots already)
        return server_state, out.replace(clients_drawn=np.int32(inputs.dispatched.sum()))

    # what a checkpoint keeps: the server state alone (every client's lies in the store); an asynchronous
    # round (`core.round.buffered`) keeps its updates in flight too
    def saved_state(self, server_state):
        return server_state

    def saved_meta(self) -> dict:
        return {}

    def resumed(self, state, meta: dict):
        if "buffered" in meta:
            raise ValueError("the checkpoint was written by asynchronous rounds; resume it with its --async-buffer")
        return state

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _prepare(self, round_index: int) -> _Inputs:
        ids, dispatched = self.conditions.sampler.host(self.seed, round_index)
        rows, held = self.store.read(ids, out=self._buffers[round_index % 2])
        windows = self.data.windows(ids)
        return _Inputs(round_index, self.store.generation, ids, dispatched, rows, held, windows.x, windows.y,
                       windows.counts)

    def _prefetched(self, round_index: int) -> _Inputs | None:
        """The prefetched inputs if they are this round's and the store was not restored since."""
        future, self._next = self._next, None
        if future is None:
            return None
        try:
            inputs = future.result()
        except Exception:  # noqa: BLE001 - a read that raced a restore; any other failure is raised
            if self._next_generation != self.store.generation:
                return None
            raise
        if inputs.round_index != round_index or inputs.generation != self.store.generation:
            return None
        return inputs

    def _take_new_rows(self, upcoming: _Inputs, ids: np.ndarray, rows: np.ndarray) -> None:
        """Clients of the prefetched round that this round just trained take their new rows."""
        position = {int(c): k for k, c in enumerate(ids)}
        owned = self.store.process.owns(upcoming.ids)
        for j, client in enumerate(upcoming.ids.tolist()):
            if owned[j] and client in position:
                upcoming.rows[j] = rows[position[client]]
                upcoming.held[j] = True
