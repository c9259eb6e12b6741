"""Algorithms from outside the library are first-class: registered by a script or declared by an installed
package (entry points; run beside plug-ins that fail in tests/test_faults_plugins.py), they run through the
command line with their own options (never dropped), checkpoint and resume exactly, have their contract
checked before the first round, and the Python entry point gives the command line's metrics."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import pytest

from fedjax_sparse.algorithms import registry
from fedjax_sparse.building_blocks import (AlgorithmSpec, FederatedAlgorithm, error_feedback, option, replicate, top_k,
                                           decompressed, weighted_mean)
from fedjax_sparse.run import RunConfig, run_experiment
from fedjax_sparse.run.cli import main

TINY = ["--num-clients", "4", "--clients-per-round", "2", "--local-epochs", "1", "--max-train-examples", "200",
        "--max-test-examples", "100", "--no-progress", "--no-tensorboard"]
tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class TopKOptions:
    topk_ratio: float = option(0.01, "top-k FedAvg: the share of the model's change each client sends", low=0.0,
                               low_open=True, high=1.0)


def topk_fedavg(context, options: TopKOptions) -> FederatedAlgorithm:
    """FedAvg whose clients send the top-k of their change with error feedback (a residual per client)."""
    local = context.local

    def init_clients(key, variables, ids):
        return replicate({"residual": tree_map(jnp.zeros_like, variables["params"])}, len(ids))

    def init(key, variables, n):
        return {"variables": variables}, init_clients(key, variables, jnp.arange(n))

    def client_update(down, state, data, key, info):
        trained, stats = local.train(down, data, key, round_index=info.index)
        change = tree_map(jnp.subtract, trained["params"], down["params"])
        sent, residual = error_feedback(change, state["residual"], lambda t: top_k(t, options.topk_ratio))
        return {"change": sent, "batch_stats": trained["batch_stats"]}, {"residual": residual}, stats

    def server_update(server_state, ups, weights, info):
        mean = weighted_mean(decompressed(ups["change"]), weights)
        params = tree_map(jnp.add, server_state["variables"]["params"], mean)
        return {"variables": {"params": params, "batch_stats": weighted_mean(ups["batch_stats"], weights)}}

    return FederatedAlgorithm(name="topk_fedavg", init=init, init_clients=init_clients,
                              broadcast=lambda s, client_id, info: s["variables"], client_update=client_update,
                              server_update=server_update, client_variables=lambda s, c: s["variables"],
                              global_variables=lambda s: s["variables"])


SPEC = AlgorithmSpec("topk_fedavg", TopKOptions, topk_fedavg, "FedAvg sending the top-k of each change, with "
                                                                     "error feedback")


@pytest.fixture
def clean_registry():
    """The registry as the library leaves it, after each test."""
    saved = (dict(registry.ALGORITHMS), dict(registry.REFUSED))
    yield
    for live, before in zip((registry.ALGORITHMS, registry.REFUSED), saved):
        live.clear()
        live.update(before)


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_registered_algorithm_runs_from_the_cli_with_its_option_and_resumes_exactly(clean_registry, tmp_path,
                                                                                        capsys):
    registry.register(SPEC)
    with pytest.raises(SystemExit):  # its options are a group of the run's flags, listed and shown
        main(["run", "--help"])
    assert re.search(r"^  topk +1 option : options of topk_fedavg$", capsys.readouterr().out, re.M)
    with pytest.raises(SystemExit):
        main(["run", "--help-group", "topk"])
    assert ("top-k FedAvg: the share of the model's change each client sends [topk_fedavg]"
            in " ".join(capsys.readouterr().out.split()))
    args = [*TINY, "--algorithm", "topk_fedavg", "--topk-ratio", "0.02"]
    assert main(["run", *args, "--rounds", "3", "--out", str(tmp_path / "whole")]) == 0
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["topk_ratio"] == 0.02  # never dropped
    assert main(["run", *args, "--rounds", "2", "--checkpoint-every", "1", "--out", str(tmp_path / "parts")]) == 0
    assert main(["run", "--resume", str(tmp_path / "parts"), "--rounds", "3", "--no-progress"]) == 0
    assert records(tmp_path / "whole") == records(tmp_path / "parts")
    sent = records(tmp_path / "whole")[0]["uplink_bytes"]
    assert sent < 0.05 * 2 * 85002 * 4  # 2 % of the values, their indexes and the (empty) statistics
    assert main(["run", *TINY, "--algorithm", "fedavg", "--topk-ratio", "0.1", "--out", str(tmp_path / "x")]) == 2
    assert "--topk-ratio is an option of topk_fedavg; --algorithm fedavg does not read it" in capsys.readouterr().err
    registry.ALGORITHMS.pop("topk_fedavg")  # a run whose algorithm this process does not know
    assert main(["run", "--resume", str(tmp_path / "parts"), "--rounds", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the run's algorithm 'topk_fedavg' is not registered here" in err


def test_the_python_entry_point_gives_the_clis_metrics(clean_registry, tmp_path):
    registry.register(SPEC)
    assert main(["run", *TINY, "--algorithm", "topk_fedavg", "--rounds", "2", "--out", str(tmp_path / "cli")]) == 0
    config = RunConfig.create(algorithm="topk_fedavg", num_clients=4, clients_per_round=2, local_epochs=1,
                              max_train_examples=200, max_test_examples=100, tensorboard=False, rounds=2,
                              out=str(tmp_path / "py"))
    run_experiment(config, progress=False)
    assert records(tmp_path / "cli") == records(tmp_path / "py")


def test_registering_refuses_clashes_and_the_contract_is_checked_before_the_first_round(clean_registry, tmp_path,
                                                                                          capsys):
    registry.register(SPEC)
    registry.register(SPEC)  # the same spec again: nothing happens
    with pytest.raises(ValueError, match=r"algorithm 'topk_fedavg' \(module test_registry\) is registered already"):
        registry.register(dataclasses.replace(SPEC, summary="another"))

    @dataclasses.dataclass(frozen=True)
    class Clash:
        mu: float = option(0.5, "not FedProx's mu")

    with pytest.raises(TypeError, match=re.escape("option 'mu' is declared differently by clash (module "
                                                  "test_registry) and fedprox (fedjax-sparse (built in))")):
        registry.register(AlgorithmSpec("clash", Clash, topk_fedavg))

    def broken(context, options):  # its clients' states grow a leaf after init
        base = topk_fedavg(context, TopKOptions())

        def client_update(down, state, data, key, info):
            up, state, metrics = base.client_update(down, state, data, key, info)
            return up, {**state, "seen": jnp.zeros(())}, metrics

        return dataclasses.replace(base, name="broken", client_update=client_update)

    registry.register(AlgorithmSpec("broken", registry.ALGORITHMS["fedavg"].options, broken))
    assert main(["run", *TINY, "--algorithm", "broken", "--rounds", "1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(r"broken: client_update \(tests/test_registry.py:\d+\) returns a "
                                              r"client state with a leaf seen", err), err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
