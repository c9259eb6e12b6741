"""What every run leaves behind: its config, per-round metrics, a summary and a plot."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import jax

from fedjax_sparse.run.faults import fault_point


class Manifest(Protocol):
    """What the writer needs of a run folder's record of its files (`run.folder.RunManifest`)."""

    def record(self, *names: str) -> None: ...


def device_description() -> str:
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    return f"{jax.device_count()} x {kind} ({device.platform}), {platform.machine()}, jax {jax.__version__}"


def strict_json(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None, so that it is valid (strict) JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """Strict JSON text: NaN and infinities are written as null, never as NaN."""
    return json.dumps(strict_json(obj), allow_nan=False, **kwargs)


def progress_bar(total: int, description: str, enabled: bool = True, initial: int = 0):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=description, unit="round", disable=not enabled, dynamic_ncols=True,
                initial=initial)


class RunWriteError(RuntimeError):
    """A run's own file could not be written; the message names it and the OS's reason, in one line."""


@contextlib.contextmanager
def writing(path: Path, point: str | None = None):
    """Turns an OSError while writing `path` into one RunWriteError naming it and the OS's reason.
    `point`: the fault point's name (`run.faults`, `write:POINT`) where it is not the file's name."""
    try:
        fault_point(f"write:{point or path.name}")
        yield
    except OSError as err:
        reason = f"{err.strerror} [errno {err.errno}]" if err.errno else " ".join(str(err).split())
        raise RunWriteError(f"cannot write {path}: {reason}") from None


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a hidden sibling, then rename it onto `path`: a kill leaves the old file or the
    new one, never half of one; a failed write leaves the old one and no sibling."""
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path):
        try:
            write(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


class RunWriter:
    """Writes a run's files into one directory, metrics line by line as they come.

    The metrics file starts with `start_metrics(records)` (a resumed run's rounds that its
    checkpoint covers); the other files are independent of it, so a run whose metrics cannot be
    written still says so in its summary. Every file but the metrics is replaced atomically; each
    metrics line is flushed to the disk (fsync) before the run goes on, so a round whose record was
    written survives a crash of the machine. Each file's name goes to the folder's `manifest` before
    the file is first written. A failed write is one `RunWriteError` naming the file.
    """

    def __init__(self, out: Path, manifest: Manifest):
        self.out, self.manifest = Path(out), manifest
        self.metrics_path = self.out / "metrics.jsonl"

    def _replace(self, name: str, write: Callable[[Path], None]) -> None:
        self.manifest.record(name)
        replace_atomically(self.out / name, write)

    def start_metrics(self, records: Sequence[dict] = ()) -> None:
        text = "".join(dumps(r) + "\n" for r in records)
        self._replace(self.metrics_path.name, lambda tmp: tmp.write_text(text))

    def _json(self, name: str, obj) -> None:
        text = dumps(obj, indent=2) + "\n"
        self._replace(name, lambda tmp: tmp.write_text(text))

    def write_config(self, config: dict) -> None:
        self._json("config.json", config)

    def write_partition(self, clients: list[dict]) -> None:
        self._json("partition.json", clients)

    def write_summary(self, summary: dict) -> None:
        self._json("summary.json", summary)

    def append_metrics(self, record: dict) -> None:
        line = dumps(record) + "\n"
        with writing(self.metrics_path), self.metrics_path.open("a") as f:
            # written in two parts only so that a crash test can stop the process between them
            f.write(line[:len(line) // 2])
            f.flush()
            fault_point("metrics_write")
            f.write(line[len(line) // 2:])
            f.flush()
            os.fsync(f.fileno())

    def plot(self, history: list[dict], title: str) -> Path:
        self._replace("accuracy.png", lambda tmp: plot_accuracy({"run": history}, tmp, title))
        return self.out / "accuracy.png"


def plot_accuracy(histories: dict[str, list[dict]], path: Path, title: str,
                  metrics: tuple[str, ...] = ("test_accuracy", "personalized_accuracy")) -> None:
    """Accuracy against rounds, against cumulative bytes and against simulated time (runs with a clock,
    `--device-profile`), one line per named run and metric; where a run records its clients' accuracy
    distribution, the band between the 10th and 90th percentile client is shaded on the rounds panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_round, by_bytes, by_time) = plt.subplots(1, 3, figsize=(16, 4))
    sent, timed = [], False
    longest = max((h.get("cumulative_simulated_seconds") or 0.0 for run in histories.values() for h in run),
                  default=0.0)
    unit, per_unit = next((u, s) for u, s in (("hours", 3600.0), ("minutes", 60.0), ("seconds", 1.0))
                          if longest >= 2 * s or s == 1.0)
    for i, (name, history) in enumerate(histories.items()):
        color = f"C{i % 10}"  # one color per run in every panel, also when a run skips one
        for key, style in zip(metrics, ("-", "--", ":")):
            points = [(h["round"], h.get("cumulative_bytes"), h.get("cumulative_simulated_seconds"), h[key])
                      for h in history if h.get(key) is not None]
            if not points:
                continue
            rounds, nbytes, seconds, acc = zip(*points)
            label = f"{name} {key.replace('_accuracy', '')}" if len(metrics) > 1 else name
            by_round.plot(rounds, acc, style, color=color, label=label)
            # a run that sends nothing, or records no bytes (a private run's), has no place on the bytes axis
            if None not in nbytes and max(nbytes) > 0:
                by_bytes.plot([b / 1e6 for b in nbytes], acc, style, color=color, label=label)
                sent += [b for b in nbytes if b > 0]
            if all(t is not None for t in seconds):
                by_time.plot([t / per_unit for t in seconds], acc, style, color=color, label=label)
                timed = True
        band = [(h["round"], h["client_accuracy_p10"], h["client_accuracy_p90"]) for h in history
                if h.get("client_accuracy_p10") is not None]
        if band:
            rounds, low, high = zip(*band)
            by_round.fill_between(rounds, low, high, color=color, alpha=0.15,
                                  label=f"{name} clients p10-p90" if len(histories) > 1 else "clients p10-p90")
    by_round.set_xlabel("round")
    # sparse methods send orders of magnitude less than dense ones: a log axis shows both
    log_bytes = bool(sent) and max(sent) > 100 * min(sent)
    if log_bytes:
        by_bytes.set_xscale("log")
    by_bytes.set_xlabel(f"cumulative bytes (MB, up + down{', log scale' if log_bytes else ''})")
    if not sent:
        by_bytes.text(0.5, 0.5, "no bytes sent", ha="center", va="center", transform=by_bytes.transAxes)
    by_time.set_xlabel(f"simulated time ({unit})")
    if not timed:
        by_time.text(0.5, 0.5, "no clock: run with --device-profile", ha="center", va="center",
                     transform=by_time.transAxes)
    for ax in (by_round, by_bytes, by_time):
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
