"""What checkpointing by default costs the digits default run (`fedjax-sparse run`, every flag at its default).

    python -m benchmarks.checkpoint_interval [--quick] [--repeats P] [--out DIR]

A run saves its whole state every `--checkpoint-minutes` (5 by default: once they passed, at the end of the next
round) and at its end, so that a killed run resumes (issue 55). Three arms of the default run, each a fresh
process (`python -m fedjax_sparse run --out DIR --no-progress [FLAGS]`), one warm-up each (the compilation
cache filled), then P repeats in turn (default, none, every round, default, ...), so that the arms share the
machine's load:
  default: no flags: the digits default run takes well under 5 minutes, so it saves once, at its end;
  none: `--checkpoint-minutes 0`: no checkpoint at all (what a run without `--checkpoint-every` did before);
  every round: `--checkpoint-every 1`: 30 saves, for the cost of one save.
Each process is timed from its start to its exit (wall), by the CPU it used (user + system: what other work on
a shared machine disturbs least), and by the run's own `wall_seconds` (summary.json: from the run's start, after
the imports, to its summary). The default's cost is its median over none's, and the median of the differences
within a repeat (the two ran one after the other), each set beside none's own spread (max - min over its
repeats: the noise); one save's cost is (every round - none) / 30, and what the 5-minute interval adds to a
longer run is at most one save per 300 s of it.
Writes `checkpoint_interval_<device>_<date>.{md,json}` in --out.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import environment, environment_markdown, fmt, load_average, markdown_table, parser, write

ROUNDS = 30  # the default run's (`RunConfig.rounds`)
ARMS = {"default": [], "none": ["--checkpoint-minutes", "0"], "every round": ["--checkpoint-every", "1"]}
SAVES = {"default": 1, "none": 0, "every round": ROUNDS}
INTERVAL_S = 5 * 60  # `RunConfig.checkpoint_minutes`' default


def one_run(flags: list[str], out: Path, cache: Path) -> dict:
    """The default run with `flags`, in a fresh process: its wall time and its summary's."""
    env = {"FEDJAX_SPARSE_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "fedjax_sparse", "run", "--out", str(out), "--no-progress", *flags],
                          capture_output=True, text=True, env={**os.environ, **env})
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - used.ru_utime) + (after.ru_stime - used.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"the run with {flags} failed: {done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    folder = out / "checkpoints"
    checkpoints = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    return {"wall": wall, "cpu": cpu, "run_wall": summary["wall_seconds"], "checkpoints": checkpoints,
            "final_test_accuracy": summary["final_test_accuracy"]}


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def main(argv=None) -> int:
    p = parser("benchmarks.checkpoint_interval", __doc__, "2 repeats of each arm")
    p.add_argument("--repeats", type=int, default=None, help="repeats of each arm (default 10; --quick: 2)")
    args = p.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 10)
    env = environment(" ".join(["python -m benchmarks.checkpoint_interval",
                                *(argv if argv is not None else sys.argv[1:])]))
    root = Path(tempfile.mkdtemp(prefix="checkpoint_interval_"))
    cache = root / "cache"
    for name, flags in ARMS.items():  # warm-up: the compilation cache holds every arm's programs after it
        one_run(flags, root / f"warm_{name.replace(' ', '_')}", cache)
    runs = {name: [] for name in ARMS}
    for i in range(repeats):
        for name, flags in ARMS.items():
            runs[name].append(one_run(flags, root / f"{name.replace(' ', '_')}_{i}", cache))
            print(name, runs[name][-1], flush=True)
    env["load_average_at_end"] = load_average()
    shutil.rmtree(root, ignore_errors=True)
    accuracies = {r["final_test_accuracy"] for arm in runs.values() for r in arm}
    assert len(accuracies) == 1, f"the arms' figures differ: {accuracies}"  # checkpoints change no result
    assert all(r["checkpoints"] == [ROUNDS] for r in runs["default"]), "the default run did not save at its end alone"
    assert all(r["checkpoints"] == [] for r in runs["none"])
    kinds = ("wall", "cpu", "run_wall")
    median = {name: {k: statistics.median(r[k] for r in arm) for k in kinds} for name, arm in runs.items()}
    noise = {k: spread([r[k] for r in runs["none"]]) for k in kinds}
    cost = {k: median["default"][k] - median["none"][k] for k in kinds}
    paired = {k: statistics.median(a[k] - b[k] for a, b in zip(runs["default"], runs["none"])) for k in kinds}
    per_save = {k: (median["every round"][k] - median["none"][k]) / SAVES["every round"] for k in kinds}
    rows = [[name, SAVES[name], *(f"{fmt(median[name][k])} ({fmt(min(r[k] for r in arm))} - "
                                  f"{fmt(max(r[k] for r in arm))})" for k in kinds)]
            for name, arm in runs.items()]
    costs = [[k, f"{cost[k]:+.2f} ({100 * cost[k] / median['none'][k]:+.1f} %)", f"{paired[k]:+.2f}",
              f"{noise[k]:.2f}", "yes" if abs(cost[k]) <= noise[k] and abs(paired[k]) <= noise[k] else "no",
              f"{per_save[k]:.3f}"] for k in kinds]
    record = {"repeats": repeats, "runs": runs, "median": median, "none_spread": noise, "default_cost": cost,
              "default_cost_paired": paired, "seconds_per_save": per_save,
              "interval_share_at_most": per_save["run_wall"] / INTERVAL_S}
    text = "\n".join([
        "# What checkpointing by default costs the digits default run", "", environment_markdown(env), "",
        f"`fedjax-sparse run --out DIR --no-progress [FLAGS]`, every other flag at its default (digits, MLP, 20 "
        f"clients, 10 a round, 5 local epochs, {ROUNDS} rounds, TensorBoard on); each arm {repeats} times in turn "
        f"after a warm-up, each run a fresh process. Seconds: the process from start to exit (wall), the run's own "
        f"`wall_seconds` (from its start, after the imports, to its summary).", "",
        markdown_table(["arm", "saves", "wall (s): median (min - max)", "CPU (s)", "run wall (s)"], rows), "",
        "What the default (one save, at the end) costs over none: the medians' difference, the median of the "
        "differences within a repeat, none's own spread (max - min: the noise), whether both differences are within "
        "it, and one save's cost ((every round - none) / 30):", "",
        markdown_table(["seconds", "default - none", "paired", "noise", "within the noise", "one save"], costs), "",
        f"So the 5-minute interval adds at most one save ({per_save['run_wall']:.3f} s of run wall time) per 300 s, "
        f"{100 * per_save['run_wall'] / INTERVAL_S:.3f} %, to a run longer than 5 minutes.",
        "",
        "Every arm computes the same figures (final test accuracy " + ", ".join(map(str, sorted(accuracies))) + ").",
    ]) + "\n"
    md, js = write(Path(args.out), "checkpoint_interval", env, record, text)
    print(text)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
