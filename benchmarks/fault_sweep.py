"""The long fault sweep: kill -9 at seeded moments over algorithms and client stores, and real I/O failures.

For every (algorithm, store) of the sweep: an uninterrupted run, then the same run killed (kill -9, through
`fedjax_sparse.run.faults`) at seeded moments (between rounds, inside a checkpoint's background write, inside
a metrics line), each time resumed, until it completes; it must write the uninterrupted run's metrics line
for line. Then, where this machine allows it, the failures the test suite injects happen for real: a full
disk (a small tmpfs; needs root), a file-size limit (`ulimit -f`), an immutable checkpoints folder
(`chattr +i`; needs root): each must end within seconds, in one line, with summary.json "failed" and a
resumable last checkpoint. Results go to benchmarks/results/fault_sweep_<device>_<date>.{md,json}.

    python -m benchmarks.fault_sweep [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BASE = ["--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1", "--max-train-examples", "300",
        "--max-test-examples", "100", "--checkpoint-every", "2", "--no-progress", "--no-tensorboard"]
ROUNDS = 6
SWEEP = [("fedavg", "device"), ("scaffold", "disk"), ("scaffold", "host"), ("spafl", "disk"), ("fedgse", "device"),
         ("spatl", "device"), ("fedpm", "disk"), ("fedspa", "host"), ("fedp3", "device"), ("fedprox", "disk")]
POINTS = ("round_end", "checkpoint_write", "metrics_write")
EXTRA = {"fedgse": ["--significant-labels", "3"]}  # what an algorithm needs beyond BASE


def command(args, faults=None, limit=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if faults:
        env["FEDJAX_SPARSE_FAULT"] = faults
    preexec = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fedjax_sparse", "run", *args], capture_output=True, text=True,
                          env=env, preexec_fn=preexec, timeout=900)
    return done, time.perf_counter() - start


def metrics(run: Path) -> str:
    return (run / "metrics.jsonl").read_text()


def kill_sweep(algorithm: str, store: str, root: Path, rng: np.random.Generator) -> dict:
    args = [*BASE, *EXTRA.get(algorithm, []), "--algorithm", algorithm, "--client-store", store, "--rounds", str(ROUNDS)]
    reference, run = root / f"{algorithm}_{store}_ref", root / f"{algorithm}_{store}"
    done, _ = command([*args, "--out", str(reference)])
    assert done.returncode == 0, done.stderr[-2000:]
    kills = []
    for _ in range(4):
        point = str(rng.choice(POINTS))
        resumable = has_checkpoint(run)
        n = int(rng.integers(1 if resumable else 2, 4))
        args_now = ["--resume", str(run), "--no-progress"] if resumable else [*args, "--out", str(run), "--overwrite"]
        done, _ = command(args_now, faults=f"{point}:{n}:kill")
        kills.append(f"{point}:{n}" + ("" if done.returncode == -signal.SIGKILL else " (run ended first)"))
        if done.returncode == 0:
            break
    if not (run / "summary.json").exists() or json.loads((run / "summary.json").read_text())["status"] != "completed":
        # killed before its first checkpoint was whole: a fresh start is what a user does then
        done, _ = command(["--resume", str(run), "--no-progress"] if has_checkpoint(run)
                          else [*args, "--out", str(run), "--overwrite"])
        assert done.returncode == 0, done.stderr[-2000:]
    return {"algorithm": algorithm, "store": store, "kills": kills, "same_metrics": metrics(run) == metrics(reference)}


def has_checkpoint(run: Path) -> bool:
    """Whether the run has a finished checkpoint (orbax names one by its step; unfinished ones are temporary)."""
    folder = run / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def io_probe(name: str, root: Path, prepare, limit=None, cleanup=None, resume=False) -> dict:
    """`prepare(run)` makes the fault (and, with `resume`, a run of 2 rounds to continue), then the run
    (or its resume to ROUNDS) must stop at once in one line."""
    run = root / name.replace(" ", "_")
    try:
        run = prepare(run)
    except (OSError, subprocess.CalledProcessError, AssertionError) as err:
        return {"probe": name, "ran": False, "why": " ".join(str(err).split())[:200]}
    args = (["--resume", str(run), "--rounds", str(ROUNDS), "--no-progress"] if resume else
            [*BASE, "--algorithm", "scaffold", "--rounds", str(ROUNDS), "--out", str(run)])
    try:
        done, seconds = command(args, limit=limit)
    finally:
        if cleanup:
            cleanup(run)
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    lines = done.stderr.strip().splitlines()
    return {"probe": name, "ran": True, "exit": done.returncode, "seconds": round(seconds, 1),
            "stderr_lines": len(lines), "tracebacks": done.stderr.count("Traceback"),
            "last_line": lines[-1][:300] if lines else "", "summary_status": summary.get("status"),
            "last_checkpoint": summary.get("last_checkpoint")}


def full_disk(run: Path) -> Path:
    mount = run.parent / "tmpfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6000k", "tmpfs", str(mount)], check=True, capture_output=True)
    (mount / "fill").write_bytes(b"\0" * 1_500_000)  # room for the first checkpoint or two, not all
    return mount / "run"


def immutable_checkpoints(run: Path) -> Path:
    """Two rounds checkpointed, then the checkpoints folder made immutable (root only)."""
    done, _ = command([*BASE, "--algorithm", "scaffold", "--rounds", "2", "--out", str(run)])
    assert done.returncode == 0, done.stderr[-500:]
    subprocess.run(["chattr", "+i", str(run / "checkpoints")], check=True, capture_output=True)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_sweep")
    parser.add_argument("--quick", action="store_true", help="two (algorithm, store) pairs")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(2026)
    root = Path(tempfile.mkdtemp(prefix="fault_sweep_"))
    sweep = SWEEP[:2] if args.quick else SWEEP
    kills = []
    for algorithm, store in sweep:
        kills.append(kill_sweep(algorithm, store, root, rng))
        print(kills[-1], flush=True)
    probes = [io_probe("full disk (tmpfs)", root, full_disk,
                       cleanup=lambda run: None),
              io_probe("ulimit -f 64 KiB", root, lambda run: run, limit=64 * 1024),
              io_probe("immutable checkpoints folder", root, immutable_checkpoints, resume=True,
                       cleanup=lambda run: subprocess.run(["chattr", "-i", str(run / "checkpoints")]))]
    for probe in probes:
        print(probe, flush=True)
    subprocess.run(["umount", str(root / "tmpfs")], capture_output=True)
    import jax
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
    stamp = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": device, "command": " ".join(["python -m benchmarks.fault_sweep", *(argv or sys.argv[1:])]),
              "date": stamp, "kills": kills, "io": probes}
    name = f"fault_sweep_{jax.default_backend()}_{stamp}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Fault sweep ({stamp})", "", f"Device: {device}. Command: `{result['command']}`.", "",
             "| algorithm | store | kills (point:n) | resumed to the uninterrupted metrics |", "|---|---|---|---|"]
    lines += [f"| {k['algorithm']} | {k['store']} | {', '.join(k['kills'])} | {k['same_metrics']} |" for k in kills]
    lines += ["", "| probe | ran | exit | seconds | stderr lines | tracebacks | summary | last checkpoint | last line |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p['probe']} | {p['ran']} | {p.get('exit', '-')} | {p.get('seconds', '-')} | "
              f"{p.get('stderr_lines', '-')} | {p.get('tracebacks', '-')} | {p.get('summary_status', '-')} | "
              f"{p.get('last_checkpoint', '-')} | {p.get('last_line', p.get('why', ''))} |" for p in probes]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    print("\n".join(lines))
    return 0 if all(k["same_metrics"] for k in kills) else 1


if __name__ == "__main__":
    raise SystemExit(main())
