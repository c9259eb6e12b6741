"""Several processes, one run: JAX's multi-controller runtime (`jax.distributed`), no process pool.

Every process runs the same program. `initialize` joins the processes (from an explicit
coordinator address, process count and id, or from what JAX detects in a SLURM, Open MPI or
TPU environment); afterwards `jax.devices()` lists every process's devices and one jitted
round spans them all. Process p owns the clients with id % P == p (`ProcessLayout`) and
holds only their data and states; the server state is replicated on every device.

Inputs that only some processes hold reach the round as blocks: each process fills a
[K, ...] block with its own clients' rows at their positions in the sampled list and zeros
elsewhere; `process_blocks` makes the global [P, K, ...] array of them (one block per
process) and the round takes the elementwise max over P, which is exact (every entry is
held by exactly one process; rows are raw bytes, labels and counts are >= 0; float features,
which may be negative, take the sum, `combine_blocks`). The result is
sharded over every device of the `processes` x `clients` mesh (`process_mesh`).

What is not a round (evaluation, a run's decisions) runs in each process on its own device,
and the small results every process needs are exchanged with `jax.experimental.multihost_utils`:
each client's figures (`gather_clients`), a stop signal and a checkpoint falling due
(`max_over_processes`), whether every process got through a step that may fail in one of them
(`agree`), so that no process waits in a collective for one that has given up.

On CPU, processes reach each other through gloo collectives, so two processes on one
machine run the same code a multi-host GPU or TPU job runs.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_sparse.core.round.step import CLIENTS_AXIS
from fedjax_sparse.data.process_layout import ProcessLayout  # noqa: F401 - re-exported

PROCESSES_AXIS = "processes"
LAUNCH_FAILURE_EXIT = 3
DEFAULT_TIMEOUT_S = 60


_meeting_timeout_s = DEFAULT_TIMEOUT_S  # `initialize`'s: how long processes wait for each other to meet
HEARTBEAT_FACTOR = 5  # JAX's heartbeat timeout, in meeting timeouts (`meeting_timeout`)


def meeting_timeout() -> int:
    """Seconds within which the run's processes must meet (`initialize`'s `timeout_s`, --launch-timeout): at
    the start, and wherever they wait for each other outside a collective (a checkpoint's barriers, of which
    a failed save meets two in a row). JAX's heartbeat waits `HEARTBEAT_FACTOR` times as long for a process that
    stopped answering, so that such a wait ends first, in Python, where the run can say so in one line (JAX's own
    ending is a trace), also when the survivor reaches the save's barriers a while after the lost process died
    (a loaded machine: three times, with the two barriers, left 12 s of it and lost a test's run once)."""
    return _meeting_timeout_s


def current_process() -> ProcessLayout:
    return ProcessLayout(jax.process_index(), jax.process_count())


class LaunchError(ValueError):
    """A bad multi-process launch, found before contacting the other processes."""


def _parse_coordinator(coordinator: str) -> tuple[str, int]:
    match = re.fullmatch(r"(.+):(\d+)", coordinator or "")
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise LaunchError(f"--coordinator must be HOST:PORT with a port in 1..65535, got {coordinator!r}")
    return match.group(1), int(match.group(2))


def _check_port_free(port: int) -> None:
    """The coordinator (process 0) binds PORT on every interface; JAX crashes if it cannot."""
    family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("::" if family == socket.AF_INET6 else "", port))
        except OSError as e:
            raise LaunchError(f"--coordinator port {port} is not free on this machine ({e.strerror}); "
                              f"choose another port") from None


