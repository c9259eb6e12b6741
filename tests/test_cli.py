"""The command line end to end on digits, and its one-line errors."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.run.checkpoints import RunCheckpointer
from fedjax_sparse.run.cli import main
from fedjax_sparse.run.outputs import device_description
from fedjax_sparse.run import RunConfig, build_experiment
from test_tensorboard import assert_same_scalars, expected_scalars, read_scalars

SMALL = ["--num-clients", "6", "--clients-per-round", "3", "--rounds", "3", "--local-epochs", "1",
         "--no-progress"]


def saved_final_state(out):
    """The experiment of run directory `out` and the states of its last checkpoint."""
    config = RunConfig.from_dict(json.loads((out / "config.json").read_text())).replace(client_store="device")
    exp = build_experiment(config)
    rounds_done, server, _ = RunCheckpointer(out).restore(exp.server_state, exp.store)
    assert rounds_done == config.rounds
    return exp, server, exp.store.states


def hand_scores(model, variables, x, y, mean, std):
    """(number of correct predictions, mean cross-entropy) from one forward pass, counted in NumPy."""
    x = (np.asarray(x, np.float32) / 255 - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    logits = np.asarray(model.apply(variables, jnp.asarray(x), train=False)[0], np.float64)
    top = logits.max(1)
    losses = top + np.log(np.exp(logits - top[:, None]).sum(1)) - logits[np.arange(len(y)), y]
    return int((logits.argmax(1) == np.asarray(y)).sum()), float(losses.mean())


def hand_personalized_accuracy(exp, variables_of_client):
    """Mean over clients of the share of a client's own test examples its model gets right."""
    test = exp.local_test
    accuracies = []
    for i, (a, n) in enumerate(zip(np.asarray(test.offsets), np.asarray(test.counts))):
        correct, _ = hand_scores(exp.model, variables_of_client(i), np.asarray(test.x)[a:a + n],
                                 np.asarray(test.y)[a:a + n], test.mean, test.std)
        accuracies.append(correct / n)
    return float(np.mean(accuracies))


