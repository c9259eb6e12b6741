"""What a lent accelerator should check and measure, in one command that fits the lease.

    python -m benchmarks.lease [--quick] [--out DIR] [--cifar10 FOLDER|TAR.GZ] [--budget SECONDS]

A GPU machine is lent for minutes (about 15 in all, its start-up included), so this runs, in order and each
in a process of its own with a time limit, what a session should not spend that time composing by hand:

  tests   the tests that compare two computations where the device could change the figures (the engine's
          vmapped round against a per-client loop, every sub-model rule at capacity 1 against FedAvg,
          FedLDF at n = K, the personalized evaluator, SpaFL's straight-through gradients: the twelve that
          failed on the first GPU) and tests/test_precision.py (the zoo and every algorithm in bfloat16),
          on `--workers` pytest workers, the slow tier left out;
  suite   `benchmarks.suite --budget B`: round throughput, float32 against TF32 against bfloat16 on the same
          round, the engine's layouts against centralized, evaluation, the agent search;
  arm     one paper-scale arm: SpaFL's CIFAR-10 setting (experiments/spafl.py: spafl_cnn, 100 clients, 10 a
          round, 5 local epochs, batch 16), its full 500 rounds, in `--arm-dtype` (bfloat16 by default: the
          accelerator's speed), from the CIFAR-10 image folder or its .tar.gz; stopped with SIGTERM at its
          time limit (the run saves a checkpoint and its summary says "interrupted" with the rounds done).

Sized from the first GPU run (issue 52, an H200): tests 150 s, the suite's 240 s budget, and the arm what is
left of `--budget` (default 510 s, under the 9 minutes a freshly started machine leaves after its start-up);
at about 0.2 s a round with its evaluation every fifth round, SpaFL's 500 rounds take 2-3 minutes there
(an estimate: it has not run on one yet). `--quick` is the CPU version CI runs: one test file's fast tests,
the suite's --quick, and SpaFL's digits setting for 2 rounds.

Everything lands in --out as at most 8 files (what the device tool brings back): lease.md and lease.json (each
step's status, seconds and figures, the device, versions and command), tests.log, the suite's .md and .json,
and the arm's config.json, metrics.jsonl and summary.json (as arm_*).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Sequence

from .common import command_line, environment, environment_markdown, load_average
from .evaluation import default_cifar10

REPO = Path(__file__).resolve().parents[1]
GPU_TESTS = ("tests/test_engine.py", "tests/test_submodels.py", "tests/test_fedldf.py", "tests/test_evaluation.py",
             "tests/test_spafl.py", "tests/test_precision.py")
QUICK_TESTS = ("tests/test_precision.py", "-k", "products or numerics or deterministic")
LIMITS = {"tests": 150, "suite": 300, "arm_least": 60}  # seconds; the suite's own budget is 240
QUICK_LIMITS = {"tests": 120, "suite": 240, "arm_least": 60}
DEFAULT_BUDGET = {"full": 510, "quick": 420}
STOP_GRACE_S = 45  # after SIGTERM, for the run to finish its round and save


def run_step(command: Sequence[str], limit: float, log: Path, env: dict | None = None) -> dict:
    """Runs `command` with its output in `log`; SIGTERM at `limit` seconds, SIGKILL `STOP_GRACE_S` later."""
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                   env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
                                   start_new_session=True)
        stopped = False
        try:
            code = process.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            stopped = True
            os.killpg(process.pid, signal.SIGTERM)
            try:
                code = process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
    return {"command": " ".join(command), "exit_code": code, "stopped_at_limit": stopped,
            "limit_seconds": round(limit), "seconds": round(time.perf_counter() - start, 1)}


def junit_counts(path: Path) -> dict:
    """{'tests', 'failures', 'errors', 'skipped', 'failed': [test ids]} from pytest's JUnit report."""
    if not path.is_file():
        return {"tests": 0, "failures": 0, "errors": 0, "skipped_tests": 0, "failed": []}
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {("skipped_tests" if k == "skipped" else k): sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "failed": failed}


def cifar10_folder(given: str | None, scratch: Path) -> Path | None:
    """The CIFAR-10 image folder: `given` (a folder, or a .tar.gz of one, unpacked into `scratch`), else the
    default (`$FEDJAX_SPARSE_CIFAR10` or ../shared/data/cifar10-jpeg); None where there is none."""
    path = Path(given) if given else default_cifar10()
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path) as archive:
            archive.extractall(scratch, filter="data")
        folders = [p for p in scratch.iterdir() if (p / "train").is_dir()]
        return folders[0] if folders else None
    return path if (path / "train").is_dir() else None


