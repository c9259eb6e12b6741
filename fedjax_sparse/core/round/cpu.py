"""The device store's round with its clients on every core of a CPU: one JAX CPU device per core.

XLA:CPU runs a computation's small operations on one thread, so a round of small clients keeps one
core busy whatever the host has. With several CPU devices (`use_cpu_cores`, set before JAX starts
its backends) the round is jitted calls on each instead of `core.round.step.build_round`'s one:

    device 0:      sample, gather the K clients' states, cut them into contiguous shares of whole chunks
                   (in slot order, or balanced by local steps: `core.round.device_split`)
    every device:  `client_phase` over its share, all dispatched before any is waited for
    device 0:      the shares' outputs, copied back in client order -> `server_phase` -> scatter

Each device runs the same single-device program as one device would over its clients (in chunks of
the same size), and the server reduces all K uploads in client order, so a run's figures do not
depend on the number of devices (tests/test_cpu_round.py). Not one SPMD program over the devices:
XLA:CPU's collectives synchronize devices slowly enough to cost more than the second core brings,
and a partitioned program compiles a client's arithmetic otherwise than one device does (a division by
one value per client stays a division there, where one device multiplies by its reciprocal: FedPM's
Adam moments differ in the last bits, docs/scale.md). The price is one compilation of the clients'
program per device.
`benchmarks.round_throughput` measures what it brings.

Large buffers. glibc returns a freed block larger than its mmap threshold (dynamic, at most
32 MiB) to the operating system, so each round's [K, ...] uploads are faulted in page by page again:
on 2 cores that took about 14 ms of a 30 ms MLP round at 100 clients. `keep_freed_memory` raises the
thresholds so freed blocks are reused; the process keeps its peak memory instead of returning it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.round.device_split import balanced_order, device_groups
from fedjax_sparse.core.round.step import (RoundConditions, RoundOutput, client_flops, check_clients_per_round,
                                      client_keys, client_phase, default_conditions, keep_absent, round_info,
                                      server_phase)
from fedjax_sparse.data.federated import FederatedSplit

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MIN_CHUNKS_PER_DEVICE = 4


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def use_cpu_cores(count: int | None = None) -> int:
    """Asks JAX for `count` CPU devices (default: one per usable core); returns how many it has.

    Takes effect only before JAX starts its backends (the first computation or device query);
    afterwards the devices it has are kept and their number returned. Accelerators are untouched.
    """
    count = usable_cores() if count is None else count
    if count < 1:
        raise ValueError(f"the number of CPU devices must be at least 1, got {count}")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backends are running: keep their devices
        pass
    return len(jax.local_devices(backend="cpu"))


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Lets glibc's allocator keep freed blocks up to 1 GiB for reuse (see the module's docstring);
    False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))


def round_devices(clients_per_round: int, client_chunk: int | None, devices: Sequence[Any], *,
                  chosen: bool = False) -> list[Any]:
    """The devices that share a round's clients, one chunk each at least.

    Unless `chosen` (the user's number), where it pays, measured on 2 cores
    (benchmarks/results/cpu_cores_2xcpu_2026-11-24.md): clients small enough that several fit the cache
    (`default_client_chunk` > 1; a larger model's operations XLA already spreads over the cores, and
    the spafl CNN ran no faster on two devices) and at least 4 chunks per device (10 MLP clients
    ran slower on two devices than on one: the copies and calls cost more than the second core
    brings). One device without chunks (one vmap of all: an accelerator's layout)."""
    if client_chunk is None or not devices:
        return list(devices[:1])
    chunks = clients_per_round // client_chunk
    if chosen:
        return list(devices[:min(len(devices), chunks)])
    if client_chunk == 1:
        return list(devices[:1])
    return list(devices[:max(1, min(len(devices), chunks // MIN_CHUNKS_PER_DEVICE))])


def client_shares(clients_per_round: int, client_chunk: int, num_devices: int) -> list[tuple[int, int]]:
    """(start, stop) of each device's clients: whole chunks (a remainder would be a program of its own,
    whose floats differ in the last bits), as many on each device as can be, the first ones one more."""
    if client_chunk < 1 or clients_per_round % client_chunk:
        raise ValueError(f"a chunk of {client_chunk} does not divide the {clients_per_round} clients per round")
    chunks = clients_per_round // client_chunk
    if not 1 <= num_devices <= chunks:
        raise ValueError(f"{num_devices} devices cannot share {chunks} chunks of {client_chunk} clients: give "
                         f"between 1 and {chunks}")
    counts = [chunks // num_devices + (g < chunks % num_devices) for g in range(num_devices)]
    stops = np.cumsum(counts) * client_chunk
    return [(int(stop - count * client_chunk), int(stop)) for count, stop in zip(counts, stops)]


class CpuRound:
    """`round(server_state, client_states, round_index) -> (server_state, client_states, RoundOutput)`,
    the device store's round (as `core.round.step.build_round`) over several CPU devices.

    The client states and the server state live on `devices[0]`; the data are copied to every
    device once. Each device trains whole chunks (`client_shares`)."""

    def __init__(self, algorithm: FederatedAlgorithm, train: FederatedSplit, clients_per_round: int, *, seed: int,
                 client_chunk: int, devices: Sequence[Any], conditions: RoundConditions | None = None):
        check_clients_per_round(clients_per_round, train.num_clients)
        conditions = conditions or default_conditions(train.num_clients, clients_per_round)
        k = conditions.sampler.slots
        shares = client_shares(k, client_chunk, len(devices))
        self.devices = list(devices)
        self._data = [jax.device_put(train, device) for device in self.devices]
        self._train = jit(client_phase(algorithm, client_chunk))
        server = server_phase(algorithm, k, seed, conditions)

        split = conditions.split
        groups = device_groups(k, client_chunk=client_chunk, num_devices=len(self.devices))

        def trained_order(counts, ids):
            """The slots in the order the devices' shares hold them: balanced (`core.round.device_split`), or as drawn."""
            return None if split is None else balanced_order(split.steps(counts[ids]), ids, *groups)

        def prepare(client_states, counts, round_index):
            drawn = conditions.sampler(seed, round_index)
            ids = drawn.ids
            sampled = jax.tree_util.tree_map(lambda a: a[ids], client_states)
            clients = (sampled, ids, client_keys(seed, round_index, ids))
            order = trained_order(counts, ids)
            if order is not None:
                clients = jax.tree_util.tree_map(lambda a: a[order], clients)
            return drawn, round_info(seed, round_index, ids), [jax.tree_util.tree_map(lambda a: a[start:stop], clients)
                                                               for start, stop in shares]

        def finish(server_state, client_states, counts, drawn, info, shares):
            ids = drawn.ids
            ups, new_states, metrics, down_bytes = jax.tree_util.tree_map(lambda *x: jnp.concatenate(x), *shares)
            order = trained_order(counts, ids)
            if order is not None:  # back in client order
                back = jnp.argsort(order)
                ups, new_states, metrics, down_bytes = jax.tree_util.tree_map(lambda x: x[back],
                                                                              (ups, new_states, metrics, down_bytes))
            # as in core.round.step.round_step: the server's update compiles apart from what feeds it (a sum
            # over a concatenation would otherwise become a sum of the shares' sums)
            weights = counts[ids].astype(jnp.float32)
            clocked = ((client_flops(metrics, weights, conditions) if conditions.timed else None, down_bytes)
                       if conditions.reads_clients else (None, None))
            ups, weights = jax.lax.optimization_barrier((ups, weights))
            server_state, server_metrics, up_bytes, priced_down, seconds, returns = server(
                server_state, ups, weights, info, drawn.dispatched, *clocked)
            if conditions.varies:
                new_states = keep_absent(new_states, jax.tree_util.tree_map(lambda a: a[ids], client_states),
                                         returns.returned)
            down_bytes = down_bytes if priced_down is None else priced_down
            client_states = jax.tree_util.tree_map(lambda a, new: a.at[ids].set(new), client_states, new_states)
            return server_state, client_states, RoundOutput(ids, up_bytes, down_bytes, metrics, drawn.dispatched,
                                                            seconds, returns, drawn.drawn, server_metrics)

        self._prepare: Callable = jit(prepare)
        self._finish: Callable = jit(finish, donate_argnums=(1,))

    def __call__(self, server_state, client_states, round_index):
        # committed to the first device from the first round on, as the rounds return them (else the
        # second round would compile again)
        server_state, client_states = jax.device_put((server_state, client_states), self.devices[0])
        drawn, info, shares = self._prepare(client_states, self._data[0].counts,
                                            jnp.asarray(round_index, jnp.int32))
        outputs = []
        for device, data, share in zip(self.devices, self._data, shares):
            # dispatched without waiting: the devices train their shares at once
            server_copy, (sampled, share_ids, keys), info_copy = jax.device_put((server_state, share, info), device)
            outputs.append(self._train(server_copy, sampled, share_ids, share_ids, keys, data, info_copy))
        shares = jax.device_put(outputs, self.devices[0])
        return self._finish(server_state, client_states, self._data[0].counts, drawn, info, shares)
