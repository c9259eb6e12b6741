"""The run folder under the second fault review (issue 36, items 1, 5 and 12): --overwrite deletes only what
the library wrote; every writer of the folder (metrics, summary, plot, partition, TensorBoard events, the
manifest, the disk store's rows) fails in one line naming its file, with a failed summary; no library's
warning comes before that line. And under the third (issue 55, items 3 and 6): folders recorded when first
written, the lock's pid file the library's own, the statuses documented.
"""

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_sparse.core.client_state.row_store import DiskStore
from fedjax_sparse.run.cli import main
from fedjax_sparse.run.folder import LOCK_FILE
from fedjax_sparse.run.failures import STATUSES
from fedjax_sparse.run.outputs import RunWriter
from test_faults import ROOT, TINY, cli, fresh_fault_counts, one_line, summary  # noqa: F401 - a fixture

TENSORBOARD = [a for a in TINY if a != "--no-tensorboard"]  # on, as by default
MANIFEST = "fedjax_sparse_files.json"  # what the library wrote in a run folder (`run.folder.RunManifest`)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-round run with TensorBoard on and a checkpoint (to copy)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["run", *TENSORBOARD, "--rounds", "2", "--checkpoint-every", "2", "--out", str(run)]) == 0
    return run


def users_folder(path):
    """What the review's user had in a folder of theirs: names a run also writes."""
    (path / "checkpoints").mkdir(parents=True)
    (path / "checkpoints" / "model.pt").write_text("w\n")
    (path / "config.json").write_text('{"app":1}\n')
    return contents(path)


