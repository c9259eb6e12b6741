"""What a run records beside its rounds: the counters it accumulates (checkpointed with its states), the figures of
an evaluation, and summary.json's totals and description of the run."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from fedjax_sparse.core.client_state.store import DeviceStore
from fedjax_sparse.core.evaluation.evaluators import all_finite, client_accuracy_figures, population_diagnostics
from fedjax_sparse.core.evaluation.store import evaluate_store
from fedjax_sparse.core.round.distributed import process_local
from fedjax_sparse.run.experiment import Experiment
from fedjax_sparse.run.outputs import device_description


@dataclasses.dataclass
class Counters:
    """What a run accumulates across rounds; saved in checkpoints beside the states."""

    rounds_done: int = 0
    cumulative_bytes: int = 0
    total_uplink_bytes: int = 0
    total_downlink_bytes: int = 0
    dense_train_flops_total: int = 0
    train_flops_total: float = 0.0  # the clients' reported `train_flops` over all rounds (the dense count where none)
    padded_step_fractions: list = dataclasses.field(default_factory=list)
    clients_dispatched_total: int = 0  # the federation's (`run.federation`), where it is not today's
    updates_lost_total: int = 0
    rounds_abandoned_total: int = 0  # abandoned for want of --min-reports
    simulated_seconds_total: float = 0.0


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
    out.update(client_accuracy_figures(accuracies))
    if diagnostics is not None:
        out.update(jax.tree_util.tree_map(_to_python, diagnostics))
    return out, finite


def _to_python(x):
    x = np.asarray(x)
    return x.item() if x.ndim == 0 else x.tolist()


def run_totals(counters: Counters) -> dict:
    """summary.json's totals of what the rounds accumulated."""
    fractions = counters.padded_step_fractions
    return {"rounds_done": counters.rounds_done,
            "total_uplink_bytes": counters.total_uplink_bytes,
            "total_downlink_bytes": counters.total_downlink_bytes,
            "cumulative_bytes": counters.cumulative_bytes,
            "dense_train_flops_total": counters.dense_train_flops_total,
            "train_flops_total": counters.train_flops_total,
            "mean_padded_step_fraction": float(np.mean(fractions)) if fractions else None}


def run_summary(exp: Experiment, history: list, totals: dict, first_round_seconds: float | None, wall: float) -> dict:
    """summary.json: what the run was, its final and best figures, `totals`, where and how it ran."""
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
        "cpu_devices": len(exp.round_fn.cpu_devices) or None,  # several CPU devices shared the clients
        "evaluation_cpu_devices": len(getattr(exp.evaluate_personalized, "devices", ())) or None,
        "client_store": exp.store.backend,
        **exp.config.numerics.describe(), "compute_dtype": exp.model.compute_dtype,
        "processes": exp.process.count,
        "num_train_examples": int(exp.train_counts.sum()),
        "first_round_seconds": first_round_seconds,
        "wall_seconds": wall,
        "device": device_description(),
    }
