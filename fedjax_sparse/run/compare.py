"""`fedjax-sparse compare RUN_DIR...`: existing runs side by side, from their folders alone.

    fedjax-sparse compare runs/a runs/b 'runs/lr_*' [--target 0.9] [--md FILE] [--csv FILE] [--plot FILE]

One row per run: its name (the folder), its algorithm and the options that differ between the runs given (the
setting they share is said once above the table), the final and best accuracy of its global model
(test) and of its clients' own models (personalized), the bytes it sent up and down, its simulated seconds
(with a clock), the round and the simulated second at which its accuracy first reached the target, and its wall
time. The target (`--target`, default 90 % of the highest final accuracy among the runs) applies to each run's
headline accuracy: the global model's where it has one, else the personalized, as the run's summary line reports
it; the column headers say which runs are which. The table goes to the terminal (markdown), `--md` and `--csv`
write it, and the plot (`--plot`, default compare.png) overlays the runs' accuracy by round, by bytes and by
simulated time. A run that stopped early (interrupted, failed) is compared on the rounds it recorded and its
status shown.
"""

from __future__ import annotations

import csv
import glob
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from fedjax_sparse.run.outputs import plot_accuracy
from fedjax_sparse.run.parsing import OneLineParser
from fedjax_sparse.run.sweep_table import table_cell

SHOWN_SHARED = ("dataset", "model", "num_clients", "clients_per_round", "rounds", "local_epochs", "batch_size", "lr",
                "partition", "alpha", "seed")  # the setting, said once above the table where every run shares it
IGNORED = ("out", "tensorboard", "compilation_cache", "logger", "mlflow_tracking_uri", "wandb_project", "data_dir",
           "download")  # where a run wrote or logged, not what it computed


class CompareError(ValueError):
    """A folder that is no run, or nothing to compare; one line naming it."""


def expand(patterns: Sequence[str]) -> list[Path]:
    """Run folders from paths and globs (a pattern the shell did not expand), in the order given."""
    out = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise CompareError(f"{pattern}: no folder matches")
        for match in matches:
            path = Path(match)
            if not (path / "config.json").is_file() or not (path / "metrics.jsonl").is_file():
                raise CompareError(f"{path} is no run folder (it needs config.json and metrics.jsonl); give run "
                                   f"folders, or a glob of them such as runs/*")
            if path not in out:
                out.append(path)
    return out


def read_run(folder: Path) -> dict:
    """config, history (metrics.jsonl) and summary (None if the run never wrote one) of a run folder."""
    try:
        config = json.loads((folder / "config.json").read_text())
        history = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").is_file() else None
    except (OSError, ValueError) as err:
        raise CompareError(f"{folder}: cannot read its run files ({' '.join(str(err).split())})") from None
    return {"name": folder.name or str(folder), "folder": folder, "config": config, "history": history,
            "summary": summary}


def differing_options(configs: Sequence[dict]) -> list[str]:
    """The options whose values differ between the runs that have them (what they ran with, not where they
    wrote), in the first config's order, then the others'. An algorithm's own option that only one run has
    compares with nothing and is left out."""
    keys = list(dict.fromkeys(k for c in configs for k in c))
    return [k for k in keys if k not in IGNORED and k != "algorithm" and sum(k in c for c in configs) > 1
            and len({json.dumps(c[k], sort_keys=True) for c in configs if k in c}) > 1]


def headline(run: dict) -> str:
    """The accuracy a run is judged by: its global model's, else its clients' (as the run's summary line)."""
    summary, history = run["summary"] or {}, run["history"]
    has_global = summary.get("has_global_model", any(h.get("test_accuracy") is not None for h in history))
    return "test_accuracy" if has_global else "personalized_accuracy"


def first_reaching(history: list[dict], metric: str, target: float, key: str) -> Any:
    """`key` of the first record whose `metric` reached `target` (None if none did)."""
    return next((h.get(key) for h in history if h.get(metric) is not None and h[metric] >= target), None)


def _final(history: list[dict], metric: str) -> float | None:
    values = [h[metric] for h in history if h.get(metric) is not None]
    return values[-1] if values else None


def _best(history: list[dict], metric: str) -> float | None:
    values = [h[metric] for h in history if h.get(metric) is not None]
    return max(values) if values else None