def check_launch(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Validates the launch flags; True when they ask for several processes, False for one process
    or for JAX's cluster detection (all three unset)."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    missing = [name for name, value in given.items() if value is None]
    if len(missing) == 3:
        return False
    if missing:
        raise LaunchError(f"{', '.join(missing)} missing: give --coordinator, --num-processes and --process-id "
                          f"together, or none of them to let JAX detect a SLURM, Open MPI or TPU cluster")
    _parse_coordinator(coordinator)
    if not isinstance(num_processes, int) or num_processes < 1:
        raise LaunchError(f"--num-processes must be an integer >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise LaunchError(f"--process-id must be in 0..{num_processes - 1} (--num-processes {num_processes}), "
                          f"got {process_id!r}")
    return True


def _fail_launch(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(LAUNCH_FAILURE_EXIT)


def _tasks_per_node(spec: str) -> list[int]:
    """SLURM's tasks-per-node list ('2(x3),1': three nodes of 2 tasks, then one of 1), one entry per node."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise LaunchError(f"--cluster: cannot read SLURM's tasks per node {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _gpus_per_task(env) -> int | None:
    """The GPUs each task asked for (`--gpus-per-task`), None where it asked for none: SLURM_GPUS_PER_TASK
    ('[type:]N', or a list of them), which sbatch sets and its steps inherit, else SLURM_TRES_PER_TASK
    ('gres/gpu[:type]=N' among other resources), which srun sets."""
    if env.get("SLURM_GPUS_PER_TASK"):
        counts = [re.fullmatch(r"(?:[^:]+:)?(\d+)", part.strip()) for part in env["SLURM_GPUS_PER_TASK"].split(",")]
    else:
        counts = [re.fullmatch(r"(?:gres[/:])?gpu(?::[^=:]+)?[=:](\d+)", part.strip())
                  for part in env.get("SLURM_TRES_PER_TASK", "").split(",") if "gpu" in part]
    if not counts or None in counts:
        return None
    return sum(int(match.group(1)) for match in counts)


def slurm_local_devices(env=os.environ) -> list[int] | None:
    """The GPUs this SLURM task should use, as JAX's `local_device_ids` ([]: every GPU it sees; None:
    not a SLURM job, or no GPU information: JAX's own choice).

    JAX's SLURM detection gives each task the one GPU numbered by its SLURM_LOCALID, which wastes
    all but one GPU of a node run with one task per node, and fails where SLURM binds GPUs to tasks
    (each task then sees its own, numbered from 0). Here: one task on the node, or GPUs bound to the
    task: every GPU it sees; several tasks sharing a node's GPUs: an equal contiguous share by
    SLURM_LOCALID, refused in one line when the GPUs do not divide.

    A task is bound to its GPUs where it asked for some per task (`--gpus-per-task`, which binds each
    task to its own: `--tres-bind=gres/gpu:per_task:N` implied, srun(1)) and sees that many, or where it
    sees fewer GPUs than SLURM_GPUS_ON_NODE counts. That variable counts the GPUs of the *step* on this
    node, not the task's: srun(1), OUTPUT ENVIRONMENT VARIABLES, "SLURM_GPUS_ON_NODE: Number of GPUs
    available to the step on this node" (https://slurm.schedmd.com/srun.html; sbatch(1): "Number of GPUs
    allocated to the batch step"), and Slurm's GPU plugin sets it in every task to the step's GPUs on the
    node while CUDA_VISIBLE_DEVICES lists the task's own (src/plugins/gres/common/gres_common.c,
    `gres_common_gpu_set_env`; the variable exists since Slurm 21.08). The per-task request is read first,
    so a Slurm that counted the task's GPUs instead, or one before 21.08 without the variable, binds the
    same tasks.

    Every process of a run needs the same number of devices, so tasks split unevenly over the nodes
    (SLURM_STEP_TASKS_PER_NODE '3,2': 3 tasks on one node, 2 on the other) and sharing their node's GPUs
    are refused in one line, the same on every node, from SLURM's variables alone, before any task waits
    for the others. Every node is taken to hold this node's GPUs, as a request per node or per task
    gives them; where the job asked for GPUs in total (`--gpus`, SLURM_GPUS), which SLURM may place
    unevenly, differing counts are found once the processes meet (`check_devices_per_process`).
    """
    if not all(name in env for name in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID")):
        return None
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    per_node = _tasks_per_node(spec) if spec else None
    tasks_here = int(env["SLURM_NTASKS_PER_NODE"]) if "SLURM_NTASKS_PER_NODE" in env else None
    if per_node:
        tasks_here = per_node[min(int(env.get("SLURM_NODEID", 0)), len(per_node) - 1)]
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    on_node = int(env["SLURM_GPUS_ON_NODE"]) if env.get("SLURM_GPUS_ON_NODE", "").isdigit() else None
    per_task = _gpus_per_task(env)
    if visible and (len(visible) == per_task or (on_node is not None and len(visible) < on_node)):
        return []
    seen = len(visible) if visible else on_node
    if seen is None or tasks_here is None:
        return [] if tasks_here == 1 else None
    if per_node and len(set(per_node)) > 1 and "SLURM_GPUS" not in env:
        raise LaunchError(f"--cluster: SLURM split the {sum(per_node)} tasks {','.join(map(str, per_node))} over "
                          f"{len(per_node)} nodes, and the tasks of a node share its {seen} GPUs: processes would "
                          f"hold different numbers of GPUs, and every process of a run needs the same number; run "
                          f"the same number of tasks on every node (--ntasks-per-node) or one task per GPU "
                          f"(--gpus-per-task 1)")
    if tasks_here == 1:
        return []
    if seen % tasks_here:
        raise LaunchError(f"--cluster: {tasks_here} SLURM tasks on this node share its {seen} GPUs, which do not "
                          f"divide among them; run one task per GPU (--gpus-per-task 1) or one task per node")
    share = seen // tasks_here
    local = int(env["SLURM_LOCALID"])
    return list(range(local * share, (local + 1) * share))


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, timeout_s: int = DEFAULT_TIMEOUT_S, cluster: bool = False) -> ProcessLayout:
    """Joins this process to the run's other processes and returns where it stands.

    Give `coordinator` ('HOST:PORT' of process 0), `num_processes` and `process_id`, or none
    of them with `cluster=True` for JAX's own detection (SLURM, Open MPI, TPU pods; under SLURM each
    task takes the GPUs `slurm_local_devices` gives it); none of them without `cluster` is a
    one-process run (nothing to join). Must run before any other
    JAX call. Selects gloo for CPU collectives.

    Failures are one line on stderr: flags that cannot be right (an id outside 0..P-1, a
    missing flag, a taken port on process 0) raise `LaunchError` at once; processes that do
    not all meet within `timeout_s` seconds (one not started, two with the same id, a wrong
    coordinator address) end this process with exit status 3 after one line. JAX offers no
    way back from a failed rendezvous (its own deadline aborts the process with a stack
    trace), so a watchdog ends the process first, `timeout_s` after the call.
    """
    global _meeting_timeout_s
    explicit = check_launch(coordinator, num_processes, process_id)
    if not explicit and not cluster:
        return ProcessLayout()
    if explicit and num_processes == 1:
        return ProcessLayout()
    if explicit and process_id == 0:
        _check_port_free(_parse_coordinator(coordinator)[1])
    local_devices = None if explicit else slurm_local_devices()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = f"at {coordinator}" if explicit else "through cluster detection"
    who = f"process {process_id} of {num_processes}" if explicit else "this process"
    how = (f"start every process with the same --coordinator and --num-processes and a distinct --process-id in "
           f"0..{num_processes - 1}" if explicit else "check that the job started all its processes (tasks)")
    watchdog = threading.Timer(timeout_s, _fail_launch, args=(
        f"fedjax_sparse: {who} did not meet all the other processes {where} within {timeout_s} s: {how}, within "
        f"{timeout_s} s of each other",))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s + 60,
                                   heartbeat_timeout_seconds=HEARTBEAT_FACTOR * max(timeout_s, 10),
                                   local_device_ids=local_devices)
        jax.devices()  # the collectives backend connects here
    except Exception as e:  # noqa: BLE001 - JAX raises several kinds; the user gets one line either way
        watchdog.cancel()
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not explicit:
            raise LaunchError(f"--cluster: JAX found no SLURM, Open MPI or TPU pod job to take the processes from "
                              f"({first}); give --coordinator, --num-processes and --process-id instead") from None
        raise LaunchError(f"jax.distributed could not start {where}: {first}") from None
    watchdog.cancel()
    _meeting_timeout_s = max(timeout_s, 10)
    check_devices_per_process(jax.devices())  # before any process loads data: every one sees the same devices
    return current_process()


def process_mesh(devices=None) -> Mesh:
    """Every device of the run as a `processes` x `clients` grid (one row per process); one line where the
    processes hold different numbers of devices (the grid has a row per process, of one length)."""
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    processes = check_devices_per_process(devices)
    return Mesh(np.array(devices, dtype=object).reshape(processes, -1), (PROCESSES_AXIS, CLIENTS_AXIS))


def check_devices_per_process(devices) -> int:
    """The number of processes holding `devices`; one line where they hold different numbers of them."""
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    if len(set(per_process.values())) > 1:
        counts = ", ".join(f"process {p} has {n}" for p, n in sorted(per_process.items()))
        raise ValueError(f"each process of a run needs the same number of devices ({counts}): give every process the "
                         f"same JAX_NUM_CPU_DEVICES, or the same number of GPUs (CUDA_VISIBLE_DEVICES)")
    return len(per_process)


def _block_spec(mesh: Mesh) -> PartitionSpec:
    if PROCESSES_AXIS in mesh.axis_names:
        return PartitionSpec(PROCESSES_AXIS, tuple(a for a in mesh.axis_names if a != PROCESSES_AXIS))
    return PartitionSpec(None, tuple(mesh.axis_names))


def process_blocks(local: Any, mesh: Mesh | None) -> Any:
    """This process's [K, ...] blocks as global [P, K, ...] arrays, one block per process."""
    if mesh is None:
        return jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(x)[None]), local)
    count = mesh.shape.get(PROCESSES_AXIS, 1)
    sharding = NamedSharding(mesh, _block_spec(mesh))
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(
        sharding, np.asarray(x)[None], (count, *np.shape(x))), local)


