"""Every client's evaluation where the client states live off the device (host and disk stores):
chunk by chunk through the store, each process its own clients.

A chunk of clients' states comes onto the device (`store.client_states`: initial states where
never written) with their test windows (`data.windows`); `core.evaluation.evaluators.split_evaluator`
scores them as `personalized_evaluator` scores the whole population on the device store (each
client stopping at its own test size), and the algorithm's `client_diagnostics` are taken on
the same chunk. Then every process holds every client's figures in id order
(`core.round.distributed.gather_clients`), so a run's figures do not depend on where the states live.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.client_state.row_store import RowStore
from fedjax_sparse.core.round.distributed import gather_clients
from fedjax_sparse.core.evaluation.evaluators import all_finite
from fedjax_sparse.data.windows import ClientWindows, window_split


@dataclasses.dataclass(frozen=True)
class ClientFigures:
    """accuracies: [N] each client's personalized accuracy; diagnostics: each client's
    `client_diagnostics` ([N, ...] numpy; None when the algorithm has none); finite: whether
    every client's state is finite."""

    accuracies: np.ndarray
    diagnostics: dict | None
    finite: bool


def evaluate_store(algorithm: FederatedAlgorithm, store: RowStore, test: ClientWindows, server_state: Any,
                   evaluate: Callable, chunk: int) -> ClientFigures:
    """The figures of every client of `store` (`test`: this process's clients' test data; `evaluate`:
    a `split_evaluator`; `server_state` on this process's device). `chunk` clients at a time: a
    round's clients per round, which the device holds anyway; the last chunk repeats its last client,
    so every chunk has one shape (one compilation)."""
    process = store.process
    own = np.arange(process.index, store.num_clients, process.count)
    accuracies, figures, finite = [], [], np.bool_(True)
    for start in range(0, len(own), chunk):
        ids = own[start:start + chunk]
        padded = np.concatenate([ids, np.full(chunk - len(ids), ids[-1])]).astype(np.int32)
        states = store.client_states(padded)
        windows = test.windows(padded)
        split = window_split(jnp.asarray(windows.x), jnp.asarray(windows.y), jnp.asarray(windows.counts),
                             jnp.asarray(test.mean), jnp.asarray(test.std), test.max_count)
        accuracies.append(np.asarray(evaluate(server_state, states, split))[:len(ids)])
        if algorithm.client_diagnostics is not None:
            figures.append(jax.tree_util.tree_map(lambda a: np.asarray(a)[:len(ids)],
                                                  algorithm.client_diagnostics(server_state, states)))
        finite &= bool(all_finite(states))
    local = {"accuracies": np.concatenate(accuracies), "finite": np.full(len(own), finite)}
    if figures:
        local["diagnostics"] = jax.tree_util.tree_map(lambda *parts: np.concatenate(parts), *figures)
    population = gather_clients(local, process, store.num_clients)
    return ClientFigures(population["accuracies"], population.get("diagnostics"), bool(population["finite"].all()))
