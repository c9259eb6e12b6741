"""A sweep's summary: one row per point, each figure as its mean and standard deviation over the seeds.

The figures are read from each run folder's summary.json (and metrics.jsonl for the plot's curves), so
a table can be rebuilt from the folders alone. A run's accuracy is its global model's test accuracy,
or its clients' personalized accuracy where the algorithm has no global model (as the run's own
summary line reports it). The standard deviation is the population one (divided by the number of
seeds, numpy's default), as the experiment modules' tables report it; with one seed it is 0.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Sequence

# summary.json's figures, named as the table names them: column -> (key with a global model, key without)
FIGURES = {
    "final_accuracy": ("final_test_accuracy", "final_personalized_accuracy"),
    "best_accuracy": ("best_test_accuracy", "best_personalized_accuracy"),
    "bytes": ("cumulative_bytes", "cumulative_bytes"),
    "simulated_seconds": ("simulated_seconds_total", "simulated_seconds_total"),
}


def run_figures(summary: dict) -> dict[str, float | None]:
    """A completed run's figures, by table column (None where the run has none: no clock)."""
    which = 0 if summary.get("has_global_model", True) else 1
    return {column: summary.get(keys[which]) for column, keys in FIGURES.items()}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def point_row(name: str, values: dict[str, Any], summaries: Sequence[dict], runs: int) -> dict:
    """The row of one point: its option values, how many of its `runs` completed, and for each figure
    that every completed run has, its mean and standard deviation over them."""
    row: dict[str, Any] = {"point": name, **values, "seeds": len(summaries), "failed": runs - len(summaries)}
    kinds = {"global" if s.get("has_global_model", True) else "personalized" for s in summaries}
    if kinds:
        row["accuracy_of"] = " and ".join(sorted(kinds))
    per_run = [run_figures(s) for s in summaries]
    for column in FIGURES:
        figures = [f[column] for f in per_run]
        if figures and all(f is not None for f in figures):
            row[f"{column}_mean"], row[f"{column}_std"] = mean_std([float(f) for f in figures])
    return row


def table_cell(value: Any) -> str:
    """A figure as a markdown table shows it: 4 significant digits, '-' for none."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_table(rows: list[dict], out: Path, title: str, command: str) -> None:
    """`out`/sweep.csv (every column, full precision) and `out`/sweep.md (mean ± std per figure)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with (out / "sweep.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    shown = [c for c in columns if not c.endswith(("_mean", "_std"))]
    figures = [c for c in FIGURES if any(f"{c}_mean" in row for row in rows)]
    # one point's global accuracy beside another's personalized one: the accuracy columns say so themselves
    mixed = len({row.get("accuracy_of") for row in rows if row.get("accuracy_of")}) > 1
    header = shown + [f"{c} (mean ± std{'; global or personalized: accuracy_of' if mixed and 'accuracy' in c else ''})"
                      for c in figures]
    lines = [f"# {title}", "", f"Command: `{command}`", "",
             "Mean and population standard deviation over the completed seeds of each point; accuracy is the "
             "global model's test accuracy (personalized accuracy for algorithms without one: accuracy_of).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [table_cell(row.get(c)) for c in shown]
        cells += [f"{row[c + '_mean']:.4g} ± {row[c + '_std']:.2g}" if c + "_mean" in row else "-" for c in figures]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "sweep.md").write_text("\n".join(lines) + "\n")


def _mean_curve(run_dirs: Sequence[Path]) -> tuple[list[int], list[float]]:
    """The rounds every run evaluated and the mean accuracy over the runs there."""
    curves = []
    for run_dir in run_dirs:
        summary = json.loads((run_dir / "summary.json").read_text())
        key = "test_accuracy" if summary.get("has_global_model", True) else "personalized_accuracy"
        history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        curves.append({h["round"]: h[key] for h in history if h.get(key) is not None})
    rounds = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return rounds, [sum(c[r] for c in curves) / len(curves) for r in rounds]


def plot_sweep(rows: list[dict], run_dirs: dict[str, list[Path]], path: Path, title: str) -> None:
    """Final accuracy per point (mean, the bar the standard deviation), and the mean accuracy against
    rounds of each point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [row for row in rows if "final_accuracy_mean" in row]
    fig, (by_point, by_round) = plt.subplots(1, 2, figsize=(14, 4.5))
    x = range(len(shown))
    by_point.errorbar(x, [r["final_accuracy_mean"] for r in shown], yerr=[r["final_accuracy_std"] for r in shown],
                      fmt="o", capsize=4)
    by_point.set_xticks(list(x), [r["point"] for r in shown], rotation=30, ha="right", fontsize=8)
    by_point.set_ylabel("final accuracy (mean ± std over seeds)")
    by_point.set_xlim(-0.5, len(shown) - 0.5)
    for i, row in enumerate(shown):
        rounds, accuracy = _mean_curve(run_dirs.get(row["point"], []))
        by_round.plot(rounds, accuracy, color=f"C{i % 10}", label=row["point"])
    by_round.set_xlabel("round")
    by_round.set_ylabel("accuracy (mean over seeds)")
    if shown:
        by_round.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
