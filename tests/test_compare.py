"""`fedjax-sparse compare`: runs side by side from their folders (issue 57, item 1).

Three run folders written by hand (config.json, metrics.jsonl, summary.json as a run writes them), so that every
figure of the table is known in advance, and one real run, so that the folders a run leaves are what compare
reads."""

from __future__ import annotations

import csv
import json

import pytest

from fedjax_sparse.run import RunConfig
from fedjax_sparse.run.cli import main
from fedjax_sparse.run.compare import compare_rows, expand, read_run


def write_run(folder, config: dict, history: list[dict], summary: dict | None):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(RunConfig.create(**config).to_dict()))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))


def record(r, test, personal, up, down, seconds=None):
    out = {"round": r, "test_accuracy": test, "personalized_accuracy": personal, "cumulative_bytes": r * (up + down),
           "cumulative_uplink_bytes": r * up}
    if seconds is not None:
        out["cumulative_simulated_seconds"] = r * seconds
    return out


@pytest.fixture
def three(tmp_path):
    """FedAvg at lr 0.1 and 0.2 (a global model, a clock of 10 s a round) and SpaFL at lr 0.1 (none), 3 rounds
    each; SpaFL's run was killed after round 2 (no summary)."""
    clock = {"device_profile": "phone"}
    write_run(tmp_path / "fedavg_a", {"algorithm": "fedavg", "lr": 0.1, "rounds": 3, **clock},
              [record(1, 0.50, 0.45, 100, 200, 10.0), record(2, 0.80, 0.70, 100, 200, 10.0),
               record(3, 0.75, 0.72, 100, 200, 10.0)],
              {"status": "completed", "has_global_model": True, "total_uplink_bytes": 300,
               "total_downlink_bytes": 600, "wall_seconds": 12.5})
    write_run(tmp_path / "fedavg_b", {"algorithm": "fedavg", "lr": 0.2, "rounds": 3, **clock},
              [record(1, 0.60, 0.50, 100, 200, 10.0), record(2, 0.70, 0.66, 100, 200, 10.0),
               record(3, 0.90, 0.85, 100, 200, 10.0)],
              {"status": "completed", "has_global_model": True, "total_uplink_bytes": 300,
               "total_downlink_bytes": 600, "wall_seconds": 11.0})
    write_run(tmp_path / "spafl", {"algorithm": "spafl", "lr": 0.1, "rounds": 3, **clock},
              [record(1, None, 0.70, 5, 5, 2.0), record(2, None, 0.88, 5, 5, 2.0)], None)
    return tmp_path


def test_the_table_of_three_runs_is_what_their_files_say(three):
    rows, shared, target = compare_rows([read_run(p) for p in expand([str(three / "*")])])
    # target: 90 % of the best final headline accuracy: FedAvg b's 0.90 (SpaFL's headline is personalized: 0.88)
    assert target == pytest.approx(0.81)
    assert shared == {"dataset": "digits", "model": "mlp", "num_clients": 20, "clients_per_round": 10, "rounds": 3,
                      "local_epochs": 5, "batch_size": 16, "partition": None, "alpha": 0.5, "seed": 0}
    a, b, spafl = rows
    assert [r["run"] for r in rows] == ["fedavg_a", "fedavg_b", "spafl"]
    assert [r["lr"] for r in rows] == [0.1, 0.2, 0.1] and "device_profile" not in a  # only what differs
    assert (a["final_test_accuracy"], a["best_test_accuracy"]) == (0.75, 0.80)
    assert (a["final_personalized_accuracy"], a["best_personalized_accuracy"]) == (0.72, 0.72)
    assert (a["uplink_bytes"], a["downlink_bytes"], a["simulated_seconds"]) == (300, 600, 30.0)
    assert a["rounds_to_target"] is None and a["simulated_seconds_to_target"] is None  # 0.80 < 0.81
    assert (b["rounds_to_target"], b["simulated_seconds_to_target"]) == (3, 30.0)
    assert (spafl["accuracy_of"], spafl["final_test_accuracy"], spafl["final_personalized_accuracy"]) == (
        "personalized", None, 0.88)
    assert (spafl["rounds_to_target"], spafl["simulated_seconds_to_target"]) == (2, 4.0)  # 0.88 at round 2
    assert (spafl["uplink_bytes"], spafl["downlink_bytes"]) == (10, 10)  # from its metrics: no summary
    assert (spafl["status"], spafl["rounds_done"], spafl["wall_seconds"]) == ("running or killed", 2, None)
    rows, _, target = compare_rows([read_run(p) for p in expand([str(three / "*")])], target=0.7)
    assert [r["rounds_to_target"] for r in rows] == [2, 2, 1]


def test_the_command_prints_the_table_and_writes_csv_md_and_the_plot(three, capsys, tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    assert main(["compare", str(three / "fedavg_a"), str(three / "fedavg_b"), str(three / "spafl"), "--csv",
                 str(out / "t.csv"), "--md", str(out / "t.md"), "--plot", str(out / "p.png")]) == 0
    printed = capsys.readouterr().out
    assert printed == (out / "t.md").read_text()
    assert "| fedavg_b | fedavg | 0.2 | global | 0.9 | 0.9 | 0.85 | 0.85 | 300 | 600 | 30 | 3 | 30 |" in printed
    # a global accuracy beside a personalized one: the header says so
    assert "rounds_to_target (global or personalized: accuracy_of)" in printed
    with open(out / "t.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == ["fedavg_a", "fedavg_b", "spafl"] and table[2]["final_test_accuracy"] == ""
    assert (out / "p.png").stat().st_size > 10_000


def test_a_real_run_folder_compares_with_itself_and_bad_input_is_one_line(tmp_path, capsys):
    args = ["--num-clients", "4", "--clients-per-round", "2", "--local-epochs", "1", "--max-train-examples", "100",
            "--max-test-examples", "50", "--no-progress", "--no-tensorboard"]
    for lr in ("0.05", "0.1"):
        assert main(["run", *args, "--rounds", "2", "--lr", lr, "--out", str(tmp_path / f"lr{lr}")]) == 0
    capsys.readouterr()
    runs = [read_run(p) for p in expand([str(tmp_path / "lr*")])]
    rows, _, _ = compare_rows(runs)
    summary = json.loads((tmp_path / "lr0.1" / "summary.json").read_text())
    assert rows[1]["final_test_accuracy"] == summary["final_test_accuracy"]
    assert rows[1]["uplink_bytes"] == summary["total_uplink_bytes"] and rows[1]["status"] == "completed"
    assert [r["lr"] for r in rows] == [0.05, 0.1]
    for bad, words in (([str(tmp_path / "nothing*")], "no folder matches"),
                       ([str(tmp_path)], "is no run folder (it needs config.json and metrics.jsonl)"),
                       ([str(tmp_path / "lr0.1"), "--target", "1.5"], "--target must be an accuracy in [0, 1]")):
        assert main(["compare", *bad, "--plot", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
