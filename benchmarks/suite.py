"""One command that measures this library on whatever device JAX finds.

    python -m benchmarks.suite [--quick] [--budget SECONDS] [--out DIR] [--cifar10 PATH]

Sections, each figure a ratio of variants timed in the same run, each with its
seconds and the seconds JAX spent compiling in it (XLA, tracing, lowering):

  round throughput   FedAvg rounds of the MLP at 10 and 100 clients per round and
                     of `spafl_cnn` at 10: the engine against centralized training
                     and a Python step loop (`benchmarks.round_throughput`);
  precision          the same `spafl_cnn` round at float32, at TF32
                     (`--matmul-precision tensorfloat32`) and in bfloat16
                     (`--compute-dtype bfloat16`), engine and centralized alike;
  layouts            the engine's layouts of that round: all K clients in one vmap,
                     chunks of them (`lax.map` over groups, `--client-chunk`), one
                     at a time, against centralized; which is fastest here, and
                     whether it is the engine's default (`default_client_chunk`);
  evaluation         evaluation against training examples per second
                     (`benchmarks.evaluation`);
  agent search       SPATL's agent search for all clients of a round, one vmap
                     against client by client (`benchmarks.agent_search`);
  SPATL run          a 10-round ResNet-20 SPATL run on the CIFAR-10 image folder
                     as `fedjax-sparse run` does it (CPU plans only; left out without
                     the folder).

`--budget` is the seconds the sections may take together (default: 4 minutes on
an accelerator, 20 on a CPU, 2 with --quick). The accelerator's sizes come from
the first run on one (an H200, issue 52): its round throughput section then took
118 s, most of it compiling `spafl_cnn` at K = 100 (32 s, centralized 58 s), so
K = 100 is left to `benchmarks.round_throughput`, and a section costs a few
compilations of 10-20 s each with seconds of device work. A section that would
start more than 30 s behind an even share of the budget is recorded as skipped
rather than run, so a slower device reports less instead of running over.
`--quick` is the CI version (MLP-sized, seconds on a CPU). Writes
`suite_<device>_<date>.{md,json}` in --out, with the device, versions and
command.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
from jax import monitoring

from . import agent_search, evaluation
from . import round_throughput as rt
from .common import (command_line, environment, environment_markdown, finish, fmt,
                     markdown_table)
from .common import parser as benchmark_parser
from fedjax_sparse.core.round.cpu import keep_freed_memory, use_cpu_cores
from fedjax_sparse.core.round.step import default_client_chunk

BUDGET_SECONDS = {"accelerator": 4 * 60, "cpu": 20 * 60, "quick": 2 * 60}
PRECISIONS = {"float32": {}, "tensorfloat32": {"matmul_precision": "tensorfloat32"},
              "bfloat16": {"compute_dtype": "bfloat16"}}
COMPILE_EVENTS = {"/jax/core/compile/backend_compile_duration": "xla",
                  "/jax/core/compile/jaxpr_trace_duration": "tracing",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What each section runs on one platform."""

    rounds: tuple[rt.Setting, ...]
    precision: rt.Setting  # the round the precision section runs at each precision
    layouts: rt.Setting  # the round the layouts section runs at each of `chunks`
    chunks: tuple[int | None, ...]  # None: all clients in one vmap
    evaluation: evaluation.Setting
    evaluation_models: tuple[str, ...]
    agent: agent_search.Setting | None  # None: left out
    spatl: dict | None  # run options of the SPATL run, None: left out
    budget_seconds: float


