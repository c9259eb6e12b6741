"""Training on client data several times larger than the process's memory (`--dataset mmap:FOLDER`).

Writes a synthetic image data set (32x32x3 uint8, 10 classes, i.i.d. clients of `PER_CLIENT`
examples) as a memory-mapped folder, chunk by chunk (`data.mapped.write_split`: never more than a
chunk in memory), at two sizes that differ only in their number of clients, then runs `fedjax-sparse
run --dataset mmap:FOLDER --client-store host` on each in a child process whose data segment is
limited (RLIMIT_DATA, which counts the memory a process allocates but not the file pages it maps
read-only), and reports the child's peak resident set (its VmHWM, file pages read through the map
included).

The bound: a round holds its K sampled clients' windows (K x max_count examples as uint8, then as
float32 for the model) beside what does not depend on the data set's size (the interpreter, JAX,
the model and its compiled round: the small set's run measures it); what grows with the data set is
its labels and the clients' example indices (4 + 8 bytes an example). So peak RSS <= small run's peak
+ 12 bytes x (examples added). The large set's run must stay under it, and under the memory limit
that the data set is several times larger than.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from . import common

SHAPE, CLASSES, PER_CLIENT, TEST = (32, 32, 3), 10, 1000, 2000
CLIENTS_PER_ROUND, ROUNDS = 4, 3
MEMORY_LIMIT = 2 ** 30  # the child's RLIMIT_DATA
_CHUNK = 20_000  # examples written at once (61 MB)


def write_set(folder: Path, num_clients: int, seed: int = 0) -> dict:
    """The synthetic set: each class a different mean brightness, so the run learns something."""
    from fedjax_sparse.data import mapped

    rng = np.random.default_rng(seed)
    splits = {}
    for split, n in (("train", num_clients * PER_CLIENT), ("test", TEST)):
        y = rng.integers(0, CLASSES, n).astype(np.int32)

        def chunks(y=y):
            for start in range(0, len(y), _CHUNK):
                labels = y[start:start + _CHUNK]
                noise = rng.integers(0, 128, (len(labels), *SHAPE), dtype=np.uint8)
                yield noise + (labels * 12).astype(np.uint8)[:, None, None, None]

        splits[split] = mapped.write_split(folder, split, chunks(), y, SHAPE, np.uint8)
    mapped.write_manifest(folder, name=f"larger_than_memory_{num_clients}", num_classes=CLASSES,
                          class_names=[str(c) for c in range(CLASSES)], mean=[0.37] * 3, std=[0.15] * 3,
                          augment=False, splits=splits)
    return splits


# The child limits itself, runs the command line's main and reports its own high-water mark (VmHWM:
# ru_maxrss would carry over the parent's, `common.peak_rss_bytes`).
_CHILD = """import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, ({limit}, {limit}))
from fedjax_sparse.run.cli import main
code = main(sys.argv[1:])
from benchmarks.common import peak_rss_bytes
print('peak_rss', peak_rss_bytes())
sys.exit(code)
"""


def train(folder: Path, num_clients: int, out: Path) -> dict:
    """One run in a child process under the memory limit: its peak RSS and wall time."""
    argv = ["run", "--dataset", f"mmap:{folder}", "--model", "mlp", "--num-clients", str(num_clients),
            "--clients-per-round", str(CLIENTS_PER_ROUND), "--rounds", str(ROUNDS), "--local-epochs", "1",
            "--batch-size", "50", "--lr", "0.01", "--partition", "iid", "--client-store", "host",
            "--no-tensorboard", "--no-progress", "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(limit=MEMORY_LIMIT), *argv], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    peak = int(proc.stdout.split("peak_rss")[-1].split()[0])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"argv": argv, "peak_rss": peak, "seconds": time.perf_counter() - start,
            "final_accuracy": rows[-1].get("test_accuracy")}


def measure(work: Path, sizes: Sequence[int]) -> list[dict]:
    records = []
    for num_clients in sorted(sizes):
        folder = work / f"set_{num_clients}"
        start = time.perf_counter()
        splits = write_set(folder, num_clients)
        written = time.perf_counter() - start
        data_bytes = sum((folder / f"{s}_x.npy").stat().st_size for s in splits)
        record = {"num_clients": num_clients, "examples": splits["train"]["examples"], "data_bytes": data_bytes,
                  "write_seconds": written, **train(folder, num_clients, work / f"run_{num_clients}")}
        records.append(record)
        for s in splits:  # the next set's disk
            (folder / f"{s}_x.npy").unlink()
    small, large = records[0], records[-1]
    window = CLIENTS_PER_ROUND * PER_CLIENT * int(np.prod(SHAPE)) * (1 + 4)
    for r in records:
        r["bound"] = small["peak_rss"] + 12 * (r["examples"] - small["examples"])
        r["within_bound"] = r["peak_rss"] <= r["bound"]
        r["round_windows_bytes"] = window
        r["data_over_limit"] = r["data_bytes"] / MEMORY_LIMIT
    assert large["within_bound"] and large["peak_rss"] < MEMORY_LIMIT < large["data_bytes"], records
    return records


def table(records: list[dict], env: dict) -> str:
    gb = lambda b: f"{b / 2 ** 30:.2f} GiB"  # noqa: E731
    lines = ["# Data larger than memory: --dataset mmap:FOLDER", "",
             f"`{env['command']}`; each run: `fedjax-sparse {' '.join(records[-1]['argv'])}` (its own folder), in "
             f"a child process under RLIMIT_DATA = {gb(MEMORY_LIMIT)}.", "",
             "| clients | training examples | data set on disk | / limit | peak RSS | bound | within | write s | "
             "run s | accuracy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['num_clients']:,} | {r['examples']:,} | {gb(r['data_bytes'])} | "
                     f"{r['data_over_limit']:.1f}x | {gb(r['peak_rss'])} | {gb(r['bound'])} | "
                     f"{'yes' if r['within_bound'] else 'NO'} | {r['write_seconds']:.0f} | {r['seconds']:.0f} | "
                     f"{r['final_accuracy']:.3f} |")
    lines += ["", f"Bound: the small set's peak RSS (interpreter, JAX, model, compiled round, and one round's "
                  f"{CLIENTS_PER_ROUND} x {PER_CLIENT} examples: {gb(records[0]['round_windows_bytes'])} as uint8 and "
                  f"float32) + 12 bytes for each training example added (its label and index). Peak RSS counts the "
                  f"file pages a round reads through the map; the map is closed after each gather.", "",
              common.environment_markdown(env)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common.parser("benchmarks.larger_than_memory", __doc__, "a 0.06 GB and a 0.3 GB set (a check, not a "
                                                                 "measurement: both fit the limit)")
    p.add_argument("--work-dir", help="folder for the data sets and runs (default: a temporary one, removed)")
    args = p.parse_args(argv)
    sizes = (20, 100) if args.quick else (100, 1000)  # 0.3 GiB and 2.9 GiB of training examples
    env = common.environment(common.command_line("benchmarks.larger_than_memory", argv))
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        records = measure(Path(work), sizes) if not args.quick else _quick(Path(work), sizes)
    common.finish(args.out, "larger_than_memory", env, records, lambda e: table(records, e))
    return records


def _quick(work: Path, sizes) -> list[dict]:
    try:
        return measure(work, sizes)
    except AssertionError as err:  # a quick set fits the limit: only the bound is checked
        records = err.args[0]
        assert records[-1]["within_bound"], records
        return records


if __name__ == "__main__":
    main()
