"""SPATL on ResNet-20 and the CIFAR-10 folder: counted against measured FLOPs, and what each client holds out.

Two figures of a SPATL run can only be trusted on the paper's own model and
data: the FLOPs reduction of the salient sub-models (Table 2), and the agent's
held-out share (its reward's validation data). This runs a short SPATL run with
the learned agent (ResNet-20, the CIFAR-10 image folder, 10 clients all
sampled, Dirichlet(0.1); a few rounds, CPU-sized) through the ordinary runner
(config, metrics, plot and checkpoint land in --out), restores its final
state and writes `flops_check.md` / `.json` beside them:

  * per client, the inference FLOPs reduction of its salient sub-model as the
    library counts it (`core.structure.flops.layer_forward_flops`, count_inputs=True, the
    figure `inference_flops_reduction_mean` logs) and as `core.structure.flops.measure_layers` reads
    it off the computation itself (the physically smaller network's multiply-
    accumulates: channels that are non-zero on a batch of the client's own
    images, outputs that reach the logits), encoder only and whole model;
  * per client, the label counts of its training data and of the share the
    agent holds out (`algorithms.spatl_selection.agent_holdout`): a class-ordered image
    folder must not leave whole classes out of training.

    python -m experiments.spatl_flops_check [--rounds R] [--max-train-examples N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .common import cifar10_folder
from fedjax_sparse.algorithms.spatl_selection import agent_holdout, encoder_layers
from fedjax_sparse.run.checkpoints import RunCheckpointer
from fedjax_sparse.core.structure.flops import layer_forward_flops, measure_layers
from fedjax_sparse.data.federated import client_batch
from fedjax_sparse.run.outputs import device_description
from fedjax_sparse.run import RunConfig, build_experiment, run_experiment


def config(rounds: int, max_train_examples: int, out: str) -> RunConfig:
    return RunConfig.create(
        algorithm="spatl", salient_policy="agent", dataset=f"imagefolder:{cifar10_folder()}", model="resnet20",
        num_clients=10, clients_per_round=10, partition="dirichlet", alpha=0.1, min_examples=10,
        rounds=rounds, local_epochs=1, batch_size=64, lr=0.005, momentum=0.9, flops_reduction=0.2,
        max_train_examples=max_train_examples, max_test_examples=2000, checkpoint_every=rounds, out=out)


def flops_rows(exp, client_states, measure_examples: int) -> list[dict]:
    """Counted and measured reductions of every client's salient sub-model."""
    structure = exp.model.structure
    encoder = encoder_layers(structure)
    dense = layer_forward_flops(structure)
    dense_total, dense_encoder = sum(dense.values()), sum(dense[n] for n in encoder)

    @jax.jit
    def one(variables, masks, client):
        data = exp.train.client(client)
        batch = client_batch(data, jnp.arange(data.max_count), 0, measure_examples, jax.random.key(0), train=False)
        counted = layer_forward_flops(structure, masks, count_inputs=True)
        measured = {name: layer.flops(count_inputs=True) for name, layer in
                    measure_layers(exp.model, {**variables, "unit_masks": masks}, batch.x, train=True).items()}
        return counted, measured

    rows = []
    for client in range(exp.config.num_clients):
        state = jax.tree_util.tree_map(lambda a: a[client], client_states)
        counted, measured = one(state["variables"], state["salient"], client)
        row = {"client": client}
        for label, per_layer in (("counted", counted), ("measured", measured)):
            per_layer = {k: float(v) for k, v in per_layer.items()}
            row[f"{label}_reduction"] = 1.0 - sum(per_layer.values()) / dense_total
            row[f"{label}_encoder_reduction"] = 1.0 - sum(per_layer[n] for n in encoder) / dense_encoder
        rows.append(row)
    return rows


