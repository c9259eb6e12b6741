"""A federated experiment from a config: data, model, algorithm, rounds, outputs.

The Python loop here is over rounds only; each round is one jitted call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedjax_sparse.algorithms import ALGORITHM_NAMES, make_algorithm, make_options, option_users, options_dict
from fedjax_sparse.algorithms.personalization import PersonalizationOptions, personalize
from fedjax_sparse.algorithms.uplink_compression import UplinkCompressionOptions, compress_uplink
from fedjax_sparse.checkpoint import KEEP, RunCheckpointer, config_mismatches, has_checkpoints
from fedjax_sparse.core.algorithm import BuildContext, NeedsDeviceData
from fedjax_sparse.core.client_store import (BACKENDS, DeviceStore, RowLayout, choose_store, client_state_shapes,
                                             initial_server_state, make_store, snapshot_backend)
from fedjax_sparse.core.compilation import release_compiler_memory
from fedjax_sparse.core.distributed import (ProcessLayout, agree, current_process, max_over_processes, process_local,
                                            process_mesh, replicated)
from fedjax_sparse.core.evaluation import (AUTO, all_finite, global_evaluator, population_diagnostics,
                                           split_evaluator)
from fedjax_sparse.core.flops import forward_flops
from fedjax_sparse.core.local_training import LocalSGD
from fedjax_sparse.core.options import option, option_fields, validate
from fedjax_sparse.core.round import clients_mesh, default_client_chunk
from fedjax_sparse.core.store_evaluation import evaluate_store
from fedjax_sparse.core.store_round import StoreRound
from fedjax_sparse.core.streams import stream_key, stream_seed
from fedjax_sparse.data import load_dataset, local_test_split, partition, partition_summary
from fedjax_sparse.data.federated import federated_split, padded_step_fraction
from fedjax_sparse.data.windows import host_data
from fedjax_sparse.faults import fault_point
from fedjax_sparse.models import MODEL_NAMES, get_model
from fedjax_sparse.reporting import RunWriter, device_description, progress_bar, say
from fedjax_sparse.run_folder import RunFolderError, claim_run_folder, hold_run_folder, recover_metrics
from fedjax_sparse.stopping import StopAfterRound
from fedjax_sparse.tensorboard_log import TensorBoardWriter


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or model; the run stops instead of going on with NaNs."""


