"""The run machinery under the faults an independent review found (its 18 probes, numbered as in its report):
records restored or refused in one line, never lost silently; I/O failures, malformed files and flags at
their limits in one line each, within seconds, with the last good checkpoint intact.

Failures of the disk are injected where the run writes (`fedjax_sparse.run.faults`: `write:NAME` raises the
OSError the OS raises, errno chosen), so they need no full disk or read-only mount; the same probes on a
real full tmpfs, a real `ulimit -f` and an immutable folder, and kill -9 at seeded moments over every
algorithm and store, are `python -m benchmarks.fault_sweep` (results in benchmarks/results/).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedjax_sparse.run.cli import main
from fedjax_sparse.run.folder import LOCK_FILE, RunFolderError, hold_run_folder
from fedjax_sparse.console import say
from fedjax_sparse.run import loop
from fedjax_sparse.run.signals import StopAfterRound, stop_start_up_at_once

TINY = ["--num-clients", "4", "--clients-per-round", "2", "--local-epochs", "1", "--max-train-examples", "200",
        "--max-test-examples", "100", "--no-progress", "--no-tensorboard"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(capsys, *args):
    code = main(["run", *args])
    return code, capsys.readouterr().err


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summary(run):
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(autouse=True)
def fresh_fault_counts():
    """Fault points count their visits per process: each test's run counts from zero."""
    from fedjax_sparse.run import faults
    faults._reached.clear()


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory):
    """A finished 3-round SCAFFOLD run (its clients keep state) with a checkpoint every round, its client
    states in the disk store (rows in its folder)."""
    run = tmp_path_factory.mktemp("three") / "run"
    assert main(["run", *TINY, "--algorithm", "scaffold", "--rounds", "3", "--checkpoint-every", "1",
                 "--client-store", "disk", "--out", str(run)]) == 0
    return run


@pytest.fixture
def copy(three_rounds, tmp_path):
    return shutil.copytree(three_rounds, tmp_path / "run")


def one_line(err, *words):
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


# --------------------------------------------------------------------------------------- records (2, 3, 4)

def test_2_missing_or_deleted_rounds_are_rewritten_from_the_checkpoint(three_rounds, copy, capsys):
    lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    (copy / "metrics.jsonl").write_text(lines[0] + lines[2])  # round 2 deleted
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 0 and "rounds 2 were missing, cut short or altered; rewritten from the checkpoint" in err
    assert records(copy)[:3] == records(three_rounds) and [r["round"] for r in records(copy)] == [1, 2, 3, 4]
    (copy / "metrics.jsonl").unlink()
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "5", "--no-progress")
    assert code == 0 and "rounds 1, 2, 3, 4 were missing" in err
    assert [r["round"] for r in records(copy)] == [1, 2, 3, 4, 5] and records(copy)[:3] == records(three_rounds)


def test_3_a_torn_line_of_a_covered_round_is_restored_and_lines_are_synced(three_rounds, copy, capsys, monkeypatch):
    text = (copy / "metrics.jsonl").read_text()
    (copy / "metrics.jsonl").write_text(text[:len(text) - 40])  # round 3's line cut short by a crash
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 0 and "rounds 3 were missing, cut short or altered" in err
    assert records(copy)[:3] == records(three_rounds) and len(records(copy)) == 4
    assert synced  # the appended round 4 reached the disk before the run went on


def write_images(root, value=None, seed=0):
    rng = np.random.default_rng(seed)
    for split, n in (("train", 10), ("test", 4)):
        for label in ("a", "b"):
            folder = root / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 255, (8, 8, 3)) if value is None else np.full((8, 8, 3), value)
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")