def arm_config(quick: bool, folder: Path | None, dtype: str, out: Path) -> dict:
    """The arm's run config (flat, as config.json): SpaFL's CIFAR-10 setting as experiments/spafl.py has it, or
    with --quick its digits setting for 2 rounds."""
    # experiments/ beside this folder: the clone's top-level package, or the installed one's copy
    spafl = importlib.import_module(__package__.rpartition("benchmarks")[0] + "experiments.spafl")
    SETTINGS = spafl.SETTINGS

    setting = SETTINGS["digits" if quick else "cifar10"]
    (arm,) = [a for a in setting.arms if a.label == "spafl"]
    config = setting.arm_config(arm, out, quick=False).replace(out=str(out), compute_dtype=dtype, tensorboard=False)
    if quick:
        config = config.replace(rounds=2)
    else:
        config = config.replace(dataset=f"imagefolder:{folder}")
    return config.to_dict()


def tests_step(args, out: Path, limits: dict) -> dict:
    if not (REPO / "tests").is_dir():
        return {"skipped": f"no tests folder beside {REPO / 'benchmarks'} (run from a clone)"}
    report = Path(tempfile.mkdtemp()) / "tests.xml"
    files = QUICK_TESTS if args.quick else GPU_TESTS
    workers = ["-n", str(args.workers)] if args.workers > 0 else []
    step = run_step([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, "-m", "not slow",
                     "--junitxml", str(report), *files], limits["tests"], out / "tests.log")
    return {**step, **junit_counts(report)}


def suite_step(args, out: Path, limits: dict) -> dict:
    budget = ["--quick"] if args.quick else ["--budget", str(args.suite_budget)]
    step = run_step([sys.executable, "-m", "benchmarks.suite", *budget, "--out", str(out)], limits["suite"],
                    out / "suite.log")
    written = sorted(out.glob("suite_*.json"))
    figures = {}
    if written:
        records = json.loads(written[-1].read_text())["records"]
        figures = {name: [{k: r[k] for k in r if k not in ("compile_seconds",)} for r in section.get("records", [])]
                   for name, section in records.items() if name in ("precision", "layouts")}
        figures["sections_seconds"] = {name: round(section["seconds"], 1) for name, section in records.items()
                                       if isinstance(section, dict) and "seconds" in section}
    (out / "suite.log").unlink(missing_ok=True)  # its figures are in the suite's own files
    return {**step, **figures}


def arm_step(args, out: Path, limit: float, scratch: Path) -> dict:
    folder = None if args.quick else cifar10_folder(args.cifar10, scratch)
    if not args.quick and folder is None:
        return {"skipped": f"no CIFAR-10 image folder at {args.cifar10 or default_cifar10()} (give --cifar10)"}
    run = scratch / "arm"
    config = arm_config(args.quick, folder, args.arm_dtype, run)
    config_file = scratch / "arm_request.json"
    config_file.write_text(json.dumps(config))
    step = run_step([sys.executable, "-m", "fedjax_sparse", "run", "--config", str(config_file),
                     "--no-progress"], limit, out / "arm.log")
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        if (run / name).is_file():
            shutil.copy(run / name, out / f"arm_{name}")
    summary = json.loads((out / "arm_summary.json").read_text()) if (out / "arm_summary.json").is_file() else {}
    log_tail = (out / "arm.log").read_text().strip().splitlines()[-3:] if (out / "arm.log").is_file() else []
    (out / "arm.log").unlink(missing_ok=True)
    rounds = summary.get("rounds_done")
    return {**step, "status": summary.get("status"), "rounds_done": rounds, "rounds": config["rounds"],
            "compute_dtype": args.arm_dtype, "first_round_seconds": summary.get("first_round_seconds"),
            "wall_seconds": summary.get("wall_seconds"),
            "final_personalized_accuracy": summary.get("final_personalized_accuracy"),
            "best_personalized_accuracy": summary.get("best_personalized_accuracy"), "last_lines": log_tail}