@dataclasses.dataclass(frozen=True)
class RunConfig(UplinkCompressionOptions, PersonalizationOptions):
    """A run: the options every algorithm shares, and the chosen algorithm's own options.

    Two patterns apply to any algorithm they fit, from the run's options: uplink compression
    (`algorithms.uplink_compression`) and personal layers (`algorithms.personalization`).

    The shared options are the fields below; each algorithm declares its own
    beside its math (e.g. `algorithms.fedprox.FedProxOptions`). `options` holds
    algorithm option values by name; `algorithm_options` turns them into the
    chosen algorithm's dataclass (defaults for the rest). Build configs with
    `RunConfig.create(**flat)` / `config.replace(**flat)`, which route every
    name to its place; `to_dict()` is the flat saved form.
    """

    algorithm: str = option("fedavg", "the federated algorithm", choices=ALGORITHM_NAMES)
    dataset: str = option("digits", "digits, cifar10, cifar100, fashion_mnist, emnist, mnist (TFDS: prepared on "
                                    "first use) or imagefolder:PATH")
    data_dir: str | None = option(None, "TFDS data directory (default: TFDS's own, $TFDS_DATA_DIR or "
                                        "~/tensorflow_datasets)")
    download: bool = option(True, "prepare a TFDS data set (download and build) on its first use; --no-download "
                                  "only reads prepared data")
    model: str = option("mlp", "the model", choices=MODEL_NAMES)
    num_clients: int = option(20, "clients in the federation", low=1)
    clients_per_round: int = option(10, "clients sampled each round", low=1)
    rounds: int = option(30, "communication rounds", low=1)
    local_epochs: int = option(5, "local epochs per round", low=1)
    batch_size: int = option(16, "local batch size", low=1)
    lr: float = option(0.1, "local learning rate", low=0.0, low_open=True)
    lr_decay: float = option(1.0, "multiply the local learning rate by this every round", low=0.0, low_open=True,
                             high=1.0)
    momentum: float = option(0.0, "local SGD momentum", low=0.0, high=1.0, high_open=True)
    weight_decay: float = option(0.0, "local weight decay", low=0.0)
    partition: str = option("dirichlet", "how data is split over clients", choices=("iid", "dirichlet", "labels"))
    alpha: float | None = option(0.5, "Dirichlet concentration", low=0.0, low_open=True)
    labels_per_client: int | None = option(None, "labels each client holds (labels partition)", low=1)
    min_examples: int = option(2, "fewest training examples a client may hold", low=1)
    local_test_ratio: float = option(0.2, "size of each client's test split relative to its training data",
                                     low=0.0, low_open=True, high=1.0)
    seed: int = option(0, "seed of every random stream of the run", low=0)
    eval_every: int = option(1, "evaluate every this many rounds", low=1)
    client_store: str = option("auto", "where the clients' states and data live: device (all on the device, the "
                                       "fastest), host (host memory), disk (files in the run folder) or auto "
                                       "(device when they fit in half the device's memory, else host when they "
                                       "fit in half the host's, else disk; says what it chose)",
                               choices=(*BACKENDS, "auto"))
    shard_clients: bool = option(False, "shard the sampled clients over all local devices")
    client_chunk: int | None = option(None, "train the sampled clients this many at a time (0: all at once, one "
                                            "vmap); default: all at once on an accelerator, a cache-sized chunk "
                                            "on a CPU", low=0)
    max_train_examples: int | None = option(None, "use a random subset of this many training examples", low=1)
    max_test_examples: int | None = option(None, "use a random subset of this many test examples", low=1)
    checkpoint_every: int | None = option(None, "save the whole run state every R rounds and at the end (an "
                                                "interrupted run saves anyway)", low=1)
    tensorboard: bool = option(True, "also write every per-round figure as TensorBoard event files into the run "
                                     "folder (on by default; view with tensorboard --logdir runs)")
    compilation_cache: bool = option(True, "keep compiled rounds in JAX's persistent cache "
                                           "($FEDJAX_SPARSE_CACHE or ~/.cache/fedjax_sparse/jax)")
    out: str = option("runs/default", "directory for config, metrics, summary and plot")
    options: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def create(cls, **values) -> "RunConfig":
        """A config from flat names: shared fields go to their fields, the rest to `options`."""
        return cls().replace(**values)

    def replace(self, **values) -> "RunConfig":
        shared = {f.name for f in dataclasses.fields(self)} - {"options"}
        users = option_users()
        unknown = sorted(k for k in values if k not in shared and k not in users and k != "options")
        if unknown:
            raise ValueError(f"unknown options {unknown}; run options are {sorted(shared)} and algorithm "
                             f"options are {sorted(users)}")
        options = {**self.options, **values.get("options", {}),
                   **{k: v for k, v in values.items() if k in users and k not in shared}}
        return dataclasses.replace(self, **{k: v for k, v in values.items() if k in shared}, options=options)

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        """From a saved (flat) config; options of algorithms other than its own are dropped, so
        configs saved before options moved beside their algorithms still load."""
        values = dict(values)
        values.pop("options", None)
        algorithm = values.get("algorithm", cls.algorithm)
        own = {f.name for f in dataclasses.fields(make_options(algorithm, {}))} if algorithm in ALGORITHM_NAMES \
            else set()
        users = option_users()
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()
                  if k not in users or k in own}
        return cls.create(**values)

    @property
    def algorithm_options(self) -> Any:
        return make_options(self.algorithm, self.options)

    def to_dict(self) -> dict:
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return {**shared, **options_dict(self.algorithm_options)}

    def validate(self) -> None:
        """Checks what can be checked before any data is loaded; one clear line per problem."""
        validate(self)
        self.algorithm_options  # validates the algorithm's own options
        if self.clients_per_round > self.num_clients:
            raise ValueError(f"--clients-per-round {self.clients_per_round} exceeds --num-clients "
                             f"{self.num_clients}; valid: 1..{self.num_clients}")
        if self.partition == "dirichlet" and self.alpha is None:
            raise ValueError("--alpha must be > 0 for the dirichlet partition, got None")
        if self.partition == "labels" and self.labels_per_client is None:
            raise ValueError("--labels-per-client must be >= 1 for the labels partition, got None")
        if self.client_chunk is not None and self.client_chunk > self.clients_per_round:
            raise ValueError(f"--client-chunk must be in [0, {self.clients_per_round}] (0: all sampled "
                             f"clients at once), got {self.client_chunk}")
        if self.client_chunk and self.shard_clients:
            raise ValueError(f"--client-chunk {self.client_chunk} and --shard-clients do not combine: "
                             f"sharding splits the vmap of all sampled clients over the devices")


