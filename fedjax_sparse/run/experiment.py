"""Building a run: its data, model, algorithm, client store, round and evaluators from a config."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from fedjax_sparse.algorithms import BUILT_IN, make_algorithm
from fedjax_sparse.privacy.mechanism import keeps_client_state, privatize
from fedjax_sparse.algorithms.personalization import personalize
from fedjax_sparse.algorithms.uplink_compression import compress_uplink
from fedjax_sparse.core.contract.algorithm import BuildContext, NeedsDeviceData
from fedjax_sparse.core.contract.check import check_contract
from fedjax_sparse.core.evaluation.cpu import CpuEvaluator, evaluation_devices
from fedjax_sparse.core.round.cpu import keep_freed_memory, round_devices
from fedjax_sparse.core.client_state.rows import RowLayout
from fedjax_sparse.core.client_state.choice import available_host_memory, choose_store, free_device_memory, make_store
from fedjax_sparse.core.client_state.store import client_state_shapes, initial_server_state
from fedjax_sparse.core.round.distributed import ProcessLayout, current_process, process_mesh
from fedjax_sparse.core.round.device_split import BalancedSplit
from fedjax_sparse.core.evaluation.evaluators import AUTO, default_evaluation_chunk, global_evaluator, split_evaluator
from fedjax_sparse.core.structure.flops import forward_flops
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.privacy.accounting import PrivacyLedger
from fedjax_sparse.core.round.step import clients_mesh, default_client_chunk
from fedjax_sparse.core.round.driver import ONE_DEVICE, round_driver
from fedjax_sparse.core.messages.secure_aggregation import summed_entries
from fedjax_sparse.core.round.streams import stream_key, stream_seed
from fedjax_sparse.core.contract.wrapping import upload_shapes
from fedjax_sparse.data import load_dataset
from fedjax_sparse.data.clients import federate
from fedjax_sparse.data.mapped import PREFIX as MAPPED
from fedjax_sparse.models import get_model
from fedjax_sparse.run.client_metrics import check_stats
from fedjax_sparse.run.checkpoints import KEEP
from fedjax_sparse.run.config import RunConfig
from fedjax_sparse.run.federation import buffering, round_conditions
from fedjax_sparse.run.fingerprint import data_fingerprint
from fedjax_sparse.console import say
from fedjax_sparse.privacy.ledger import privacy_ledger


@dataclasses.dataclass
class Experiment:
    """Everything a run builds before its first round (also what tests poke at).

    store: where the client states live (`core.client_state.store`); train, local_test: the
    clients' data, on the device (`FederatedSplit`) with the device store, else this
    process's clients' (`data.windows.HostData`); round_fn: `core.round.driver.RoundDriver`,
    `round_fn(server_state, r) -> (server_state, RoundOutput)`; evaluate_personalized:
    `core.evaluation.evaluators.split_evaluator`, given local_test with the device store (every client),
    a chunk of the clients' test windows otherwise.
    """

    config: RunConfig
    dataset: Any
    model: Any
    algorithm: Any
    train: Any
    local_test: Any
    client_indices: list
    train_counts: np.ndarray
    store: Any
    round_fn: Any
    evaluate_global: Any
    evaluate_personalized: Any
    server_state: Any
    num_params: int
    client_chunk: int | None
    process: ProcessLayout
    federation: Any = None  # data.clients: the clients' data, whichever the source
    data_fingerprint: dict = dataclasses.field(default_factory=dict)
    privacy: PrivacyLedger | None = None  # differential privacy's accounting (privacy.ledger)

    def close(self) -> None:
        self.round_fn.close()
        self.store.close()


def load_run_dataset(config: RunConfig, progress: bool = True):
    dataset = load_dataset(config.dataset, data_dir=config.data_dir, download=config.download, progress=progress,
                           num_clients=config.num_clients, population_seed=stream_seed(config.seed, "population"))
    return dataset.subset(config.max_train_examples, config.max_test_examples, config.seed)


def build_experiment(config: RunConfig, progress: bool = True, *, process: ProcessLayout | None = None,
                     snapshot: str | None = None, dataset: Any = None,
                     before_store: Callable[[str], None] | None = None) -> Experiment:
    """The run's data, model, algorithm, client store and round, for this process (default: the
    one `jax.distributed` says it is). `snapshot`: the backend of the client-state snapshot a
    resumed run restores (a disk store's restores only into the disk store); `dataset`: the
    loaded data set (default: loaded here); `before_store(backend)`: called before the store is
    made (the run records a disk store's folder before it exists)."""
    config.validate()
    process = process or current_process()
    if process.count > 1 and config.cpu_devices is not None:
        raise ValueError(f"--cpu-devices {config.cpu_devices} shares one process's clients among its CPU devices; a "
                         f"run of {process.count} processes shards them over every process's devices instead (one "
                         f"CPU device each, or JAX_NUM_CPU_DEVICES, the same in every process): leave it unset")
    if process.count > 1 and config.client_chunk:
        raise ValueError(f"--client-chunk {config.client_chunk} and {process.count} processes do not combine: the "
                         f"round shards all sampled clients over every process's devices; leave it unset")
    dataset = dataset if dataset is not None else load_run_dataset(config, progress)
    split_by = config.split_by
    if split_by == "labels" and config.labels_per_client > dataset.num_classes:
        raise ValueError(f"--labels-per-client {config.labels_per_client} exceeds the "
                         f"{dataset.num_classes} classes of {config.dataset}")
    model = dataclasses.replace(get_model(config.model, dataset.input_shape, dataset.num_classes),
                                compute_dtype=config.compute_dtype)
    if model.input_kind != ("tokens" if dataset.kind == "tokens" else "numbers"):
        reads = "token sequences" if model.input_kind == "tokens" else "images or feature vectors"
        raise ValueError(f"--model {config.model} reads {reads}, but {config.dataset} holds {dataset.kind}; choose "
                         f"another --model or --dataset")
    federation = federate(dataset, config.num_clients, split_by, seed=stream_seed(config.seed, "partition"),
                          test_seed=stream_seed(config.seed, "local_test"), alpha=config.alpha,
                          labels_per_client=config.labels_per_client, min_examples=config.min_examples,
                          local_test_ratio=config.local_test_ratio)
    local = LocalSGD(model, config.lr, config.local_epochs, config.batch_size, config.momentum,
                     config.weight_decay, config.lr_decay, config.grad_clip_norm)
    # the round's slots: K, or what the sampler and over-selection dispatch (the round's static shapes)
    conditions = round_conditions(config, federation.train_counts,
                                  3.0 * forward_flops(model.structure) * config.local_epochs)
    slots = conditions.sampler.slots
    context = BuildContext(local=local, num_clients=config.num_clients, clients_per_round=slots,
                           train=None, num_classes=dataset.num_classes, seed=config.seed,
                           labels_per_client=config.labels_per_client if split_by == "labels" else None,
                           device_profile=conditions.profile, round_deadline=conditions.stragglers.deadline,
                           train_counts=federation.train_counts)
    try:  # built without the clients' data first: most algorithms never read them
        algorithm, needs_device = with_patterns(make_algorithm(config.algorithm, context, config.algorithm_options),
                                                context, config), None
    except NeedsDeviceData as e:
        algorithm, needs_device = None, e
    privacy = None
    if algorithm is not None:
        algorithm, privacy = with_privacy(algorithm, context, config)
    key = stream_key(config.seed, "algorithm_init")
    backend = client_store_backend(config, process, needs_device, snapshot, algorithm, key,
                                   jax.eval_shape(model.init, stream_key(config.seed, "model_init")),
                                   federation.data_bytes)
    variables = model.init(stream_key(config.seed, "model_init"))
    train, local_test = federation.on_device() if backend == "device" else federation.on_host(process)
    if algorithm is None:
        context = dataclasses.replace(context, train=train)
        algorithm, privacy = with_privacy(with_patterns(make_algorithm(config.algorithm, context,
                                                                       config.algorithm_options), context, config),
                                          context, config)
    for metric, stats in algorithm.client_metric_stats:
        check_stats(stats, f"{algorithm.name}'s client_metric_stats for {metric!r}")
    if conditions.secure is not None:  # what the protocol sums: refused in one line where the sum would not do
        conditions = dataclasses.replace(conditions, upload_entries=summed_entries(algorithm,
                                                                                   upload_shapes(algorithm, context)))
    if config.algorithm not in BUILT_IN:  # an algorithm from outside the library: its contract, on shapes, first
        check_contract(algorithm, jax.eval_shape(model.init, stream_key(config.seed, "model_init")), config.num_clients,
                       slots, federation.first_client(), config.seed, varies=conditions.varies)
    if before_store is not None:
        before_store(backend)
    store = make_store(backend, algorithm, key, variables, config.num_clients,
                       directory=Path(config.out) / "client_store", process=process, keep=KEEP)
    mesh = None
    if process.count > 1 or (config.shard_clients and backend != "device"):
        mesh = process_mesh()
    elif config.shard_clients:
        mesh = clients_mesh()
    chunk = None if mesh is not None else resolve_client_chunk(config, variables, slots)
    check_local_sizes(config, int(federation.train_counts.max()), dataset.input_shape,
                      chunk or slots)
    asynchronous = buffering(config)
    if asynchronous is not None and (config.cpu_devices or 1) > 1:
        raise ValueError(ONE_DEVICE)
    cpu_devices = round_cpu_devices(config, backend, mesh, chunk, slots) if asynchronous is None else []
    if config.device_split == "balanced" and (mesh is not None or len(cpu_devices) > 1):
        conditions = dataclasses.replace(conditions, split=BalancedSplit(config.batch_size))
    round_fn = round_driver(algorithm, store, train, config.clients_per_round, seed=config.seed, mesh=mesh,
                            client_chunk=chunk, conditions=conditions, counts=federation.train_counts,
                            buffering=asynchronous, cpu_devices=cpu_devices)
    evaluate_global = (global_evaluator(model, *federation.global_test, dataset.mean, dataset.std)
                       if algorithm.global_variables is not None else None)
    evaluate_personalized = split_evaluator(model, algorithm.client_variables, client_chunk=evaluation_chunk(config))
    devices = evaluation_cpu_devices(config, backend, mesh, local_test)
    if len(devices) > 1:
        evaluate_personalized = CpuEvaluator(evaluate_personalized, devices)
    server_state = initial_server_state(algorithm, key, variables, config.num_clients)
    return Experiment(config, dataset, model, algorithm, train, local_test, federation.client_indices,
                      federation.train_counts, store, round_fn, evaluate_global, evaluate_personalized, server_state,
                      model.num_params(variables), chunk, process, federation, data_fingerprint(federation), privacy)


def with_patterns(algorithm, context: BuildContext, config: RunConfig):
    """The algorithm with the run's personal layers and uplink compression, where asked for."""
    return compress_uplink(personalize(algorithm, context, config), context, config)


def with_privacy(algorithm, context: BuildContext, config: RunConfig) -> tuple[Any, PrivacyLedger | None]:
    """`with_patterns`' algorithm under the run's differential privacy, where asked for, and the run's ledger
    (None without), whose noise multiplier and sampling the clients and server use: the ledger asks whether this
    algorithm's clients keep state. Privacy wraps the compression, so that it clips the message the client
    sends."""
    privacy = privacy_ledger(config, keeps_state=lambda: keeps_client_state(algorithm, context))
    if privacy is None:
        return algorithm, None
    return privatize(algorithm, context, config, noise_multiplier=privacy.noise_multiplier,
                     expected_clients=config.clients_per_round, sampling=privacy.sampling), privacy


def check_local_sizes(config: RunConfig, largest_client: int, input_shape: tuple, clients_at_once: int) -> None:
    """Refuses, in one line naming the flag, a batch or a number of local epochs whose arrays alone (a
    batch's float32 examples, each client's example orders over its epochs, for the clients trained at
    once) would not fit in the device's free memory (on a CPU, the host's): XLA would stop with an
    out-of-memory trace at the first round instead."""
    free = free_device_memory()
    free = available_host_memory() if free is None else free
    batch = clients_at_once * config.batch_size * int(np.prod(input_shape)) * 4
    orders = clients_at_once * config.local_epochs * largest_client * 4
    where = "the host's" if jax.default_backend() == "cpu" else "the device's"
    for flag, value, nbytes, what in (("--batch-size", config.batch_size, batch, "a batch of float32 examples"),
                                      ("--local-epochs", config.local_epochs, orders,
                                       "the example orders of every epoch")):
        if nbytes > free:
            raise ValueError(f"{flag} {value} needs {nbytes / 2 ** 30:.1f} GiB for {what} of the {clients_at_once} "
                             f"clients trained at once, more than {where} {free / 2 ** 30:.1f} GiB free; choose a "
                             f"smaller {flag}")


def client_store_backend(config: RunConfig, process: ProcessLayout, needs_device: NeedsDeviceData | None,
                         snapshot: str | None, algorithm, key, variables, data_bytes: int) -> str:
    """The store `config.client_store` gives for this run, or a one-line error where that store cannot
    hold it. `auto` says what it chose and why, unless it is the device (today's layout; summary.json
    names the store of every run). `variables`: the model's (their shapes suffice)."""
    wanted, prefix = config.client_store, f"process {process.tag()}: " if process.count > 1 else ""
    if needs_device is not None:
        if wanted not in ("auto", "device") or process.count > 1:
            raise needs_device
        backend, reason = "device", None
    elif wanted != "auto":
        backend, reason = wanted, None
    elif snapshot == "disk":
        backend, reason = "disk", "disk: the checkpoint's client states are rows in the disk store's files"
    else:
        row_bytes = RowLayout(client_state_shapes(algorithm, key, variables, config.num_clients)).row_bytes
        backend, reason = choose_store(config.num_clients, row_bytes, data_bytes, processes=process.count,
                                       data_on_disk=config.dataset.startswith(MAPPED))
    if backend == "device" and process.count > 1:
        raise ValueError(f"--client-store device keeps every client on one process's device; with {process.count} "
                         f"processes use host, disk or auto")
    if snapshot == "disk" and backend != "disk":
        raise ValueError(f"--client-store {backend}: the checkpoint's client states are rows in the disk store's "
                         f"files ({Path(config.out) / 'client_store'}); resume with --client-store disk or auto")
    if backend != "device" and reason is not None:
        say(f"{prefix}--client-store auto chose {reason}")
    return backend


def usable_cpu_devices(config: RunConfig, backend: str, mesh) -> list:
    """The CPU devices a run may share its clients among: on a CPU, with the device store and no mesh,
    `--cpu-devices` of them (all by default), else none."""
    if jax.default_backend() != "cpu" or backend != "device" or mesh is not None:
        return []
    return jax.local_devices(backend="cpu")[:config.cpu_devices]


def round_cpu_devices(config: RunConfig, backend: str, mesh, chunk: int | None, slots: int) -> list:
    """The CPU devices that share a round's clients (`core.round.cpu`): the usable ones where they pay
    (`round_devices`), all of them with `--cpu-devices`."""
    devices = usable_cpu_devices(config, backend, mesh)
    if not devices:
        return []
    keep_freed_memory()
    return round_devices(slots, chunk, devices, chosen=config.cpu_devices is not None)


def evaluation_cpu_devices(config: RunConfig, backend: str, mesh, local_test) -> list:
    """The CPU devices that share the personalized evaluation of every client (`core.evaluation.cpu`):
    the usable ones where they pay (`evaluation_devices`), all of them with `--cpu-devices`."""
    devices = usable_cpu_devices(config, backend, mesh)
    chunk = evaluation_chunk(config)
    return evaluation_devices(local_test.num_clients, local_test.max_count,
                              default_evaluation_chunk() if chunk == AUTO else chunk, devices,
                              chosen=config.cpu_devices is not None)


def resolve_client_chunk(config: RunConfig, variables, slots: int) -> int | None:
    """The chunk the round trains clients in: the flag (0 = all at once), else the platform's default
    for the round's `slots`."""
    if config.shard_clients or config.client_chunk == 0:
        return None
    if config.client_chunk is not None:
        return config.client_chunk
    return default_client_chunk(variables, slots)


def evaluation_chunk(config: RunConfig) -> int | None | str:
    """How many clients personalized evaluation takes at once: as training, but over all clients."""
    if config.shard_clients or config.client_chunk == 0:
        return None
    if config.client_chunk is not None:
        return min(config.client_chunk, config.num_clients)
    return AUTO


def compilation_cache_dir() -> Path:
    """Where compiled rounds are kept between runs: $FEDJAX_SPARSE_JAX_CACHE (the compiled programs alone, apart
    from the decoded data sets), else $FEDJAX_SPARSE_CACHE, else the user's cache folder."""
    if os.environ.get("FEDJAX_SPARSE_JAX_CACHE"):
        return Path(os.environ["FEDJAX_SPARSE_JAX_CACHE"])
    if os.environ.get("FEDJAX_SPARSE_CACHE"):
        return Path(os.environ["FEDJAX_SPARSE_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fedjax_sparse" / "jax"


class CompilationCacheGuard:
    """Keeps JAX's persistent compilation cache free of entries cut short, and its failures out of the run's output.

    JAX writes an entry in place (no temporary file) and never replaces one that exists: a write stopped by a
    file-size limit or a full disk left a cut entry, which every later run failed to read, warning in two lines
    ("Error reading persistent compilation cache entry", then compiling anew), for good. JAX has no option to
    write atomically or drop what it cannot read, and reports both failures only as warnings naming the
    function (not its entry), so the guard sees JAX's warnings (`warnings.showwarning`, always shown to it):

    * a write that failed: the function's entries this process made (not in the folder when the cache was
      set up) are deleted; the warning is dropped (the run's own files, under the same limit or disk, say what
      failed in its one line; the cache costs only a compilation);
    * a read that failed (an entry cut short by a kill or before this guard): the function's entries are
      deleted, so that JAX writes the one it compiles next instead, whole (the function's entries of other
      shapes are compiled again once: which entry failed, JAX does not say); the warning is dropped.

    Other warnings go on to the `showwarning` there was.
    """

    FAILURE = re.compile(r"Error (reading|writing) persistent compilation cache entry for '([^']+)'")

    def __init__(self):
        self.path: Path | None = None
        self.present: set[str] = set()  # the entries in the folder when the cache was set up
        self.previous = warnings.showwarning

    def watch(self, path: Path | None) -> None:
        """Guards the cache in `path` (None: none) from now on."""
        self.path, self.present = path, set(os.listdir(path)) if path is not None else set()
        if path is None:
            return
        if warnings.showwarning != self.showwarning:  # (again after a test's catch_warnings restored it)
            self.previous, warnings.showwarning = warnings.showwarning, self.showwarning
        # every failure, not only a function's first: each may leave its own entry
        warnings.filterwarnings("always", message=self.FAILURE.pattern, category=UserWarning)

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        failure = self.FAILURE.match(str(message)) if self.path is not None else None
        if failure is None:
            self.previous(message, category, filename, lineno, file, line)
            return
        kind, function = failure.groups()
        entry = re.compile(re.escape(function) + r"-[0-9a-f]+-cache")
        with contextlib.suppress(OSError):
            for name in os.listdir(self.path):
                if entry.fullmatch(name) and (kind == "reading" or name not in self.present):
                    (self.path / name).unlink(missing_ok=True)


_cache_guard = CompilationCacheGuard()


def use_compilation_cache(enabled: bool) -> None:
    """Turns JAX's persistent compilation cache on (in `compilation_cache_dir()`, guarded by
    `CompilationCacheGuard`) or off.

    A run's first round spends seconds compiling; with the cache, a repeated
    run (same model, algorithm and shapes) loads the compiled round instead.
    Only what compiles for 0.5 s or longer is kept, unless JAX's own
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise (0 keeps every
    program: a resumed or relaunched run then compiles nothing again).
    """
    if enabled:
        path = compilation_cache_dir()
        path.mkdir(parents=True, exist_ok=True)
        _cache_guard.watch(path)
        jax.config.update("jax_compilation_cache_dir", str(path))
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    else:
        _cache_guard.watch(None)
        jax.config.update("jax_compilation_cache_dir", None)