def compare_rows(runs: Sequence[dict], target: float | None = None) -> tuple[list[dict], dict, float]:
    """(one row per run, the options all runs share, the target accuracy)."""
    if not runs:
        raise CompareError("nothing to compare: give run folders")
    options = differing_options([r["config"] for r in runs])
    if target is None:
        finals = [f for r in runs if (f := _final(r["history"], headline(r))) is not None]
        target = 0.9 * max(finals) if finals else 0.0
    rows = []
    for run in runs:
        history, summary, config = run["history"], run["summary"] or {}, run["config"]
        metric = headline(run)
        last = history[-1] if history else {}
        row = {"run": run["name"], "algorithm": config.get("algorithm"), **{k: config.get(k) for k in options},
               "accuracy_of": "global" if metric == "test_accuracy" else "personalized",
               "final_test_accuracy": _final(history, "test_accuracy"),
               "best_test_accuracy": _best(history, "test_accuracy"),
               "final_personalized_accuracy": _final(history, "personalized_accuracy"),
               "best_personalized_accuracy": _best(history, "personalized_accuracy"),
               "uplink_bytes": summary.get("total_uplink_bytes", last.get("cumulative_uplink_bytes")),
               "downlink_bytes": summary.get("total_downlink_bytes",
                                             (last.get("cumulative_bytes") or 0) - (last.get("cumulative_uplink_bytes")
                                                                                    or 0) if last else None),
               "simulated_seconds": last.get("cumulative_simulated_seconds"),
               "rounds_to_target": first_reaching(history, metric, target, "round"),
               "simulated_seconds_to_target": first_reaching(history, metric, target, "cumulative_simulated_seconds"),
               "rounds_done": last.get("round"), "wall_seconds": summary.get("wall_seconds"),
               "status": summary.get("status", "running or killed")}
        rows.append(row)
    shared = {k: runs[0]["config"][k] for k in SHOWN_SHARED if k in runs[0]["config"] and k not in options}
    return rows, shared, target


def markdown(rows: list[dict], shared: dict, target: float) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    columns = [c for c in columns if any(row.get(c) is not None for row in rows)]  # no clock: no seconds columns
    headers = {c: c for c in columns}
    kinds = {row["accuracy_of"] for row in rows}
    if len(kinds) > 1:  # a global accuracy beside a personalized one: say so where the figures are
        for c in ("rounds_to_target", "simulated_seconds_to_target"):
            headers[c] = f"{c} (global or personalized: accuracy_of)"
    lines = [f"Target accuracy: {target:.4g} (each run's {' or '.join(sorted(kinds))} accuracy). Every run: "
             + ", ".join(f"{k}={json.dumps(v)}" for k, v in shared.items())
             + " (the columns are the options that differ; each run's config.json has the rest).", "",
             "| " + " | ".join(headers[c] for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(table_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: Sequence[str]) -> int:
    parser = OneLineParser(prog="fedjax-sparse compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders, or globs of them ('runs/*')")
    parser.add_argument("--target", type=float, default=None,
                        help="the accuracy for the time-to-target columns (default: 90 %% of the best final one)")
    parser.add_argument("--md", metavar="FILE", help="also write the table as markdown")
    parser.add_argument("--csv", metavar="FILE", help="also write the table as CSV (every column, full precision)")
    parser.add_argument("--plot", metavar="FILE", default="compare.png",
                        help="the plot of the runs' accuracy by round, bytes and simulated time (default compare.png)")
    args = parser.parse_args(list(argv))
    try:
        if args.target is not None and not 0 <= args.target <= 1:
            raise CompareError(f"--target must be an accuracy in [0, 1], got {args.target:g}")
        runs = [read_run(folder) for folder in expand(args.runs)]
        rows, shared, target = compare_rows(runs, args.target)
        text = markdown(rows, shared, target)
        print(text, end="")
        if args.md:
            Path(args.md).write_text(text)
        if args.csv:
            write_csv(rows, Path(args.csv))
        plot_accuracy({run["name"]: run["history"] for run in runs}, Path(args.plot),
                      f"{len(runs)} runs compared")
    except (CompareError, OSError) as err:
        print(f"fedjax-sparse: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"plot in {args.plot}" + "".join(f"; table in {p}" for p in (args.md, args.csv) if p),
          file=sys.stderr)
    return 0
