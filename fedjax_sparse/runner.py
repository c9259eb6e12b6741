"""A federated experiment from a config: data, model, algorithm, rounds, outputs.

The Python loop here is over rounds only; each round is one jitted call.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedjax_sparse.algorithms import make_algorithm
from fedjax_sparse.checkpoint import RunCheckpointer, config_mismatches
from fedjax_sparse.core.evaluation import global_evaluator, personalized_evaluator
from fedjax_sparse.core.local_training import LocalSGD
from fedjax_sparse.core.round import build_round, clients_mesh, default_client_chunk
from fedjax_sparse.data import load_dataset, local_test_split, partition, partition_summary
from fedjax_sparse.data.federated import federated_split, padded_step_fraction
from fedjax_sparse.models import get_model
from fedjax_sparse.reporting import RunWriter, device_description, progress_bar


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss; the run stops instead of going on with NaNs."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    algorithm: str = "fedavg"
    dataset: str = "digits"
    model: str = "mlp"
    num_clients: int = 20
    clients_per_round: int = 10
    rounds: int = 30
    local_epochs: int = 5
    batch_size: int = 16
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    partition: str = "dirichlet"
    alpha: float | None = 0.5
    labels_per_client: int | None = None
    min_examples: int = 2
    local_test_ratio: float = 0.2
    seed: int = 0
    eval_every: int = 1
    mu: float = 0.01
    server_lr: float = 1.0
    sparsity_coef: float = 0.002
    weight_bounds: bool = True
    threshold_update: bool = True
    clients_per_layer: int = 4
    shard_clients: bool = False
    client_chunk: int | None = None
    max_train_examples: int | None = None
    max_test_examples: int | None = None
    checkpoint_every: int | None = None
    out: str = "runs/default"

    def validate(self) -> None:
        """Checks what can be checked before any data is loaded; one clear line per problem."""
        positive = {"num_clients": self.num_clients, "clients_per_round": self.clients_per_round,
                    "rounds": self.rounds, "local_epochs": self.local_epochs,
                    "batch_size": self.batch_size, "eval_every": self.eval_every}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.clients_per_round > self.num_clients:
            raise ValueError(f"--clients-per-round {self.clients_per_round} exceeds --num-clients "
                             f"{self.num_clients}; valid: 1..{self.num_clients}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.partition == "dirichlet" and (self.alpha is None or not self.alpha > 0):
            raise ValueError(f"--alpha must be > 0 for the dirichlet partition, got {self.alpha}")
        if self.partition == "labels" and (self.labels_per_client is None or self.labels_per_client < 1):
            raise ValueError(f"--labels-per-client must be >= 1 for the labels partition, "
                             f"got {self.labels_per_client}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.client_chunk is not None and not 0 <= self.client_chunk <= self.clients_per_round:
            raise ValueError(f"--client-chunk must be in [0, {self.clients_per_round}] (0: all sampled "
                             f"clients at once), got {self.client_chunk}")
        if self.client_chunk and self.shard_clients:
            raise ValueError(f"--client-chunk {self.client_chunk} and --shard-clients do not combine: "
                             f"sharding splits the vmap of all sampled clients over the devices")
        if not 0 < self.local_test_ratio <= 1:
            raise ValueError(f"--local-test-ratio must be in (0, 1], got {self.local_test_ratio}")


@dataclasses.dataclass
class Experiment:
    """Everything a run builds before its first round (also what tests poke at)."""

    config: RunConfig
    dataset: Any
    model: Any
    algorithm: Any
    train: Any
    local_test: Any
    client_indices: list
    round_fn: Any
    evaluate_global: Any
    evaluate_personalized: Any
    server_state: Any
    client_states: Any
    num_params: int
    client_chunk: int | None


def build_experiment(config: RunConfig) -> Experiment:
    config.validate()
    dataset = load_dataset(config.dataset).subset(config.max_train_examples, config.max_test_examples,
                                                  config.seed)
    if config.partition == "labels" and config.labels_per_client > dataset.num_classes:
        raise ValueError(f"--labels-per-client {config.labels_per_client} exceeds the "
                         f"{dataset.num_classes} classes of {config.dataset}")
    model = get_model(config.model, dataset.input_shape, dataset.num_classes)
    client_indices = partition(dataset.y_train, config.num_clients, config.partition, seed=config.seed,
                               alpha=config.alpha, labels_per_client=config.labels_per_client,
                               min_examples=config.min_examples)
    test_indices = local_test_split(client_indices, dataset.y_train, dataset.y_test, dataset.num_classes,
                                    seed=config.seed, ratio=config.local_test_ratio)
    train = federated_split(dataset.x_train, dataset.y_train, client_indices, dataset.mean, dataset.std,
                            augment=dataset.augment)
    local_test = federated_split(dataset.x_test, dataset.y_test, test_indices, dataset.mean, dataset.std)
    local = LocalSGD(model, config.lr, config.local_epochs, config.batch_size, config.momentum,
                     config.weight_decay)
    algorithm = make_algorithm(config.algorithm, local, config)
    key = jax.random.key(config.seed)
    variables = model.init(jax.random.fold_in(key, 0))
    server_state, client_states = algorithm.init(jax.random.fold_in(key, 1), variables, config.num_clients)
    mesh = clients_mesh() if config.shard_clients else None
    chunk = resolve_client_chunk(config, variables)
    round_fn = build_round(algorithm, train, config.clients_per_round, seed=config.seed, mesh=mesh,
                           client_chunk=chunk)
    evaluate_global = (global_evaluator(model, dataset.x_test, dataset.y_test, dataset.mean, dataset.std)
                       if algorithm.global_variables is not None else None)
    evaluate_personalized = personalized_evaluator(model, algorithm.client_variables, local_test)
    return Experiment(config, dataset, model, algorithm, train, local_test, client_indices, round_fn,
                      evaluate_global, evaluate_personalized, server_state, client_states,
                      model.num_params(variables), chunk)


def resolve_client_chunk(config: RunConfig, variables) -> int | None:
    """The chunk the round trains clients in: the flag (0 = all at once), else the platform's default."""
    if config.shard_clients or config.client_chunk == 0:
        return None
    if config.client_chunk is not None:
        return config.client_chunk
    return default_client_chunk(variables, config.clients_per_round)


