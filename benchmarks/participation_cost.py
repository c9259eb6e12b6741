"""What issue 37's federation costs a round: today's round before and after it, and with it switched on.

    python -m benchmarks.participation_cost [--base REF] [--quick] [--pairs P] [--out DIR]

Before and after. The tree at --base (default 8165eb1, the commit before participation samplers, the
clock and stragglers) is unpacked with `git archive` into a temporary folder; one measurement script
then runs in fresh processes, alternating between that tree and this one (before, after, before,
after, ...: P pairs for each K), so both see the machine's load as far as possible. Each process
builds FedAvg (LocalSGD, batch 16, one epoch of 64 examples a client: 4 steps) on the digits MLP,
N = `POPULATION` x K clients, K = 10 and 100 per round, and the round the command line runs: on a
CPU a JAX device per usable core, the platform's client chunk, and `CpuRound` where `round_devices`
shares the clients among several devices, else `build_round`'s one jit. The tree after the change
gets what `run.federation.round_conditions` builds with every option off (uniform sampling, no
clock, no stragglers). It runs rounds 0-2 (round 0 compiles), prints a checksum of the server state
and of the rounds' outputs (client ids, bytes, metrics: the fields both trees have), then times
`rounds` steady rounds one at a time (wall and process CPU; the process's figure is their median).

Bit for bit. Every process of a K must print the same checksum (a SHA-256 of every leaf's dtype,
shape and bytes; each leaf's float64 sum is recorded beside it): the base tree's round and today's
default round compute the same figures.

Switched on. In this tree only, further processes time four rounds interleaved (default, (a), (b),
uniform at S, default, ...) after the same three warm-up rounds each:
  (a) clock: the uniform sampler, `device_profile("phone", N)`, no stragglers, the dense model's
      training FLOPs per example: every round also prices each client's seconds;
  (b) varying: Poisson sampling (each client with probability K/N, in S > K slots, the draw's
      static bound), the phone clock, a deadline at the 80th percentile of (a)'s client seconds
      and dropout 0.1: participation that varies round to round.
Each is reported as its time over the default round's in the same process. A Poisson round trains
S slots where the default trains K, in the layout S allows (its chunk divides S), so these processes
also time the default round with S uniform slots: (b) over it is what the sampler, clock and
stragglers themselves cost.
Writes `participation_cost_<device>_<date>.{md,json}` in --out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from .common import command_line, environment, environment_markdown, finish, fmt, markdown_table
from .common import parser as benchmark_parser
from fedjax_sparse.core.round.cpu import use_cpu_cores

POPULATION = 4  # N = POPULATION x K: a Poisson draw's slots then exceed K by a few standard deviations
DROPOUT = 0.1
DEADLINE_QUANTILE = 0.8
SWITCHED_ON = ["default", "clock", "varying", "uniform_slots"]

# Runs in the tree under test (its own fedjax_sparse, from the working directory), so the default
# round uses only what both trees have; the switched-on variants only this tree's issue-37 API.
CHILD = r'''
import hashlib, json, sys, time
config = json.loads(sys.argv[1])
from fedjax_sparse.core.round.cpu import CpuRound, keep_freed_memory, round_devices, use_cpu_cores
use_cpu_cores()  # as the command line does, before JAX starts: a CPU device per usable core
import jax, numpy as np
import fedjax_sparse
from fedjax_sparse.algorithms import fedavg
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.round.step import build_round, default_client_chunk
from fedjax_sparse.data import load_dataset
from fedjax_sparse.data.federated import federated_split
from fedjax_sparse.models import get_model
try:
    from fedjax_sparse.core.round.step import RoundConditions
    from fedjax_sparse.core.federation.participation import poisson_sampler, uniform_sampler
    from fedjax_sparse.core.federation.clock import Stragglers, device_profile
    from fedjax_sparse.core.structure.flops import forward_flops
except ImportError:  # the tree before issue 37
    RoundConditions = None

k, n, seed = config["k"], config["num_clients"], 0
examples, check_rounds = config["examples_per_client"], config["check_rounds"]
cpu = jax.default_backend() == "cpu"
if cpu:
    keep_freed_memory()
digits = load_dataset("digits")
rng = np.random.default_rng(seed)
index = rng.permutation(len(digits.y_train))
index = np.concatenate([index, rng.integers(0, len(index), max(0, n * examples - len(index)))])[:n * examples]
split = federated_split(digits.x_train[index], digits.y_train[index],
                        [np.arange(i * examples, (i + 1) * examples) for i in range(n)], digits.mean, digits.std,
                        augment=False)
model = get_model("mlp", (8, 8, 1), 10)
local = LocalSGD(model, learning_rate=0.05, epochs=1, batch_size=16)
algorithm = fedavg(local)
variables = model.init(jax.random.key(seed + 1))


def conditions_of(variant, deadline=None):
    if RoundConditions is None:
        return None
    dense = 3.0 * forward_flops(model.structure) * local.epochs
    if variant == "default":  # what run.federation.round_conditions builds with every option off
        return RoundConditions(uniform_sampler(n, k), None, Stragglers(), dense)
    if variant == "clock":
        return RoundConditions(uniform_sampler(n, k), device_profile("phone", n), Stragglers(), dense)
    return RoundConditions(poisson_sampler(n, k), device_profile("phone", n),
                           Stragglers(deadline=deadline, dropout=config["dropout"]), dense)


class Runner:
    """One round as the command line lays it out; each call runs the next round."""

    def __init__(self, conditions):
        slots = k if conditions is None else conditions.sampler.slots
        chunk = default_client_chunk(variables, slots)
        devices = round_devices(slots, chunk, jax.local_devices()) if cpu else []
        extra = {} if conditions is None else {"conditions": conditions}
        if len(devices) > 1:
            self.fn = CpuRound(algorithm, split, k, seed=seed, client_chunk=chunk, devices=devices, **extra)
        else:
            self.fn = build_round(algorithm, split, k, seed=seed, client_chunk=chunk, **extra)
        self.layout = {"slots": slots, "client_chunk": chunk, "cpu_devices": max(1, len(devices)),
                       "round": type(self.fn).__name__ if len(devices) > 1 else "build_round"}
        self.server, self.clients = algorithm.init(jax.random.key(seed), variables, n)
        self.round_index = 0

    def __call__(self):
        self.server, self.clients, out = self.fn(self.server, self.clients, self.round_index)
        self.round_index += 1
        return self.server, out


def leaves(tree):
    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf))
    return out


def checksum(runner, outputs):
    """SHA-256 of every leaf's dtype, shape and bytes, and its float64 sum: the server state after the
    check rounds and each round's ids, bytes and metrics (the RoundOutput fields both trees have)."""
    common = [(o.client_ids, o.uplink_bytes, o.downlink_bytes, o.metrics) for o in outputs]
    digest, sums = hashlib.sha256(), []
    for leaf in leaves(runner.server) + leaves(common):
        digest.update(f"{leaf.dtype}{leaf.shape}".encode())
        digest.update(np.ascontiguousarray(leaf).tobytes())
        sums.append(float(np.sum(leaf, dtype=np.float64)))
    return {"sha256": digest.hexdigest(), "float64_sums": sums}


