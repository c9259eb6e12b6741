"""A run folder nothing can corrupt: kills at chosen moments, signals, a second run, a rerun, damaged files.

Every interrupted run, once resumed, must write the metrics of the uninterrupted run line for line
(and its summary, wall-clock fields aside). Processes are stopped at exact points through the
test-only hook `fedjax_sparse.run.faults` (kill -9 itself, or pause until the test lets it go), so
nothing here depends on timing. The runs are SCAFFOLD's, whose clients keep state: the reference
keeps it on the device, the killed runs and the damaged ones in the disk store (rows in the run
folder), the signalled one in host memory, resumed on the device; all must write the reference's
metrics.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from conftest import SCAFFOLD_ARGS, SCAFFOLD_ROUNDS
from fedjax_sparse.run.checkpoints import CheckpointError, RunCheckpointer
from fedjax_sparse.run.cli import main
from fedjax_sparse.data.image_folder import load_image_folder
from fedjax_sparse.run.folder import LOCK_FILE, hold_run_folder

ROUNDS, ARGS = SCAFFOLD_ROUNDS, SCAFFOLD_ARGS
DISK = ["--client-store", "disk"]
WALL_CLOCK = ("first_round_seconds", "median_round_seconds", "wall_seconds", "client_store")


def cli(capsys, *args):
    code = main(["run", *args])
    return code, capsys.readouterr().err


def metrics_text(run):
    return (run / "metrics.jsonl").read_text()


def summary(run):
    return json.loads((run / "summary.json").read_text())


def timeless(values):
    return {k: v for k, v in values.items() if k not in WALL_CLOCK}


def checkpoint_rounds(run):
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def assert_same_as(run, reference):
    assert metrics_text(run) == metrics_text(reference)
    assert timeless(summary(run)) == {**timeless(summary(reference)), "status": "completed"}


@pytest.fixture(scope="module")
def reference(scaffold_reference):
    """The uninterrupted run every interrupted one must end up equal to."""
    assert summary(scaffold_reference)["status"] == "completed"
    return scaffold_reference


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """A run stopped cleanly after 4 of its rounds (checkpoints of rounds 2 and 4); tests damage copies."""
    run = tmp_path_factory.mktemp("partial") / "run"
    assert main(["run", *ARGS, *DISK, "--rounds", "4", "--out", str(run)]) == 0
    assert summary(run)["client_store"] == "disk"
    return run


def copy_of(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def start(args, faults, flag):
    """`fedjax-sparse run ARGS` in a new process, its faults armed."""
    env = {**os.environ, "FEDJAX_SPARSE_FAULT": faults, "FEDJAX_SPARSE_FAULT_FLAG": str(flag)}
    return subprocess.Popen([sys.executable, "-m", "fedjax_sparse", "run", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_pause(proc, flag, point):
    deadline = time.monotonic() + 240
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"never reached {point}"
        time.sleep(0.02)
    assert flag.read_text() == point


# ---------------------------------------------------------------------------------------------
# kill -9


def kill_moments(rng, done):
    """For each point, a seeded n (the n-th time a process resuming after `done` rounds reaches it),
    chosen so that a checkpoint exists before the kill and rounds remain after it."""
    first = done == 0  # the first checkpoint (round 2) must be complete before the first kill
    saves = [r for r in range(done + 1, ROUNDS + 1) if r % 2 == 0]
    return {"round_end": int(rng.integers(2 if first else 1, ROUNDS - done)),  # after round <= 5
            "checkpoint_write": int(rng.integers(2 if first else 1, len(saves) + 1)),
            "metrics_write": int(rng.integers(3 if first else 1, ROUNDS - done + 1))}


def test_kill_9_at_seeded_moments_then_resume_writes_the_uninterrupted_metrics(reference, tmp_path):
    """Three kill -9s, one between rounds, one inside a checkpoint write and one inside a metrics line,
    in a seeded order at seeded rounds, each followed by --resume."""
    rng = np.random.default_rng(17)
    run, flag = tmp_path / "run", tmp_path / "flag"
    done = 0
    for i, point in enumerate(rng.permutation(["round_end", "checkpoint_write", "metrics_write"])):
        n = kill_moments(rng, done)[point]
        first = [*ARGS, *DISK, "--rounds", str(ROUNDS), "--out", str(run)]
        proc = start(first if i == 0 else ["--resume", str(run), "--no-progress"], f"{point}:{n}:kill", flag)
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
        if point == "metrics_write":  # the kill left a torn line
            assert not metrics_text(run).endswith("\n")
        if point == "checkpoint_write":  # ... or an uncommitted checkpoint
            assert any(not p.name.isdigit() for p in (run / "checkpoints").iterdir())
        done = checkpoint_rounds(run)[-1]
        assert 2 <= done < ROUNDS
    assert main(["run", "--resume", str(run), "--no-progress"]) == 0
    assert_same_as(run, reference)
    assert summary(run)["client_store"] == "disk" and (run / "client_store" / "client_rows.0-of-1.bin").exists()


# ---------------------------------------------------------------------------------------------
# Signals and a second process


def test_sigterm_saves_and_a_second_signal_waits_for_the_save_and_a_second_run_is_refused(reference, tmp_path,
                                                                                            capsys):
    """A run paused after round 3 holds its folder: a second run fails at once naming its pid. SIGTERM
    then stops it after that round, saving a checkpoint though --checkpoint-every is not given; a
    SIGINT arriving in the middle of the save only says it waits. The run exits 143 with
    summary.json "interrupted", and --resume completes it exactly."""
    run, flag = tmp_path / "run", tmp_path / "flag"
    at = ARGS.index("--checkpoint-every")
    args = [*ARGS[:at], *ARGS[at + 2:], "--rounds", str(ROUNDS)]
    proc = start([*args, "--client-store", "host", "--out", str(run)], "round_end:3:pause,checkpoint_write:1:pause",
                 flag)
    wait_for_pause(proc, flag, "round_end")

    code, err = cli(capsys, *args, "--out", str(run))
    assert code == 2
    assert err.strip() == (f"fedjax-sparse: error: --out {run} is in use by another run (pid {proc.pid}); "
                           f"wait for it to end, or choose another --out")

    proc.send_signal(signal.SIGTERM)
    flag.unlink()
    wait_for_pause(proc, flag, "checkpoint_write")  # the save of round 3, the run's first
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)  # (the handler runs while the paused save sleeps)
    flag.unlink()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        "fedjax-sparse: SIGTERM: stopping after round 3, then saving a checkpoint",
        f"fedjax-sparse: SIGINT: already stopping; waiting for the checkpoint of round 3 to be saved (kill -9 "
        f"{proc.pid} stops at once, losing the rounds since the last checkpoint)",
        f"fedjax-sparse: SIGTERM: stopped after round 3 of 6; checkpoint saved in {run / 'checkpoints' / '3'}; "
        f"continue with --resume {run}"]
    assert checkpoint_rounds(run) == [3]
    stopped = summary(run)
    assert stopped["status"] == "interrupted" and stopped["signal"] == "SIGTERM" and stopped["rounds_done"] == 3
    assert metrics_text(run) == "".join(metrics_text(reference).splitlines(keepends=True)[:3])

    # the host store's checkpoint resumes on the device (the stores hold the same states)
    assert main(["run", "--resume", str(run), "--client-store", "device", "--no-progress"]) == 0
    assert_same_as(run, reference)


def test_a_signal_during_start_up_ends_the_run_with_one_line(tmp_path):
    run, flag = tmp_path / "run", tmp_path / "flag"
    proc = start([*ARGS, "--rounds", str(ROUNDS), "--out", str(run)], "start_up:1:pause", flag)
    wait_for_pause(proc, flag, "start_up")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert err == "fedjax-sparse: SIGINT during start-up, before the first round: nothing was run\n" and out == ""
    assert list(run.iterdir()) == []  # so the same command may simply be run again


def test_the_lock_names_its_holder(tmp_path, capsys):
    run = tmp_path / "run"
    with hold_run_folder(run) as held:
        held.announce()
        code, err = cli(capsys, *ARGS, "--rounds", "1", "--out", str(run))
        assert [p.name for p in run.iterdir()] == [LOCK_FILE]  # the holder's, untouched by the refused run
    assert code == 2 and err.count("\n") == 1
    assert f"--out {run} is in use by another run (pid {os.getpid()})" in err
    assert list(run.iterdir()) == []  # the holder removed it


# ---------------------------------------------------------------------------------------------
# A folder belongs to one run


def test_a_rerun_into_a_finished_folder_is_refused_and_overwrite_starts_afresh(partial, tmp_path, capsys):
    run = copy_of(partial, tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, err = cli(capsys, *ARGS, "--rounds", "3", "--out", str(run))
    assert code == 2
    events = next(run.glob("events.out.tfevents.*")).name
    assert err.strip() == (f"fedjax-sparse: error: --out {run} holds the files of an earlier run (config.json, "
                           f"metrics.jsonl, partition.json, summary.json, accuracy.png, checkpoints, client_store, "
                           f"{events}); continue that run with --resume {run}, choose a new --out, or pass "
                           f"--overwrite to delete them first")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert checkpoint_rounds(run) == [2, 4]

    # --overwrite: a new 3-round run, which saves its own checkpoints (no round-4 one hides them) and
    # keeps its clients on the device: the disk store's rows went with the old run
    assert main(["run", *ARGS, "--rounds", "3", "--overwrite", "--out", str(run)]) == 0
    assert checkpoint_rounds(run) == [2, 3]
    assert not (run / "client_store").exists() and summary(run)["client_store"] == "device"
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # the old run's were deleted
    assert metrics_text(run) == "".join(metrics_text(partial).splitlines(keepends=True)[:3])
    assert summary(run)["rounds"] == 3 and summary(run)["cumulative_bytes"] == json.loads(
        metrics_text(run).splitlines()[-1])["cumulative_bytes"]
    code, err = cli(capsys, "--resume", str(run), "--overwrite", "--no-progress")
    assert code == 2 and "--overwrite deletes the run that --resume" in err


def test_a_save_that_cannot_happen_is_an_error(tmp_path):
    """orbax skips, without a word, a step that is not above the latest one on disk."""
    import jax
    from conftest import linear_model
    from fedjax_sparse.algorithms import fedavg
    from fedjax_sparse.core.client_state.choice import make_store
    from fedjax_sparse.core.round.local_training import LocalSGD

    model = linear_model()
    store = make_store("device", fedavg(LocalSGD(model, 0.1, 1, 2)), jax.random.key(0), model.init(jax.random.key(1)),
                       2)
    state = {"w": np.arange(3.0)}
    RunCheckpointer(tmp_path).save(4, state, store, {"config": {}, "counters": {}})
    with pytest.raises(CheckpointError, match="cannot save the checkpoint of round 2 .* already holds one of "
                                              "round 4"):
        RunCheckpointer(tmp_path).save(2, state, store, {"config": {}, "counters": {}})
    assert checkpoint_rounds(tmp_path) == [4]


def test_shrinking_rounds_below_the_rounds_done_is_refused(partial, tmp_path, capsys):
    run = copy_of(partial, tmp_path)
    code, err = cli(capsys, "--resume", str(run), "--rounds", "3", "--no-progress")
    assert code == 2
    assert err.strip() == (f"fedjax-sparse: error: --rounds 3 is below the 4 rounds the run in {run} has done; "
                           f"give --rounds 4 or more")
    assert json.loads((run / "config.json").read_text())["rounds"] == 4 and summary(run)["rounds"] == 4


# ---------------------------------------------------------------------------------------------
# --resume recovers what can be recovered


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(reference, partial, tmp_path, capsys):
    run = copy_of(partial, tmp_path)
    text = metrics_text(run)
    (run / "metrics.jsonl").write_text(text + text.splitlines()[-1][:30])  # round 5's line, cut by a kill
    code, err = cli(capsys, "--resume", str(run), "--rounds", str(ROUNDS), "--no-progress")
    assert code == 0, err
    assert err.startswith(f"fedjax-sparse: {run / 'metrics.jsonl'}: dropped its last line, cut short")
    assert "the checkpoint of round 4 decides which rounds stand" in err
    assert_same_as(run, reference)


@pytest.mark.parametrize("damage,problem", [('{"algorithm": "fedavg", "rou', "cannot be used (Unterminated string"),
                                            ("[1, 2]", "cannot be used (it holds a JSON list, not an object)")])
def test_an_unusable_config_is_taken_from_the_checkpoint(reference, partial, tmp_path, capsys, damage, problem):
    run = copy_of(partial, tmp_path)
    (run / "config.json").write_text(damage)
    code, err = cli(capsys, "--resume", str(run), "--rounds", str(ROUNDS), "--no-progress")
    assert code == 0, err
    assert err.startswith(f"fedjax-sparse: {run / 'config.json'} {problem}")
    assert err.strip().endswith("; using the config saved with the checkpoint")
    assert_same_as(run, reference)


def test_mixed_or_garbled_records_are_rewritten_from_the_checkpoint(reference, partial, tmp_path, capsys):
    """Records the checkpoint covers are restored from the copy it keeps, whatever happened to the file."""
    run = copy_of(partial, tmp_path)
    lines = metrics_text(run).splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(lines[0] + lines[1] + lines[0] + lines[2])  # two runs' rounds mixed
    code, err = cli(capsys, "--resume", str(run), "--rounds", str(ROUNDS), "--no-progress")
    assert code == 0, err
    assert f"{run / 'metrics.jsonl'} could not be read ({run / 'metrics.jsonl'} line 3 is round 1 after round 2" in err
    assert err.strip().endswith("its records are taken from the checkpoint of round 4") and err.count("\n") == 1
    assert_same_as(run, reference)


def test_what_cannot_be_recovered_is_one_line_naming_the_file(partial, tmp_path, capsys):
    run = copy_of(partial, tmp_path)
    shutil.rmtree(run / "checkpoints")
    (run / "config.json").write_text("[]")
    code, err = cli(capsys, "--resume", str(run), "--no-progress")
    assert code == 2 and err.count("\n") == 1
    assert (f"{run / 'config.json'} cannot be used (it holds a JSON list, not an object) and there is no "
            f"checkpoint to take the config from; start the run again with --overwrite") in err


# ---------------------------------------------------------------------------------------------
# The image-folder cache


def test_a_replaced_image_with_an_old_mtime_is_decoded_again(tmp_path):
    root = tmp_path / "images"
    for split in ("train", "test"):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((4, 4, 3), 10 * i + 1, np.uint8)).save(root / split / label / f"{i}.png")
    first = load_image_folder(root, cache_dir=tmp_path / "cache", progress=False)
    assert first.x_train[0].max() == 1
    image = root / "train" / "a" / "0.png"
    times = image.stat()
    Image.fromarray(np.full((4, 4, 3), 200, np.uint8)).save(image)  # as cp -p, tar or rsync -t would
    os.utime(image, ns=(times.st_atime_ns, times.st_mtime_ns))
    again = load_image_folder(root, cache_dir=tmp_path / "cache", progress=False)
    assert again.x_train[0].min() == 200
    np.testing.assert_array_equal(again.x_train[1:], first.x_train[1:])
