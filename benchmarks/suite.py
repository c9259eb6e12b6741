"""One command that measures this library on whatever device JAX finds.

    python -m benchmarks.suite [--quick] [--out DIR] [--cifar10 PATH]

Sections, each figure a ratio of variants timed in the same run:

  round throughput   FedAvg rounds of the MLP and `spafl_cnn` at 10 and 100
                     clients per round: the engine against centralized training
                     and a Python step loop (`benchmarks.round_throughput`);
  vmap vs loop       CNN clients (`spafl_cnn`, `resnet20`) trained in one vmap
                     against one at a time: is a vmap over per-client kernels
                     (a grouped convolution) slow on this device too?
  evaluation         evaluation against training examples per second
                     (`benchmarks.evaluation`);
  agent search       SPATL's agent search for all clients of a round, one vmap
                     against client by client (`benchmarks.agent_search`);
  SPATL run          a 10-round ResNet-20 SPATL run on the CIFAR-10 image folder
                     as `fedjax-sparse run` does it (left out without the folder).

Sizes are chosen per platform so that the whole suite fits 8 minutes on one
H100-class GPU (estimated, not yet run on one: each section is a few
compilations of seconds to a minute and at most tens of seconds of device
work, the SPATL run 500,000 ResNet-20 example-passes); the CPU sizes are for
a 2-core machine (budget 20 minutes). A section that would start more than
30 s behind an even share of the budget is recorded as skipped rather than
run, so a slower device reports less instead of running over. `--quick` is the CI version (MLP-sized, seconds on
a CPU). Writes `suite_<device>_<date>.{md,json}` in --out, with the device,
versions and command.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import jax

from . import agent_search, evaluation
from . import round_throughput as rt
from .common import (best, command_line, environment, environment_markdown, finish, fmt, interleaved,
                     markdown_table)
from .common import parser as benchmark_parser
from fedjax_sparse.core.cpu_round import keep_freed_memory, use_cpu_cores

BUDGET_SECONDS = {"accelerator": 8 * 60, "cpu": 20 * 60}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What each section runs on one platform."""

    rounds: tuple[rt.Setting, ...]
    vmap_models: tuple[str, ...]
    vmap_clients: int
    vmap_examples: int
    evaluation: evaluation.Setting
    evaluation_models: tuple[str, ...]
    agent: agent_search.Setting | None  # None: left out
    spatl: dict | None  # run options of the SPATL run, None: left out
    budget_seconds: float


def plan(platform_name: str, quick: bool) -> Plan:
    accelerator = platform_name != "cpu"
    if quick:
        return Plan(rounds=(rt.Setting("mlp", 4, 32, repeats=1),), vmap_models=("mlp",), vmap_clients=2,
                    vmap_examples=16, evaluation=evaluation.QUICK, evaluation_models=("mlp",),
                    agent=None, spatl=None, budget_seconds=120)
    # The same sections on every full run; an accelerator gets larger CNN clients, wider vmaps and the whole
    # CIFAR-10 SPATL run, a CPU sizes that fit its budget.
    cnn = (dict(examples_per_client=64, batch_size=16, repeats=3) if accelerator
           else dict(examples_per_client=8, batch_size=8, repeats=1))
    spatl = dict(num_clients=10, clients_per_round=10, rounds=10, local_epochs=1, batch_size=64)
    if not accelerator:
        spatl.update(max_train_examples=2000, max_test_examples=1000)
    return Plan(rounds=(rt.Setting("mlp", 10, 64), rt.Setting("mlp", 100, 64),
                        rt.Setting("spafl_cnn", 10, **cnn), rt.Setting("spafl_cnn", 100, **cnn)),
                vmap_models=("spafl_cnn", "resnet20"), vmap_clients=10 if accelerator else 4,
                vmap_examples=64 if accelerator else 32,
                evaluation=dataclasses.replace(evaluation.FULL, issue_setting=False, repeats=2),
                evaluation_models=evaluation.MODELS,
                agent=agent_search.Setting(clients=10 if accelerator else 4, updates=5 if accelerator else 2,
                                           repeats=1),
                spatl=spatl, budget_seconds=BUDGET_SECONDS["accelerator" if accelerator else "cpu"])


