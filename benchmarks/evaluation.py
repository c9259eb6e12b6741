"""Evaluation throughput beside training throughput, and the 100-client evaluation of issue 19.

    python -m benchmarks.evaluation [--quick] [--out DIR] [--cifar10 PATH]

Per model (the MLP on 8x8x1 digits shapes, with 10x the examples and clients; `spafl_cnn`,
`resnet20`, `cnn4` on
CIFAR-10 shapes), in one process, as examples per second:

  training      one client's local training as a round runs it (FedAvg,
                batch 64, momentum 0.9; `benchmarks.local_training`);
  personalized  `personalized_evaluator` as the runner builds it: clients of
                uneven test sizes, each with its own weights;
  global        `global_evaluator` over one test set.

The goal on a CPU: evaluation at least 3x training (a forward pass against
forward and backward). Then, with the CIFAR-10 image folder, issue 19's
setting: SpaFL with `spafl_cnn`, 100 clients with Dirichlet(0.2) label skew,
each client's personal sparse model scored on its own test split (about
10,000 examples in all) as `fedjax-sparse run` does after a round; the
official SpaFL code takes 11 s for this on the same 2-core CPU. Reported with
the process's resident memory and XLA's memory analysis of the evaluator.
Writes `evaluation_<device>_<date>.{md,json}` in --out.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from .common import (best, command_line, environment, environment_markdown, finish, fmt, interleaved,
                     markdown_table, peak_rss_bytes, rss_bytes)
from .common import parser as benchmark_parser
from .local_training import Setting as TrainSetting
from .local_training import client_update_fn, synthetic_split
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.evaluation.evaluators import global_evaluator, personalized_evaluator

MODELS = ("mlp", "spafl_cnn", "resnet20", "cnn4")
REFERENCE_SECONDS = 11.0  # official SpaFL code, 100 clients' personal models, 2-core CPU (issue 19)


@dataclasses.dataclass(frozen=True)
class Setting:
    train_examples: int = 512
    clients: int = 10
    test_examples: int = 1000  # over `clients` clients of uneven sizes (personalized), or one set (global)
    repeats: int = 3
    issue_setting: bool = True
    # The MLP's forward pass takes microseconds an example: 10x the examples, so that each of its timings
    # spans milliseconds and a dispatch's fixed cost does not decide the ratio.
    mlp_scale: int = 10


FULL = Setting()
QUICK = Setting(train_examples=64, clients=3, test_examples=96, repeats=1, issue_setting=False, mlp_scale=1)


def uneven_counts(total: int, clients: int, seed: int = 0) -> list[int]:
    """`clients` sizes summing to `total`, from 1/4 to 7/4 of the mean (Dirichlet partitions are uneven)."""
    weights = np.linspace(0.25, 1.75, clients)
    counts = np.maximum(1, np.floor(weights / weights.sum() * total)).astype(int)
    counts[-1] += total - counts.sum()
    return np.random.default_rng(seed).permutation(counts).tolist()


def run_model(model_name: str, setting: Setting) -> dict:
    if model_name == "mlp":
        setting = dataclasses.replace(setting, train_examples=setting.train_examples * setting.mlp_scale,
                                      clients=setting.clients * setting.mlp_scale,
                                      test_examples=setting.test_examples * setting.mlp_scale, mlp_scale=1)
    train = TrainSetting(examples=setting.train_examples, repeats=setting.repeats, profile=False)
    update, args, model, variables = client_update_fn(model_name, "fedavg", train)
    train_fn = jit(update)
    counts = uneven_counts(setting.test_examples, setting.clients)
    test = synthetic_split(model_name, counts, seed=1)
    clients = jax.vmap(model.init)(jax.random.split(jax.random.key(3), setting.clients))
    personalized = personalized_evaluator(model, lambda server, client: client, test)
    x, y = np.asarray(test.x), np.asarray(test.y)
    global_ = global_evaluator(model, x, y, test.mean, test.std)
    times = interleaved({"training": lambda: train_fn(*args), "personalized": lambda: personalized({}, clients),
                         "global": lambda: global_(variables)}, setting.repeats)
    examples = {"training": setting.train_examples, "personalized": setting.test_examples,
                "global": setting.test_examples}
    rate = {name: examples[name] / best(t)["wall"] for name, t in times.items()}
    cpu_rate = {name: examples[name] / best(t)["cpu"] for name, t in times.items()}
    return {"model": model_name, "examples": examples, "test_client_counts": counts,
            "examples_per_second": rate, "cpu_examples_per_second": cpu_rate, "times": times,
            "personalized_over_training": rate["personalized"] / rate["training"],
            "global_over_training": rate["global"] / rate["training"]}


def run_issue_setting(cifar10: Path, repeats: int) -> dict:
    """SpaFL, spafl_cnn, 100 clients, Dirichlet(0.2): the runner's personalized evaluation of all clients."""
    from fedjax_sparse.run import RunConfig, build_experiment, evaluate

    config = RunConfig.create(algorithm="spafl", dataset=f"imagefolder:{cifar10}", model="spafl_cnn",
                              num_clients=100, clients_per_round=10, rounds=1, local_epochs=5, batch_size=64,
                              lr=0.001, momentum=0.9, partition="dirichlet", alpha=0.2, out="unused",
                              compilation_cache=False, client_store="device")
    rss_start = rss_bytes()
    exp = build_experiment(config, progress=False)
    rss_built = rss_bytes()
    server, clients = exp.server_state, exp.store.states
    start = time.perf_counter()
    jax.block_until_ready(exp.evaluate_personalized(server, clients, exp.local_test))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        evaluate(exp, server)  # as the runner evaluates: personalized, plus SpaFL's diagnostics
        times.append(time.perf_counter() - start)
    stats = exp.evaluate_personalized.lower(server, clients, exp.local_test).compile().memory_analysis()
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    seconds = min(times)
    return {"config": config.to_dict(), "local_test_examples": int(np.asarray(exp.local_test.counts).sum()),
            "largest_client_test_split": int(exp.local_test.max_count), "first_call_seconds": first,
            "seconds": seconds, "all_seconds": times, "reference_seconds": REFERENCE_SECONDS,
            "speed_over_reference": REFERENCE_SECONDS / seconds,
            "rss_bytes": {"start": rss_start, "after_build": rss_built, "after_evaluation": rss_bytes(),
                          "peak": peak_rss_bytes()},
            "train_data_bytes": nbytes((exp.train.x, exp.train.y)),
            "test_data_bytes": nbytes((exp.local_test.x, exp.local_test.y, exp.dataset.x_test, exp.dataset.y_test)),
            "client_states_bytes": nbytes(clients),
            "xla_temp_bytes": None if stats is None else int(stats.temp_size_in_bytes)}


