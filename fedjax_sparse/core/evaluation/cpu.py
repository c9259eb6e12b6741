"""Personalized evaluation with its clients on every core of a CPU, as `core.round.cpu` trains a round's.

On a CPU `core.evaluation.evaluators.split_evaluator` scores one client at a time (`default_evaluation_chunk`),
each client by the same program, so contiguous shares of the clients scored on several CPU devices
give each client's accuracy of one device bit for bit, concatenated in client order
(tests/test_cpu_round.py). It pays where the work is large enough to hide the copies and the calls:
measured on 2 cores (benchmarks/results/evaluation_share_2xcpu_2026-11-26.md, the whole evaluation
with the global model's), FedProx's synthetic clients of at most 100 test examples took 0.89x the
time on two devices at 20 clients (2,000 padded test examples), 1.07x at 50, 1.15x at 100, 1.32x at
200 and 1.56x at 1,000; 200 digits clients (800 padded examples) 0.99x.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from fedjax_sparse.core.round.cpu import client_shares
from fedjax_sparse.data.federated import FederatedSplit

MIN_SLOTS_PER_DEVICE = 5_000  # padded test examples (clients x largest client) a device takes at least


def evaluation_devices(num_clients: int, max_count: int, chunk: int | None, devices: Sequence[Any], *,
                       chosen: bool = False) -> list[Any]:
    """The devices that share a personalized evaluation: several only where each client is scored alone
    (`chunk` 1: a group's vmapped program would change with the share) and, unless `chosen` (the
    user's number), each device gets `MIN_SLOTS_PER_DEVICE` padded examples; two clients each at least
    (the evaluator takes a single client in a program of its own)."""
    if chunk != 1 or not devices:
        return list(devices[:1])
    count = len(devices) if chosen else num_clients * max_count // MIN_SLOTS_PER_DEVICE
    return list(devices[:max(1, min(len(devices), num_clients // 2, count))])


class CpuEvaluator:
    """`evaluate(server_state, client_states, test) -> [M] accuracies` as `evaluate`
    (`core.evaluation.evaluators.split_evaluator`, scoring one client at a time) gives them, over several CPU
    devices. The test split is copied to every device once (again only for another split)."""

    def __init__(self, evaluate: Callable[[Any, Any, FederatedSplit], jax.Array], devices: Sequence[Any]):
        if len(devices) < 2:
            raise ValueError(f"a CpuEvaluator shares clients among several devices, got {len(devices)}")
        self.devices = list(devices)
        self._evaluate = evaluate
        self._test: FederatedSplit | None = None
        self._views: list[tuple[tuple[int, int], FederatedSplit]] = []

    def _share_views(self, test: FederatedSplit) -> list[tuple[tuple[int, int], FederatedSplit]]:
        if test is not self._test:
            # contiguous shares of two clients at least, the first ones one more (chunks of one client)
            shares = client_shares(test.num_clients, 1, max(1, min(len(self.devices), test.num_clients // 2)))
            copies = [jax.device_put(test, device) for device in self.devices[:len(shares)]]
            self._views = [((start, stop), dataclasses.replace(copy, offsets=copy.offsets[start:stop],
                                                               counts=copy.counts[start:stop]))
                           for (start, stop), copy in zip(shares, copies)]
            self._test = test
        return self._views

    def __call__(self, server_state, client_states, test: FederatedSplit) -> jax.Array:
        outputs = []
        for device, ((start, stop), view) in zip(self.devices, self._share_views(test)):
            # dispatched without waiting: the devices score their shares at once
            share = jax.tree_util.tree_map(lambda a: a[start:stop], client_states)
            outputs.append(self._evaluate(*jax.device_put((server_state, share), device), view))
        return jnp.concatenate(jax.device_put(outputs, self.devices[0]))
