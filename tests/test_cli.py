"""The command line end to end on digits, and its one-line errors."""

import json
import subprocess
import sys

import pytest

from fedjax_sparse.cli import main

SMALL = ["--num-clients", "6", "--clients-per-round", "3", "--rounds", "3", "--local-epochs", "1",
         "--no-progress"]


def test_run_writes_config_metrics_summary_partition_and_plot(tmp_path):
    out = tmp_path / "run"
    assert main(["run", *SMALL, "--eval-every", "2", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_clients"] == 6 and config["algorithm"] == "fedavg"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 3]
    for key in ("test_accuracy", "personalized_accuracy", "train_loss", "uplink_bytes", "downlink_bytes",
                "cumulative_bytes"):
        assert all(key in r for r in rows), key
    per_round = 3 * 85002 * 4
    assert rows[-1]["uplink_bytes"] == rows[-1]["downlink_bytes"] == per_round
    assert rows[-1]["cumulative_bytes"] == 3 * 2 * per_round
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_params"] == 85002
    assert summary["final_test_accuracy"] == rows[-1]["test_accuracy"]
    assert "cpu" in summary["device"].lower() or summary["device"]
    clients = json.loads((out / "partition.json").read_text())
    assert len(clients) == 6 and sum(c["num_examples"] for c in clients) == summary["num_train_examples"]
    assert (out / "accuracy.png").stat().st_size > 1000


def test_local_run_has_no_global_accuracy_and_no_bytes(tmp_path):
    out = tmp_path / "local"
    assert main(["run", *SMALL, "--algorithm", "local", "--out", str(out)]) == 0
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["test_accuracy"] is None and last["cumulative_bytes"] == 0
    assert 0.0 <= last["personalized_accuracy"] <= 1.0


@pytest.mark.parametrize("args,fragment", [
    (["--alpha", "0"], "--alpha must be > 0"),
    (["--clients-per-round", "30", "--num-clients", "20"], "--clients-per-round 30 exceeds"),
    (["--partition", "labels", "--labels-per-client", "11"], "--labels-per-client 11 exceeds the 10 classes"),
    (["--dataset", "imagefolder:/no/such/folder"], "/no/such/folder"),
    (["--model", "lenet5_caffe"], "8x8"),
    (["--dataset", "mnist"], "mnist"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--client-chunk", "-1"], "--client-chunk must be >= 0, got -1"),
    (["--client-chunk", "11"], "--client-chunk must be in [0, 3]"),
])
def test_bad_arguments_get_a_one_line_error(tmp_path, capsys, args, fragment):
    assert main(["run", *SMALL, *args, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err


def test_console_entry_point_runs_as_a_module(tmp_path):
    out = tmp_path / "module"
    proc = subprocess.run([sys.executable, "-m", "fedjax_sparse", "run", *SMALL, "--rounds", "1",
                           "--algorithm", "scaffold", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: test accuracy" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["total_uplink_bytes"] == 3 * 2 * 85002 * 4
