"""Exact resume: an interrupted and resumed run writes the metrics of the uninterrupted run."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fedjax_sparse.run.checkpoints import CheckpointError, RunCheckpointer
from fedjax_sparse.run.cli import main
from test_tensorboard import assert_same_scalars, expected_scalars, read_scalars

BASE = ["--num-clients", "8", "--clients-per-round", "4", "--local-epochs", "1", "--no-progress"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_extends_to_the_uninterrupted_metrics(tmp_path):
    """SCAFFOLD keeps server and per-client state, and FedAdam's server optimizer its m and v: a resume
    that lost or re-initialized any of them would not reproduce rounds 4 to 6."""
    for algorithm in ("scaffold",):
        full, part = tmp_path / f"{algorithm}_full", tmp_path / f"{algorithm}_part"
        args = [*BASE, "--algorithm", algorithm, "--server-optimizer", "adam", "--server-lr", "0.01"]
        assert main(["run", *args, "--rounds", "6", "--out", str(full)]) == 0
        assert main(["run", *args, "--rounds", "3", "--checkpoint-every", "2", "--out", str(part)]) == 0
        saved = json.loads((part / "config.json").read_text())
        assert saved["rounds"] == 3 and saved["server_optimizer"] == "adam"
        assert main(["run", "--resume", str(part), "--rounds", "6", "--no-progress"]) == 0
        assert metrics(part) == metrics(full)
        assert_same_scalars(read_scalars(part), expected_scalars(metrics(full)))  # each round once
        summary = json.loads((part / "summary.json").read_text())
        assert summary["cumulative_bytes"] == json.loads((full / "summary.json").read_text())["cumulative_bytes"]


def test_checkpoint_of_another_configuration_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", *BASE, "--rounds", "2", "--checkpoint-every", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(run), "--lr", "0.2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "lr: checkpoint has 0.1, this run has 0.2" in err and len(err.strip().splitlines()) == 1
    assert main(["run", "--resume", str(tmp_path / "nothing"), "--no-progress"]) == 2
    # which device trains which client changes no figure of the run: a resume may change it
    assert main(["run", "--resume", str(run), "--rounds", "3", "--device-split", "id", "--no-progress"]) == 0


def test_lr_decay_is_exact_on_resume_and_really_applied(tmp_path):
    """4 rounds at lr 0.1 x 0.9^r: stopped after 2 (checkpointed) and resumed, the metrics are those of
    the uninterrupted run. The first round (0.9^0) equals a run without decay and the second does
    not, so the decay is really applied, from round index 0."""
    full, part, plain = tmp_path / "full", tmp_path / "part", tmp_path / "plain"
    args = [*BASE, "--algorithm", "fedavg"]
    assert main(["run", *args, "--lr-decay", "0.9", "--rounds", "4", "--out", str(full)]) == 0
    assert main(["run", *args, "--lr-decay", "0.9", "--rounds", "2", "--checkpoint-every", "2",
                 "--out", str(part)]) == 0
    assert len(metrics(part)) == 2
    assert main(["run", "--resume", str(part), "--rounds", "4", "--no-progress"]) == 0
    assert json.loads((part / "config.json").read_text())["lr_decay"] == 0.9
    assert metrics(part) == metrics(full)
    assert main(["run", *args, "--rounds", "2", "--out", str(plain)]) == 0
    decayed, undecayed = metrics(full), metrics(plain)
    assert decayed[0] == undecayed[0]
    assert decayed[1]["train_loss"] != undecayed[1]["train_loss"]
    assert decayed[1]["test_loss"] != undecayed[1]["test_loss"]


def test_a_config_saved_before_options_moved_beside_their_algorithms_still_loads():
    """The flat config.json of the earlier layout held every algorithm's flags; loading keeps the run's
    own algorithm's options, drops the others', fills options added since with their defaults, and
    resuming against it reports no mismatch."""
    from fedjax_sparse.run.checkpoints import config_mismatches
    from fedjax_sparse.run import RunConfig
    old = {"algorithm": "fedldf", "dataset": "digits", "model": "mlp", "num_clients": 20, "clients_per_round": 10,
           "rounds": 30, "local_epochs": 5, "batch_size": 16, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0,
           "partition": "dirichlet", "alpha": 0.5, "labels_per_client": None, "min_examples": 2,
           "local_test_ratio": 0.2, "seed": 0, "eval_every": 1, "mu": 0.01, "server_lr": 1.0, "sparsity_coef": 0.002,
           "weight_bounds": True, "threshold_update": True, "clients_per_layer": 3, "shard_clients": False,
           "client_chunk": None, "max_train_examples": None, "max_test_examples": None, "checkpoint_every": 5,
           "out": "runs/old"}
    config = RunConfig.from_dict(old)
    assert config.algorithm_options.clients_per_layer == 3
    flat = config.to_dict()
    assert "mu" not in flat and "sparsity_coef" not in flat and flat["lr_decay"] == 1.0
    assert config_mismatches(RunConfig.from_dict(old).to_dict(), RunConfig.create(**{
        k: v for k, v in old.items() if k not in ("mu", "server_lr", "sparsity_coef", "weight_bounds",
                                                 "threshold_update")}).to_dict()) == []


def test_a_checkpoint_saved_before_the_client_stores_restores_on_the_device(tmp_path):
    """Runs before the client stores kept the client states beside the server's in the state item: the
    device store takes them; another store is refused in one line saying what would work."""
    from conftest import linear_model
    from fedjax_sparse.algorithms import scaffold
    from fedjax_sparse.core.client_state.choice import make_store
    from fedjax_sparse.core.round.local_training import LocalSGD

    model = linear_model()
    alg, key, variables = scaffold(LocalSGD(model, 0.1, 1, 2), 3), jax.random.key(0), model.init(jax.random.key(1))
    store = make_store("device", alg, key, variables, 3)
    server = {"w": np.arange(3.0)}
    clients = jax.tree_util.tree_map(lambda a: np.random.default_rng(0).normal(size=a.shape).astype(a.dtype),
                                     store.states)
    meta = {"config": {}, "counters": {"rounds_done": 2}}
    with ocp.CheckpointManager((tmp_path / "checkpoints").resolve()) as manager:  # the layout of those runs
        manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave({"server_state": server,
                                                                             "client_states": clients}),
                                                meta=ocp.args.JsonSave(meta)))
    rounds, restored, saved_meta = RunCheckpointer(tmp_path).restore(server, store)
    assert rounds == 2 and saved_meta == meta
    np.testing.assert_array_equal(restored["w"], server["w"])
    jax.tree_util.tree_map(np.testing.assert_array_equal, store.states, clients)
    with pytest.raises(CheckpointError, match="keeps the client states the way runs before the client stores did; "
                                              "resume it with --client-store device"):
        RunCheckpointer(tmp_path).restore(server, make_store("host", alg, key, variables, 3))
