"""The long fault sweep: kill -9 at seeded moments over algorithms and client stores, and real I/O failures.

For every (algorithm, store) of the sweep: an uninterrupted run, then the same run killed (kill -9, through
`fedjax_sparse.run.faults`) at seeded moments (between rounds, inside a checkpoint's background write, between
orbax's commit of a checkpoint and its checksums, inside a metrics line), each time resumed with --resume (also
when no checkpoint was complete yet), until it completes; it must write the uninterrupted run's metrics line
for line. Then, where this machine allows it, the failures the test suite injects happen for real: a full
disk (a small tmpfs; needs root), a file-size limit (`ulimit -f`), an immutable checkpoints folder
(`chattr +i`; needs root): each must end within seconds, in one line, with summary.json "failed" and a
resumable last checkpoint. Then the probes of issues 36 and 55 (benchmarks/fault_probes.py), each a real process
judged against what its test in tests/test_faults_*.py requires: the run folder and its writers, signals in the
first 1.5 s, broken installed plug-ins, bad data and config files, damaged store rows and checkpoints,
checkpoints without their checksums, kills before the first checkpoint, SIGUSR1 and SIGUSR2, files the run
never wrote. Results
go to benchmarks/results/fault_sweep_<device>_<date>.{md,json}.

    python -m benchmarks.fault_sweep [--quick] [--no-kills] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from . import fault_probes
from .fault_probes import Expect, command, probe, summary_of

BASE = ["--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1", "--max-train-examples", "300",
        "--max-test-examples", "100", "--checkpoint-every", "2", "--no-progress", "--no-tensorboard"]
ROUNDS = 6
SWEEP = [("fedavg", "device"), ("scaffold", "disk"), ("scaffold", "host"), ("spafl", "disk"), ("fedgse", "device"),
         ("spatl", "device"), ("fedpm", "disk"), ("fedspa", "host"), ("fedp3", "device"), ("fedprox", "disk")]
POINTS = ("round_end", "checkpoint_write", "metrics_write", "write:checksums.json")
EXTRA = {"fedgse": ["--significant-labels", "3"]}  # what an algorithm needs beyond BASE


def metrics(run: Path) -> str:
    return (run / "metrics.jsonl").read_text()


def kill_sweep(algorithm: str, store: str, root: Path, rng: np.random.Generator) -> dict:
    args = [*BASE, *EXTRA.get(algorithm, []), "--algorithm", algorithm, "--client-store", store, "--rounds", str(ROUNDS)]
    reference, run = root / f"{algorithm}_{store}_ref", root / f"{algorithm}_{store}"
    done, _ = command([*args, "--out", str(reference)])
    assert done.returncode == 0, done.stderr[-2000:]
    kills = []
    for attempt in range(4):
        point = str(rng.choice(POINTS))
        # killed before its first checkpoint was complete, a run resumes too (from round 1: issue 55)
        before = "" if attempt == 0 or has_checkpoint(run) else " (resumed without a checkpoint)"
        args_now = [*args, "--out", str(run)] if attempt == 0 else ["--resume", str(run), "--no-progress"]
        n = int(rng.integers(1, 4))
        done, _ = command(args_now, faults=f"{point}:{n}:kill")
        kills.append(f"{point}:{n}{before}" + ("" if done.returncode == -signal.SIGKILL else " (run ended first)"))
        if done.returncode == 0:
            break
    if not (run / "summary.json").exists() or json.loads((run / "summary.json").read_text())["status"] != "completed":
        done, _ = command(["--resume", str(run), "--no-progress"])
        assert done.returncode == 0, done.stderr[-2000:]
    return {"algorithm": algorithm, "store": store, "kills": kills, "same_metrics": metrics(run) == metrics(reference)}


def has_checkpoint(run: Path) -> bool:
    """Whether the run has a finished checkpoint (orbax names one by its step; unfinished ones are temporary)."""
    folder = run / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def io_probes(root: Path) -> list[dict]:
    """The failures the test suite injects, for real: each run (or its resume to ROUNDS) must stop at once in
    one line naming the path, with summary.json "failed" (a full disk may leave no room for it)."""
    args = lambda run: [*BASE, "--algorithm", "scaffold", "--rounds", str(ROUNDS), "--out", str(run)]  # noqa: E731
    tmpfs, limited, immutable = root / "tmpfs" / "run", root / "ulimit_-f_64_KiB", root / "immutable_checkpoints"
    return [
        probe("I/O", "full disk (tmpfs)", root, args(tmpfs), Expect(words=(str(tmpfs),), summary=("failed", None)),
              run=tmpfs, prepare=lambda: full_disk(tmpfs), shown_prefix="mount -t tmpfs -o size=6000k; "),
        # without the compilation cache: a cache entry cut short by the limit would outlive the sweep
        probe("I/O", "ulimit -f 64 KiB", root, [*args(limited), "--no-compilation-cache"],
              Expect(words=(str(limited),)), run=limited, limit=64 * 1024, shown_prefix="ulimit -f 64; "),
        probe("I/O", "immutable checkpoints folder", root,
              ["--resume", str(immutable), "--rounds", str(ROUNDS), "--no-progress"],
              Expect(words=(str(immutable / "checkpoints"),),
                     check=lambda done: "" if summary_of(immutable).get("last_checkpoint") == 2 else
                     "the last checkpoint is not round 2's"),
              run=immutable, prepare=lambda: immutable_checkpoints(immutable), shown_prefix="chattr +i checkpoints; ",
              cleanup=lambda: subprocess.run(["chattr", "-i", str(immutable / "checkpoints")], capture_output=True))]


def full_disk(run: Path) -> None:
    mount = run.parent
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6000k", "tmpfs", str(mount)], check=True, capture_output=True)
    (mount / "fill").write_bytes(b"\0" * 1_500_000)  # room for the first checkpoint or two, not all


def immutable_checkpoints(run: Path) -> None:
    """Two rounds checkpointed, then the checkpoints folder made immutable (root only)."""
    done, _ = command([*BASE, "--algorithm", "scaffold", "--rounds", "2", "--out", str(run)])
    assert done.returncode == 0, done.stderr[-500:]
    subprocess.run(["chattr", "+i", str(run / "checkpoints")], check=True, capture_output=True)


def unmount_all(root: Path) -> None:
    """Unmounts the sweep's tmpfs mounts (those under `root`)."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(str(root))), reverse=True):
        subprocess.run(["umount", mount], capture_output=True)