def round_throughput(p: Plan) -> list[dict]:
    records = []
    for setting in p.rounds:
        r = rt.run_setting(setting, variants=("engine", "step_loop", "centralized"))
        records.append({k: r[k] for k in ("model", "clients_per_round", "examples_per_client", "batch_size",
                                          "engine_client_chunk", "engine", "step_loop", "centralized",
                                          "engine_over_step_loop", "engine_over_centralized",
                                          "round_seconds", "compile_seconds")})
    return records


def vmap_against_loop(p: Plan) -> list[dict]:
    """One FedAvg round of K CNN clients: all in one vmap, against one client at a time (chunk 1)."""
    records = []
    for model in p.vmap_models:
        w = rt.build_workload(rt.Setting(model, p.vmap_clients, p.vmap_examples,
                                         batch_size=min(16, p.vmap_examples), repeats=1))
        runners = {"vmap": rt.EngineRunner(w, None), "loop": rt.EngineRunner(w, 1)}
        rounds = iter(range(1, 10_000))
        times = interleaved({name: (lambda r=r: r(next(rounds))[0]) for name, r in runners.items()}, repeats=2)
        examples = p.vmap_clients * p.vmap_examples
        rate = {name: examples / best(t)["wall"] for name, t in times.items()}
        records.append({"model": model, "clients": p.vmap_clients, "examples_per_client": p.vmap_examples,
                        "examples_per_second": rate, "vmap_over_loop": rate["vmap"] / rate["loop"]})
    return records


def evaluation_section(p: Plan) -> list[dict]:
    records = []
    for model in p.evaluation_models:
        r = evaluation.run_model(model, p.evaluation)
        records.append({k: r[k] for k in ("model", "examples", "examples_per_second", "personalized_over_training",
                                          "global_over_training")})
    return records


def agent_section(p: Plan) -> list[dict]:
    if p.agent is None:
        return [{"skipped": "left out in --quick (the search compiles for a minute on a CPU; "
                            "tests/test_agent.py checks it)"}]
    r = agent_search.run_setting(p.agent)
    return [{k: r[k] for k in ("model", "clients", "updates", "validation_examples", "vmapped_seconds",
                               "loop_seconds", "speedup", "vmapped_compile_seconds", "loop_compile_seconds")}]


def spatl_run(p: Plan, cifar10: Path) -> list[dict]:
    if p.spatl is None:
        return [{"skipped": "left out in --quick"}]
    if not cifar10.is_dir():
        return [{"skipped": f"no CIFAR-10 image folder at {cifar10}"}]
    from fedjax_sparse.run import RunConfig, run_experiment

    with tempfile.TemporaryDirectory() as out:
        config = RunConfig.create(algorithm="spatl", dataset=f"imagefolder:{cifar10}", model="resnet20",
                                  partition="dirichlet", alpha=0.1, lr=0.005, momentum=0.9, out=out,
                                  compilation_cache=False, tensorboard=False, **p.spatl)
        start = time.perf_counter()
        summary = run_experiment(config, progress=False)
        wall = time.perf_counter() - start
    passes = summary["num_train_examples"] * config.local_epochs * config.rounds * config.clients_per_round \
        / config.num_clients
    steady = (wall - summary["first_round_seconds"]) / max(config.rounds - 1, 1)
    return [{"config": {k: v for k, v in config.to_dict().items() if k in p.spatl or k in ("algorithm", "model")},
             "wall_seconds": wall, "first_round_seconds": summary["first_round_seconds"],
             "steady_seconds_per_round_with_evaluation": steady,
             "training_examples_per_second": passes / wall,
             "final_test_accuracy": summary["final_test_accuracy"],
             "final_personalized_accuracy": summary["final_personalized_accuracy"]}]


