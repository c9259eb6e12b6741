"""Elastic resume: a checkpoint written by P processes resumes on P' (the survivors of a lost process,
or more of them), each process taking its clients' rows (id % P') from the P snapshots. Through the
command line, 2 processes lose one for real (kill -9 while the checkpoint of round 4 is written: the other
stops in one line naming the checkpoint of round 2, and leaves no part of round 4's), the survivor resumes
alone to round 4, and 3 processes end the run:
every record of rounds 1 to 6, the final server state and every client's final state are the
uninterrupted run's, to the last bit; in the library, the rows of 2 processes' stores (host and disk
mixed) land on 3 and on 1, each client's bytes where its new process holds them; a checkpoint missing
a part is refused in one line naming the file."""

import json
import re
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import SCAFFOLD_ARGS, SCAFFOLD_ROUNDS, linear_model
from test_distributed import assert_same_records, finish, free_port, launch_cli, records, run_processes
from fedjax_sparse.algorithms import scaffold
from fedjax_sparse.core.client_state.choice import make_store
from fedjax_sparse.core.round.distributed import ProcessLayout
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.federation.participation import sample_clients_host
from fedjax_sparse.core.client_state.snapshots import ClientRowsLost, SnapshotError
from fedjax_sparse.run.checkpoints import ClientStatesHandler, ClientStatesRestore
from fedjax_sparse.run.cli import main

RUN = SCAFFOLD_ARGS
NUM_CLIENTS, PER_ROUND = (int(RUN[RUN.index(flag) + 1]) for flag in ("--num-clients", "--clients-per-round"))
LOST_AFTER = 4  # the round whose checkpoint's save process 1 of 2 does not outlive; the last checkpoint is round 2's
MEET_S = 12  # --launch-timeout of the run that loses a process: how long the other waits in the save
GROWN = 3  # the processes that end the run


def summary(run):
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def chain(tmp_path_factory, scaffold_reference):
    """conftest's SCAFFOLD run, in three launches into one folder: two processes (auto picks the host
    store), process 1 killed by the fault hook while it writes its part of the checkpoint of round 4 (its
    second), so process 0 stops; the survivor alone resumes the checkpoint of round 2 to round 4 on the disk
    store; three processes resume that to round 6 (auto again: the host store, each gathering its rows from
    the one process's disk file). K = 6 puts 3, 6 and 2 clients on each device. What the loss left
    (records, summary, checkpoints) is kept before the folder is resumed."""
    run = tmp_path_factory.mktemp("elastic") / "run"
    port, kill = free_port(), {"FEDJAX_SPARSE_FAULT": "checkpoint_write:2:kill"}
    lost = finish([launch_cli(i, port, *RUN, "--rounds", SCAFFOLD_ROUNDS, "--out", run, "--checkpoint-minutes", 0,
                              timeout=MEET_S, env=kill if i == 1 else None) for i in range(2)], timeout=400)
    left = SimpleNamespace(records=records(run), summary=summary(run),
                           checkpoints=sorted(p.name for p in (run / "checkpoints").iterdir()))
    assert main(["run", "--resume", str(run), "--rounds", "4", "--client-store", "disk", "--no-progress"]) == 0
    resumed = run_processes(GROWN, "--resume", run, "--rounds", SCAFFOLD_ROUNDS, "--client-store", "auto",
                            "--no-progress")
    return SimpleNamespace(reference=scaffold_reference, run=run, lost=lost, left=left, resumed=resumed)


def test_a_process_lost_in_a_save_stops_the_other_in_one_line_leaving_no_part_of_it(chain):
    """Process 1 died by SIGKILL while the checkpoint of round 4 was written; process 0, which wrote round 4
    (the uninterrupted run's figures), waited for it at orbax's barrier and ended with exit 2 and one line: a
    lost process, resume with the processes there are. The third review: exit 134 after JAX's heartbeat with a
    30-line absl trace, a summary advising to free the disk, and checkpoints/4 left as if complete."""
    (rc, _, stderr), (killed_rc, _, _) = chain.lost
    assert killed_rc == -9 and rc == 2, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last == (f"fedjax-sparse: error: cannot save the checkpoint of round 4 in {chain.run / 'checkpoints'}: a "
                    f"process of the 2 stopped answering while it was saved (DEADLINE_EXCEEDED: Barrier timed out); "
                    f"the checkpoint of round 2 is intact; every process stops: resume with the processes you have, "
                    f"--resume {chain.run} (a checkpoint resumes on any number of processes)"), last
    assert "Traceback" not in stderr and "Check failure" not in stderr
    assert chain.left.checkpoints == ["2"]  # neither orbax's unfinished folder nor the save's mark
    assert_same_records(records(chain.reference)[:LOST_AFTER], chain.left.records, LOST_AFTER)
    assert chain.left.summary["status"] == "failed" and chain.left.summary["rounds_done"] == LOST_AFTER
    assert chain.left.summary["error"] == last.split("error: ", 1)[1] and chain.left.summary["last_checkpoint"] == 2