def plan(platform_name: str, quick: bool, budget: float | None = None) -> Plan:
    accelerator = platform_name != "cpu"
    if quick:
        mlp = rt.Setting("mlp", 4, 32, repeats=1)
        return Plan(rounds=(mlp,), precision=mlp, layouts=mlp, chunks=(None, 1),
                    evaluation=evaluation.QUICK, evaluation_models=("mlp",), agent=None, spatl=None,
                    budget_seconds=budget or BUDGET_SECONDS["quick"])
    # The same sections on every full run; an accelerator gets larger CNN clients and wider vmaps (the issue's
    # measured round: 512 examples per client, batch 64, 8 steps), a CPU sizes that fit its budget and the
    # whole-run SPATL section.
    if accelerator:
        cnn = rt.Setting("spafl_cnn", 10, 512, batch_size=64, repeats=3)
        rounds = (rt.Setting("mlp", 10, 64), rt.Setting("mlp", 100, 64), cnn)
        chunks = (None, 5, 2, 1)
    else:
        cnn = rt.Setting("spafl_cnn", 4, 8, batch_size=8, repeats=1)
        rounds = (rt.Setting("mlp", 10, 64), rt.Setting("mlp", 100, 64), cnn)
        chunks = (None, 2, 1)
    spatl = None
    if not accelerator:
        spatl = dict(num_clients=10, clients_per_round=10, rounds=10, local_epochs=1, batch_size=64,
                     max_train_examples=2000, max_test_examples=1000)
    return Plan(rounds=rounds, precision=cnn, layouts=cnn, chunks=chunks,
                evaluation=dataclasses.replace(evaluation.FULL, issue_setting=False, repeats=2),
                evaluation_models=evaluation.MODELS if not accelerator else ("mlp", "spafl_cnn", "resnet20"),
                agent=agent_search.Setting(clients=10 if accelerator else 4, updates=5 if accelerator else 2,
                                           repeats=1),
                spatl=spatl, budget_seconds=budget or BUDGET_SECONDS["accelerator" if accelerator else "cpu"])


class CompileClock:
    """The seconds JAX spends compiling (XLA, tracing, lowering) while it is entered, from JAX's own events."""

    _active: list["CompileClock"] = []
    _listening = False

    def __init__(self):
        self.seconds = {name: 0.0 for name in COMPILE_EVENTS.values()}

    @classmethod
    def _on_duration(cls, event: str, duration: float, **kwargs) -> None:
        name = COMPILE_EVENTS.get(event)
        for clock in cls._active if name else ():
            clock.seconds[name] += duration

    def __enter__(self) -> "CompileClock":
        if not CompileClock._listening:
            monitoring.register_event_duration_secs_listener(CompileClock._on_duration)
            CompileClock._listening = True
        CompileClock._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        CompileClock._active.remove(self)


def round_throughput(p: Plan) -> list[dict]:
    records = []
    for setting in p.rounds:
        r = rt.run_setting(setting, variants=("engine", "step_loop", "centralized"))
        records.append({k: r[k] for k in ("model", "clients_per_round", "examples_per_client", "batch_size",
                                          "engine_client_chunk", "engine", "step_loop", "centralized",
                                          "engine_over_step_loop", "engine_over_centralized",
                                          "round_seconds", "compile_seconds")})
    return records


def precision_section(p: Plan) -> list[dict]:
    """The same round at each precision: engine and centralized, and each one's speed over float32's."""
    records = []
    for name, change in PRECISIONS.items():
        r = rt.run_setting(dataclasses.replace(p.precision, **change), variants=("engine", "centralized"))
        r = {**r, "compile_seconds": {k: round(v, 2) for k, v in r["compile_seconds"].items()}}
        records.append({"precision": name, "model": r["model"], "clients_per_round": r["clients_per_round"],
                        "examples_per_client": r["examples_per_client"], "batch_size": r["batch_size"],
                        "engine": r["engine"], "centralized": r["centralized"],
                        "engine_over_centralized": r["engine_over_centralized"],
                        "compile_seconds": r["compile_seconds"]})
    base = records[0]
    for r in records:
        r["engine_over_float32"] = r["engine"] / base["engine"]
        r["centralized_over_float32"] = r["centralized"] / base["centralized"]
    return records


