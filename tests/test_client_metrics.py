"""A per-client metric as the user and the algorithm want it reduced over a round's clients (issue 57, item 5):
the statistics by hand, and in a run, in metrics.jsonl and TensorBoard, against the clients' own figures."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import fedavg, registry
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, NoOptions
from fedjax_sparse.run.cli import main
from fedjax_sparse.run.client_metrics import check_stats, client_metrics
from test_tensorboard import read_scalars


def test_the_statistics_by_hand():
    metrics = {"loss": np.ones(5), "num_steps": np.ones(5), "reward": np.array([4.0, 1.0, 9.0, 2.0, 100.0])}
    dispatched = np.array([True, True, True, True, False])  # the fifth slot trained no client
    out = client_metrics(metrics, dispatched, ("mean", "min", "max", "p50", "std"), (("reward", ("p25",)),))
    # over 1, 2, 4, 9: mean 4, median 3, population std sqrt(((-3)^2 + (-2)^2 + 0 + 5^2) / 4) = sqrt(9.5),
    # 25th percentile 1 + 0.75 * (2 - 1) = 1.75 (linear interpolation at position 0.75)
    assert out == pytest.approx({"client_reward": 4.0, "client_reward_min": 1.0, "client_reward_max": 9.0,
                                 "client_reward_p50": 3.0, "client_reward_std": 9.5 ** 0.5,
                                 "client_reward_p25": 1.75})
    assert client_metrics(metrics, np.zeros(5, bool), ("max",)) == {"client_reward": None, "client_reward_max": None}
    for bad in ("median", "p101", "q10"):
        with pytest.raises(ValueError, match=f"'{bad}' is no statistic; valid: mean, min, max, std or pN"):
            check_stats(["mean", bad])


def test_a_run_logs_what_is_asked_for_from_every_client_that_trained(tmp_path, monkeypatch, capsys):
    """Every client trains every round (K = N), each reporting its number of examples: the round's figures are
    then those of partition.json's counts, whatever the sampling."""
    def build(context, options):
        base = fedavg(context.local)

        def client_update(down, state, data, key, info):
            up, state, metrics = base.client_update(down, state, data, key, info)
            return up, state, {**metrics, "examples": data.count.astype(jnp.float32)}

        return dataclasses.replace(base, name="counting", client_update=client_update,
                                   client_metric_stats=(("examples", ("p90",)),))

    monkeypatch.setitem(registry.ALGORITHMS, "counting", AlgorithmSpec("counting", NoOptions, build))
    out = tmp_path / "run"
    assert main(["run", "--algorithm", "counting", "--num-clients", "5", "--clients-per-round", "5", "--rounds", "2",
                 "--local-epochs", "1", "--max-train-examples", "300", "--client-metric-stats", "min,max,p50",
                 "--no-progress", "--out", str(out)]) == 0
    counts = np.array([c["num_examples"] for c in json.loads((out / "partition.json").read_text())], np.float64)
    expected = {"client_examples": counts.mean(), "client_examples_min": counts.min(),
                "client_examples_max": counts.max(), "client_examples_p50": np.median(counts),
                "client_examples_p90": np.percentile(counts, 90)}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tensorboard = read_scalars(out)
    for record in records:
        assert {k: record[k] for k in expected} == pytest.approx(expected)
        for tag, value in expected.items():
            assert (record["round"], pytest.approx(value)) in tensorboard[tag]
    assert main(["run", "--client-metric-stats", "mean,p200", "--out", str(tmp_path / "bad")]) == 2
    assert "--client-metric-stats: 'p200' is no statistic" in capsys.readouterr().err