def test_the_survivor_then_three_processes_write_the_uninterrupted_runs_figures(chain):
    """Every record of rounds 1 to 6, once each (rounds 3 and 4, written before the loss past the checkpoint,
    are replaced by the survivor's), is the uninterrupted run's."""
    run = chain.run
    assert_same_records(records(chain.reference), records(run), SCAFFOLD_ROUNDS)
    assert summary(run)["processes"] == GROWN and summary(run)["status"] == "completed"
    assert summary(run)["client_store"] == "host" and "done: " in chain.resumed[0][1]
    for i in range(GROWN):
        assert f"fedjax-sparse: process {i}-of-{GROWN}: --client-store auto chose host: " in chain.resumed[i][2]
    # each layout saved its own processes' snapshots, and the one process its disk rows
    layouts = {rounds: sorted(p.name for p in (run / "checkpoints" / str(rounds) / "client_states").glob("client_*"))
               for rounds in (4, 6)}
    assert layouts == {4: ["client_states.0-of-1"], 6: [f"client_states.{p}-of-{GROWN}" for p in range(GROWN)]}
    assert (run / "client_store" / "client_rows.0-of-1.bin").is_file()
    assert not [p for p in (run / "client_store").iterdir() if p.name.startswith(".replaced")]


def saved_server_states(*runs):
    """The server states saved after the runs' last round, on this process's device: the first run's as
    it was saved (one process), each other's restored into that layout (it is replicated over any count)."""
    checkpointer = ocp.StandardCheckpointer()
    paths = [(run / "checkpoints" / str(SCAFFOLD_ROUNDS) / "state").resolve() for run in runs]
    first = checkpointer.restore(paths[0])
    return [first, *(checkpointer.restore(path, first) for path in paths[1:])]


def test_the_final_states_are_the_uninterrupted_runs_bytes(chain):
    """After round 6 the server state (model and control variate) is the uninterrupted run's, and
    process p of 3 holds a row for each of its clients (id % 3 == p) ever sampled and for no other,
    each the uninterrupted run's final state of that client, byte for byte."""
    uninterrupted, resumed = map(jax.tree_util.tree_leaves_with_path, saved_server_states(chain.reference, chain.run))
    for (name, mine), (_, theirs) in zip(resumed, uninterrupted, strict=True):
        assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes(), jax.tree_util.keystr(name)
    final = np.load(chain.reference / "checkpoints" / str(SCAFFOLD_ROUNDS) / "client_states" / "client_states.0-of-1"
                    / "rows.npy")
    sampled = set(np.concatenate([sample_clients_host(0, r, NUM_CLIENTS, PER_ROUND)
                                  for r in range(SCAFFOLD_ROUNDS)]).tolist())
    assert len(sampled) < NUM_CLIENTS  # some client never trained: its process must hold no row for it
    held = []
    for p in range(GROWN):
        snapshot = chain.run / "checkpoints" / str(SCAFFOLD_ROUNDS) / "client_states" / f"client_states.{p}-of-{GROWN}"
        slots, rows = np.load(snapshot / "slots.npy"), np.load(snapshot / "rows.npy")
        for local in np.flatnonzero(slots >= 0):
            held.append(local * GROWN + p)
            np.testing.assert_array_equal(rows[slots[local]], final[local * GROWN + p])
    assert sorted(held) == sorted(sampled)