def layouts_section(p: Plan) -> list[dict]:
    """The engine's round in each layout of its K clients, against centralized training on the same examples."""
    w = rt.build_workload(p.layouts)
    examples = p.layouts.examples_per_round
    default = default_client_chunk(w.variables, p.layouts.clients_per_round)
    if default is not None and default >= p.layouts.clients_per_round:
        default = None  # a chunk of all K is the one vmap
    timings = {}
    for chunk in p.chunks:
        timings[chunk] = rt.time_rounds(rt.EngineRunner(w, chunk), p.layouts.repeats)
    central = rt.time_rounds(rt.centralized_runner(w), p.layouts.repeats)
    rates = {chunk: examples / t["steady"] for chunk, t in timings.items()}
    fastest = max(rates, key=rates.get)
    return [{"model": p.layouts.model, "clients_per_round": p.layouts.clients_per_round,
             "examples_per_client": p.layouts.examples_per_client, "batch_size": p.layouts.batch_size,
             "layout": "all" if chunk is None else chunk, "engine": rates[chunk],
             "centralized": examples / central["steady"],
             "engine_over_centralized": rates[chunk] * central["steady"] / examples,
             "compile_seconds": timings[chunk]["compile"], "fastest": chunk == fastest,
             "engine_default": chunk == default} for chunk in p.chunks]


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
        return [{"skipped": "left out in --quick and on an accelerator (the lease's paper-scale arm runs instead: "
                            "benchmarks.lease)"}]
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
    """Each section in turn, with its seconds and JAX's compile seconds in it; one that would start more than
    30 s behind an even share of the budget per section is recorded as skipped instead of run."""
    sections: list[tuple[str, Callable[[], list[dict]]]] = [
        ("round_throughput", lambda: round_throughput(p)),
        ("precision", lambda: precision_section(p)),
        ("layouts", lambda: layouts_section(p)),
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
        with CompileClock() as clock:
            records = run()
        out[name] = {"records": records, "seconds": time.perf_counter() - t0, "compile_seconds": clock.seconds}
    out["total_seconds"] = time.perf_counter() - start
    out["budget_seconds"] = p.budget_seconds
    return out


def markdown(env: dict, result: dict) -> str:
    parts = ["# Benchmark suite", "", environment_markdown(env), "",
             f"Total: {result['total_seconds']:.0f} s of a {result['budget_seconds']:.0f} s budget. Every ratio "
             "compares variants timed in this run.", ""]

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
        compiling = s["compile_seconds"]
        parts.extend(["", f"({s['seconds']:.0f} s, of which JAX compiling {sum(compiling.values()):.0f} s: XLA "
                          f"{compiling['xla']:.0f}, tracing {compiling['tracing']:.0f}, lowering "
                          f"{compiling['lowering']:.0f})", ""])

    section("round_throughput", "Round throughput (examples per second), FedAvg",
            ["model", "K", "examples/client", "chunk", "engine", "step loop", "centralized", "engine / step loop",
             "engine / centralized"],
            lambda r: [r["model"], r["clients_per_round"], r["examples_per_client"],
                       "all" if r["engine_client_chunk"] is None else r["engine_client_chunk"], fmt(r["engine"]),
                       fmt(r["step_loop"]), fmt(r["centralized"]), f"{r['engine_over_step_loop']:.2f}x",
                       f"{r['engine_over_centralized']:.2f}x"])
    section("precision", "Precision: the same round in float32, TF32 and bfloat16 (examples per second)",
            ["precision", "model", "K", "examples/client", "batch", "engine", "centralized", "engine / centralized",
             "engine / float32", "centralized / float32"],
            lambda r: [r["precision"], r["model"], r["clients_per_round"], r["examples_per_client"], r["batch_size"],
                       fmt(r["engine"]), fmt(r["centralized"]), f"{r['engine_over_centralized']:.2f}x",
                       f"{r['engine_over_float32']:.2f}x", f"{r['centralized_over_float32']:.2f}x"])
    section("layouts", "Layouts: the engine's K clients in one vmap, in chunks, one at a time (examples per second)",
            ["model", "K", "examples/client", "layout (clients at once)", "engine", "centralized",
             "engine / centralized", "compile s", "fastest", "engine's default"],
            lambda r: [r["model"], r["clients_per_round"], r["examples_per_client"], r["layout"], fmt(r["engine"]),
                       fmt(r["centralized"]), f"{r['engine_over_centralized']:.2f}x", fmt(r["compile_seconds"]),
                       "yes" if r["fastest"] else "", "yes" if r["engine_default"] else ""])
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
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="seconds the sections may take together (default: 240 on an accelerator, 1200 on a "
                             "CPU, 120 with --quick); a section that would start too far behind is skipped")
    parser.add_argument("--cifar10", default=None, help="the CIFAR-10 image folder of the SPATL run (default: "
                                                        "$FEDJAX_SPARSE_CIFAR10 or ../shared/data/cifar10-jpeg)")
    args = parser.parse_args(argv)
    use_cpu_cores()  # as the command line does: on a CPU, a device per core where a round pays for it
    if jax.devices()[0].platform == "cpu":
        keep_freed_memory()
    env = environment(command_line("benchmarks.suite", argv))
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget must be a number of seconds > 0, got {args.budget:g}")
    p = plan(jax.devices()[0].platform, args.quick, args.budget)
    env["plan"] = {"budget_seconds": p.budget_seconds, "quick": args.quick}
    result = run_sections(p, Path(args.cifar10) if args.cifar10 else evaluation.default_cifar10())
    finish(args.out, "suite", env, result, lambda env: markdown(env, result))
    return result


if __name__ == "__main__":
    main()
