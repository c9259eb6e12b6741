"""Two processes on JAX's distributed runtime (gloo on CPU) against one: the same rounds, each
process holding half the clients, in the library and through the command line (where only
process 0 writes the run's files, and a two-process run resumes); bad launches end with one line
within the stated timeout."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import distributed_job
from conftest import SCAFFOLD_ARGS
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.round import distributed
from fedjax_sparse.core.federation.participation import sample_clients_host

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent / "distributed_job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, str(JOB), *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs, timeout):
    """Waits for every process (killing all of them past `timeout`); returns (rc, stdout, stderr)s."""
    deadline = time.monotonic() + timeout
    try:
        outputs = [p.communicate(timeout=max(1, deadline - time.monotonic())) for p in procs]
        return [(p.returncode, *output) for p, output in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    port = free_port()
    procs = [launch(i, 2, port, out) for i in range(2)]
    results = finish(procs, timeout=400)
    for rc, stdout, stderr in results:
        assert rc == 0, stderr[-3000:]
    return [dict(np.load(out / f"process{i}.npz")) for i in range(2)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return distributed_job.run(distributed.ProcessLayout(), None, tmp_path_factory.mktemp("one"))


def test_two_processes_compute_the_one_process_rounds(two_processes, one_process):
    name = "fedavg"
    single = one_process[name]
    for result in two_processes:
        np.testing.assert_allclose(result[f"{name}/loss"], single["loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(result[f"{name}/uplink"], single["uplink"])
        for i, leaf in enumerate(single["server"]):
            np.testing.assert_allclose(result[f"{name}/server/{i}"], leaf, rtol=1e-5, atol=1e-6)
    # each process holds exactly its own clients' states (id % 2), and together the one process's
    held = [r[f"{name}/held"] for r in two_processes]
    for p, ids in enumerate(held):
        assert np.all(ids % 2 == p)
    merged = np.concatenate(held)
    order = np.argsort(merged)
    np.testing.assert_array_equal(merged[order], single["held"])
    rows = np.concatenate([r[f"{name}/rows"] for r in two_processes])[order]
    np.testing.assert_allclose(rows.view(np.float32), single["rows"].view(np.float32), rtol=1e-5, atol=1e-6)


def test_each_process_holds_about_half_the_data(two_processes, one_process):
    """The bytes of training data each process holds (its clients' states: in the command-line test below)."""
    single = one_process["fedavg"]["data_bytes"]
    shares = [int(r["fedavg/data_bytes"]) for r in two_processes]
    assert sum(shares) == single and all(0.3 * single <= s <= 0.7 * single for s in shares), (shares, single)


# ---------------------------------------------------------------------------------------------
# Through the command line: conftest's SCAFFOLD run, 15 clients, 6 a round (3 on each process's device)

RUN, ROUNDS = SCAFFOLD_ARGS, 4
NUM_CLIENTS, PER_ROUND = (int(RUN[RUN.index(flag) + 1]) for flag in ("--num-clients", "--clients-per-round"))


def launch_cli(process_id, port, *args, processes=2, timeout=None, cwd=ROOT, env=None) -> subprocess.Popen:
    """Process `process_id` of `processes` of `fedjax-sparse run ARGS`, `env` added to this one's."""
    launch = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(process_id)]
    if timeout is not None:
        launch = [*launch, "--launch-timeout", str(timeout)]
    return subprocess.Popen([sys.executable, "-m", "fedjax_sparse", "run", *map(str, args), *launch], cwd=cwd,
                            env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_processes(processes, *args):
    """`fedjax-sparse run ARGS` on `processes` processes, each of which must succeed: their (rc, stdout, stderr)."""
    port = free_port()
    results = finish([launch_cli(i, port, *args, processes=processes) for i in range(processes)], timeout=400)
    for rc, stdout, stderr in results:
        assert rc == 0, stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, scaffold_reference):
    """Two processes run 2 rounds (auto picks the host store: several processes never use the device's)
    and save; two processes resume them to 4 rounds on the disk store. One process ran the rounds on
    the device store (conftest's reference, checkpointed at round 4)."""
    two = tmp_path_factory.mktemp("cli") / "two"
    first = run_processes(2, *RUN, "--rounds", 2, "--out", two)
    resumed = run_processes(2, "--resume", two, "--rounds", ROUNDS, "--client-store", "disk", "--no-progress")
    return scaffold_reference, two, first, resumed


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_through_the_cli_write_the_one_process_metrics(cli_runs):
    """The issue's case (SCAFFOLD on digits drifted 1.6 % in train loss by round 26 on two processes): every
    figure of every round equal to the last bit, through a resume. Each device reduces all sampled clients'
    uploads in client order, and one process trains its clients in chunks that divide the round (no
    remainder program)."""
    one, two, _, _ = cli_runs
    assert_same_records(records(one)[:ROUNDS], records(two), ROUNDS)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["client_store"] == "disk" and summary["status"] == "completed"