def test_4_other_data_on_resume_are_refused_unless_allowed(tmp_path, capsys):
    images, run = tmp_path / "images", tmp_path / "run"
    write_images(images)
    args = ["--dataset", f"imagefolder:{images}", "--num-clients", "4", "--clients-per-round", "2", "--local-epochs",
            "1", "--no-progress", "--no-tensorboard", "--checkpoint-every", "1"]
    assert main(["run", *args, "--rounds", "1", "--out", str(run)]) == 0
    write_images(images, value=0)  # blacked out between the runs
    code, err = cli(capsys, "--resume", str(run), "--rounds", "2", "--no-progress")
    assert code == 2
    one_line(err, "the data differ from the run's (the training examples' content", "--allow-data-change")
    code, err = cli(capsys, "--resume", str(run), "--rounds", "2", "--allow-data-change", "--no-progress")
    assert code == 0 and "going on with them (--allow-data-change)" in err


# --------------------------------------------------------------------------------- the folder (5, 11, 18)

def test_5_an_empty_out_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli(capsys, *TINY, "--rounds", "1", "--out", "")
    assert code == 2 and not list(tmp_path.iterdir())
    one_line(err, "--out must name a folder for the run's files, got ''")


def test_11_overwrite_unlinks_a_linked_checkpoints_folder_and_run_files_that_are_folders_are_refused(
        copy, tmp_path, capsys):
    target = tmp_path / "elsewhere"
    shutil.move(copy / "checkpoints", target)
    (copy / "checkpoints").symlink_to(target)
    code, err = cli(capsys, *TINY, "--rounds", "1", "--out", str(copy), "--overwrite")
    assert code == 0, err
    # the link went, never its target (the new run's checkpoint is a folder of its own)
    assert target.is_dir() and any(target.iterdir()) and not (copy / "checkpoints").is_symlink()
    other = tmp_path / "other"
    shutil.copytree(copy, other)
    assert main(["run", *TINY, "--rounds", "2", "--checkpoint-every", "1", "--out", str(other), "--overwrite"]) == 0
    (other / "summary.json").unlink()
    (other / "summary.json").mkdir()
    code, err = cli(capsys, "--resume", str(other), "--rounds", "3", "--no-progress")
    assert code == 2
    one_line(err, f"{other / 'summary.json'} is a directory, not the run's summary.json")


def test_18_deleting_the_lock_file_does_not_let_a_second_run_in(tmp_path):
    run = tmp_path / "run"
    with hold_run_folder(run) as held:
        held.announce()
        (run / LOCK_FILE).unlink()
        with pytest.raises(RunFolderError, match="in use by another run \\(pid unknown\\)"):
            with hold_run_folder(run):
                pass
    with hold_run_folder(run):  # released with its holder
        pass


# ------------------------------------------------------------------------------------- I/O (6, 7, 8)

@pytest.mark.parametrize("fault,words,last", [
    ("write:checkpoints:2:errno=13", "cannot save the checkpoint of round 2 in", 1),  # 6: an unwritable folder
    ("checkpoint_write:2:errno=28", "No space left on device [errno 28]", 1),        # 7: full while writing
    ("write:metrics.jsonl:3:errno=27", "File too large [errno 27]", 1),               # 8: ulimit -f
])
def test_6_7_8_io_failures_end_at_once_in_one_line_with_a_failed_summary(tmp_path, capsys, monkeypatch, fault,
                                                                          words, last):
    run = tmp_path / "run"
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT", fault)
    code, err = cli(capsys, *TINY, "--rounds", "4", "--checkpoint-every", "1", "--out", str(run))
    monkeypatch.delenv("FEDJAX_SPARSE_FAULT")
    assert code == 2
    one_line(err, words)
    failed = summary(run)
    assert failed["status"] == "failed" and failed["last_checkpoint"] == last and words in failed["error"]
    assert main(["run", "--resume", str(run), "--no-progress"]) == 0  # the last good checkpoint resumes
    assert [r["round"] for r in records(run)] == [1, 2, 3, 4] and summary(run)["status"] == "completed"


def test_8_a_failed_plot_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT", "write:accuracy.png:1:errno=28")
    code, err = cli(capsys, *TINY, "--rounds", "1", "--out", str(run))
    assert code == 2
    one_line(err, f"cannot write {run / 'accuracy.png'}: No space left on device [errno 28]")
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # nor the lock's pid file
    assert summary(run)["status"] == "failed"


# ------------------------------------------------------------------------ files that cannot be read (9, 12-14)

