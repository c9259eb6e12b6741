"""`fedjax-sparse sweep`: many runs over a grid (or a list, or an Optuna search) of run options, times seeds.

    fedjax-sparse sweep [run flags] --grid lr=0.05,0.1 --grid mu=0,0.01 --seeds 0,1,2 --out DIR

Every point (one setting of the swept options) runs once per seed, each run a normal run folder
DIR/<point>/seed_<s> made by its own process, `python -m fedjax_sparse run ... --out DIR/<point>/seed_<s>`:
a run that crashes ends its process, not the sweep, and parallel runs share nothing. Choices:

* Resuming. The plan (run flags, points, seeds, search) is saved in DIR/sweep.json before any run
  starts, and `--resume DIR` continues it: a run whose summary says "completed" with the config this
  plan gives is kept, one with checkpoints is resumed from them (`run --resume`; restarted when that
  fails), any other is restarted (`--overwrite`). A point's runs are deterministic in its seed (the
  runs' own promise), so a resumed sweep writes the table an uninterrupted one writes.
* A run's process gets SIGTERM when the sweep's process dies (Linux's parent-death signal), kill -9
  included, so it saves its checkpoint rather than running on unseen; a signal to the sweep is passed
  to its runs, which stop after their round and save.
* Parallel runs: `--parallel N`; by default one per two usable cores, fewer where the available memory
  holds fewer than one per 4 GiB (a guess at a run's peak; JAX on a CPU also uses every core for one
  run's arithmetic, so more runs than half the cores mostly wait on each other). With N > 1 on a GPU
  each run may take 90 %/N of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set).
* The table: `sweep_table` (mean and standard deviation over seeds per point), sweep.md, sweep.csv
  and sweep.png in DIR, from the completed runs; a point with failed runs says how many.
* `--search NAME=log:LO:HI` (or float:, int:, choice:A,B) asks Optuna's TPE sampler (seeded, so a
  search is repeatable) for `--trials` points in turn, each run over every seed; the objective is the
  mean final accuracy over them, maximized. The study lives in DIR/study.db (SQLite), so a resumed
  search goes on from the trials it has: a trial that was running when the sweep stopped is finished
  with its runs kept or resumed, and a trial whose run failed is marked failed (the trials asked after
  a resume come from a sampler seeded anew, by the number of trials so far, so they need not be those an
  uninterrupted search would have asked). DIR/best.json names the best trial. Optuna is the optional
  extra `[sweep]`.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from fedjax_sparse.run.signals import SIGNALS
from fedjax_sparse.run import sweep_search
from fedjax_sparse.run.sweep_plan import (LAUNCH, MEMORY_PER_RUN, PLAN_FILE, RUN_OPTIONS_FILE, Plan, SweepError,
                                          expected_config, file_points, grid_points, parse_grid, parse_search,
                                          parse_seeds, point_name, read_sweep_file)
from fedjax_sparse.run.sweep_table import plot_sweep, point_row, write_table
from fedjax_sparse.run.trackers import SWEEP_ENV

_POLL_S = 0.2


# --- running: one process per run, at most `parallel` at once ---------------------------------------


PARENT_ENV = "FEDJAX_SPARSE_SWEEP_PARENT"  # a run started by a sweep: the sweep's process id


def follow_parent() -> None:
    """In a run a sweep started (`PARENT_ENV` set), as it starts: SIGTERM it when the sweep's process dies
    (Linux only), so that it saves a checkpoint and stops. Done by the run itself rather than between fork and
    exec (`preexec_fn`), which in a process with JAX's threads may deadlock; a sweep that died before this
    line ran is seen by the parent's id having changed."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def default_parallel() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        memory = MEMORY_PER_RUN
    return max(1, min(cores // 2, memory // MEMORY_PER_RUN))


def _wait_for_folder(run_dir: Path) -> None:
    """Waits while a run holds `run_dir`'s lock (`run.folder`): a run of a killed sweep saving its checkpoint."""
    try:
        folder = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
    finally:
        os.close(folder)


def _completed(run_dir: Path, expected: dict) -> dict | None:
    """The summary of the run in `run_dir` when it completed with the `expected` config, else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("status") == "completed" and saved == expected else None


class _Stop(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Runner:
    """Starts runs as processes, at most `parallel` at once, and reports each as it ends."""

    def __init__(self, out: Path, parallel: int):
        self.name = out.resolve().name  # the group its runs' trackers log them in (`run.trackers`)
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.parallel = parallel
        self.running: dict[subprocess.Popen, tuple] = {}
        self.env = dict(os.environ)
        if parallel > 1:  # JAX on a GPU takes 75 % of its memory per process by default
            self.env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.3f}")

    @property
    def has_room(self) -> bool:
        return len(self.running) < self.parallel

    def start(self, key: tuple, run_dir: Path, flags: list[str], expected: dict, retry: bool = True) -> bool:
        """Starts the run `key` unless it completed already (then False). `retry`: a failed resume from
        checkpoints restarts it."""
        _wait_for_folder(run_dir)
        if _completed(run_dir, expected) is not None:
            return False
        if (run_dir / "checkpoints").is_dir() and retry:
            how, args = "resumed", ["--resume", str(run_dir)]
        else:
            how, args = "started", [*flags, *(["--overwrite"] if run_dir.exists() else [])]
            retry = False
        log = self.logs / f"{run_dir.parent.name}__{run_dir.name}.log"
        with log.open("a") as f:
            process = subprocess.Popen([sys.executable, "-m", "fedjax_sparse", "run", *args, "--no-progress"],
                                       stdout=f, stderr=subprocess.STDOUT,
                                       env={**self.env, PARENT_ENV: str(os.getpid()), SWEEP_ENV: self.name})
        self.running[process] = (key, run_dir, flags, expected, retry)
        print(f"[sweep] {how} {run_dir.parent.name} seed {run_dir.name[5:]} (log: {log})", flush=True)
        return True

    def wait(self) -> tuple[tuple, bool]:
        """Waits for a run to end; (its key, whether it completed). A failed resume restarts it first."""
        while True:
            for process, (key, run_dir, flags, expected, retry) in list(self.running.items()):
                if process.poll() is None:
                    continue
                del self.running[process]
                done = _completed(run_dir, expected) is not None
                if not done and retry:
                    print(f"[sweep] resuming {run_dir} failed; starting it again", flush=True)
                    self.start(key, run_dir, flags, expected, retry=False)
                    continue
                print(f"[sweep] {'completed' if done else 'FAILED'} {run_dir.parent.name} seed "
                      f"{run_dir.name[5:]}", flush=True)
                return key, done
            time.sleep(_POLL_S)

    def stop(self, signum: int) -> None:
        """Passes the signal on to every run, and waits for them to save."""
        for process in self.running:
            process.send_signal(signum)
        for process in self.running:
            process.wait()


def _run_points(plan: Plan, runner: Runner, points: list[tuple[str, dict]]) -> None:
    """Runs every point of `points` over every seed."""
    pending = [(name, values, seed) for name, values in points for seed in plan.seeds]
    checked = {(name, seed): expected_config(plan.run_command(values, seed, name)) for name, values, seed in pending}
    while pending or runner.running:
        while pending and runner.has_room:
            name, values, seed = pending.pop(0)
            runner.start((name, seed), plan.run_dir(name, seed), plan.run_command(values, seed, name),
                         checked[(name, seed)])
        if runner.running:
            runner.wait()


def write_summary(plan: Plan, points: list[tuple[str, dict]]) -> list[dict]:
    """The table and plot from the run folders: DIR/sweep.md, sweep.csv, sweep.png."""
    rows, run_dirs = [], {}
    for name, values in points:
        completed = {plan.run_dir(name, s): _completed(plan.run_dir(name, s),
                                                       expected_config(plan.run_command(values, s, name)))
                     for s in plan.seeds}
        run_dirs[name] = [d for d, summary in completed.items() if summary is not None]
        rows.append(point_row(name, values, [s for s in completed.values() if s is not None], len(completed)))
    title = f"Sweep {plan.out.name}"
    write_table(rows, plan.out, title, plan.command)
    plot_sweep(rows, run_dirs, plan.out / "sweep.png", title)
    return rows


# --- the command ------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from fedjax_sparse.run.parsing import OneLineParser

    p = OneLineParser(prog="fedjax-sparse sweep", allow_abbrev=False,
                      description="Runs a grid, a list or an Optuna search of run options, each point over "
                                  "several seeds, and tabulates them. Every other flag is a `fedjax-sparse run` "
                                  "flag that all runs share.")
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2",
                   help="sweep run option NAME over these values (repeat: the grid is the product)")
    p.add_argument("--search", action="append", default=[], metavar="NAME=KIND:...",
                   help="search option NAME with Optuna: log:LOW:HIGH, float:LOW:HIGH, int:LOW:HIGH or "
                        "choice:A,B (repeat for several options)")
    p.add_argument("--trials", type=int, default=None, help="with --search: how many points to try (default 20)")
    p.add_argument("--seeds", default=None, help="run every point with each of these seeds (default: --seed, or 0)")
    p.add_argument("--out", default=None, help="the sweep's folder (a run folder per point and seed)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a JSON, YAML or TOML file of run options and the sweep's own keys (grid, points, seeds, "
                        "search, trials); flags given with it override it")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the sweep in DIR: completed runs are kept, interrupted ones resumed")
    p.add_argument("--parallel", type=int, default=None,
                   help="runs at once (default: one per two cores, as memory allows; here "
                        f"{default_parallel()})")
    return p


def _new_plan(args: argparse.Namespace, run_args: list[str], command: str) -> Plan:
    file_sweep, file_run = read_sweep_file(args.config) if args.config is not None else ({}, {})
    if args.out is None:
        raise SweepError("--out DIR is required: the sweep's folder")
    out = Path(args.out)
    if (out / PLAN_FILE).exists():
        raise SweepError(f"--out {out} holds a sweep already; --resume {out} continues it, or choose another --out")
    refused = [a for a in run_args if a.split("=")[0] in ("--resume", "--overwrite", "--out", *LAUNCH)]
    if refused:
        raise SweepError(f"{refused[0]}: not a flag of the sweep's runs (the sweep gives each run its --out, "
                         f"resumes them itself, and runs each in one process)")
    if "--seed" in run_args and (args.seeds is not None or "seeds" in file_sweep):
        raise SweepError("--seed and --seeds: give --seeds alone")
    points = parse_grid(args.grid) if args.grid else None
    if points is not None:
        points = grid_points(points)
    elif args.config is not None:
        points = file_points(file_sweep, args.config)
    search_items = args.search or [f"{k}={v}" for k, v in (file_sweep.get("search") or {}).items()]
    search = parse_search(search_items) if search_items else None
    if search is not None and points is not None:
        raise SweepError("--search and --grid (or a file's grid, points) do not combine: give one")
    trials = args.trials if args.trials is not None else file_sweep.get("trials", 20 if search else None)
    if trials is not None and (search is None or not isinstance(trials, int) or trials < 1):
        raise SweepError(f"--trials {trials}: needs --search and a count >= 1")
    if args.seeds is not None:
        seeds = parse_seeds(args.seeds)
    elif "seeds" in file_sweep:
        seeds = parse_seeds(",".join(str(s) for s in file_sweep["seeds"]))
    else:
        seeds = parse_seeds(run_args[run_args.index("--seed") + 1]) if "--seed" in run_args[:-1] else [0]
        run_args = [a for i, a in enumerate(run_args) if a != "--seed" and (i == 0 or run_args[i - 1] != "--seed")]
    if file_run:
        out.mkdir(parents=True, exist_ok=True)
        (out / RUN_OPTIONS_FILE).write_text(json.dumps(file_run, indent=2) + "\n")
        run_args = ["--config", str(out / RUN_OPTIONS_FILE), *run_args]
    return Plan(out, run_args, points if points is not None else ([{}] if search is None else None), seeds,
                search, trials, command)


def main(argv: Sequence[str]) -> int:
    """`fedjax-sparse sweep ...`; returns its exit code (1: some runs failed, 2: a bad request)."""
    argv = list(argv)
    args, run_args = _parser().parse_known_args(argv)
    command = shlex.join(["fedjax-sparse", "sweep", *argv])
    try:
        if args.resume is not None:
            given = [a for a in ("grid", "search", "seeds", "out", "config") if getattr(args, a)] + run_args
            if given:
                raise SweepError(f"--resume {args.resume} continues the saved sweep; {given[0]} cannot change it "
                                 f"(only --parallel and --trials may be given)")
            plan = Plan.load(Path(args.resume))
            if args.trials is not None:
                if plan.search is None or args.trials < 1:
                    raise SweepError(f"--trials {args.trials}: needs a search sweep and a count >= 1")
                plan.trials = args.trials
        else:
            plan = _new_plan(args, run_args, command)
        if args.parallel is not None and args.parallel < 1:
            raise SweepError(f"--parallel {args.parallel}: must be >= 1")
        if plan.points is not None:  # every point's flags checked before the first run starts
            for values in plan.points:
                expected_config(plan.run_command(values, plan.seeds[0], point_name(values)))
        else:
            if importlib.util.find_spec("optuna") is None:
                raise SweepError("--search needs Optuna: pip install 'fedjax_sparse[sweep]'")
            for name, space in plan.search.items():  # each choice, and each end of a range, as a run takes it
                for value in space.get("choices", (space.get("low"), space.get("high"))):
                    expected_config(plan.run_command({name: value}, plan.seeds[0], "check"))
        plan.out.mkdir(parents=True, exist_ok=True)
        folder = os.open(plan.out, os.O_RDONLY | os.O_DIRECTORY)
    except (SweepError, ValueError, FileNotFoundError) as e:
        print(f"fedjax-sparse: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:  # the kernel drops the lock when the process ends, kill -9 included: no stale lock
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(folder)
        print(f"fedjax-sparse: error: {plan.out} is in use by another sweep; wait for it to end", file=sys.stderr)
        return 2
    try:
        plan.save()
        return _sweep(plan, args.parallel or default_parallel())
    finally:
        os.close(folder)


def _sweep(plan: Plan, parallel: int) -> int:
    runner = Runner(plan.out, parallel)

    def stop(signum, frame):
        raise _Stop(signum)

    # a SIGHUP ignored from the start (nohup) stays ignored, as a run leaves it (`run.signals`)
    previous = {s: signal.signal(s, stop) for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        if plan.search is None:
            points = [(point_name(v), v) for v in plan.points]
            _run_points(plan, runner, points)
        else:
            sweep_search.search(plan, runner)
            points = sweep_search.search_points(plan)
    except _Stop as e:
        for s, handler in previous.items():
            signal.signal(s, handler)
        runner.stop(e.signum)
        print(f"fedjax-sparse: sweep stopped by {signal.Signals(e.signum).name}; --resume {plan.out} continues it",
              file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    rows = write_summary(plan, points)
    print((plan.out / "sweep.md").read_text().split("\n\n", 3)[-1], end="")  # the table, as an experiment prints it
    failed, runs = sum(row["failed"] for row in rows), len(rows) * len(plan.seeds)
    print(f"done: {len(rows)} points x {len(plan.seeds)} seeds; table in {plan.out / 'sweep.md'}"
          + (f"; {failed} of {runs} runs FAILED (logs in {plan.out / 'logs'})" if failed else ""))
    return 1 if failed else 0