SHARED_OPTIONS = tuple(f.name for f in option_fields(RunConfig))


@dataclasses.dataclass
class Experiment:
    """Everything a run builds before its first round (also what tests poke at).

    store: where the client states live (`core.client_store`); train, local_test: the
    clients' data, on the device (`FederatedSplit`) with the device store, else this
    process's clients' (`data.windows.HostData`); round_fn: `core.store_round.StoreRound`,
    `round_fn(server_state, r) -> (server_state, RoundOutput)`; evaluate_personalized:
    `core.evaluation.split_evaluator`, given local_test with the device store (every client),
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

    def close(self) -> None:
        self.round_fn.close()
        self.store.close()


def load_run_dataset(config: RunConfig, progress: bool = True):
    dataset = load_dataset(config.dataset, data_dir=config.data_dir, download=config.download, progress=progress)
    return dataset.subset(config.max_train_examples, config.max_test_examples, config.seed)


def build_experiment(config: RunConfig, progress: bool = True, *, process: ProcessLayout | None = None,
                     snapshot: str | None = None, dataset: Any = None) -> Experiment:
    """The run's data, model, algorithm, client store and round, for this process (default: the
    one `jax.distributed` says it is). `snapshot`: the backend of the client-state snapshot a
    resumed run restores (a disk store's restores only into the disk store); `dataset`: the
    loaded data set (default: loaded here)."""
    config.validate()
    process = process or current_process()
    if process.count > 1 and config.client_chunk:
        raise ValueError(f"--client-chunk {config.client_chunk} and {process.count} processes do not combine: the "
                         f"round shards all sampled clients over every process's devices; leave it unset")
    dataset = dataset if dataset is not None else load_run_dataset(config, progress)
    if config.partition == "labels" and config.labels_per_client > dataset.num_classes:
        raise ValueError(f"--labels-per-client {config.labels_per_client} exceeds the "
                         f"{dataset.num_classes} classes of {config.dataset}")
    model = get_model(config.model, dataset.input_shape, dataset.num_classes)
    client_indices = partition(dataset.y_train, config.num_clients, config.partition,
                               seed=stream_seed(config.seed, "partition"), alpha=config.alpha,
                               labels_per_client=config.labels_per_client, min_examples=config.min_examples)
    test_indices = local_test_split(client_indices, dataset.y_train, dataset.y_test, dataset.num_classes,
                                    seed=stream_seed(config.seed, "local_test"), ratio=config.local_test_ratio)
    local = LocalSGD(model, config.lr, config.local_epochs, config.batch_size, config.momentum,
                     config.weight_decay, config.lr_decay)
    context = BuildContext(local=local, num_clients=config.num_clients, clients_per_round=config.clients_per_round,
                           train=None, num_classes=dataset.num_classes, seed=config.seed,
                           labels_per_client=config.labels_per_client if config.partition == "labels" else None)
    try:  # built without the clients' data first: most algorithms never read them
        algorithm, needs_device = with_patterns(make_algorithm(config.algorithm, context, config.algorithm_options),
                                                context, config), None
    except NeedsDeviceData as e:
        algorithm, needs_device = None, e
    key = stream_key(config.seed, "algorithm_init")
    backend = client_store_backend(config, process, needs_device, snapshot, algorithm, key,
                                   jax.eval_shape(model.init, stream_key(config.seed, "model_init")),
                                   _data_bytes(dataset, client_indices, test_indices))
    variables = model.init(stream_key(config.seed, "model_init"))
    if backend == "device":
        train = federated_split(dataset.x_train, dataset.y_train, client_indices, dataset.mean, dataset.std,
                                augment=dataset.augment)
        local_test = federated_split(dataset.x_test, dataset.y_test, test_indices, dataset.mean, dataset.std)
    else:
        train = host_data(dataset.x_train, dataset.y_train, client_indices, dataset.mean, dataset.std,
                          augment=dataset.augment, process=process)
        local_test = host_data(dataset.x_test, dataset.y_test, test_indices, dataset.mean, dataset.std,
                               process=process)
    if algorithm is None:
        context = dataclasses.replace(context, train=train)
        algorithm = with_patterns(make_algorithm(config.algorithm, context, config.algorithm_options), context, config)
    store = make_store(backend, algorithm, key, variables, config.num_clients,
                       directory=Path(config.out) / "client_store", process=process, keep=KEEP)
    mesh = None
    if process.count > 1 or (config.shard_clients and backend != "device"):
        mesh = process_mesh()
    elif config.shard_clients:
        mesh = clients_mesh()
    chunk = None if mesh is not None else resolve_client_chunk(config, variables)
    round_fn = StoreRound(algorithm, store, train, config.clients_per_round, seed=config.seed, mesh=mesh,
                          client_chunk=chunk)
    evaluate_global = (global_evaluator(model, dataset.x_test, dataset.y_test, dataset.mean, dataset.std)
                       if algorithm.global_variables is not None else None)
    evaluate_personalized = split_evaluator(model, algorithm.client_variables, client_chunk=evaluation_chunk(config))
    server_state = initial_server_state(algorithm, key, variables, config.num_clients)
    return Experiment(config, dataset, model, algorithm, train, local_test, client_indices,
                      np.array([len(ix) for ix in client_indices], np.int64), store, round_fn,
                      evaluate_global, evaluate_personalized, server_state, model.num_params(variables), chunk,
                      process)


def with_patterns(algorithm, context: BuildContext, config: RunConfig):
    """The algorithm with the run's personal layers and uplink compression, where asked for."""
    return compress_uplink(personalize(algorithm, context, config), context, config)


def _data_bytes(dataset, client_indices: list, test_indices: list) -> int:
    """Bytes of the clients' training and test examples (images and int32 labels)."""
    example = int(np.prod(dataset.input_shape)) * dataset.x_train.itemsize + 4
    return example * (sum(len(ix) for ix in client_indices) + sum(len(ix) for ix in test_indices))


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
        backend, reason = choose_store(config.num_clients, row_bytes, data_bytes, processes=process.count)
    if backend == "device" and process.count > 1:
        raise ValueError(f"--client-store device keeps every client on one process's device; with {process.count} "
                         f"processes use host, disk or auto")
    if snapshot == "disk" and backend != "disk":
        raise ValueError(f"--client-store {backend}: the checkpoint's client states are rows in the disk store's "
                         f"files ({Path(config.out) / 'client_store'}); resume with --client-store disk or auto")
    if backend != "device" and reason is not None:
        say(f"{prefix}--client-store auto chose {reason}")
    return backend


def resolve_client_chunk(config: RunConfig, variables) -> int | None:
    """The chunk the round trains clients in: the flag (0 = all at once), else the platform's default."""
    if config.shard_clients or config.client_chunk == 0:
        return None
    if config.client_chunk is not None:
        return config.client_chunk
    return default_client_chunk(variables, config.clients_per_round)


def evaluation_chunk(config: RunConfig) -> int | None | str:
    """How many clients personalized evaluation takes at once: as training, but over all clients."""
    if config.shard_clients or config.client_chunk == 0:
        return None
    if config.client_chunk is not None:
        return min(config.client_chunk, config.num_clients)
    return AUTO


def evaluate(exp: Experiment, server_state) -> tuple[dict, bool]:
    """The figures of an evaluation, and whether every client's state is finite. With a host or
    disk store the clients are evaluated a round's worth at a time through the store, each process
    its own (every process must call this)."""
    on_device = isinstance(exp.store, DeviceStore)
    if not on_device:
        server_state = process_local(server_state)  # each process evaluates on its own device
    if exp.algorithm.evaluation_state is not None:
        server_state = exp.algorithm.evaluation_state(server_state)
    out = {"test_accuracy": None, "test_loss": None}
    if exp.evaluate_global is not None:
        scores = exp.evaluate_global(exp.algorithm.global_variables(server_state))
        out = {"test_accuracy": float(scores["accuracy"]), "test_loss": float(scores["loss"])}
        variants = exp.algorithm.global_variants(server_state) if exp.algorithm.global_variants else {}
        for name, variables in variants.items():
            scores = exp.evaluate_global(variables)
            out.update({f"test_accuracy_{name}": float(scores["accuracy"]), f"test_loss_{name}": float(scores["loss"])})
    if on_device:
        client_states = exp.store.states
        finite = bool(all_finite(client_states))
        evaluated = client_states
        if exp.algorithm.evaluation_clients is not None:
            evaluated = exp.algorithm.evaluation_clients(server_state, client_states)
        accuracies = np.asarray(exp.evaluate_personalized(server_state, evaluated, exp.local_test))
        diagnostics = None if exp.algorithm.diagnostics is None else population_diagnostics(
            exp.algorithm, server_state, client_states)
    else:
        population = evaluate_store(exp.algorithm, exp.store, exp.local_test, server_state,
                                    exp.evaluate_personalized, exp.config.clients_per_round)
        accuracies, finite = population.accuracies, population.finite
        diagnostics = None if exp.algorithm.diagnostics is None else exp.algorithm.diagnostics(
            server_state, population.diagnostics)
    out["personalized_accuracy"] = float(accuracies.mean())
    if diagnostics is not None:
        out.update(jax.tree_util.tree_map(_to_python, diagnostics))
    return out, finite


def client_metrics(metrics: dict) -> dict:
    """The round's per-client figures beyond loss and steps (an agent's reward, a sub-model's
    capacity, ...), each as `client_<name>`: the mean over the sampled clients."""
    return {f"client_{name}": float(np.mean(np.asarray(value, np.float64)))
            for name, value in metrics.items() if name not in ("loss", "num_steps")}


def _to_python(x):
    x = np.asarray(x)
    return x.item() if x.ndim == 0 else x.tolist()


def likely_culprit(config: RunConfig) -> str:
    """The flag most likely to blame for a diverged run, as advice."""
    options = config.options
    if options.get("server_lr", 1.0) > 1.0:
        return f"try a smaller --server-lr than {options['server_lr']}"
    if config.momentum >= 0.95:
        return f"try a smaller --momentum than {config.momentum} or a smaller --lr than {config.lr}"
    return f"try a smaller --lr than {config.lr}"


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run after a round, whose checkpoint was saved and verified."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


@dataclasses.dataclass
class Counters:
    """What a run accumulates across rounds; saved in checkpoints beside the states."""

    rounds_done: int = 0
    cumulative_bytes: int = 0
    total_uplink_bytes: int = 0
    total_downlink_bytes: int = 0
    dense_train_flops_total: int = 0
    train_flops_total: float = 0.0  # the sum of the clients' reported `train_flops` over all rounds
    padded_step_fractions: list = dataclasses.field(default_factory=list)


def compilation_cache_dir() -> Path:
    """Where compiled rounds are kept between runs: $FEDJAX_SPARSE_CACHE, else the user's cache folder."""
    if os.environ.get("FEDJAX_SPARSE_CACHE"):
        return Path(os.environ["FEDJAX_SPARSE_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fedjax_sparse" / "jax"


def use_compilation_cache(enabled: bool) -> None:
    """Turns JAX's persistent compilation cache on (in `compilation_cache_dir()`) or off.

    A run's first round spends seconds compiling; with the cache, a repeated
    run (same model, algorithm and shapes) loads the compiled round instead.
    """
    if enabled:
        path = compilation_cache_dir()
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    else:
        jax.config.update("jax_compilation_cache_dir", None)


def run_experiment(config: RunConfig, *, progress: bool = True, resume: bool = False,
                   overwrite: bool = False) -> dict:
    """Runs `config` and writes config.json, metrics.jsonl, partition.json, summary.json and a plot.

    The run holds its folder's lock throughout (`run_folder.hold_run_folder`). A new run refuses a
    folder holding another run's files unless `overwrite` (which deletes them first); `resume=True`
    continues the run in `config.out` from its latest checkpoint, refusing one made with a config
    that would change the results, or `config.rounds` below the rounds done. With
    `config.checkpoint_every` the whole run state is saved every so many rounds and at the end.
    SIGINT or SIGTERM during the rounds finishes the current round, saves it and raises
    `Interrupted` after writing summary.json with status "interrupted". A non-finite loss or model
    stops the run with `DivergenceError` after writing what was measured so far.

    Several processes (`core.distributed.initialize` first): every process calls this with the
    same config. Process 0 alone holds the lock, claims the folder and writes the run's files;
    every process loads the data, holds its own clients, and takes part in every round,
    evaluation and checkpoint. Where a step fails in some process, all stop (`agree`).
    """
    start = time.perf_counter()
    config.validate()
    out = Path(config.out)
    if resume and not out.is_dir():
        raise FileNotFoundError(f"--resume {out}: no such folder")
    use_compilation_cache(config.compilation_cache)
    process = current_process()
    lead = process.index == 0
    with hold_run_folder(out) if lead else contextlib.nullcontext(out):
        failure, snapshot, dataset, counters = None, None, None, Counters()
        try:  # the folder made this run's (by process 0) before any process writes into it
            if lead and not resume:
                claim_run_folder(out, overwrite)
            fault_point("start_up")
            if resume:
                snapshot = _check_resume(config, out, process)
            if lead:  # first, so that a data set prepared on first use is prepared once
                dataset = load_run_dataset(config, progress)
        except Exception as e:  # noqa: BLE001 - raised below, in every process
            failure = e
        agree(failure, "preparing the run folder")
        exp, failure = None, None
        try:
            exp = build_experiment(config, progress=progress and lead, process=process, snapshot=snapshot,
                                   dataset=dataset)
        except Exception as e:  # noqa: BLE001
            failure = e
        agree(failure, "during start-up")
        try:
            server_state, records = exp.server_state, []
            if resume:
                server_state, counters, records = _restore(exp, out, lead)
            with StopAfterRound() as stop:
                return _run_rounds(exp, config, out, counters, records, server_state, stop,
                                   progress and lead, start)
        finally:
            exp.close()


def _check_resume(config: RunConfig, out: Path, process: ProcessLayout) -> str | None:
    """Refuses a resume that cannot continue the run in `out` as it was; the backend of this process's
    client-state snapshot in its latest checkpoint (None: a checkpoint from before the client stores)."""
    checkpointer = RunCheckpointer(out) if has_checkpoints(out) else None
    saved_meta = checkpointer.read_meta() if checkpointer is not None else None
    if saved_meta is None:
        raise RunFolderError(f"--resume {out}: no checkpoint in {out / 'checkpoints'} (the run stopped "
                             f"before its first); start it again with --overwrite")
    # normalized first: a config saved by an older version lacks newer options (at their defaults)
    mismatches = config_mismatches(RunConfig.from_dict(saved_meta["config"]).to_dict(), config.to_dict())
    if mismatches:
        raise ValueError(f"--resume {out}: the checkpoint was made with another configuration ("
                         + "; ".join(mismatches) + "); drop those flags, or start a new run with "
                         "another --out")
    done = saved_meta["counters"]["rounds_done"]
    if config.rounds < done:
        raise ValueError(f"--rounds {config.rounds} is below the {done} rounds the run in {out} has "
                         f"done; give --rounds {done} or more")
    processes = saved_meta.get("processes", 1)
    if processes != process.count:
        raise ValueError(f"--resume {out}: the checkpoint holds the client states of {processes} process"
                         f"{'es' if processes > 1 else ''}, each its own clients'; resume it with --num-processes "
                         f"{processes}")
    states = checkpointer.client_states_dir()
    return None if states is None else snapshot_backend(states, process)


def _restore(exp: Experiment, out: Path, lead: bool) -> tuple[Any, Counters, list]:
    """The latest checkpoint's server state (the store takes its client states), counters and, in
    process 0, the metrics records it covers."""
    failure = None
    try:
        # several processes: restored replicated over all of them, as the rounds hold it
        server_like = replicated(exp.server_state, exp.round_fn.mesh) if exp.process.count > 1 else exp.server_state
        _, server_state, meta = RunCheckpointer(out).restore(server_like, exp.store)
        counters = Counters(**meta["counters"])
        records = recover_metrics(out / "metrics.jsonl", counters.rounds_done, say) if lead else []
    except Exception as e:  # noqa: BLE001
        failure = e
    agree(failure, "restoring the checkpoint")
    return server_state, counters, records


def _run_rounds(exp: Experiment, config: RunConfig, out: Path, counters: Counters, history: list,
                server_state, stop: StopAfterRound, progress: bool, start: float) -> dict:
    """The rounds of `run_experiment` from `counters.rounds_done` on, and the files they leave
    (process 0's; every process runs the rounds, evaluations and checkpoints)."""
    lead = exp.process.index == 0
    writer = RunWriter(out, history) if lead else None
    if lead:
        writer.write_config(config.to_dict())
        writer.write_partition(partition_summary(exp.client_indices, exp.dataset.y_train,
                                                 exp.dataset.num_classes))
    board = TensorBoardWriter(out, first_round=counters.rounds_done + 1) if config.tensorboard and lead else None
    title = f"{config.algorithm} / {config.model} / {config.dataset}"
    checkpointer, saved = None, {}  # saved: rounds done -> the checkpoint this process wrote of them

    def save() -> Path:
        nonlocal checkpointer
        checkpointer = checkpointer or RunCheckpointer(out)
        before, stop.waiting_for = stop.waiting_for, f"the checkpoint of round {counters.rounds_done} to be saved"
        saved[counters.rounds_done] = checkpointer.save(counters.rounds_done, server_state, exp.store, {
            "config": config.to_dict(), "counters": dataclasses.asdict(counters), "processes": exp.process.count})
        stop.waiting_for = before
        return saved[counters.rounds_done]

    def finish(status: str, **extra) -> dict:
        bar.close()
        if board is not None:
            board.close()
        summary = {**_summary(exp, history, _totals(counters), first_round_seconds, time.perf_counter() - start),
                   "status": status, **extra}
        if lead:
            writer.write_summary(summary)
            writer.plot(history, title=title)
        return summary

    def diverged(message: str) -> DivergenceError:
        finish("diverged", error=message)
        return DivergenceError(message)

    counts = exp.train_counts
    dense_forward = forward_flops(exp.model.structure)
    first_round_seconds = None
    start_round = counters.rounds_done
    bar = progress_bar(config.rounds, f"{config.algorithm} on {config.dataset}", enabled=progress,
                       initial=counters.rounds_done)
    for r in range(counters.rounds_done, config.rounds):
        stop.round, stop.waiting_for = r + 1, f"round {r + 1} to finish"
        t0 = time.perf_counter()
        server_state, round_out = exp.round_fn(server_state, r, prefetch_next=r + 1 < config.rounds)
        ids = np.asarray(round_out.client_ids)
        if first_round_seconds is None:
            first_round_seconds = time.perf_counter() - t0
        train_loss = float(np.average(np.asarray(round_out.metrics["loss"]), weights=counts[ids]))
        if not math.isfinite(train_loss):
            raise diverged(f"round {r + 1}: the training loss is {train_loss}; the run diverged "
                           f"({likely_culprit(config)})")
        if not bool(all_finite(process_local(server_state))):
            raise diverged(f"round {r + 1}: the server's model is not finite; the run diverged "
                           f"({likely_culprit(config)})")
        uplink = int(np.asarray(round_out.uplink_bytes, np.int64).sum())
        downlink = int(np.asarray(round_out.downlink_bytes, np.int64).sum())
        counters.rounds_done = r + 1
        counters.cumulative_bytes += uplink + downlink
        counters.total_uplink_bytes += uplink
        counters.total_downlink_bytes += downlink
        counters.dense_train_flops_total += 3 * dense_forward * config.local_epochs * int(counts[ids].sum())
        if "train_flops" in round_out.metrics:  # what the clients' sparse computation cost (SpaFL, sub-models, ...)
            counters.train_flops_total += float(np.asarray(round_out.metrics["train_flops"], np.float64).sum())
        counters.padded_step_fractions.append(
            padded_step_fraction(counts[ids], config.batch_size, exp.client_chunk))
        if (r + 1) % config.eval_every == 0 or r + 1 == config.rounds:
            figures, finite = evaluate(exp, server_state)
            if not finite:
                raise diverged(f"round {r + 1}: a client's model is not finite; the run diverged "
                               f"({likely_culprit(config)})")
            record = {"round": r + 1, "train_loss": train_loss, "uplink_bytes": uplink,
                      "downlink_bytes": downlink, "cumulative_bytes": counters.cumulative_bytes,
                      "cumulative_uplink_bytes": counters.total_uplink_bytes,
                      "dense_train_flops": counters.dense_train_flops_total / config.num_clients,
                      "padded_step_fraction": counters.padded_step_fractions[-1],
                      **({"train_flops": counters.train_flops_total / config.num_clients}
                         if "train_flops" in round_out.metrics else {}),
                      **client_metrics(round_out.metrics), **figures}
            if lead:
                writer.append_metrics(record)
            if board is not None:
                board.write(record)
            history.append(record)
            if record["test_loss"] is not None and not math.isfinite(record["test_loss"]):
                raise diverged(f"round {r + 1}: the test loss is {record['test_loss']}; the run diverged "
                               f"({likely_culprit(config)})")
            bar.set_postfix(acc=_fmt(record["test_accuracy"]), pacc=_fmt(record["personalized_accuracy"]),
                            loss=f"{train_loss:.3f}", MB=f"{counters.cumulative_bytes / 1e6:.1f}")
        bar.update(1)
        if r == start_round:
            release_compiler_memory()  # the round (and, evaluating every round, the evaluators) compiled
        if config.checkpoint_every and ((r + 1) % config.checkpoint_every == 0 or r + 1 == config.rounds):
            save()
        fault_point("round_end")
        signum = max_over_processes(stop.signum or 0)  # a signal to one process stops them all
        if signum and r + 1 < config.rounds:
            path = saved.get(r + 1) or save()
            name = signal.Signals(signum).name
            stop.waiting_for = "the summary to be written"
            finish("interrupted", signal=name)
            raise Interrupted(f"{name}: stopped after round {r + 1} of {config.rounds}; checkpoint saved in "
                              f"{path}; continue with --resume {out}", signum)
    return finish("completed")


def _totals(counters: Counters) -> dict:
    fractions = counters.padded_step_fractions
    return {"rounds_done": counters.rounds_done,
            "total_uplink_bytes": counters.total_uplink_bytes,
            "total_downlink_bytes": counters.total_downlink_bytes,
            "cumulative_bytes": counters.cumulative_bytes,
            "dense_train_flops_total": counters.dense_train_flops_total,
            "train_flops_total": counters.train_flops_total,
            "mean_padded_step_fraction": float(np.mean(fractions)) if fractions else None}


def _fmt(x):
    return "-" if x is None else f"{x:.3f}"


def _summary(exp: Experiment, history: list, totals: dict, first_round_seconds: float | None, wall: float) -> dict:
    final = history[-1] if history else {}
    test = [h["test_accuracy"] for h in history if h.get("test_accuracy") is not None]
    personal = [h["personalized_accuracy"] for h in history if h.get("personalized_accuracy") is not None]
    return {
        "algorithm": exp.config.algorithm, "model": exp.config.model, "dataset": exp.config.dataset,
        "rounds": exp.config.rounds,
        "has_global_model": exp.algorithm.global_variables is not None,
        "final_test_accuracy": final.get("test_accuracy"),
        "best_test_accuracy": max(test) if test else None,
        "final_personalized_accuracy": final.get("personalized_accuracy"),
        "best_personalized_accuracy": max(personal) if personal else None,
        "final_train_loss": final.get("train_loss"),
        **totals,
        "num_params": exp.num_params,
        # the weights of the prunable layers (SpaFL's d: kernels only), in structure order
        "prunable_layer_weights": {l.name: l.num_weights for l in exp.model.structure.layers},
        "client_chunk": exp.client_chunk,
        "client_store": exp.store.backend,
        "processes": exp.process.count,
        "num_train_examples": int(exp.train_counts.sum()),
        "first_round_seconds": first_round_seconds,
        "wall_seconds": wall,
        "device": device_description(),
    }
