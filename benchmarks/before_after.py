"""One CNN client's local training and 100 clients' evaluation, this tree against an earlier commit.

    python -m benchmarks.before_after [--base REF] [--quick] [--out DIR]

The earlier commit (default 583d0a1, before issue 19's changes) is unpacked
with `git archive` into a temporary folder; the same measurement script then
runs in fresh processes, alternating between the two trees (before, after,
before, after, ...), so both see the same machine load as far as possible.
Each process times one client's local training (FedAvg and SpaFL on
`spafl_cnn`, FedAvg on `resnet20` and `cnn4`; CIFAR-10 shapes, batch 64,
momentum 0.9, 512 examples, as `benchmarks.local_training`) after a warm-up
call, as wall and CPU milliseconds per example-pass; and the personalized
evaluation of 20 `spafl_cnn` clients of uneven test sizes (about 2,000
examples), as the runner builds it. Writes
`before_after_<device>_<date>.{md,json}` in --out.
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

CASES = (("spafl_cnn", "fedavg"), ("spafl_cnn", "spafl"), ("resnet20", "fedavg"), ("cnn4", "fedavg"))

# Runs in the tree under test (its own fedjax_sparse), so it uses only what both trees have.
CHILD = r'''
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
try:
    from fedjax_sparse.core.round.compilation import jit
except ImportError:  # a tree before the library chose its own compiler options
    jit = jax.jit
from fedjax_sparse.algorithms import BuildContext, make_algorithm
from fedjax_sparse.core.evaluation.evaluators import personalized_evaluator
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.round.step import round_info
from fedjax_sparse.data.federated import federated_split
from fedjax_sparse.models import get_model

model_name, algorithm_name, examples, repeats, eval_clients = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
rng = np.random.default_rng(0)
def split(counts, augment):
    n = sum(counts)
    x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, n).astype(np.int32)
    b = np.cumsum([0, *counts])
    return federated_split(x, y, [np.arange(s, e) for s, e in zip(b, b[1:])], [0.5] * 3, [0.25] * 3, augment=augment)
model = get_model(model_name, (32, 32, 3), 10)
train = split([examples], True)
local = LocalSGD(model, 0.001, 1, 64, momentum=0.9)
algorithm = make_algorithm(algorithm_name, BuildContext(local=local, num_clients=1, clients_per_round=1, train=train,
                                                        num_classes=10))
server, clients = algorithm.init(jax.random.key(1), model.init(jax.random.key(0)), 1)
client = jax.tree_util.tree_map(lambda a: a[0], clients)
ids = jnp.zeros((1,), jnp.int32)
def update(server, client, key):
    info = round_info(0, 0, ids)
    up, state, metrics = algorithm.client_update(algorithm.broadcast(server, ids[0], info), client,
                                                 train.client(ids[0]), key, info)
    return up, metrics["loss"]
def timed(fn, repeats):
    jax.block_until_ready(fn())
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        wall.append(time.perf_counter() - w); cpu.append(time.process_time() - c)
    return min(wall), min(cpu)
f = jit(update)
wall, cpu = timed(lambda: f(server, client, jax.random.key(2)), repeats)
out = {"train_ms_per_example": 1e3 * wall / examples, "train_cpu_ms_per_example": 1e3 * cpu / examples}
if eval_clients:
    counts = np.maximum(1, np.round(np.linspace(0.25, 1.75, eval_clients) * 100)).astype(int).tolist()
    test = split(counts, False)
    personal = jax.vmap(model.init)(jax.random.split(jax.random.key(3), eval_clients))
    evaluate = personalized_evaluator(model, lambda s, c: c, test)
    wall, cpu = timed(lambda: evaluate({}, personal), max(1, repeats - 1))
    out.update(eval_examples=sum(counts), eval_seconds=wall, eval_cpu_seconds=cpu)
print("RESULT " + json.dumps(out))
'''


def measure(tree: Path, model: str, algorithm: str, examples: int, repeats: int, eval_clients: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, model, algorithm, str(examples), str(repeats),
                           str(eval_clients)], cwd=tree, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measurement in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = benchmark_parser("benchmarks.before_after", __doc__, "64 examples, one repeat, 3 evaluated clients")
    parser.add_argument("--base", default="583d0a1", help="the earlier commit (default: before issue 19)")
    parser.add_argument("--rounds", type=int, default=2, help="before/after alternations per case")
    args = parser.parse_args(argv)
    env = environment(command_line("benchmarks.before_after", argv))
    root = Path(__file__).resolve().parents[1]
    examples, repeats, eval_clients = (64, 1, 3) if args.quick else (512, 2, 20)
    env["base_commit"] = subprocess.run(["git", "rev-parse", args.base], cwd=root, capture_output=True,
                                        text=True, check=True).stdout.strip()
    env["head_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                        text=True, check=True).stdout.strip()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        archive = subprocess.run(["git", "archive", args.base], cwd=root, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        for model, algorithm in CASES:
            runs = {"before": [], "after": []}
            for _ in range(args.rounds):
                for name, tree in (("before", base), ("after", root)):
                    print(f"{model}/{algorithm} {name} ...", file=sys.stderr, flush=True)
                    clients = eval_clients if (model, algorithm) == ("spafl_cnn", "fedavg") else 0
                    runs[name].append(measure(tree, model, algorithm, examples, repeats, clients))
            best = {name: {k: float(np.min([r[k] for r in rs])) for k in rs[0]} for name, rs in runs.items()}
            record = {"model": model, "algorithm": algorithm, "examples": examples, "runs": runs, "best": best,
                      "train_speedup": best["before"]["train_ms_per_example"] / best["after"]["train_ms_per_example"],
                      "train_cpu_speedup": best["before"]["train_cpu_ms_per_example"]
                      / best["after"]["train_cpu_ms_per_example"]}
            if "eval_seconds" in best["after"]:
                record["eval_speedup"] = best["before"]["eval_seconds"] / best["after"]["eval_seconds"]
            records.append(record)
    finish(args.out, "before_after", env, records, lambda env: markdown(env, records))
    return records


def markdown(env: dict, records: list[dict]) -> str:
    rows = [[r["model"], r["algorithm"], fmt(r["best"]["before"]["train_ms_per_example"]),
             fmt(r["best"]["after"]["train_ms_per_example"]), f"{r['train_speedup']:.2f}x",
             fmt(r["best"]["before"]["train_cpu_ms_per_example"]), fmt(r["best"]["after"]["train_cpu_ms_per_example"]),
             f"{r['train_cpu_speedup']:.2f}x"] for r in records]
    parts = ["# Before and after issue 19: one client's local training", "", environment_markdown(env),
             f"- Before: commit {env['base_commit']}; after: {env['head_commit']} (plus any uncommitted changes)", "",
             "Milliseconds per example-pass (fastest of the runs; each run in a fresh process).", "",
             markdown_table(["model", "algorithm", "before ms", "after ms", "speed-up", "before CPU-ms",
                             "after CPU-ms", "CPU speed-up"], rows)]
    for r in records:
        if "eval_speedup" in r:
            b, a = r["best"]["before"], r["best"]["after"]
            parts += ["", f"Personalized evaluation of {r['model']} clients ({int(a['eval_examples']):,} examples of "
                          f"uneven clients): before {b['eval_seconds']:.2f} s, after {a['eval_seconds']:.2f} s, "
                          f"{r['eval_speedup']:.1f}x."]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