def test_9_a_saved_config_of_wrong_types_gives_way_to_the_checkpoints(three_rounds, copy, capsys):
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rounds": "six", "num_clients": None}))
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 0, err
    assert "is not a valid int); using the config saved with the checkpoint" in err
    assert records(copy)[:3] == records(three_rounds)


def test_12_13_unreadable_client_state_snapshots_name_their_file_and_what_can_help(copy, capsys):
    meta = copy / "checkpoints" / "3" / "client_states" / "client_states.0-of-1" / "meta.json"
    meta.write_text(meta.read_text()[:20])
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    one_line(err, f"the client-state snapshot {meta} cannot be read", f"delete its checkpoint folder {copy / 'checkpoints' / '3'}")
    shutil.rmtree(copy / "checkpoints" / "3")
    rows = copy / "client_store" / "client_rows.0-of-1.bin"
    rows.write_bytes(rows.read_bytes()[:10])
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    one_line(err, f"the disk client store's rows file {rows} holds 10 bytes", "none can be resumed: start the run "
             "again with --overwrite")
    assert "delete" not in err


def test_14_a_binary_config_file_is_named(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_bytes(b"\xff\xfe\x00binary")
    code, err = cli(capsys, "--config", str(config), "--out", str(tmp_path / "r"))
    assert code == 2
    one_line(err, f"--config {config}: not a text file (byte 0xff at offset 0 is not UTF-8)")


# --------------------------------------------------------------------------------- signals (15, 16)

def test_15_16_signal_messages_say_what_happens_and_sighup_is_caught(capsys, request):
    # SIGHUP as a process started from a terminal has it, whatever started the tests (nohup ignores it)
    started_with = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    request.addfinalizer(lambda: signal.signal(signal.SIGHUP, started_with))
    with StopAfterRound(first_round=4, last_round=6) as stop:
        os.kill(os.getpid(), signal.SIGHUP)  # a closed terminal: caught, not the end of the process
        assert stop.signum == signal.SIGHUP
    err = capsys.readouterr().err
    assert err.strip() == "fedjax-sparse: SIGHUP: stopping after round 4, then saving a checkpoint"
    with StopAfterRound(first_round=6, last_round=6) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
    err = capsys.readouterr().err
    assert err.strip() == "fedjax-sparse: SIGTERM: round 6 is the run's last; the run ends after it, as it would have"
    say("the handlers are gone again")
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL


def test_55_4_sigusr1_and_sigusr2_stop_a_run_after_its_round_as_sigterm_does(tmp_path, capsys, monkeypatch, request):
    """The third review: `kill -USR1` (what SLURM's --signal=USR1@90 sends before a job's time limit) ended a run
    at once, exit 138, with no checkpoint and no summary. docs/scale.md says which signals a run handles."""
    ignored = []  # stands in for Python's default, which would end the test process where the run takes none
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        before = signal.signal(signum, lambda s, frame: ignored.append(s))
        request.addfinalizer(lambda signum=signum, before=before: signal.signal(signum, before))
    real = loop.fault_point

    def signal_after_round_1(point):
        if point == "round_end" and not sent:
            sent.append(point)
            os.kill(os.getpid(), signal.SIGUSR1)
        real(point)

    sent = []
    monkeypatch.setattr(loop, "fault_point", signal_after_round_1)
    run = tmp_path / "run"
    code, err = cli(capsys, *TINY, "--rounds", "3", "--out", str(run))
    assert (code, ignored) == (128 + signal.SIGUSR1, [])
    assert err.strip().splitlines()[-1] == (f"fedjax-sparse: SIGUSR1: stopped after round 1 of 3; checkpoint saved in "
                                            f"{run / 'checkpoints' / '1'}; continue with --resume {run}")
    assert summary(run)["status"] == "interrupted" and summary(run)["signal"] == "SIGUSR1"
    with StopAfterRound(first_round=2, last_round=3) as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
    assert stop.signum == signal.SIGUSR2 and ignored == []
    assert capsys.readouterr().err == "fedjax-sparse: SIGUSR2: stopping after round 2, then saving a checkpoint\n"
    with stop_start_up_at_once():  # in start-up: the one line, as for the others
        assert all(signal.getsignal(s) == signal.getsignal(signal.SIGTERM) for s in (signal.SIGUSR1, signal.SIGUSR2))
    scale = " ".join((Path(ROOT) / "docs" / "scale.md").read_text().split())
    assert "A run handles SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 alike" in scale


# ------------------------------------------------------------------------------- flags (10, 17)

@pytest.mark.parametrize("flags,words", [
    (["--seed", "9223372036854775808"], "--seed must be in [0, 4294967295], got 9223372036854775808"),
    (["--batch-size", "1000000000"], "--batch-size 1000000000 needs"),
    (["--local-epochs", "100000000"], "--local-epochs 100000000 needs"),
    (["--lr", "fast"], "argument --lr: 'fast' is not a valid float"),
    (["--rounds"], "argument --rounds: expected one argument"),
])
def test_10_17_flags_at_their_limits_and_malformed_are_one_line(tmp_path, capsys, flags, words):
    try:
        code, err = cli(capsys, *TINY, "--rounds", "1", "--out", str(tmp_path / "r"), *flags)
    except SystemExit as exit_:  # argparse
        code, err = exit_.code, capsys.readouterr().err
    assert code == 2
    one_line(err, words)


# ---------------------------------------------------------------------------- sharded resume (1)

SHARDED = """
import json, sys
from fedjax_sparse.run.cli import main
tiny, out = sys.argv[1].split(), sys.argv[2]
assert main(["run", *tiny, "--shard-clients", "--clients-per-round", "4", "--rounds", "3", "--out", out + "/whole"]) == 0
assert main(["run", *tiny, "--shard-clients", "--clients-per-round", "4", "--rounds", "2", "--checkpoint-every", "1",
             "--out", out + "/parts"]) == 0
assert main(["run", "--resume", out + "/parts", "--rounds", "3", "--no-progress"]) == 0
assert main(["run", "--resume", out + "/parts", "--rounds", "4", "--no-shard-clients", "--no-progress"]) == 2
"""


def test_1_a_sharded_run_resumes_exactly_and_its_device_count_is_kept(tmp_path):
    tiny = " ".join(a for a in TINY if a not in ("--clients-per-round", "2")).replace("--num-clients 4", "--num-clients 6")
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SHARDED, tiny, str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the checkpoint was made with another configuration (shard_clients: checkpoint has True" in done.stderr
    assert records(tmp_path / "whole") == records(tmp_path / "parts")
    # one device here, whatever this process was started with: a process on one core asks JAX for one CPU device
    # (the child pins itself before it becomes the run: a preexec_fn would run in a fork of this threaded process)
    on_one_core = ("import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
                   "os.execv(sys.executable, [sys.executable, '-m', 'fedjax_sparse.run.cli', *sys.argv[1:]])")
    done = subprocess.run([sys.executable, "-c", on_one_core, "run", "--resume", str(tmp_path / "parts"),
                           "--rounds", "4", "--no-progress"], env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    one_line(done.stderr, "the run sharded its clients over 2 devices and 1 are here")


def test_a_paused_runs_flag_holds_its_point_whenever_it_exists(tmp_path, monkeypatch):
    """The pause's flag file appears whole: a test that saw it existing read an empty file (the file made, the
    point not yet written) and failed. Here every write is slowed between making the file and writing it."""
    import threading

    from fedjax_sparse.run import faults

    def slow_write(path, text, *args, **kwargs):
        path.open("w").close()
        time.sleep(0.3)
        with path.open("w") as f:
            return f.write(text)

    flag = tmp_path / "flag"
    monkeypatch.setattr(Path, "write_text", slow_write)
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT", "round_end:1:pause")
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT_FLAG", str(flag))
    paused = threading.Thread(target=faults.fault_point, args=("round_end",))
    paused.start()
    seen = []
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        if flag.exists():
            seen.append(flag.read_text())
        time.sleep(0.005)
    flag.unlink(missing_ok=True)  # the run goes on
    paused.join(timeout=30)
    assert seen == ["round_end"] and not paused.is_alive()