def test_process_0_reports_the_run_as_the_console_entry_point_does(cli_runs):
    """`python -m fedjax_sparse run` (each process here) ends with process 0's one line on the run.
    SCAFFOLD sends the model and its control variate both ways: 6 clients x 2 x 85,002 float32s a round."""
    _, two, _, resumed = cli_runs
    summary = json.loads((two / "summary.json").read_text())
    assert summary["total_uplink_bytes"] == summary["total_downlink_bytes"] == ROUNDS * PER_ROUND * 2 * 85002 * 4
    assert summary["cumulative_bytes"] == 2 * ROUNDS * PER_ROUND * 2 * 85002 * 4
    stdout = resumed[0][1]
    assert (f"done: test accuracy {summary['final_test_accuracy']:.4f}, personalized accuracy "
            f"{summary['final_personalized_accuracy']:.4f}, {summary['cumulative_bytes']:,} bytes in ") in stdout
    assert stdout.strip().endswith(f"results in {two}")


def test_only_process_0_writes_the_run_files(cli_runs):
    """Each launch left one TensorBoard file (process 0's); process 0 alone reports; each process says
    which store auto chose for it; both saved their clients' states into every checkpoint."""
    _, two, first, resumed = cli_runs
    events = sorted(p.name for p in two.glob("events.out.tfevents.*"))
    assert sorted(p.name for p in two.iterdir()) == sorted(
        ["accuracy.png", "checkpoints", "client_store", "config.json", "fedjax_sparse_files.json",
         "metrics.jsonl", "partition.json", "summary.json", *events]) and len(events) == 2
    for launch in (first, resumed):
        assert "done: " in launch[0][1] and "done: " not in launch[1][1]
    for i in range(2):
        assert f"fedjax-sparse: process {i}-of-2: --client-store auto chose host: " in first[i][2]
    for rounds in (2, 4):
        assert sorted(p.name for p in (two / "checkpoints" / str(rounds) / "client_states").glob("client_states.*")) \
            == ["client_states.0-of-2", "client_states.1-of-2"]
    assert json.loads((two / "config.json").read_text())["client_store"] == "disk"


def test_each_process_keeps_the_states_of_its_own_clients(cli_runs):
    """After round 4, process p's disk store holds the rows of its clients ever sampled (id % 2 == p)
    and nothing else, about half of them, and they are the one process's final client states."""
    one, two, _, _ = cli_runs
    final = one / "checkpoints" / str(ROUNDS) / "client_states" / "client_states.0-of-1"
    single = np.load(final / "rows.npy")
    sampled = set(np.concatenate([sample_clients_host(0, r, NUM_CLIENTS, PER_ROUND) for r in range(ROUNDS)]).tolist())
    held = []
    for p in range(2):
        snapshot = two / "checkpoints" / str(ROUNDS) / "client_states" / f"client_states.{p}-of-2"
        slots = np.load(snapshot / "slots.npy")
        rows = np.fromfile(two / "client_store" / f"client_rows.{p}-of-2.bin", np.uint8).reshape(-1, single.shape[1])
        assert len(rows) == (slots >= 0).sum()  # a row for each client it trained, no more
        assert 0.3 * len(sampled) <= len(rows) <= 0.7 * len(sampled)
        for local in np.flatnonzero(slots >= 0):
            client = local * 2 + p
            held.append(client)
            np.testing.assert_allclose(rows[slots[local]].view(np.float32), single[client].view(np.float32),
                                       rtol=1e-5, atol=1e-6)
    assert sorted(held) == sorted(sampled)


