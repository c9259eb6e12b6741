"""`fedjax-sparse sweep`: run folders per point and seed, a table of means and standard deviations computed
here by hand from the runs' own summaries, the same table after the sweep was killed with SIGKILL and
resumed, one-line refusals, a sweep from a config file, and an Optuna search whose study is stored."""

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from fedjax_sparse.run.cli import main
from fedjax_sparse.run.sweep import _new_plan, _parser

TINY = ["--dataset", "digits", "--rounds", "2", "--num-clients", "4", "--clients-per-round", "2", "--local-epochs",
        "1", "--max-train-examples", "200", "--max-test-examples", "100", "--no-tensorboard"]
GRID = ["--grid", "lr=0.05,0.1", "--seeds", "0,1"]
ROOT = Path(__file__).resolve().parents[1]


def table(out: Path) -> list[dict]:
    with (out / "sweep.csv").open() as f:
        return list(csv.DictReader(f))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def completed(run_dir: Path) -> bool:
    try:
        return summary(run_dir)["status"] == "completed"
    except (OSError, ValueError, KeyError):  # not written yet, or being written
        return False


PRINTED = {}  # what the module's sweep printed


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "grid"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["sweep", *TINY, *GRID, "--parallel", "2", "--out", str(out)]) == 0
    PRINTED["grid"] = printed.getvalue()
    return out


def test_a_sweep_prints_its_table_at_the_end(grid_sweep):
    """As an experiment does: the table of sweep.md, then the line naming where it is."""
    table_text = (grid_sweep / "sweep.md").read_text().split("\n\n", 3)[-1]
    assert table_text.startswith("| point | lr | seeds | failed | accuracy_of |")
    assert PRINTED["grid"].endswith(table_text + f"done: 2 points x 2 seeds; table in {grid_sweep / 'sweep.md'}\n")


def test_a_grid_times_seeds_writes_a_run_folder_per_run_and_their_means_and_stds(grid_sweep):
    rows = {row["point"]: row for row in table(grid_sweep)}
    assert sorted(rows) == ["lr=0.05", "lr=0.1"]
    for lr in ("0.05", "0.1"):
        runs = [grid_sweep / f"lr={lr}" / f"seed_{s}" for s in (0, 1)]
        for seed, run in enumerate(runs):
            config = json.loads((run / "config.json").read_text())
            assert summary(run)["status"] == "completed" and (config["lr"], config["seed"]) == (float(lr), seed)
        row = rows[f"lr={lr}"]
        assert (row["lr"], row["seeds"], row["failed"]) == (lr, "2", "0")
        for column, key in (("final_accuracy", "final_test_accuracy"), ("best_accuracy", "best_test_accuracy"),
                            ("bytes", "cumulative_bytes")):
            a, b = (summary(run)[key] for run in runs)
            # two values: their mean, and their population standard deviation is half their distance
            assert float(row[f"{column}_mean"]) == pytest.approx((a + b) / 2, rel=1e-12)
            assert float(row[f"{column}_std"]) == pytest.approx(abs(a - b) / 2, rel=1e-12, abs=1e-15)
        assert "simulated_seconds_mean" not in row  # no clock: no column
    assert (grid_sweep / "sweep.png").stat().st_size > 0
    assert "| lr=0.1 | 0.1 | 2 | 0 | global |" in (grid_sweep / "sweep.md").read_text()


def test_a_sweep_killed_with_sigkill_and_resumed_writes_the_same_table(grid_sweep, tmp_path, capsys):
    # one point of the grid, two seeds (fewer processes to pay for): killed once the first is done, during the second
    out = tmp_path / "killed"
    first = out / "lr=0.05" / "seed_0"
    sweep = subprocess.Popen([sys.executable, "-m", "fedjax_sparse", "sweep", *TINY, "--grid", "lr=0.05", "--seeds",
                              "0,1", "--out", str(out)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not completed(first):
        assert sweep.poll() is None and time.monotonic() < deadline, "the sweep ended before its first run did"
        time.sleep(0.1)
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.wait()
    assert not (out / "sweep.csv").exists()
    kept = (first / "summary.json").stat().st_mtime_ns
    assert main(["sweep", "--resume", str(out)]) == 0
    assert (first / "summary.json").stat().st_mtime_ns == kept  # the completed run was not run again
    assert table(out) == [row for row in table(grid_sweep) if row["point"] == "lr=0.05"]
    assert "started lr=0.05 seed 0" not in capsys.readouterr().out


@pytest.mark.parametrize("flag, words", [
    ("lr=abc", ["--grid lr=abc", "--lr", "'abc' is not a valid float"]),
    ("lr=0.1,0", ["--grid lr=0.1,0", "--lr"]),
    ("lrr=0.1", ["--grid lrr=0.1", "unknown option 'lrr'", "did you mean 'lr'"]),
    ("seed=1,2", ["--grid seed=1,2", "--seeds"]),
])
def test_a_bad_grid_value_is_one_line_naming_the_flag_and_nothing_is_run(flag, words, tmp_path, capsys):
    assert main(["sweep", *TINY, "--grid", flag, "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedjax-sparse: error: ") and all(w in err for w in words), err
    assert not (tmp_path / "s").exists()


def test_a_sweep_config_file_plans_what_the_same_flags_plan(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("grid:\n  lr: [0.05, 0.1]\n  momentum: [0, 0.5]\nseeds: [0, 1]\nrounds: 2\n")
    from_file = _new_plan(_parser().parse_args(["--config", str(path), "--out", str(tmp_path / "a")]), [], "")
    flags = _parser().parse_args(["--grid", "lr=0.05,0.1", "--grid", "momentum=0,0.5", "--seeds", "0,1",
                                  "--out", str(tmp_path / "b")])
    from_flags = _new_plan(flags, ["--rounds", "2"], "")
    assert from_file.points == from_flags.points == [
        {"lr": 0.05, "momentum": 0.0}, {"lr": 0.05, "momentum": 0.5}, {"lr": 0.1, "momentum": 0.0},
        {"lr": 0.1, "momentum": 0.5}]
    assert from_file.seeds == from_flags.seeds == [0, 1]
    assert json.loads((tmp_path / "a" / "run_options.json").read_text()) == {"rounds": 2}
    assert from_file.run_args == ["--config", str(tmp_path / "a" / "run_options.json")]


def test_an_optuna_search_stores_its_study_and_names_its_best_trial(tmp_path):
    out = tmp_path / "search"
    assert main(["sweep", *TINY, "--rounds", "1", "--search", "lr=log:0.001:0.3", "--trials", "2",
                 "--out", str(out)]) == 0
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{out / 'study.db'}")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for trial in study.trials:
        run = out / f"trial_{trial.number}" / "seed_0"
        assert json.loads((run / "config.json").read_text())["lr"] == trial.params["lr"]
        assert 0.001 <= trial.params["lr"] <= 0.3
        assert trial.value == summary(run)["final_test_accuracy"]  # one seed: the mean is its accuracy
    best = max(study.trials, key=lambda t: t.value)
    saved = json.loads((out / "best.json").read_text())
    assert (saved["trial"], saved["params"], saved["mean_final_accuracy"]) == (best.number, best.params, best.value)
    assert len(table(out)) == 2
