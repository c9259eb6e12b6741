"""Client scale: a round's time and memory as the population grows, per client store and process count.

    python -m benchmarks.client_scale [--quick] [--json FILE] [--markdown FILE] [--work-dir DIR]

Workload. Synthetic clients of 20 examples each, shaped like the digits (8x8x1 uint8 images),
labels skewed per client (80 % one label drawn per client, the rest uniform); the digits MLP
(85,002 parameters, 340,008 bytes) trained by `LocalSGD` (lr 0.05, one epoch, batch 16: 2 steps
a client), K = 100 clients per round. SCAFFOLD (a control variate of the model's size per
client) at N = 10^3, 10^4, 10^5; FedAvg (no client state) at N = 10^3 and 10^6. Stores:
`device` (states and data on the device, `build_round`'s jit), `host` (rows in memory) and
`disk` (rows in a file), the last two with round r+1's reads prefetched during round r
(`core.round.store.StoreRound`). A store is skipped where the `auto` rule says it does not fit
(`core.client_state.store.choose_store`). Two processes (jax.distributed, gloo) against one at
N = 10^4, SCAFFOLD, host store.

Method. Every setting runs in a fresh Python process (so its peak RSS is its own): the data are
generated once per N into .npy files (x, y, offsets, counts); the device and host settings load
them into memory, the disk setting memory-maps them. One warm-up round (compiles), then
`rounds` timed rounds; seconds per round = their median, each ended by reading the round's
outputs on the host (the row stores also wait for their writes and prefetch). Measured:
- peak_rss: the process's peak resident memory (VmHWM), and rss_data: its resident memory
  right after the data were loaded (so peak_rss - rss_data is what the round and store add);
- device_bytes: bytes of live device buffers after the rounds (`jax.live_arrays()`; on a CPU
  the device has no allocator statistics) and device_peak where the backend reports one;
- store_bytes: bytes of client state the store holds; disk_bytes: the store's row file (disk
  store) plus the data files the process reads from disk (disk store only);
- read_s / write_s: one round's store reads + data windows, and its writes, timed apart after
  the rounds (what bounds the row stores against the device store).
The full benchmark's results are in benchmarks/results/client_scale_cpu.{md,json}.

The command line's path (`--cli`): the same figures for whole `fedjax-sparse run` processes on
FedProx's Synthetic(1, 1) (`--dataset synthetic:1,1`: 60 features, clients of 50-1,000 examples,
each process generating its own clients when a round samples them), the MLP, one local epoch of
batch 16 at lr 0.05, K = 100, disk store: SCAFFOLD at N = 10^3 and 10^5, FedAvg at 10^3 and 10^6.
Each run evaluates once, after its last round (`--eval-every` = rounds). Measured per run: its
median round (summary.json's `median_round_seconds`, rounds after the first), first round
(compiles), the process's wall time, its set-up and final evaluation (the run's wall time minus
its rounds: the population's sizes, the store, the compilations, every client scored once), and
its peak resident memory (the child's own, from wait4). Results: benchmarks/results/client_scale_cli_cpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from .common import peak_rss_bytes, rss_bytes
from .round_throughput import environment

EXAMPLES, SHAPE, CLASSES, SKEW = 20, (8, 8, 1), 10, 0.8


@dataclasses.dataclass(frozen=True)
class Setting:
    algorithm: str
    num_clients: int
    store: str
    processes: int = 1
    clients_per_round: int = 100
    rounds: int = 5
    seed: int = 0

    @property
    def name(self) -> str:
        procs = f", {self.processes} processes" if self.processes > 1 else ""
        return f"{self.algorithm} N={self.num_clients:,} {self.store}{procs}"


def full_settings() -> list[Setting]:
    settings = [Setting("scaffold", n, store) for n in (10**3, 10**4, 10**5) for store in ("device", "host", "disk")]
    settings += [Setting("fedavg", n, store) for n in (10**3, 10**6) for store in ("device", "host", "disk")]
    settings.append(Setting("scaffold", 10**4, "host", processes=2))
    return settings


def quick_settings() -> list[Setting]:
    """Run in this process, one after the other (their peak RSS is then the process's so far)."""
    return [Setting("scaffold", 200, store, clients_per_round=10, rounds=1) for store in ("device", "host", "disk")]


def row_bytes(algorithm: str) -> int:
    """Bytes of one client's state: SCAFFOLD's control variate is the MLP's 85,002 float32 params."""
    return 0 if algorithm == "fedavg" else 4 * 85_002


def device_fits(setting: Setting) -> tuple[bool, str]:
    """Whether the `auto` rule would put this population on the device."""
    from fedjax_sparse.core.client_state.choice import choose_store
    data_bytes = setting.num_clients * EXAMPLES * (int(np.prod(SHAPE)) + 4)
    backend, reason = choose_store(setting.num_clients, row_bytes(setting.algorithm), data_bytes)
    return backend == "device", reason


# ---------------------------------------------------------------- data

def write_clients(directory: Path, num_clients: int, seed: int = 0, chunk: int = 50_000) -> Path:
    """N synthetic clients in `save_host_data`'s format, generated a chunk of clients at a time."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "meta.json").exists():
        return directory
    total = num_clients * EXAMPLES
    x = np.lib.format.open_memmap(directory / "x.npy", "w+", np.uint8, (total, *SHAPE))
    y = np.lib.format.open_memmap(directory / "y.npy", "w+", np.int32, (total,))
    for start in range(0, num_clients, chunk):
        n = min(chunk, num_clients - start)
        rng = np.random.default_rng([seed, start])
        rows = slice(start * EXAMPLES, (start + n) * EXAMPLES)
        x[rows] = rng.integers(0, 256, (n * EXAMPLES, *SHAPE), dtype=np.uint8)
        dominant = np.repeat(rng.integers(0, CLASSES, n), EXAMPLES)
        y[rows] = np.where(rng.random(n * EXAMPLES) < SKEW, dominant, rng.integers(0, CLASSES, n * EXAMPLES))
    x.flush()
    y.flush()
    del x, y
    np.save(directory / "offsets.npy", np.arange(num_clients, dtype=np.int64) * EXAMPLES)
    np.save(directory / "counts.npy", np.full(num_clients, EXAMPLES, np.int32))
    meta = {"mean": [0.5], "std": [0.25], "max_count": EXAMPLES, "num_clients": num_clients, "augment": False,
            "process_index": 0, "process_count": 1}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


# ---------------------------------------------------------------- one setting, in this process

@functools.lru_cache(maxsize=None)
def workload(algorithm: str, num_clients: int):
    """(model, algorithm): built once per process, so settings in one process share compiled rounds."""
    from fedjax_sparse.algorithms import fedavg, scaffold
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.models import get_model

    model = get_model("mlp", SHAPE, CLASSES)
    local = LocalSGD(model, 0.05, 1, 16)
    return model, fedavg(local) if algorithm == "fedavg" else scaffold(local, num_clients)


def run_setting(setting: Setting, data_dir: Path, work_dir: Path, process=None, mesh=None) -> dict:
    from fedjax_sparse.core.client_state.choice import choose_store, make_store
    from fedjax_sparse.core.client_state.store import initial_server_state
    from fedjax_sparse.core.federation.participation import sample_clients_host
    from fedjax_sparse.core.round.step import default_client_chunk
    from fedjax_sparse.core.round.store import StoreRound
    from fedjax_sparse.data.federated import FederatedSplit
    from fedjax_sparse.data.windows import host_data, open_host_data

    n, k = setting.num_clients, setting.clients_per_round
    model, alg = workload(setting.algorithm, n)
    key, variables = jax.random.key(setting.seed), model.init(jax.random.key(setting.seed + 1))
    data = open_host_data(data_dir, mmap=setting.store == "disk" or setting.processes > 1)
    if process is not None and process.count > 1:
        data = host_data(data.x, data.y, [np.arange(i * EXAMPLES, (i + 1) * EXAMPLES) for i in range(n)],
                         data.mean, data.std, process=process)
    if setting.store == "device":
        data = FederatedSplit(x=jax.device_put(data.x), y=jax.device_put(data.y),
                              offsets=jax.device_put(data.offsets.astype(np.int32)),
                              counts=jax.device_put(data.counts), mean=jax.device_put(data.mean),
                              std=jax.device_put(data.std), max_count=EXAMPLES)
    rss_data = rss_bytes()
    store = make_store(setting.store, alg, key, variables, n, directory=work_dir / "store", process=process)
    auto = choose_store(n, store.row_bytes, n * EXAMPLES * (int(np.prod(SHAPE)) + 4),
                        processes=process.count if process else 1)
    round_fn = StoreRound(alg, store, data, k, seed=setting.seed, mesh=mesh,
                          client_chunk=None if mesh is not None else default_client_chunk(variables, k))
    server = initial_server_state(alg, key, variables, n)
    times = []
    for r in range(setting.rounds + 1):
        start = time.perf_counter()
        server, out = round_fn(server, r, prefetch_next=r < setting.rounds)
        np.asarray(out.metrics["loss"])
        times.append(time.perf_counter() - start)
    round_fn.close()
    record = {"setting": dataclasses.asdict(setting), "name": setting.name,
              "round_seconds": float(np.median(times[1:])), "round_seconds_all": times[1:],
              "first_round_seconds": times[0], "rss_data_bytes": rss_data, "peak_rss_bytes": peak_rss_bytes(),
              "device_bytes": int(sum(a.nbytes for a in jax.live_arrays())),
              "device_peak_bytes": _device_peak(), "store_bytes": store.nbytes, "auto": auto[0],
              "auto_reason": auto[1], "final_loss": float(np.mean(np.asarray(out.metrics["loss"])))}
    if setting.store == "disk":
        data_files = sum((data_dir / f).stat().st_size for f in ("x.npy", "y.npy", "offsets.npy", "counts.npy"))
        record["disk_bytes"] = store.disk_bytes + data_files
        record["store_file_bytes"] = store.disk_bytes
    if setting.store != "device":
        ids = sample_clients_host(setting.seed, setting.rounds + 1, n, k)
        start = time.perf_counter()
        rows, _ = store.read(ids)
        data.windows(ids)
        record["read_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        store.write(ids, rows)
        record["write_seconds"] = time.perf_counter() - start
    if process is not None:
        record["process"] = process.tag()
    return record


def _device_peak() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


# ---------------------------------------------------------------- each setting in its own process(es)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(setting: Setting, data_dir: Path, work_dir: Path, timeout: float = 1800) -> list[dict]:
    """Runs `setting` in fresh processes (one per process of the setting); their records."""
    root = Path(__file__).resolve().parents[1]
    port = _free_port()
    procs = []
    try:
        for p in range(setting.processes):
            command = [sys.executable, "-m", "benchmarks.client_scale", "--one", json.dumps(dataclasses.asdict(setting)),
                       "--data", str(data_dir), "--work-dir", str(work_dir / f"p{p}"), "--process-id", str(p),
                       "--port", str(port)]
            procs.append(subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = []
    for proc, (stdout, stderr) in zip(procs, outputs):
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{setting.name} failed (exit {proc.returncode}): {stderr.strip()[-2000:]}")
        records.append(json.loads(lines[-1]))
    return records


def _one(args) -> None:
    setting = Setting(**json.loads(args.one))
    process = mesh = None
    if setting.processes > 1:
        from fedjax_sparse.core.round import distributed
        process = distributed.initialize(f"127.0.0.1:{args.port}", setting.processes, args.process_id, timeout_s=120)
        mesh = distributed.process_mesh()
    print(json.dumps(run_setting(setting, Path(args.data), Path(args.work_dir), process, mesh)), flush=True)


# ---------------------------------------------------------------- tables

def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.3f}"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(records: list[dict]) -> str:
    head = ("| setting | s/round | first round s | peak RSS GB | RSS after data GB | device GB | store GB | "
            "disk GB | read s | write s | auto |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        proc = f" (process {r['process']})" if r.get("process") and r["setting"]["processes"] > 1 else ""
        lines.append(f"| {r['name']}{proc} | {r['round_seconds']:.3f} | {r['first_round_seconds']:.1f} | "
                     f"{_gb(r['peak_rss_bytes'])} | {_gb(r['rss_data_bytes'])} | {_gb(r['device_bytes'])} | "
                     f"{_gb(r['store_bytes'])} | {_gb(r.get('disk_bytes'))} | "
                     f"{_seconds(r.get('read_seconds'))} | {_seconds(r.get('write_seconds'))} | "
                     f"{r['auto']} |")
    return "\n".join(lines)


def merge_repeats(records: list[dict]) -> list[dict]:
    """One record per (setting, process): the median of its runs' round times (each run's own median),
    the highest peak RSS; the other figures from its first run."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["name"], r.get("process")), []).append(r)
    merged = []
    for runs in groups.values():
        merged.append({**runs[0], "round_seconds": float(np.median([r["round_seconds"] for r in runs])),
                       "round_seconds_runs": [r["round_seconds"] for r in runs],
                       "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs)})
    return merged


def ratios(records: list[dict]) -> dict:
    """The issue's goals as measured ratios (None where a setting is missing)."""
    def seconds(algorithm, n, store, processes=1):
        for r in records:
            s = r["setting"]
            if (s["algorithm"], s["num_clients"], s["store"], s["processes"]) == (algorithm, n, store, processes):
                return r["round_seconds"]
        return None

    def ratio(a, b):
        return None if a is None or b is None else a / b

    return {"disk_1e3_over_device_1e3": ratio(seconds("scaffold", 10**3, "disk"), seconds("scaffold", 10**3, "device")),
            "host_1e3_over_device_1e3": ratio(seconds("scaffold", 10**3, "host"), seconds("scaffold", 10**3, "device")),
            "disk_1e5_over_disk_1e3": ratio(seconds("scaffold", 10**5, "disk"), seconds("scaffold", 10**3, "disk")),
            "fedavg_disk_1e6_over_disk_1e3": ratio(seconds("fedavg", 10**6, "disk"), seconds("fedavg", 10**3, "disk")),
            "two_processes_over_one_1e4": ratio(seconds("scaffold", 10**4, "host", 2), seconds("scaffold", 10**4, "host"))}


# ---------------------------------------------------------------- the command line's path

@dataclasses.dataclass(frozen=True)
class CliSetting:
    algorithm: str
    num_clients: int
    store: str = "disk"
    clients_per_round: int = 100
    rounds: int = 5

    @property
    def name(self) -> str:
        return f"cli {self.algorithm} N={self.num_clients:,} {self.store}"

    def command(self, out: Path) -> list[str]:
        return ["fedjax-sparse", "run", "--dataset", "synthetic:1,1", "--algorithm", self.algorithm,
                "--num-clients", str(self.num_clients), "--clients-per-round", str(self.clients_per_round),
                "--client-store", self.store, "--rounds", str(self.rounds), "--eval-every", str(self.rounds),
                "--local-epochs", "1", "--batch-size", "16", "--lr", "0.05", "--no-progress", "--no-tensorboard",
                "--no-compilation-cache", "--out", str(out)]


def cli_settings(quick: bool) -> list[CliSetting]:
    if quick:
        return [CliSetting("scaffold", 200, clients_per_round=10, rounds=2)]
    return [CliSetting("scaffold", 10**3), CliSetting("scaffold", 10**5), CliSetting("fedavg", 10**3),
            CliSetting("fedavg", 10**6)]


def measure_cli(setting: CliSetting, out: Path) -> dict:
    """One `fedjax-sparse run` in a child process: its summary's timings and its own peak RSS."""
    command = setting.command(out)
    argv = [sys.executable, "-m", "fedjax_sparse", *command[1:]]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.log", "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[1], stdout=log, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{setting.name} failed (exit {proc.returncode}): "
                           f"{(out.parent / f'{out.name}.log').read_text()[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rounds = summary["first_round_seconds"] + (setting.rounds - 1) * summary["median_round_seconds"]
    return {"setting": dataclasses.asdict(setting), "name": setting.name, "command": " ".join(command),
            "round_seconds": summary["median_round_seconds"], "first_round_seconds": summary["first_round_seconds"],
            "run_seconds": summary["wall_seconds"], "process_seconds": wall,
            "evaluation_seconds": summary["wall_seconds"] - rounds, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "client_store": summary["client_store"], "num_train_examples": summary["num_train_examples"],
            "final_test_accuracy": summary["final_test_accuracy"]}


def cli_table(records: list[dict]) -> str:
    head = "| setting | s/round | first round s | set-up + final evaluation s | process wall s | peak RSS GB |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        lines.append(f"| {r['name']} | {r['round_seconds']:.3f} | {r['first_round_seconds']:.1f} | "
                     f"{r['evaluation_seconds']:.1f} | {r['process_seconds']:.1f} | {_gb(r['peak_rss_bytes'])} |")
    return "\n".join(lines)


def run_cli(args, env: dict) -> list[dict]:
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="client_scale_cli_"))
    records = []
    try:
        for setting in cli_settings(args.quick):
            if args.only is not None and args.only not in setting.name:
                continue
            print(f"# {setting.name}: {' '.join(setting.command(Path('OUT')))}", flush=True)
            records.append(measure_cli(setting, work / setting.name.replace(" ", "_").replace(",", "")))
            print(cli_table(records[-1:]).splitlines()[-1], flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    by = {(r["setting"]["algorithm"], r["setting"]["num_clients"]): r["round_seconds"] for r in records}
    summary = {"scaffold_1e5_over_1e3": by.get(("scaffold", 10**5), 0) / by[("scaffold", 10**3)]
               if ("scaffold", 10**3) in by else None,
               "fedavg_1e6_over_1e3": by.get(("fedavg", 10**6), 0) / by[("fedavg", 10**3)]
               if ("fedavg", 10**3) in by else None}
    print(cli_table(records))
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "ratios": summary, "settings": records}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(cli_table(records) + "\n")
    return records


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.client_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 200, K = 10, one timed round: a CI check")
    parser.add_argument("--json", metavar="FILE", help="write the records (and the environment) as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as markdown")
    parser.add_argument("--repeats", type=int, default=None, help="runs of every setting, interleaved (default 3; "
                                                                   "1 with --quick): the table takes their median")
    parser.add_argument("--only", metavar="TEXT", help="run only the settings whose name contains TEXT, e.g. "
                                                        "'scaffold N=1,000'")
    parser.add_argument("--work-dir", help="folder for data and store files (default: a temporary one, removed)")
    parser.add_argument("--cli", action="store_true", help="measure whole fedjax-sparse run processes on synthetic:1,1 "
                                                           "instead (the command line's path)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(args)
        return []

    env = environment(argv, "benchmarks.client_scale")
    if args.cli:
        return run_cli(args, env)
    settings = quick_settings() if args.quick else full_settings()
    settings = [s for s in settings if args.only is None or args.only in s.name]
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="client_scale_"))
    print(f"# client scale: {env['device']}, {env['cpu_count']} CPUs; jax {env['jax']}; "
          f"load average {env['load_average_at_start']}", flush=True)
    repeats = args.repeats or (1 if args.quick else 3)
    records, skipped = [], []
    try:
        for repeat in range(repeats):
            for setting in settings:
                fits, reason = device_fits(setting)
                if setting.store == "device" and not fits:
                    if repeat == 0:
                        skipped.append({"name": setting.name, "reason": reason})
                        print(f"# {setting.name}: skipped ({reason})", flush=True)
                    continue
                data_dir = write_clients(work / f"data_{setting.num_clients}", setting.num_clients, setting.seed)
                run_dir = work / "runs" / setting.name.replace(" ", "_").replace(",", "").replace("=", "")
                print(f"# {setting.name}, run {repeat + 1} of {repeats} ...", flush=True)
                runs = [run_setting(setting, data_dir, run_dir)] if args.quick else measure(setting, data_dir, run_dir)
                for record in runs:
                    record["repeat"] = repeat
                records.extend(runs)
                shutil.rmtree(run_dir, ignore_errors=True)
                print(table(runs).splitlines()[-1], flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    try:
        env["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    merged = merge_repeats(records)
    summary = ratios(merged)
    print(table(merged))
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "ratios": summary, "settings": merged,
                                               "runs": records, "skipped": skipped}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table(merged) + "\n")
    return merged


if __name__ == "__main__":
    main()