PROBE_CLASSES = (io_probes, fault_probes.folder_probes, fault_probes.signal_probes, fault_probes.plugin_probes,
                 fault_probes.data_probes, fault_probes.checkpoint_probes, fault_probes.missing_checksum_probes,
                 fault_probes.kill_probes, fault_probes.cluster_signal_probes, fault_probes.foreign_file_probes)


def table(probes: list[dict]) -> list[str]:
    lines = ["| class | probe | verdict | exit | seconds | stderr lines | tracebacks | summary | last line |",
             "|---|---|---|---|---|---|---|---|---|"]
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    for p in probes:
        last = p.get("last_line", p.get("why", "")) if p["ran"] else p["why"]
        lines.append(f"| {p['class']} | {cell(p['probe'])} | {p['verdict']} | {p.get('exit', '-')} | "
                     f"{p.get('seconds', '-')} | {p.get('stderr_lines', '-')} | {p.get('tracebacks', '-')} | "
                     f"{p.get('summary_status', '-')} | {cell(last)} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_sweep")
    parser.add_argument("--quick", action="store_true", help="two (algorithm, store) pairs")
    parser.add_argument("--no-kills", action="store_true", help="the probes only, without the kill -9 sweep")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(2026)
    root = Path(tempfile.mkdtemp(prefix="fault_sweep_"))
    os.environ["FEDJAX_SPARSE_CACHE"] = str(root / "cache")  # the sweep's runs never touch the user's cache
    sweep = [] if args.no_kills else SWEEP[:2] if args.quick else SWEEP
    kills, probes = [], []
    try:
        for algorithm, store in sweep:
            kills.append(kill_sweep(algorithm, store, root, rng))
            print(kills[-1], flush=True)
        for probe_class in PROBE_CLASSES:
            for p in probe_class(root):
                probes.append(p)
                print({k: v for k, v in p.items() if k != "stderr_tail"}, flush=True)
    finally:
        unmount_all(root)
    import jax
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
    stamp = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": device, "command": " ".join(["python -m benchmarks.fault_sweep", *(argv or sys.argv[1:])]),
              "date": stamp, "kills": kills, "probes": probes}
    name = f"fault_sweep_{jax.default_backend()}_{stamp}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    verdicts = {v: sum(p["verdict"] == v for p in probes) for v in ("pass", "fail", "not run")}
    lines = [f"# Fault sweep ({stamp})", "", f"Device: {device}. Command: `{result['command']}`.", "",
             "| algorithm | store | kills (point:n) | resumed to the uninterrupted metrics |", "|---|---|---|---|"]
    lines += [f"| {k['algorithm']} | {k['store']} | {', '.join(k['kills'])} | {k['same_metrics']} |" for k in kills]
    lines += ["", f"Probes: {verdicts['pass']} pass, {verdicts['fail']} fail, {verdicts['not run']} not run "
              f"(what each must show: benchmarks/fault_probes.py; $ROOT is the sweep's temporary folder; the "
              f"commands are in the .json).", "", *table(probes)]
    failing = [p for p in probes if p["verdict"] == "fail"]
    if failing:
        lines += ["", "## Failing probes", ""]
        for p in failing:
            lines += [f"**{p['class']}: {p['probe']}**: {p['why']}.", "", f"    {p['command']}", "",
                      *[f"    {line}" for line in p.get("stderr_tail", "").splitlines()[-15:]], ""]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    print("\n".join(lines))
    return 0 if all(k["same_metrics"] for k in kills) and not failing else 1


if __name__ == "__main__":
    raise SystemExit(main())