def run_sections(p: Plan, cifar10: Path) -> dict:
    """Each section in turn; one that would start more than 30 s behind an even share of the budget per
    section is recorded as skipped instead of run."""
    sections: list[tuple[str, Callable[[], list[dict]]]] = [
        ("round_throughput", lambda: round_throughput(p)),
        ("vmap_against_loop", lambda: vmap_against_loop(p)),
        ("evaluation", lambda: evaluation_section(p)),
        ("agent_search", lambda: agent_section(p)),
        ("spatl_run", lambda: spatl_run(p, cifar10)),
    ]
    start = time.perf_counter()
    out = {}
    for i, (name, run) in enumerate(sections):
        elapsed = time.perf_counter() - start
        if elapsed > p.budget_seconds * i / len(sections) + 30:  # behind schedule: keep the total in budget
            out[name] = {"skipped": f"{elapsed:.0f} s spent of a {p.budget_seconds:.0f} s budget"}
            continue
        print(f"[{elapsed:6.0f} s] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        out[name] = {"records": run(), "seconds": time.perf_counter() - t0}
    out["total_seconds"] = time.perf_counter() - start
    return out


def markdown(env: dict, result: dict) -> str:
    parts = ["# Benchmark suite", "", environment_markdown(env), "",
             f"Total: {result['total_seconds']:.0f} s. Every ratio compares variants timed in this run.", ""]

    def section(name: str, title: str, header: list[str], row: Callable[[dict], list]) -> None:
        parts.extend([f"## {title}", ""])
        s = result[name]
        if "skipped" in s:
            parts.extend([f"Skipped: {s['skipped']}.", ""])
            return
        records = [r for r in s["records"] if "skipped" not in r]
        for r in s["records"]:
            if "skipped" in r:
                parts.append(f"Skipped: {r['skipped']}.")
        if records:
            parts.append(markdown_table(header, [row(r) for r in records]))
        parts.extend(["", f"({s['seconds']:.0f} s)", ""])

    section("round_throughput", "Round throughput (examples per second), FedAvg",
            ["model", "K", "examples/client", "chunk", "engine", "step loop", "centralized", "engine / step loop",
             "engine / centralized"],
            lambda r: [r["model"], r["clients_per_round"], r["examples_per_client"],
                       "all" if r["engine_client_chunk"] is None else r["engine_client_chunk"], fmt(r["engine"]),
                       fmt(r["step_loop"]), fmt(r["centralized"]), f"{r['engine_over_step_loop']:.2f}x",
                       f"{r['engine_over_centralized']:.2f}x"])
    section("vmap_against_loop", "CNN clients: one vmap against one client at a time (examples per second)",
            ["model", "clients", "examples/client", "vmap", "loop", "vmap / loop"],
            lambda r: [r["model"], r["clients"], r["examples_per_client"], fmt(r["examples_per_second"]["vmap"]),
                       fmt(r["examples_per_second"]["loop"]), f"{r['vmap_over_loop']:.2f}x"])
    section("evaluation", "Evaluation against training (examples per second)",
            ["model", "training", "personalized eval", "global eval", "personalized / training", "global / training"],
            lambda r: [r["model"], fmt(r["examples_per_second"]["training"]),
                       fmt(r["examples_per_second"]["personalized"]), fmt(r["examples_per_second"]["global"]),
                       f"{r['personalized_over_training']:.2f}x", f"{r['global_over_training']:.2f}x"])
    section("agent_search", "SPATL agent search for all clients of a round",
            ["model", "clients", "PPO updates", "vmapped s", "loop s", "vmapped speed / loop"],
            lambda r: [r["model"], r["clients"], r["updates"], fmt(r["vmapped_seconds"]), fmt(r["loop_seconds"]),
                       f"{r['speedup']:.2f}x"])
    section("spatl_run", "SPATL, ResNet-20, CIFAR-10 image folder, 10 rounds",
            ["settings", "wall s", "first round s", "s per later round", "training examples/s", "test acc",
             "personalized acc"],
            lambda r: [", ".join(f"{k}={v}" for k, v in r["config"].items()), fmt(r["wall_seconds"]),
                       fmt(r["first_round_seconds"]), fmt(r["steady_seconds_per_round_with_evaluation"]),
                       fmt(r["training_examples_per_second"]), fmt(r["final_test_accuracy"]),
                       fmt(r["final_personalized_accuracy"])])
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = benchmark_parser("benchmarks.suite", __doc__, "MLP-sized sections only: the CI version")
    parser.add_argument("--cifar10", default=None, help="the CIFAR-10 image folder of the SPATL run (default: "
                                                        "$FEDJAX_SPARSE_CIFAR10 or ../shared/data/cifar10-jpeg)")
    args = parser.parse_args(argv)
    use_cpu_cores()  # as the command line does: on a CPU, a device per core where a round pays for it
    if jax.devices()[0].platform == "cpu":
        keep_freed_memory()
    env = environment(command_line("benchmarks.suite", argv))
    p = plan(jax.devices()[0].platform, args.quick)
    env["plan"] = {"budget_seconds": p.budget_seconds, "quick": args.quick}
    result = run_sections(p, Path(args.cifar10) if args.cifar10 else evaluation.default_cifar10())
    finish(args.out, "suite", env, result, lambda env: markdown(env, result))
    return result


if __name__ == "__main__":
    main()
