"""Two processes on JAX's distributed runtime (gloo on CPU) against one: the same rounds, each
process holding half the clients; bad launches end with one line within the stated timeout."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import distributed_job
from fedjax_sparse.core import distributed

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


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_two_processes_compute_the_one_process_rounds(two_processes, one_process, name):
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


def test_each_process_holds_about_half_the_clients(two_processes, one_process):
    """The bytes of client state (SCAFFOLD's rows) and of data each process holds."""
    for kind in ("state_bytes", "data_bytes"):
        single = one_process["scaffold"][kind]
        shares = [int(r[f"scaffold/{kind}"]) for r in two_processes]
        assert sum(shares) == single, kind
        assert all(0.3 * single <= s <= 0.7 * single for s in shares), (kind, shares, single)
    assert one_process["scaffold"]["state_bytes"] > 0


def test_a_missing_process_fails_with_one_line_within_the_timeout(tmp_path):
    """Process 0 of 2 started alone: one line on stderr and exit status 3 after the 3 s timeout."""
    script = ("import sys; sys.path.insert(0, '.'); from fedjax_sparse.core import distributed; "
              f"distributed.initialize('127.0.0.1:{free_port()}', 2, 0, timeout_s=3)")
    start = time.monotonic()
    [(rc, stdout, stderr)] = finish([subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)], timeout=60)
    elapsed = time.monotonic() - start
    assert rc == distributed.LAUNCH_FAILURE_EXIT, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "process 0 of 2 did not meet all the other processes" in lines[0], stderr
    assert 3 <= elapsed < 3 + 30  # the timeout, plus starting Python and importing JAX


def test_bad_launch_flags_fail_at_once_with_one_line():
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