def test_run_writes_config_metrics_summary_partition_and_plot(tmp_path):
    out = tmp_path / "run"
    assert main(["run", *SMALL, "--eval-every", "2", "--checkpoint-every", "3", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_clients"] == 6 and config["algorithm"] == "fedavg"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 3]
    per_round = 3 * 85002 * 4  # K = 3 clients, each sent and sending the MLP's 85,002 float32s
    for r in rows:
        assert r["uplink_bytes"] == r["downlink_bytes"] == per_round
        assert r["cumulative_bytes"] == 2 * r["round"] * per_round
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total_uplink_bytes"] == summary["total_downlink_bytes"] == 3 * per_round
    assert summary["cumulative_bytes"] == 2 * 3 * 3 * 85002 * 4
    assert summary["num_params"] == 85002
    assert summary["device"] == device_description()
    assert summary["status"] == "completed" and summary["rounds"] == 3
    assert summary["final_test_accuracy"] == rows[-1]["test_accuracy"]
    assert summary["best_test_accuracy"] == max(r["test_accuracy"] for r in rows)
    assert summary["final_personalized_accuracy"] == rows[-1]["personalized_accuracy"]
    assert summary["final_train_loss"] == rows[-1]["train_loss"]
    # FedAvg's clients train the dense model: its training FLOPs are the dense count, never a 0 for "not counted".
    assert summary["train_flops_total"] == summary["dense_train_flops_total"] > 0
    assert all(r["train_flops"] == r["dense_train_flops"] > 0 for r in rows)

    # The final figures are those of the saved final model, counted here by hand.
    exp, server, _ = saved_final_state(out)
    data, variables = exp.dataset, exp.algorithm.global_variables(server)
    correct, loss = hand_scores(exp.model, variables, data.x_test, data.y_test, data.mean, data.std)
    assert rows[-1]["test_accuracy"] == pytest.approx(correct / len(data.y_test), abs=1e-6)
    assert rows[-1]["test_loss"] == pytest.approx(loss, rel=1e-4)
    assert rows[-1]["personalized_accuracy"] == pytest.approx(
        hand_personalized_accuracy(exp, lambda i: variables), abs=1e-6)

    clients = json.loads((out / "partition.json").read_text())
    assert len(clients) == 6 and sum(c["num_examples"] for c in clients) == summary["num_train_examples"]
    assert summary["num_train_examples"] == len(data.y_train)
    assert (out / "accuracy.png").stat().st_size > 1000
    # TensorBoard (on by default) reads every figure of every metrics record from the run folder.
    assert_same_scalars(read_scalars(out), expected_scalars(rows))


def test_local_run_has_no_global_accuracy_and_no_bytes(tmp_path):
    out = tmp_path / "local"
    assert main(["run", *SMALL, "--algorithm", "local", "--checkpoint-every", "3", "--no-tensorboard",
                 "--out", str(out)]) == 0
    assert not list(out.glob("events.out.tfevents.*"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["test_accuracy"] is None and r["test_loss"] is None for r in rows)
    assert all(r["uplink_bytes"] == r["downlink_bytes"] == r["cumulative_bytes"] == 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["has_global_model"] is False and summary["final_test_accuracy"] is None
    # Every client is scored with its own model, which no other client shares.
    exp, _, clients = saved_final_state(out)
    own = lambda i: jax.tree_util.tree_map(lambda a: a[i], clients)
    assert rows[-1]["personalized_accuracy"] == pytest.approx(hand_personalized_accuracy(exp, own), abs=1e-6)
    first = np.asarray(jax.tree_util.tree_leaves(own(0))[0])
    assert all(not np.array_equal(first, np.asarray(jax.tree_util.tree_leaves(own(i))[0])) for i in range(1, 6))


@pytest.mark.parametrize("args,fragment", [
    (["--alpha", "0"], "--alpha must be > 0"),
    (["--clients-per-round", "30", "--num-clients", "20"], "--clients-per-round 30 exceeds"),
    (["--partition", "labels", "--labels-per-client", "11"], "--labels-per-client 11 exceeds the 10 classes"),
    (["--dataset", "imagefolder:/no/such/folder"], "/no/such/folder"),
    (["--model", "lenet5_caffe"], "8x8"),
    (["--dataset", "svhn"], "unknown data set spec 'svhn'"),
    (["--dataset", "mnist", "--no-download", "--data-dir", "/no/such/tfds"],
     "'mnist' is not prepared under /no/such/tfds/mnist/3.0.1 (--no-download"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--client-chunk", "-1"], "--client-chunk must be >= 0, got -1"),
    (["--client-chunk", "11"], "--client-chunk must be in [0, 3]"),
    (["--algorithm", "spafl", "--server-optimizer", "adam"], "--server-optimizer is an option of fedavg"),
    # methods that read every client's data on the device, with a store that keeps them off it
    (["--algorithm", "fedgse", "--significant-labels", "2", "--client-store", "host"],
     "--algorithm fedgse draws its public set and its clients' label answers from every client's training data, "
     "which needs every client's data on one device: run it with --client-store device (or auto) in one process"),
    (["--algorithm", "spatl", "--client-store", "disk"], "--algorithm spatl fits predictors for never-sampled "
     "clients on their training data at each evaluation (partial participation), which needs every client's data "
     "on one device: run it with --client-store device (or auto) in one process, or --salient-policy fixed with "
     "--clients-per-round equal to --num-clients"),
    (["--algorithm", "heterofl", "--model", "cnn4", "--client-store", "host"], "--algorithm heterofl recomputes the "
     "global model's BatchNorm statistics over every client's training data (static BN), which needs every "
     "client's data on one device: run it with --client-store device (or auto) in one process, or --no-static-bn"),
])
def test_bad_arguments_get_a_one_line_error(tmp_path, capsys, args, fragment):
    assert main(["run", *SMALL, *args, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err


def test_auto_says_what_it_chose_and_keeps_on_the_device_what_needs_it(tmp_path, monkeypatch, capsys):
    """With 1 kB of host memory available, auto puts FedAvg's clients on disk and says why; FedGSE, which
    reads every client's data on the device, stays on the device (the only store it runs with)."""
    from fedjax_sparse.core.client_state import choice
    monkeypatch.setattr(choice, "available_host_memory", lambda: 1000)
    base = dict(num_clients=6, clients_per_round=3, out=str(tmp_path / "run"))
    assert build_experiment(RunConfig.create(**base), progress=False).store.backend == "disk"
    err = capsys.readouterr().err
    assert err.startswith("fedjax-sparse: --client-store auto chose disk: ") and "of available host memory" in err
    exp = build_experiment(RunConfig.create(**base, algorithm="fedgse", significant_labels=2), progress=False)
    assert exp.store.backend == "device" and capsys.readouterr().err == ""


def test_version_names_the_library_and_what_it_computes_with(capsys):
    import jax

    from fedjax_sparse import __version__

    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"fedjax-sparse {__version__} (jax {jax.__version__}, jaxlib ") and "Python 3." in line


def test_the_progress_bar_says_the_first_round_is_compiling(tmp_path, capsys):
    """Until the first round's figures arrive the bar reads "compiling: N s" with what JAX's cache held (the
    session's cache here); the rounds after show their figures."""
    args = [a for a in SMALL if a != "--no-progress"]
    assert main(["run", *args, "--rounds", "2", "--out", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    compiling = [line for line in lines if "compiling: " in line]
    assert compiling and all(" 0/2 " in line for line in compiling), compiling
    assert re.search(r"compiling: \d+ s \(JAX's cache held \d+ programs; \d+ read from it, \d+ compiled so far\)",
                     compiling[0])
    assert any(" 2/2 " in line and "acc=" in line for line in lines)


def test_help_lists_the_option_groups_and_help_group_shows_one_whole(capsys):
    """`run --help` fits on two screens, a line or two per group; `--help-group privacy` is that group in full;
    every option is in exactly one group and keeps its flag."""
    import argparse

    from fedjax_sparse.algorithms import registered
    from fedjax_sparse.core.contract.options import flag_name, option_fields
    from fedjax_sparse.run import RunConfig
    from fedjax_sparse.run.run_flags import GROUPS, command_parser

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 60
    for name in (*GROUPS, "server-optimizer", "sub-models", "spatl", "spafl", "fedgse"):
        assert re.search(rf"^  {re.escape(name)} +\d+ options?: ", text, re.M), name
    with pytest.raises(SystemExit):
        main(["run", "--help-group", "privacy"])
    privacy = capsys.readouterr().out
    assert privacy.startswith("privacy:") and "--dp-clip" in privacy and "--secure-aggregation" in privacy
    assert "--lr " not in privacy and "--rounds" not in privacy
    with pytest.raises(SystemExit):
        main(["run", "--help-group", "nope"])
    assert "--help-group 'nope' is no group; valid: all, data, federation" in capsys.readouterr().err

    run = next(a for a in command_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith(" run"))
    in_groups = [a.dest for g in run._action_groups for a in g._group_actions
                 if g.title not in ("positional arguments", "options")]
    assert len(in_groups) == len(set(in_groups))  # one group each
    declared = {f.name for cls in (RunConfig, *(s.options for s in registered().values())) for f in option_fields(cls)}
    assert declared <= set(in_groups)
    flags = {s for a in run._actions for s in a.option_strings}
    assert {flag_name(name) for name in declared} <= flags and isinstance(run, argparse.ArgumentParser)