def contents(path):
    return {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------------ item 1

def test_36_1_overwrite_deletes_only_what_the_library_wrote(finished, tmp_path, capsys):
    """The review: `--overwrite` into a folder holding the user's checkpoints/ and config.json exited 0
    having deleted them; the refusal called them "another run's files" and --resume advised --overwrite."""
    user = tmp_path / "u"
    before = users_folder(user)
    for flags in (["--overwrite"], []):
        code, err = cli(capsys, *TINY, "--rounds", "1", "--out", str(user), *flags)
        assert code == 2
        one_line(err, f"--out {user} holds config.json, checkpoints, which fedjax-sparse has no record of writing "
                      f"(there is no {user / MANIFEST})", f"move them out of {user}, or choose another --out")
        assert "another run" not in err and "pass --overwrite" not in err and "--resume" not in err
        assert contents(user) == before
    code, err = cli(capsys, "--resume", str(user), "--no-progress")
    assert code == 2
    one_line(err, f"{user / 'config.json'} cannot be used", "fedjax-sparse has no record of writing config.json, "
             "checkpoints", "give the folder of a run")
    assert "--overwrite" not in err and contents(user) == before

    # a run's folder: what the run recorded goes, a file the user added (even of a run file's name) stays or
    # is refused by name
    run = shutil.copytree(finished, tmp_path / "run")
    (run / "notes.txt").write_text("mine\n")
    (run / "events.out.tfevents.mine").write_text("mine\n")
    code, err = cli(capsys, *TENSORBOARD, "--rounds", "1", "--out", str(run), "--overwrite")
    assert code == 2
    one_line(err, f"holds events.out.tfevents.mine, which fedjax-sparse has no record of writing ({run / MANIFEST} "
                  f"does not list them)")
    (run / "events.out.tfevents.mine").unlink()
    code, err = cli(capsys, *TENSORBOARD, "--rounds", "1", "--out", str(run))
    assert code == 2
    one_line(err, f"--out {run} holds the files of an earlier run (config.json, metrics.jsonl, partition.json, "
                  f"summary.json, accuracy.png, checkpoints, events.out.tfevents.", "pass --overwrite")
    old_events = sorted(p.name for p in run.glob("events.out.tfevents.*"))
    assert main(["run", *TENSORBOARD, "--rounds", "1", "--out", str(run), "--overwrite"]) == 0
    assert (run / "notes.txt").read_text() == "mine\n" and [p.name for p in (run / "checkpoints").iterdir()] == ["1"]
    assert not set(old_events) & {p.name for p in run.glob("events.out.tfevents.*")}
    assert set(json.loads((run / MANIFEST).read_text())["files"]) >= {p.name for p in run.iterdir()} - {
        MANIFEST, "notes.txt"}


# ------------------------------------------------------------------------------------------ item 5

def test_36_5_a_file_size_limit_with_tensorboard_on_ends_in_one_line_and_a_failed_summary(tmp_path):
    """The review: TensorBoard on (the default) under `ulimit -f 16` gave 29 lines, two tensorboardX tracebacks
    (its background thread, its exit hook), no file named and no summary.json. A real limit needs a real process."""
    run = tmp_path / "run"
    command = shlex.join([sys.executable, "-m", "fedjax_sparse", "run", *TENSORBOARD, "--rounds", "20", "--out",
                          str(run), "--no-compilation-cache"])  # a cache entry cut short would outlive the test
    done = subprocess.run(["bash", "-c", f"ulimit -f 6 && exec {command}"],  # 6 KiB
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    one_line(done.stderr, f"fedjax-sparse: error: cannot write {run}/", "File too large [errno 27]")
    failed = summary(run)
    assert failed["status"] == "failed" and "File too large [errno 27]" in failed["error"]


@pytest.mark.parametrize("point,visit,name", [
    ("events.out.tfevents", 3, None),       # the TensorBoard events of round 1
    (MANIFEST, 2, MANIFEST),                # recording metrics.jsonl, the run's first file
])
def test_36_5_every_writer_of_the_run_folder_fails_in_one_line_naming_its_file(tmp_path, capsys, monkeypatch,
                                                                                point, visit, name):
    """The review: each writer of the run folder must take the one failure path: one line naming the file
    and the OS's reason, summary.json "failed"."""
    run = tmp_path / "run"
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT", f"write:{point}:{visit}:errno=27")
    code, err = cli(capsys, *TENSORBOARD, "--rounds", "2", "--out", str(run))
    assert code == 2
    path = run / name if name else next(run.glob("events.out.tfevents.*"))
    one_line(err, f"fedjax-sparse: error: cannot write {path}: File too large [errno 27]")
    assert summary(run)["status"] == "failed" and str(path) in summary(run)["error"]


# ------------------------------------------------------------------------------------------ item 12

def test_36_12_a_full_disk_under_the_disk_store_names_its_rows_file(tmp_path, capsys, monkeypatch):
    """The review: a full disk said "cannot write the run's files in the run folder: No space left on device"
    (pwrite gives no file name)."""
    def full(self, slots, rows, positions):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(DiskStore, "_write_rows", full)
    run = tmp_path / "run"
    code, err = cli(capsys, *TINY, "--algorithm", "scaffold", "--client-store", "disk", "--rounds", "2", "--out",
                    str(run))
    assert code == 2
    one_line(err, "No space left on device [errno 28]: " + str(run / "client_store" / "client_rows.0-of-1.bin"))
    assert summary(run)["status"] == "failed"


def test_36_12_an_unwritable_metrics_file_leaves_no_completed_summary(finished, tmp_path, capsys, monkeypatch):
    """The review: an immutable metrics.jsonl (chattr +i) left summary.json saying "completed" from the run
    before; the failure is injected here where the run writes the file (EPERM, what chattr +i gives)."""
    run = shutil.copytree(finished, tmp_path / "run")
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT", "write:metrics.jsonl:1:errno=1")
    code, err = cli(capsys, "--resume", str(run), "--rounds", "3", "--no-progress")
    assert code == 2
    one_line(err, f"cannot write {run / 'metrics.jsonl'}: Operation not permitted [errno 1]")
    stopped = summary(run)
    assert stopped["status"] == "failed" and stopped["last_checkpoint"] == 2
    assert (run / "metrics.jsonl").read_bytes() == (finished / "metrics.jsonl").read_bytes()


def test_36_12_a_diverged_run_logs_no_warning_before_its_line(tmp_path, capsys, caplog):
    """The review: `--server-lr 1e30` printed tensorboardX's "NaN or Inf found in input tensor" before the line."""
    caplog.set_level(logging.WARNING)
    run = tmp_path / "run"
    code, err = cli(capsys, *TENSORBOARD, "--rounds", "2", "--server-lr", "1e30", "--out", str(run))
    assert code == 2
    one_line(err, "the run diverged (try a smaller --server-lr than 1e+30)")
    assert summary(run)["status"] == "diverged" and not caplog.records


def test_36_12_a_data_set_not_prepared_logs_no_warning_before_its_line(tmp_path, capsys, caplog):
    """The review: a TFDS set that is not prepared (offline, --no-download) printed absl's "Variant folder ...
    has no dataset_info.json" before the line. A run that fails before its first round leaves its folder as it
    was, so the same command may simply be run again once the data are there."""
    caplog.set_level(logging.WARNING)
    (tmp_path / "tfds").mkdir()
    code, err = cli(capsys, *TINY, "--rounds", "1", "--dataset", "mnist", "--data-dir", str(tmp_path / "tfds"),
                    "--no-download", "--out", str(tmp_path / "mnist"))
    assert code == 2
    one_line(err, f"tfds data set 'mnist' is not prepared under {tmp_path / 'tfds' / 'mnist'}")
    assert not caplog.records
    assert list((tmp_path / "mnist").iterdir()) == []  # the same command may be run again


# ------------------------------------------------------------------ the third fault review (issue 55)

def test_55_3a_overwrite_keeps_a_users_checkpoints_and_client_store_the_run_never_made(tmp_path, capsys,
                                                                                       monkeypatch):
    """The manifest listed checkpoints/ and client_store/ from the start, so --overwrite deleted them with the
    user's files inside though the run had made neither (it failed before its first save; auto chose the device
    store). A folder is recorded when the run first writes into it."""
    run = tmp_path / "run"
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT", "write:metrics.jsonl:1:errno=28")  # ends in round 1, before a save
    code, _ = cli(capsys, *TINY, "--rounds", "2", "--out", str(run))
    monkeypatch.delenv("FEDJAX_SPARSE_FAULT")
    assert code == 2 and summary(run)["status"] == "failed"
    for folder in ("checkpoints", "client_store"):
        (run / folder).mkdir()
        (run / folder / "mine.txt").write_text("mine\n")
    before = contents(run)
    code, err = cli(capsys, *TINY, "--rounds", "1", "--out", str(run), "--overwrite")
    assert code == 2
    one_line(err, f"--out {run} holds checkpoints, client_store, which fedjax-sparse has no record of writing")
    assert contents(run) == before


def test_55_3c_the_lock_is_the_librarys_own_file_gone_after_the_run_never_made_in_a_refused_folder(
        tmp_path, capsys, monkeypatch):
    """The review's own .lock in --out was overwritten with a PID; a refused run left a new .lock in the user's
    folder; every run left .lock behind, outside its manifest."""
    user = tmp_path / "user"
    user.mkdir()
    (user / ".lock").write_text("mine\n")
    (user / "config.json").write_text('{"app": 1}\n')
    before = contents(user)
    code, err = cli(capsys, *TINY, "--rounds", "1", "--out", str(user))
    assert code == 2 and "holds config.json, which fedjax-sparse has no record of writing" in err
    assert contents(user) == before  # nothing added, nothing changed
    (user / "config.json").unlink()
    held = []
    real = RunWriter.write_config
    monkeypatch.setattr(RunWriter, "write_config", lambda self, config: (
        held.append((user / LOCK_FILE).read_text()), real(self, config)))
    assert main(["run", *TINY, "--rounds", "1", "--out", str(user)]) == 0
    assert held == [f"{os.getpid()}\n"]  # while the run held the folder, its pid in the library's file
    assert (user / ".lock").read_text() == "mine\n" and not (user / LOCK_FILE).exists()


def test_55_6_the_statuses_a_summary_takes_are_the_documented_ones(tmp_path, capsys):
    """A diverged run wrote "diverged" where the docs promised "failed" for every failure: the docs list every
    status, and a diverged run writes the one they give it."""
    text = " ".join((Path(ROOT) / "docs" / "cli.md").read_text().split())
    listed = re.search(r'`summary\.json`\'s `"status"` is one of (.*?)\.', text).group(1)
    assert tuple(re.findall(r"`(\w+)`(?: \(| or|,)", listed)) == STATUSES
    assert "`diverged` (a non-finite loss or model)" in listed
    run = tmp_path / "run"
    code, err = cli(capsys, *TINY, "--rounds", "2", "--server-lr", "1e30", "--out", str(run))
    assert code == 2 and "the run diverged" in err and summary(run)["status"] == "diverged"
