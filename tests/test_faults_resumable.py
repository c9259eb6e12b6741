"""Runs resumable by default, the third fault review (issue 55, item 2): a run saves its state every few minutes
of wall time and at its end without being asked, and --resume of a run killed before its first checkpoint was
complete runs it again from round 1, with the figures of a new run; it used to refuse ("no checkpoint ...
start it again with --overwrite"), and a run on default settings lost everything to a kill -9."""

import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fedjax_sparse.run.checkpoints import RunCheckpointer
from fedjax_sparse.run.cli import main
from fedjax_sparse.run.config import RunConfig
from fedjax_sparse.run.folder import RunManifest
from test_faults import ROOT, TINY, cli, fresh_fault_counts, records, summary  # noqa: F401 - a fixture

ROUNDS = 4


def saved_rounds(monkeypatch):
    """The rounds each checkpoint saved in this process covers, as they are saved."""
    saved, real = [], RunCheckpointer.save
    monkeypatch.setattr(RunCheckpointer, "save", lambda self, rounds_done, *args: (
        saved.append(rounds_done), real(self, rounds_done, *args))[1])
    return saved


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run on default settings killed (kill -9, through the fault hook) at the end of its round 2, and the same
    run uninterrupted, with the rounds it saved."""
    root = tmp_path_factory.mktemp("killed")
    run, fresh = root / "killed", root / "fresh"
    kill = {"JAX_PLATFORMS": "cpu", "FEDJAX_SPARSE_FAULT": "round_end:2:kill"}
    done = subprocess.run([sys.executable, "-m", "fedjax_sparse", "run", *TINY, "--rounds", str(ROUNDS), "--out",
                           str(run)], env={**os.environ, **kill}, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    with pytest.MonkeyPatch.context() as patch:
        saved = saved_rounds(patch)
        assert main(["run", *TINY, "--rounds", str(ROUNDS), "--out", str(fresh)]) == 0
    return SimpleNamespace(run=run, fresh=fresh, fresh_saved=saved)


def test_55_2_a_default_run_killed_after_round_2_resumes_with_a_new_runs_figures(killed, tmp_path, capsys):
    """The review: `run --rounds 4`, kill -9 after round 2, `--resume`: "no checkpoint ... start it again with
    --overwrite"."""
    run = shutil.copytree(killed.run, tmp_path / "run")
    assert [r["round"] for r in records(run)] == [1, 2] and not (run / "checkpoints").exists()
    code, err = cli(capsys, "--resume", str(run), "--no-progress")
    assert code == 0, err
    assert (f"--resume {run}: no checkpoint there yet (the run stopped before its first); running it from round 1 "
            f"again") in err
    assert records(run) == records(killed.fresh) and summary(run)["status"] == "completed"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(ROUNDS)]


def test_55_2_a_run_killed_inside_its_first_checkpoint_resumes_from_round_1(killed, tmp_path, capsys):
    """The review's kills with --checkpoint-every 1: 5 of 28 landed before the first checkpoint was complete,
    and --resume refused. What such a kill leaves beside the rounds: the checkpoints folder recorded, the save's
    mark and orbax's unfinished folder."""
    run = shutil.copytree(killed.run, tmp_path / "run")
    RunManifest(run).record("checkpoints")
    (run / "checkpoints" / "1.orbax-checkpoint-tmp-1764300000" / "state").mkdir(parents=True)
    (run / "checkpoints" / ".saving-1").touch()
    code, err = cli(capsys, "--resume", str(run), "--checkpoint-every", "1", "--no-progress")
    assert code == 0, err
    assert "no checkpoint there yet" in err and records(run) == records(killed.fresh)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["3", "4"]  # the unfinished one gone


def test_55_2_checkpoints_come_every_few_minutes_and_at_the_end_without_being_asked(killed, tmp_path, monkeypatch):
    """By default a run saves every 5 minutes (once they passed, at the end of the next round) and at its end;
    --checkpoint-minutes sets the interval, 0 turns it off."""
    assert RunConfig().checkpoint_minutes == 5 and killed.fresh_saved == [ROUNDS]  # a run of seconds: the end's
    saved = saved_rounds(monkeypatch)
    assert main(["run", *TINY, "--rounds", "3", "--checkpoint-minutes", "1e-4", "--out", str(tmp_path / "a")]) == 0
    assert saved == [2, 3]  # 6 ms passed in round 1: saved after round 2; in round 2: after round 3 (the end)
    saved.clear()
    assert main(["run", *TINY, "--rounds", "2", "--checkpoint-minutes", "0", "--out", str(tmp_path / "b")]) == 0
    assert saved == [] and not (tmp_path / "b" / "checkpoints").exists()