def holdout_rows(exp) -> list[dict]:
    """Per client, its label counts in training and in the agent's held-out share, and in what the
    rule before issue 16 held out (the last share of its data window)."""
    options = exp.config.algorithm_options
    held = np.asarray(agent_holdout(exp.train, options.agent_validation_fraction, exp.config.seed))
    y, offsets, counts = (np.asarray(a) for a in (exp.train.y, exp.train.offsets, exp.train.counts))
    classes = exp.dataset.num_classes
    rows = []
    for client, (offset, count) in enumerate(zip(offsets, counts)):
        labels, flags = y[offset:offset + count], held[offset:offset + count]
        tail = labels[count - int(np.ceil(options.agent_validation_fraction * count)):]
        rows.append({"client": client,
                     "train": np.bincount(labels[~flags], minlength=classes).tolist(),
                     "held_out": np.bincount(labels[flags], minlength=classes).tolist(),
                     "window_tail": np.bincount(tail, minlength=classes).tolist()})
    return rows


def write(out: Path, cfg: RunConfig, summary: dict, flops: list[dict], holdout: list[dict], command: str) -> None:
    lines = ["# SPATL on ResNet-20 / CIFAR-10: counted against measured FLOPs, and the agent's held-out shares", "",
             f"Device: {device_description()}. Command: `{command}`.",
             f"Setting: {cfg.num_clients} clients all sampled, Dirichlet({cfg.alpha}), {cfg.rounds} rounds, "
             f"{cfg.local_epochs} local epoch, batch {cfg.batch_size}, lr {cfg.lr}, momentum {cfg.momentum}, "
             f"{cfg.max_train_examples} training examples, the learned agent at a "
             f"{cfg.options['flops_reduction']} FLOPs target. Final personalized accuracy "
             f"{summary['final_personalized_accuracy']:.4f}.", "",
             "## FLOPs reduction of each client's salient sub-model (inference, one example)", "",
             "Counted: `layer_forward_flops(count_inputs=True)` (what the run logs). Measured: "
             "`measure_layers` on 64 of the client's own images (the computation itself).", "",
             "| client | counted (model) | measured (model) | counted (encoder) | measured (encoder) |",
             "|---|---|---|---|---|"]
    for r in flops:
        lines.append(f"| {r['client']} | {r['counted_reduction']:.4f} | {r['measured_reduction']:.4f} | "
                     f"{r['counted_encoder_reduction']:.4f} | {r['measured_encoder_reduction']:.4f} |")
    gap = max(abs(r["counted_reduction"] - r["measured_reduction"]) for r in flops)
    lines += ["", f"Largest |counted - measured| over clients: {gap:.2e}.", "",
              "## Label counts of each client's training data and held-out share", "",
              "The last column is what the rule before issue 16 held out: the last share of the client's data "
              "window, which in a class-ordered image folder is its last classes.", "",
              "| client | training (per class) | held out (per class) | classes trained / held out | "
              "old rule: window tail (per class) |",
              "|---|---|---|---|---|"]
    for r in holdout:
        kinds = [sum(1 for c in r[k] if c) for k in ("train", "held_out")]
        lines.append(f"| {r['client']} | {' '.join(map(str, r['train']))} | {' '.join(map(str, r['held_out']))} | "
                     f"{kinds[0]} / {kinds[1]} | {' '.join(map(str, r['window_tail']))} |")
    (out / "flops_check.md").write_text("\n".join(lines) + "\n")
    (out / "flops_check.json").write_text(json.dumps({"flops": flops, "holdout": holdout, "command": command,
                                                      "device": device_description()}, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-train-examples", type=int, default=5000)
    parser.add_argument("--out", default="runs/spatl_flops_check")
    args = parser.parse_args(argv)
    cfg = config(args.rounds, args.max_train_examples, args.out)
    start = time.perf_counter()
    summary = run_experiment(cfg, overwrite=True)
    exp = build_experiment(cfg, progress=False)
    RunCheckpointer(cfg.out).restore(exp.server_state, exp.store)
    client_states = exp.store.client_states(np.arange(cfg.num_clients))
    command = ("python -m experiments.spatl_flops_check --rounds "
               f"{args.rounds} --max-train-examples {args.max_train_examples} --out {args.out}")
    write(Path(cfg.out), cfg, summary, flops_rows(exp, client_states, 64), holdout_rows(exp), command)
    print(f"done in {time.perf_counter() - start:.0f} s: {Path(cfg.out) / 'flops_check.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