def test_a_checkpoint_missing_a_process_snapshot_is_refused_in_one_line(chain, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(chain.run, copy)
    lost = copy / "checkpoints" / str(SCAFFOLD_ROUNDS) / "client_states" / f"client_states.1-of-{GROWN}"
    shutil.rmtree(lost)
    assert main(["run", "--resume", str(copy), "--rounds", str(SCAFFOLD_ROUNDS + 1), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{lost / 'meta.json'} is missing from the checkpoint" in err, err
    assert f"process 1 of the {GROWN}" in err and len(records(copy)) == SCAFFOLD_ROUNDS


# ---------------------------------------------------------------------------------------------
# The library: two processes' stores, written and saved, re-placed onto three and onto one

CLIENTS = 11


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    """The client states of 11 SCAFFOLD clients (a linear model's control variates) as random bytes,
    clients 0, 3, 4, 7, 9 and 10 written; process 0 of 2 keeps them on the host, process 1 on disk
    (auto decides for each process by its own memory), each saved into one checkpoint's client states.
    Process 1's disk store wrote client 3 twice (a new slot the second time: a kept checkpoint held the first)."""
    model = linear_model()
    algorithm = scaffold(LocalSGD(model, 0.1, 1, 4), CLIENTS)
    key, variables = jax.random.key(0), model.init(jax.random.key(1))
    run = tmp_path_factory.mktemp("two_stores")
    rows_dir, states = run / "client_store", run / "checkpoints" / "2" / "client_states"
    written = np.array([0, 3, 4, 7, 9, 10])

    def store(backend, process):
        return make_store(backend, algorithm, key, variables, CLIENTS, directory=rows_dir, process=process)

    stores = [store("host", ProcessLayout(0, 2)), store("disk", ProcessLayout(1, 2))]
    rows = np.random.default_rng(0).integers(0, 256, (CLIENTS, stores[0].row_bytes), dtype=np.uint8)
    stores[1].write(np.array([3]), rows[[0]])
    stores[1].snapshot(run / "checkpoints" / "1" / "client_states")
    for s in stores:
        s.write(written, rows[written])
        s.snapshot(states)
    return dict(store=store, states=states, rows_dir=rows_dir, rows=rows, written=written)


@pytest.mark.parametrize("count, backends", [(3, ("host", "disk")), (1, ("host", "disk", "device"))])
def test_rows_written_by_two_processes_land_on_their_clients_new_processes(saved_by_two, count, backends):
    s = saved_by_two
    for backend in backends:
        for index in range(count):
            process = ProcessLayout(index, count)
            store = s["store"](backend, process)
            ClientStatesHandler().restore(s["states"], ClientStatesRestore(store, 2, s["rows_dir"]))
            mine = process.owned(CLIENTS)
            if backend == "device":
                snapshot = store.snapshot(s["rows_dir"].parent / "device")  # every client, initial where unwritten
                got, held = np.load(snapshot / "rows.npy"), np.isin(mine, s["written"])
                initial = make_store("host", store.algorithm, store.init_key, store.init_variables, CLIENTS)
                np.testing.assert_array_equal(got[~held], np.asarray(initial.layout.pack(
                    initial.client_states(mine[~held]), int((~held).sum()))))
            else:
                got, held = store.read(mine)
                np.testing.assert_array_equal(held, np.isin(mine, s["written"]))
                np.testing.assert_array_equal(store.held_clients, mine[held])
            np.testing.assert_array_equal(got[held], s["rows"][mine[held]])
            if backend == "disk":
                assert store.path.name == f"client_rows.{process.tag()}.bin"
                assert not [p for p in s["rows_dir"].iterdir() if p.name.startswith(".replaced")]
            store.close()


def test_re_placing_refuses_a_missing_rows_file_or_damaged_rows_naming_the_file(saved_by_two, tmp_path):
    s = saved_by_two
    rows_dir = tmp_path / "client_store"
    shutil.copytree(s["rows_dir"], rows_dir)
    rows_file = rows_dir / "client_rows.1-of-2.bin"
    data = bytearray(rows_file.read_bytes())
    data[-1] ^= 1  # client 9's row: the last one written by process 1
    rows_file.write_bytes(bytes(data))
    store = s["store"]("host", ProcessLayout(0, 1))
    damaged = f"the rows of clients 9 in the disk client store's file {rows_file} differ from the checksums"
    with pytest.raises(SnapshotError, match=re.escape(damaged)):
        ClientStatesHandler().restore(s["states"], ClientStatesRestore(store, 2, rows_dir))
    rows_file.unlink()
    with pytest.raises(ClientRowsLost, match=re.escape(f"{rows_file} is missing")):
        ClientStatesHandler().restore(s["states"], ClientStatesRestore(store, 2, rows_dir))