def combine_blocks(blocks: Any) -> Any:
    """[P, K, ...] blocks -> [K, ...] (traceable): exact, since each entry is held by one block and zero in
    the others: their max where entries are >= 0 (raw bytes, labels, counts, images, tokens), their sum
    where they may be negative (float features: x + 0 is x)."""

    def combine(b):
        if b.shape[0] == 1:
            return b[0]
        return b.sum(axis=0) if jnp.issubdtype(b.dtype, jnp.floating) else b.max(axis=0)

    return jax.tree_util.tree_map(combine, blocks)


def replicated(tree: Any, mesh: Mesh | None) -> Any:
    """`tree` on every device of `mesh` (no-op without a mesh); every process must give the same values."""
    if mesh is None:
        return tree
    sharding = NamedSharding(mesh, PartitionSpec())

    def place(x):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.make_array_from_process_local_data(sharding, np.asarray(x), np.shape(x))

    return jax.tree_util.tree_map(place, tree)


def replicated_sharding(mesh: Mesh | None) -> NamedSharding | None:
    return None if mesh is None else NamedSharding(mesh, PartitionSpec())


def process_local(tree: Any) -> Any:
    """`tree` with every array that spans several devices (a replicated server state) replaced by its
    copy on this process's first device, for computations each process runs on its own."""
    def local(x):
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            return x.addressable_data(0)
        return x

    return jax.tree_util.tree_map(local, tree)