def evaluate(exp: Experiment, server_state, client_states) -> dict:
    out = {"test_accuracy": None, "test_loss": None}
    if exp.evaluate_global is not None:
        scores = exp.evaluate_global(exp.algorithm.global_variables(server_state))
        out = {"test_accuracy": float(scores["accuracy"]), "test_loss": float(scores["loss"])}
    accuracies = np.asarray(exp.evaluate_personalized(server_state, client_states))
    out["personalized_accuracy"] = float(accuracies.mean())
    if exp.algorithm.diagnostics is not None:
        out.update(jax.tree_util.tree_map(_to_python, exp.algorithm.diagnostics(server_state, client_states)))
    return out


def _to_python(x):
    x = np.asarray(x)
    return x.item() if x.ndim == 0 else x.tolist()


class Interrupted(RuntimeError):
    """Ctrl-C stopped the run after a round; a checkpoint was saved if checkpointing is on."""


@dataclasses.dataclass
class Counters:
    """What a run accumulates across rounds; saved in checkpoints beside the states."""

    rounds_done: int = 0
    cumulative_bytes: int = 0
    total_uplink_bytes: int = 0
    total_downlink_bytes: int = 0
    padded_step_fractions: list = dataclasses.field(default_factory=list)


class _StopOnInterrupt:
    """The first Ctrl-C asks the run to stop after the current round; a second one stops at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def run_experiment(config: RunConfig, *, progress: bool = True, resume: bool = False) -> dict:
    """Runs `config` and writes config.json, metrics.jsonl, partition.json, summary.json and a plot.

    With `config.checkpoint_every` the whole run state is saved every so many
    rounds, at the end and on Ctrl-C; `resume=True` continues the run in
    `config.out` from its latest checkpoint, refusing one made with a config
    that would change the results.
    """
    start = time.perf_counter()
    out = Path(config.out)
    checkpointer = RunCheckpointer(out) if config.checkpoint_every or resume else None
    saved_meta = checkpointer.read_meta() if resume else None
    if resume:
        if saved_meta is None:
            raise FileNotFoundError(f"--resume {out}: no checkpoint under {checkpointer.directory}")
        mismatches = config_mismatches(saved_meta["config"], dataclasses.asdict(config))
        if mismatches:
            raise ValueError(f"--resume {out}: the checkpoint was made with another configuration ("
                             + "; ".join(mismatches) + ")")
    exp = build_experiment(config)
    server_state, client_states = exp.server_state, exp.client_states
    counters = Counters()
    if resume:
        rounds_done, server_state, client_states, meta = checkpointer.restore(server_state, client_states)
        counters = Counters(**meta["counters"])
    writer = RunWriter(out, keep_rounds_up_to=counters.rounds_done if resume else None)
    writer.write_config(dataclasses.asdict(config))
    writer.write_partition(partition_summary(exp.client_indices, exp.dataset.y_train,
                                             exp.dataset.num_classes))
    history = writer.read_metrics()

    def save():
        if checkpointer is not None:
            checkpointer.save(counters.rounds_done, server_state, client_states,
                              {"config": dataclasses.asdict(config), "counters": dataclasses.asdict(counters)})

    counts = np.asarray(exp.train.counts)
    compile_seconds = None
    bar = progress_bar(config.rounds, f"{config.algorithm} on {config.dataset}", enabled=progress,
                       initial=counters.rounds_done)
    with _StopOnInterrupt() as interrupt:
        for r in range(counters.rounds_done, config.rounds):
            t0 = time.perf_counter()
            server_state, client_states, round_out = exp.round_fn(server_state, client_states, r)
            ids = np.asarray(round_out.client_ids)
            if compile_seconds is None:
                compile_seconds = time.perf_counter() - t0
            train_loss = float(np.average(np.asarray(round_out.metrics["loss"]), weights=counts[ids]))
            if not math.isfinite(train_loss):
                bar.close()
                raise DivergenceError(f"round {r + 1}: training loss is {train_loss}; the run diverged "
                                      f"(try a smaller --lr than {config.lr})")
            uplink = int(np.asarray(round_out.uplink_bytes, np.int64).sum())
            downlink = int(np.asarray(round_out.downlink_bytes, np.int64).sum())
            counters.rounds_done = r + 1
            counters.cumulative_bytes += uplink + downlink
            counters.total_uplink_bytes += uplink
            counters.total_downlink_bytes += downlink
            counters.padded_step_fractions.append(
                padded_step_fraction(counts[ids], config.batch_size, exp.client_chunk))
            if (r + 1) % config.eval_every == 0 or r + 1 == config.rounds:
                record = {"round": r + 1, "train_loss": train_loss, "uplink_bytes": uplink,
                          "downlink_bytes": downlink, "cumulative_bytes": counters.cumulative_bytes,
                          "padded_step_fraction": counters.padded_step_fractions[-1],
                          **evaluate(exp, server_state, client_states)}
                writer.append_metrics(record)
                history.append(record)
                bar.set_postfix(acc=_fmt(record["test_accuracy"]), pacc=_fmt(record["personalized_accuracy"]),
                                loss=f"{train_loss:.3f}", MB=f"{counters.cumulative_bytes / 1e6:.1f}")
            bar.update(1)
            if config.checkpoint_every and ((r + 1) % config.checkpoint_every == 0 or r + 1 == config.rounds):
                save()
            if interrupt.requested and r + 1 < config.rounds:
                bar.close()
                if checkpointer is None:
                    raise Interrupted(f"interrupted after round {r + 1}; no checkpoint (use --checkpoint-every)")
                save()
                raise Interrupted(f"interrupted after round {r + 1}; checkpoint saved in "
                                  f"{checkpointer.directory}; continue with --resume {out}")
    bar.close()
    totals = {"total_uplink_bytes": counters.total_uplink_bytes,
              "total_downlink_bytes": counters.total_downlink_bytes,
              "cumulative_bytes": counters.cumulative_bytes,
              "mean_padded_step_fraction": float(np.mean(counters.padded_step_fractions))}
    summary = _summary(exp, history, totals, compile_seconds, time.perf_counter() - start)
    writer.write_summary(summary)
    writer.plot(history, title=f"{config.algorithm} / {config.model} / {config.dataset}")
    return summary


def _fmt(x):
    return "-" if x is None else f"{x:.3f}"


def _summary(exp: Experiment, history: list, totals: dict, compile_seconds: float, wall: float) -> dict:
    final = history[-1]
    test = [h["test_accuracy"] for h in history if h["test_accuracy"] is not None]
    return {
        "algorithm": exp.config.algorithm, "model": exp.config.model, "dataset": exp.config.dataset,
        "rounds": exp.config.rounds,
        "final_test_accuracy": final["test_accuracy"],
        "best_test_accuracy": max(test) if test else None,
        "final_personalized_accuracy": final["personalized_accuracy"],
        "best_personalized_accuracy": max(h["personalized_accuracy"] for h in history),
        "final_train_loss": final["train_loss"],
        **totals,
        "num_params": exp.num_params,
        "client_chunk": exp.client_chunk,
        "num_train_examples": int(np.asarray(exp.train.counts).sum()),
        "compile_seconds": compile_seconds,
        "wall_seconds": wall,
        "device": device_description(),
    }
