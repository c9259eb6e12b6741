"""The tutorial "Write your own algorithm" (docs/write_your_own.md) runs as written, and its FedDyn, FedPer and
MOON at mu = 0 give the metrics of the library's `feddyn`, `fedavg --personal predictor` and `fedavg`."""

import json
import re
from pathlib import Path

import pytest

from fedjax_sparse.algorithms import registry
from fedjax_sparse.run import RunConfig, run_experiment

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "write_your_own.md"
TINY = dict(rounds=2, num_clients=4, clients_per_round=2, local_epochs=1, max_train_examples=200,
            max_test_examples=100, tensorboard=False)


@pytest.fixture
def clean_registry():
    saved = dict(registry.ALGORITHMS)
    yield
    registry.ALGORITHMS.clear()
    registry.ALGORITHMS.update(saved)


def records(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_the_tutorials_code_runs_and_its_algorithms_equal_the_librarys(clean_registry, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), flags=re.S)
    assert len(blocks) == 5
    monkeypatch.chdir(tmp_path)  # the tutorial writes its runs under runs/tutorial, relative to where it runs
    namespace = {}
    for block in blocks:
        exec(compile(block, str(TUTORIAL), "exec"), namespace)
    assert records(tmp_path / "runs" / "tutorial" / "topk")[-1]["uplink_bytes"] < 0.1 * 2 * 85002 * 4
    for mine, library in (({"algorithm": "feddyn_tutorial"}, {"algorithm": "feddyn"}),
                          ({"algorithm": "feddyn_tutorial", "sampler": "poisson", "num_clients": 6},
                           {"algorithm": "feddyn", "sampler": "poisson", "num_clients": 6}),
                          ({"algorithm": "fedper_tutorial"}, {"algorithm": "fedavg", "personal": "predictor"}),
                          ({"algorithm": "moon_tutorial", "moon_mu": 0.0}, {"algorithm": "fedavg"})):
        runs = [tmp_path / f"{name}_{mine['algorithm']}_{len(mine)}" for name in ("mine", "library")]
        for run, values in zip(runs, (mine, library)):
            run_experiment(RunConfig.create(**{**TINY, **values}, out=str(run)), progress=False)
        assert records(runs[0]) == records(runs[1]), mine
    moon = tmp_path / "moon"
    run_experiment(RunConfig.create(**TINY, algorithm="moon_tutorial", moon_mu=1.0, out=str(moon)), progress=False)
    assert records(moon) != records(runs[1]) and all(r["train_loss"] < 10 for r in records(moon))