def test_a_missing_process_fails_with_one_line_within_the_timeout(tmp_path):
    """Process 0 of 2 started alone through the command line: one line on stderr and exit status 3
    after the 3 s --launch-timeout, nothing written in the run folder."""
    start = time.monotonic()
    [(rc, stdout, stderr)] = finish([launch_cli(0, free_port(), *RUN, "--out", tmp_path / "run", timeout=3)],
                                    timeout=90)
    elapsed = time.monotonic() - start
    assert rc == distributed.LAUNCH_FAILURE_EXIT, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "process 0 of 2 did not meet all the other processes" in lines[0], stderr
    assert 3 <= elapsed < 3 + 45  # the timeout, plus starting Python and importing the library
    assert not (tmp_path / "run").exists()


def test_bad_launch_flags_fail_at_once_with_one_line(tmp_path, capsys):
    out = ["--out", str(tmp_path / "run"), "--no-progress"]
    for flags, message in [(["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
                            "--process-id must be in 0..1 (--num-processes 2), got 2"),
                           (["--coordinator", "127.0.0.1:1234", "--process-id", "0"], "--num-processes missing"),
                           (["--cluster", "--coordinator", "127.0.0.1:1234"], "--cluster lets JAX find the processes"),
                           (["--launch-timeout", "0"], "--launch-timeout must be >= 1 second, got 0")]:
        assert main(["run", *flags, *out]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("fedjax-sparse: error: ") and message in err, err
    assert not (tmp_path / "run").exists()


def test_bad_launch_flags_of_the_library_fail_at_once_with_one_line():
    cases = [(("127.0.0.1:1234", 2, 2), r"--process-id must be in 0\.\.1 \(--num-processes 2\), got 2"),
             (("127.0.0.1:1234", 2, -1), r"--process-id must be in 0\.\.1 .* got -1"),
             (("127.0.0.1:1234", 0, 0), r"--num-processes must be an integer >= 1, got 0"),
             (("localhost", 2, 0), r"--coordinator must be HOST:PORT .* got 'localhost'"),
             (("127.0.0.1:1234", None, 0), r"--num-processes missing")]
    for args, message in cases:
        with pytest.raises(distributed.LaunchError, match=message) as error:
            distributed.initialize(*args)
        assert "\n" not in str(error.value)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(distributed.LaunchError, match=f"--coordinator port {port} is not free"):
            distributed.initialize(f"127.0.0.1:{port}", 2, 0)


def test_the_readmes_two_process_synthetic_command_runs_as_written_at_a_small_size(tmp_path):
    """README's two-process example (FedProx's Synthetic(1, 1), SCAFFOLD) at 40 clients: each process
    generates its own clients when they are sampled or scored, and the run writes the one-process
    metrics. The processes run in two folders (as a TPU pod slice's workers, each on its own disk, under
    the same relative --out): without checkpoints (--checkpoint-minutes 0) process 0 alone writes the run, in
    its own."""
    args = ["--dataset", "synthetic:1,1", "--algorithm", "scaffold", "--num-clients", "40", "--clients-per-round", "4",
            "--rounds", "2", "--local-epochs", "1", "--no-progress", "--no-tensorboard", "--checkpoint-minutes", "0"]
    disks = [tmp_path / "worker0", tmp_path / "worker1"]
    for disk in disks:
        disk.mkdir()
    port = free_port()
    for rc, _, stderr in finish([launch_cli(i, port, *args, "--out", "two", cwd=disks[i]) for i in range(2)],
                                timeout=300):
        assert rc == 0, stderr[-2000:]
    assert not (disks[1] / "two" / "metrics.jsonl").exists()
    assert main(["run", *args, "--out", str(tmp_path / "one")]) == 0
    assert_same_records(records(tmp_path / "one"), records(disks[0] / "two"), 2)
    assert json.loads((disks[0] / "two" / "summary.json").read_text())["processes"] == 2


# what depends on the layout and not on the results: the clock, and the share of vmapped steps that idle
LAYOUT_FIGURES = ("seconds", "padded_step_fraction")


def assert_same_records(expected, got, rounds):
    assert [r["round"] for r in got] == [r["round"] for r in expected] == list(range(1, rounds + 1))
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys()
        for name, value in theirs.items():
            if not any(word in name for word in LAYOUT_FIGURES):
                assert mine[name] == value, (mine["round"], name, mine[name], value)


SLURM = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_NODELIST": "node[1-4]", "SLURM_NTASKS": "8"}


@pytest.mark.parametrize("env, devices", [
    ({}, None),  # not a SLURM job: JAX decides
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_LOCALID": "0", "SLURM_GPUS_ON_NODE": "8"}, []),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, [4, 5, 6, 7]),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "8(x4)", "SLURM_GPUS_ON_NODE": "8"}, [1]),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "8(x4)", "SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "5"}, []),
    ({**SLURM, "SLURM_TASKS_PER_NODE": "3,1(x3)", "SLURM_NODEID": "2", "SLURM_LOCALID": "0"}, []),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x4)"}, None),  # no GPU named: a CPU job
])
def test_slurm_tasks_get_the_gpus_of_their_share(env, devices):
    """One task per node takes every GPU (JAX alone gives it GPU 0 of 8); tasks sharing a node's GPUs
    take equal contiguous shares; a task SLURM bound to its GPUs takes what it sees."""
    assert distributed.slurm_local_devices(env) == devices


