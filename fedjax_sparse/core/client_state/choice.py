"""Which client store a run gets: `make_store` builds one by name, `choose_store` is `--client-store auto`'s rule
(the device where the states and data fit in half its memory, else host memory where they fit in half of it,
else disk)."""


from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.round.distributed import ProcessLayout

from fedjax_sparse.core.client_state.row_store import DiskStore, HostStore
from fedjax_sparse.core.client_state.store import ClientStore, DeviceStore

BACKENDS = ("device", "host", "disk")
AUTO_FRACTION = 0.5


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