def warm(runner):
    """The check rounds (round 0 compiles); their outputs."""
    outputs = []
    for _ in range(check_rounds):
        server, out = runner()
        jax.block_until_ready((server, out))
        outputs.append(out)
    return outputs


def timed(runner):
    wall, cpu_time = time.perf_counter(), time.process_time()
    jax.block_until_ready(runner())
    return time.perf_counter() - wall, time.process_time() - cpu_time


result = {"fedjax_sparse": fedjax_sparse.__file__, "devices": len(jax.local_devices()),
          "has_conditions": RoundConditions is not None}
variants = config["variants"]
runners = {"default": Runner(conditions_of("default"))}
default_outputs = warm(runners["default"])
result["checksum"] = checksum(runners["default"], default_outputs)
extra = {}
if "clock" in variants:
    runners["clock"] = Runner(conditions_of("clock"))
    clock_outputs = warm(runners["clock"])
    seconds = np.concatenate([np.asarray(o.client_seconds) for o in clock_outputs])
    deadline = float(np.quantile(seconds, config["deadline_quantile"]))
    extra["clock"] = {"round_seconds": [float(o.returns.seconds) for o in clock_outputs]}
if "varying" in variants:
    runners["varying"] = Runner(conditions_of("varying", deadline))
    varying_outputs = warm(runners["varying"])
    extra["varying"] = {"deadline_seconds": deadline,
                        "dispatched": [int(np.sum(o.dispatched)) for o in varying_outputs],
                        "returned": [int(np.sum(o.returns.returned)) for o in varying_outputs]}
