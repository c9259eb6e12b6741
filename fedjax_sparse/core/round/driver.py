"""One interface for every way a round runs: where client states live and how clients spread are parameters.

A run drives its rounds through a `RoundDriver`, whichever placement computes them:

    synchronous (`core.round.store.StoreRound`): the device store's one jit (`core.round.step.build_round`),
        its clients over several CPU devices (`core.round.cpu`), or the host and disk stores' rows and
        windows, over processes and devices with a mesh;
    asynchronous (`core.round.buffered.BufferedRound`): FedBuff's buffered steps on the simulated clock,
        over any client store.

All of them compute the clients through `core.round.step.client_phase` and the server through its
`server_phase` or the algorithm's `server_update`, so participation masks, the clock and stragglers are
written once. `round_driver` builds the one a run asks for.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
from jax.sharding import Mesh

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.round.buffered import Buffering, BufferedRound
from fedjax_sparse.core.client_state.store import ClientStore
from fedjax_sparse.core.round.step import RoundConditions, RoundOutput
from fedjax_sparse.core.round.store import StoreRound
from fedjax_sparse.data.federated import FederatedSplit
from fedjax_sparse.data.windows import ClientWindows


ONE_DEVICE = ("asynchronous rounds (--async-buffer) run in one process on one device: give no --shard-clients and "
              "no --cpu-devices above 1")


class RoundDriver(Protocol):
    """What a run's loop needs of its rounds.

    __call__(server_state, round_index, prefetch_next=True) -> (server_state, RoundOutput): runs round
      `round_index` (rounds run in order; a synchronous driver may be asked for any); `prefetch_next=False`
      on the last round;
    conditions: the federation it simulates; mesh, cpu_devices: how its clients spread (None, []: one
      device); store: where the client states live;
    saved_state(server_state) -> the arrays a checkpoint keeps; saved_meta() -> the JSON it keeps beside
      them; resumed(saved, meta) -> the server state, the driver restored with it;
    close(): ends background work (a prefetching thread)."""

    conditions: RoundConditions
    mesh: Mesh | None
    cpu_devices: list
    store: ClientStore

    def __call__(self, server_state: Any, round_index: int, *, prefetch_next: bool = True
                 ) -> tuple[Any, RoundOutput]: ...

    def saved_state(self, server_state: Any) -> Any: ...

    def saved_meta(self) -> dict: ...

    def resumed(self, saved: Any, meta: dict) -> Any: ...

    def close(self) -> None: ...


def round_driver(algorithm: FederatedAlgorithm, store: ClientStore, data: FederatedSplit | ClientWindows,
                 clients_per_round: int, *, seed: int, conditions: RoundConditions, counts: np.ndarray,
                 buffering: Buffering | None = None, mesh: Mesh | None = None, client_chunk: int | None = None,
                 cpu_devices: Sequence[Any] = (), prefetch: bool = True) -> RoundDriver:
    """The rounds of a run: synchronous, or asynchronous where `buffering` is given (FedBuff's buffer,
    concurrency and staleness weighting). `counts`: every client's training examples."""
    if buffering is None:
        return StoreRound(algorithm, store, data, clients_per_round, seed=seed, mesh=mesh, client_chunk=client_chunk,
                          prefetch=prefetch, cpu_devices=cpu_devices, conditions=conditions)
    if mesh is not None or len(cpu_devices) > 1:
        raise ValueError(ONE_DEVICE)
    return BufferedRound(algorithm, store, data, buffering, seed=seed, conditions=conditions, counts=counts,
                         client_chunk=client_chunk)