def markdown(env: dict, result: dict) -> str:
    parts = ["# Accelerator lease", "", environment_markdown(env), "",
             f"Total: {result['total_seconds']:.0f} s of a {result['budget_seconds']:.0f} s budget.", ""]
    arm = "SpaFL, digits, 2 rounds (--quick)" if result["quick"] else "SpaFL, CIFAR-10"
    for name, title in (("tests", "Tests that compare two computations"), ("suite", "Benchmark suite"),
                        ("arm", f"Paper-scale arm: {arm}")):
        step = result[name]
        parts.extend([f"## {title}", ""])
        if "skipped" in step:
            parts.extend([f"Skipped: {step['skipped']}.", ""])
            continue
        parts.append(f"`{step['command']}`: exit {step['exit_code']}, {step['seconds']:.0f} s of a "
                     f"{step['limit_seconds']} s limit" + (" (stopped at the limit)" if step["stopped_at_limit"] else ""))
        if name == "tests":
            parts.append(f"\n{step['tests']} tests: {step['failures']} failed, {step['errors']} errors, "
                         f"{step['skipped_tests']} skipped." + "".join(f"\n- failed: `{t}`" for t in step["failed"]))
        if name == "suite":
            for p in step.get("precision", []):
                parts.append(f"\n- {p['precision']}: engine {p['engine']:,.0f} examples/s "
                             f"({p['engine_over_float32']:.2f}x float32), centralized {p['centralized']:,.0f} "
                             f"({p['centralized_over_float32']:.2f}x), engine / centralized "
                             f"{p['engine_over_centralized']:.2f}")
            for p in step.get("layouts", []):
                parts.append(f"\n- layout {p['layout']}: engine / centralized {p['engine_over_centralized']:.2f}"
                             + (" (fastest)" if p["fastest"] else "") + (" (the engine's default)"
                                                                        if p["engine_default"] else ""))
        if name == "arm":
            parts.append(f"\n{step['status']}: {step['rounds_done']} of {step['rounds']} rounds in "
                         f"{step['compute_dtype']}, first round {step['first_round_seconds']} s, whole run "
                         f"{step['wall_seconds']} s; personalized accuracy final {step['final_personalized_accuracy']}, "
                         f"best {step['best_personalized_accuracy']}.")
        parts.append("")
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lease", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the CPU version CI runs (minutes on 2 cores)")
    parser.add_argument("--out", default="benchmarks/results/lease", help="folder for the lease's files")
    parser.add_argument("--cifar10", default=None, help="the CIFAR-10 image folder or its .tar.gz (default: "
                                                        "$FEDJAX_SPARSE_CIFAR10 or ../shared/data/cifar10-jpeg)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="seconds for all three steps (default 510; 420 with --quick)")
    parser.add_argument("--suite-budget", type=float, default=240, metavar="SECONDS",
                        help="the suite's own --budget (default 240)")
    parser.add_argument("--arm-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="the arm's --compute-dtype (default bfloat16)")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest workers for the tests (default: up to 8 of the machine's cores, none with "
                             "--quick; 0: none)")
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = 0 if args.quick else min(8, os.cpu_count() or 1)
    budget = args.budget if args.budget is not None else DEFAULT_BUDGET["quick" if args.quick else "full"]
    for flag, value in (("--budget", budget), ("--suite-budget", args.suite_budget)):
        if not value > 0:
            parser.error(f"{flag} must be a number of seconds > 0, got {value:g}")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0 (0: no pytest workers), got {args.workers}")
    limits = QUICK_LIMITS if args.quick else LIMITS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(command_line("benchmarks.lease", argv))
    start = time.perf_counter()
    result = {"budget_seconds": budget, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="lease-") as scratch:
        print("[lease] tests ...", file=sys.stderr, flush=True)
        result["tests"] = tests_step(args, out, limits)
        print("[lease] suite ...", file=sys.stderr, flush=True)
        result["suite"] = suite_step(args, out, limits)
        left = budget - (time.perf_counter() - start) - STOP_GRACE_S
        print(f"[lease] arm ({left:.0f} s) ...", file=sys.stderr, flush=True)
        result["arm"] = (arm_step(args, out, left, Path(scratch)) if left >= limits["arm_least"]
                         else {"skipped": f"{left:.0f} s left of the {budget:.0f} s budget"})
    result["total_seconds"] = time.perf_counter() - start
    env["load_average_at_end"] = load_average()
    (out / "lease.json").write_text(json.dumps({"environment": env, "result": result}, indent=1, default=str))
    (out / "lease.md").write_text(markdown(env, result))
    print((out / "lease.md").read_text())
    return result


if __name__ == "__main__":
    main()