if "uniform_slots" in variants:  # (b)'s slots and layout without its sampler, clock and stragglers
    slots = runners["varying"].layout["slots"]
    runners["uniform_slots"] = Runner(RoundConditions(uniform_sampler(n, slots)))
    warm(runners["uniform_slots"])
times = {name: {"wall": [], "cpu": []} for name in runners}
for _ in range(config["rounds"]):
    for name, runner in runners.items():  # interleaved: the variants share the machine's load
        wall, cpu_time = timed(runner)
        times[name]["wall"].append(wall)
        times[name]["cpu"].append(cpu_time)
result["variants"] = {name: {**runners[name].layout, **extra.get(name, {}), "wall": times[name]["wall"],
                             "cpu": times[name]["cpu"], "wall_median": float(np.median(times[name]["wall"])),
                             "cpu_median": float(np.median(times[name]["cpu"]))} for name in runners}
print("RESULT " + json.dumps(result))
'''


def measure(tree: Path, config: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config)], cwd=tree, capture_output=True,
                          text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measurement in {tree} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if not Path(result["fedjax_sparse"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the process in {tree} imported {result['fedjax_sparse']}, not its tree's library")
    return result


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = benchmark_parser("benchmarks.participation_cost", __doc__,
                              "K = 10 only, one pair, one switched-on process, few rounds (about a minute)")
    parser.add_argument("--base", default="8165eb1", help="the earlier commit (default: before issue 37)")
    parser.add_argument("--pairs", type=int, help="before/after alternations per K (default 3; --quick 1)")
    args = parser.parse_args(argv)
    use_cpu_cores()  # the device count the measuring processes have, for the record's device name
    env = environment(command_line("benchmarks.participation_cost", argv))
    root = Path(__file__).resolve().parents[1]
    env["base_commit"] = git(root, "rev-parse", args.base)
    env["head_commit"] = git(root, "rev-parse", "HEAD")
    env["uncommitted_changes"] = bool(git(root, "status", "--porcelain", "--untracked-files=no"))
    pairs = args.pairs or (1 if args.quick else 3)
    settings = [(10, 12, 1)] if args.quick else [(10, 150, 2), (100, 30, 2)]  # (K, timed rounds, switched-on runs)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        archive = subprocess.run(["git", "archive", args.base], cwd=root, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        for k, rounds, switched_on in settings:
            config = {"k": k, "num_clients": POPULATION * k, "examples_per_client": 64, "check_rounds": 3,
                      "rounds": rounds, "dropout": DROPOUT, "deadline_quantile": DEADLINE_QUANTILE,
                      "variants": ["default"]}
            runs = {"before": [], "after": [], "switched_on": []}
            for p in range(pairs):
                for name, tree in (("before", base), ("after", root)):
                    print(f"K={k} {name} {p + 1}/{pairs} ...", file=sys.stderr, flush=True)
                    runs[name].append(measure(tree, config))
            for p in range(switched_on):
                print(f"K={k} {', '.join(SWITCHED_ON)} {p + 1}/{switched_on} ...", file=sys.stderr, flush=True)
                runs["switched_on"].append(measure(root, {**config, "variants": SWITCHED_ON}))
            records.append(summarize(k, config, runs))
    finish(args.out, "participation_cost", env, records, lambda env: markdown(env, records))
    return records


def summarize(k: int, config: dict, runs: dict) -> dict:
    def medians(name, variant, clock):
        return [r["variants"][variant][f"{clock}_median"] for r in runs[name]]

    checksums = {name: [r["checksum"]["sha256"] for r in rs] for name, rs in runs.items()}
    every = [c for cs in checksums.values() for c in cs]
    record = {"clients_per_round": k, "num_clients": config["num_clients"], "timed_rounds": config["rounds"],
              "check_rounds": config["check_rounds"],
              "layout": {name: layout(rs[0]["variants"]["default"]) for name, rs in runs.items() if rs},
              "bit_identical": len(set(every)) == 1, "checksums": checksums, "runs": runs}
    for clock in ("wall", "cpu"):
        before, after = medians("before", "default", clock), medians("after", "default", clock)
        record[f"before_{clock}_ms"] = 1e3 * min(before)
        record[f"after_{clock}_ms"] = 1e3 * min(after)
        record[f"after_over_before_{clock}"] = min(after) / min(before)
        record[f"after_over_before_{clock}_median"] = float(np.median(after) / np.median(before))
        fastest = {name: min(t for r in runs[name] for t in r["variants"]["default"][clock]) for name in runs}
        record[f"after_over_before_{clock}_fastest_round"] = fastest["after"] / fastest["before"]
    on = runs["switched_on"]
    varying = on[0]["variants"]["varying"]
    record["varying_slots"] = varying["slots"]
    record["varying_layout"] = layout(varying)
    ratios = [("clock", "default"), ("varying", "default"), ("uniform_slots", "default"),
              ("varying", "uniform_slots")]
    for variant, reference in ratios:
        for clock in ("wall", "cpu"):
            per_process = [r["variants"][variant][f"{clock}_median"] / r["variants"][reference][f"{clock}_median"]
                           for r in on]
            record[f"{variant}_over_{reference}_{clock}"] = float(np.median(per_process))
            record[f"{variant}_over_{reference}_{clock}_runs"] = per_process
    record["varying_dispatched"] = [d for r in on for d in r["variants"]["varying"]["dispatched"]]
    record["varying_returned"] = [d for r in on for d in r["variants"]["varying"]["returned"]]
    record["varying_deadline_seconds"] = varying["deadline_seconds"]
    return record


def layout(variant: dict) -> str:
    return (f"{variant['round']}, chunk {variant['client_chunk']}, {variant['cpu_devices']} device"
            + "s" * (variant["cpu_devices"] > 1))


def markdown(env: dict, records: list[dict]) -> str:
    before_after = [[r["clients_per_round"], r["num_clients"], r["layout"]["before"], fmt(r["before_wall_ms"]),
                     fmt(r["after_wall_ms"]), f"{r['after_over_before_wall']:.3f}",
                     f"{r['after_over_before_wall_median']:.3f}", f"{r['after_over_before_wall_fastest_round']:.3f}",
                     fmt(r["before_cpu_ms"]), fmt(r["after_cpu_ms"]), f"{r['after_over_before_cpu']:.3f}",
                     "yes" if r["bit_identical"] else "**no**"] for r in records]
    switched = [[r["clients_per_round"], f"{r['clock_over_default_wall']:.3f}", f"{r['clock_over_default_cpu']:.3f}",
                 f"{r['varying_over_default_wall']:.3f}", f"{r['varying_over_default_cpu']:.3f}", r["varying_slots"],
                 r["varying_layout"], f"{r['uniform_slots_over_default_wall']:.3f}",
                 f"{r['varying_over_uniform_slots_wall']:.3f}", f"{r['varying_over_uniform_slots_cpu']:.3f}",
                 f"{np.mean(r['varying_dispatched']):.1f} / {np.mean(r['varying_returned']):.1f}"]
                for r in records]
    pairs = len(records[0]["runs"]["before"])
    parts = ["# What issue 37's federation costs a round (FedAvg, digits MLP)", "", environment_markdown(env),
             f"- Before: commit {env['base_commit']}; after: {env['head_commit']}"
             + (" plus the uncommitted changes of the working tree" if env["uncommitted_changes"] else ""), "",
             "## Everything off: before and after", "",
             f"Steady round time in fresh processes, alternating before/after ({pairs} pair{'s' * (pairs > 1)} "
             "per K). Each process's figure is the median of its timed rounds; the table gives the fastest "
             "process's, after/before of those, of the processes' medians, and of the fastest single rounds. "
             "Bit-identical: every process of a K (the switched-on ones' default rounds included) printed the "
             f"same SHA-256 of the server state and the round outputs after {records[0]['check_rounds']} rounds.",
             "", markdown_table(["K", "N", "round", "before ms", "after ms", "after/before", "(median)",
                                 "(fastest round)", "before CPU-ms", "after CPU-ms", "CPU after/before",
                                 "bit-identical"], before_after),
             "", "## Switched on: this tree, ratio to the default round in the same process", "",
             "(a) clock: uniform sampling, phone profiles, no stragglers. (b) varying: Poisson sampling in S "
             f"slots, phone profiles, a deadline at the {DEADLINE_QUANTILE:.0%} quantile of (a)'s client seconds, "
             f"dropout {DROPOUT}. Uniform at S: the default round with S slots (the layout (b) gets), so (b) / "
             "uniform at S is what Poisson sampling, the clock and the stragglers cost beside the slots. Medians "
             "over the processes of per-process ratios (wall unless CPU).", "",
             markdown_table(["K", "(a) clock", "(a) CPU", "(b) varying", "(b) CPU", "S", "(b) round",
                             "uniform at S", "(b) / uniform at S", "(same, CPU)",
                             "(b) dispatched / returned per round"], switched)]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