def gather_clients(values: Any, process: ProcessLayout, num_clients: int) -> Any:
    """Every process's figures of its own clients ([num_local, ...] numpy, in local order) as the
    population's ([num_clients, ...], in id order), on every process."""
    if process.count == 1:
        return values
    width = ProcessLayout(0, process.count).num_local(num_clients)  # process 0 owns the most

    def pad(x):
        x = np.asarray(x)
        return np.concatenate([x, np.zeros((width - len(x), *x.shape[1:]), x.dtype)])

    gathered = multihost_utils.process_allgather(jax.tree_util.tree_map(pad, values))

    def place(x):
        out = np.empty((num_clients, *x.shape[2:]), x.dtype)
        for p in range(process.count):
            out[p::process.count] = x[p, :ProcessLayout(p, process.count).num_local(num_clients)]
        return out

    return jax.tree_util.tree_map(place, gathered)


def max_over_processes(*values: int) -> tuple[int, ...]:
    """For each of `values`, the largest of the processes' values, on every process (one collective)."""
    if jax.process_count() == 1:
        return tuple(values)
    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int64))).reshape(-1, len(values))
    return tuple(int(v) for v in gathered.max(axis=0))


def agree(failure: BaseException | None, when: str) -> None:
    """Whether every process got through a step (`failure`: this process's error, None if it did):
    a process that failed raises its error, the others a one-line ValueError naming the first that
    failed, so that none goes on to wait for it in a collective."""
    if jax.process_count() == 1:
        if failure is not None:
            raise failure
        return
    failed = np.asarray(multihost_utils.process_allgather(np.bool_(failure is not None)))
    if failure is not None:
        raise failure
    if failed.any():
        raise ValueError(f"process {int(np.argmax(failed))} of {jax.process_count()} stopped {when}; its own error "
                         f"says why")


def _text_bytes(text: str, size: int) -> np.ndarray:
    data = text.encode()[:size]
    return np.frombuffer(data + b"\0" * (size - len(data)), np.uint8)


def broadcast_text(text: str, size: int = 64) -> str:
    """Process 0's `text` (its first `size` bytes), on every process."""
    if jax.process_count() == 1:
        return text
    data = np.asarray(multihost_utils.broadcast_one_to_all(_text_bytes(text, size)), np.uint8)
    return data.tobytes().rstrip(b"\0").decode(errors="replace")


def gather_texts(text: str, size: int = 512) -> list[str]:
    """Every process's `text` (its first `size` bytes), in process order, on every process."""
    if jax.process_count() == 1:
        return [text]
    data = np.asarray(multihost_utils.process_allgather(_text_bytes(text, size)), np.uint8)
    return [row.tobytes().rstrip(b"\0").decode(errors="replace") for row in data.reshape(-1, size)]