def markdown(env: dict, records: list[dict], issue: dict | None) -> str:
    rows = [[r["model"], fmt(r["examples_per_second"]["training"]), fmt(r["examples_per_second"]["personalized"]),
             fmt(r["examples_per_second"]["global"]), f"{r['personalized_over_training']:.2f}x",
             f"{r['global_over_training']:.2f}x"] for r in records]
    parts = ["# Evaluation throughput beside training throughput", "", environment_markdown(env), "",
             "Examples per second (fastest of the repeats); the goal on a CPU is evaluation >= 3x training.", "",
             markdown_table(["model", "training", "personalized eval", "global eval", "personalized / training",
                             "global / training"], rows)]
    if issue is not None:
        mib = lambda b: "-" if b is None else f"{b / 2**20:,.0f} MiB"  # noqa: E731
        rss = issue["rss_bytes"]
        parts += ["", "## Issue 19's setting: 100 clients' personal SpaFL models on CIFAR-10", "",
                  f"{issue['local_test_examples']:,} local test examples (largest client {issue['largest_client_test_split']}):"
                  f" {issue['seconds']:.1f} s per evaluation (first call, compile included, "
                  f"{issue['first_call_seconds']:.1f} s); the official SpaFL code: {issue['reference_seconds']:.0f} s, "
                  f"so this is {issue['speed_over_reference']:.2f}x its speed.", "",
                  f"Memory: training data {mib(issue['train_data_bytes'])}, test data {mib(issue['test_data_bytes'])}, "
                  f"client states {mib(issue['client_states_bytes'])}, the evaluator's XLA temporaries "
                  f"{mib(issue['xla_temp_bytes'])}; resident memory after building {mib(rss['after_build'])}, after "
                  f"evaluating {mib(rss['after_evaluation'])}, peak {mib(rss['peak'])}."]
    return "\n".join(parts) + "\n"


def default_cifar10() -> Path:
    return Path(os.environ.get("FEDJAX_SPARSE_CIFAR10", Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg"))


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = benchmark_parser("benchmarks.evaluation", __doc__, "tiny sizes, no CIFAR-10 setting")
    parser.add_argument("--cifar10", default=None, help="the CIFAR-10 image folder (default: $FEDJAX_SPARSE_CIFAR10 "
                                                        "or ../shared/data/cifar10-jpeg)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    args = parser.parse_args(argv)
    env = environment(command_line("benchmarks.evaluation", argv))
    setting = QUICK if args.quick else FULL
    records = []
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)}")
        print(f"{name} ...", file=sys.stderr, flush=True)
        records.append(run_model(name, setting))
    issue = None
    folder = Path(args.cifar10) if args.cifar10 else default_cifar10()
    if setting.issue_setting:
        if folder.is_dir():
            print("issue 19's setting (CIFAR-10, 100 SpaFL clients) ...", file=sys.stderr, flush=True)
            issue = run_issue_setting(folder, setting.repeats)
        else:
            print(f"no CIFAR-10 image folder at {folder}: issue 19's setting left out", file=sys.stderr)
    finish(args.out, "evaluation", env, {"models": records, "issue_setting": issue},
           lambda env: markdown(env, records, issue))
    return {"models": records, "issue_setting": issue}


if __name__ == "__main__":
    main()