def test_slurm_gpus_that_do_not_divide_among_the_tasks_are_one_line():
    env = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "3(x4)", "SLURM_GPUS_ON_NODE": "8"}
    with pytest.raises(distributed.LaunchError, match="3 SLURM tasks on this node share its 8 GPUs"):
        distributed.slurm_local_devices(env)


def test_cluster_launch_hands_jax_the_tasks_gpus(monkeypatch):
    calls = []
    for name, value in {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_GPUS_ON_NODE": "4"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed.jax.config, "update", lambda *a: None)
    distributed.initialize(cluster=True, timeout_s=5)
    assert calls[0]["local_device_ids"] == [] and calls[0]["coordinator_address"] is None


def test_checkpoints_of_processes_without_a_shared_folder_are_refused_in_one_line(tmp_path):
    """Each process's own disk (a TPU pod slice's workers): the same relative --out names another folder
    in each; with checkpoints every process stops in one line saying what the run folder needs."""
    disks = [tmp_path / "worker0", tmp_path / "worker1"]
    for disk in disks:
        disk.mkdir()
    args = ["--num-clients", "4", "--clients-per-round", "2", "--local-epochs", "1", "--max-train-examples", "200",
            "--max-test-examples", "100", "--rounds", "1", "--no-progress", "--no-tensorboard", "--out", "run",
            "--checkpoint-every", "1"]
    port = free_port()
    for rc, _, stderr in finish([launch_cli(i, port, *args, cwd=disks[i]) for i in range(2)], timeout=300):
        assert rc == 2, stderr[-2000:]
        assert "is not one folder for all 2 processes (process 1:" in stderr.strip().splitlines()[-1]
    assert not list((disks[0] / "run").glob(".shared_check"))


def test_a_process_killed_mid_run_stops_the_others_at_once_in_one_line(tmp_path):
    """kill -9 of process 1 after some rounds: process 0's next collective fails (gloo), and it ends within
    seconds with one line, exit 2 and a summary saying so, instead of JAX's trace after its heartbeat
    timeout at exit."""
    # no checkpoints (a kill inside a save: tests/test_elastic_resume.py)
    args = ["--num-clients", "10", "--clients-per-round", "4", "--local-epochs", "1", "--rounds", "100000",
            "--checkpoint-minutes", "0", "--no-progress", "--no-tensorboard", "--out", tmp_path / "run"]
    port = free_port()
    procs = [launch_cli(i, port, *args) for i in range(2)]
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 6) and time.monotonic() < deadline:
        time.sleep(0.2)
    procs[1].kill()
    killed = time.monotonic()
    (rc, _, stderr), _ = finish(procs, timeout=60)
    assert rc == 2 and time.monotonic() - killed < 30, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert "another process stopped while round" in lines[-1] and "Traceback" not in stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_done"] >= 6
    assert f"no checkpoint was saved yet: --resume {tmp_path / 'run'} runs it again from round 1" in summary["error"]
