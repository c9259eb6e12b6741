"""A round's per-client metrics as the user (or the algorithm) wants them reduced over the clients that trained.

An algorithm's `client_update` reports scalar metrics per client (an agent's reward, a sub-model's capacity, a
mask's density); a round logs each, over its dispatched clients, as `client_<name>` (the mean) and, for every
other statistic asked for, `client_<name>_<stat>`: `min`, `max`, `std` (population) and percentiles `pN`
(0 <= N <= 100, numpy's linear interpolation), as Flower's `fit_metrics_aggregation_fn` lets its users choose.
The run's `--client-metric-stats` applies to every metric; an algorithm may ask for more for its own metrics
(`FederatedAlgorithm.client_metric_stats`). metrics.jsonl, TensorBoard and the trackers log them alike.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np

NAMED = ("mean", "min", "max", "std")
_PERCENTILE = re.compile(r"p(\d+(\.\d+)?)$")
SKIPPED = ("loss", "num_steps")  # the round's train_loss and its steps report these


def check_stats(stats: Sequence[str], flag: str = "--client-metric-stats") -> None:
    """One line naming the first statistic that is none of NAMED or pN with 0 <= N <= 100."""
    for stat in stats:
        percentile = _PERCENTILE.match(stat)
        if stat not in NAMED and not (percentile and float(percentile.group(1)) <= 100):
            raise ValueError(f"{flag}: {stat!r} is no statistic; valid: {', '.join(NAMED)} or pN with 0 <= N <= 100 "
                             f"(p10, p50, p90)")


def statistic(values: np.ndarray, stat: str) -> float:
    if stat == "mean":
        return float(values.mean())
    if stat in ("min", "max", "std"):
        return float(getattr(values, stat)())
    return float(np.percentile(values, float(stat[1:])))


def client_metrics(metrics: Mapping[str, np.ndarray], dispatched: np.ndarray, stats: Sequence[str] = ("mean",),
                   per_metric: Sequence[tuple[str, Sequence[str]]] = ()) -> dict:
    """{`client_<name>`: mean, `client_<name>_<stat>`: ...} of each per-client metric over the `dispatched`
    clients (None where none was); the mean always, under its old name. `per_metric`: ((metric, statistics), ...)
    an algorithm asks for besides `stats`."""
    out, per_metric = {}, dict(per_metric)
    for name, value in metrics.items():
        if name in SKIPPED:
            continue
        values = np.asarray(value, np.float64)[np.asarray(dispatched, bool)]
        wanted = dict.fromkeys(["mean", *stats, *per_metric.get(name, ())])
        for stat in wanted:
            key = f"client_{name}" if stat == "mean" else f"client_{name}_{stat}"
            out[key] = statistic(values, stat) if values.size else None
    return out
