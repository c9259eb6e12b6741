"""Elastic resume: a checkpoint written by P processes resumes on P' (the survivors of a lost process,
or more of them), each process taking its clients' rows (id % P') from the P snapshots. Through the
command line, 2 -> 1 -> 2 processes write the uninterrupted run's figures and client states to the
last bit; in the library, the rows of 2 processes' stores (host and disk mixed) land on 3 and on 1,
each client's bytes where its new process holds them; a checkpoint missing a part is refused in one
line naming the file."""

import json
import re
import shutil

import jax
import numpy as np
import pytest

from conftest import SCAFFOLD_ARGS, SCAFFOLD_ROUNDS, linear_model
from test_distributed import assert_same_records, records, run_two
from fedjax_sparse.algorithms import scaffold
from fedjax_sparse.core.client_store import make_store
from fedjax_sparse.core.distributed import ProcessLayout
from fedjax_sparse.core.local_training import LocalSGD
from fedjax_sparse.core.participation import sample_clients_host
from fedjax_sparse.core.store_snapshots import ClientRowsLost, SnapshotError
from fedjax_sparse.run.checkpoints import ClientStatesHandler, ClientStatesRestore
from fedjax_sparse.run.cli import main

RUN = SCAFFOLD_ARGS
NUM_CLIENTS, PER_ROUND = (int(RUN[RUN.index(flag) + 1]) for flag in ("--num-clients", "--clients-per-round"))


@pytest.fixture(scope="module")
def chain(tmp_path_factory, scaffold_reference):
    """conftest's SCAFFOLD run, in three launches into one folder: two processes to round 2 (auto picks
    the host store), one process to round 4 on the disk store (the survivor of a lost process), two
    processes to round 6 (auto again: the host store, from the one process's disk rows). Several
    processes need K = 4 to be a multiple of their devices: 3 processes are refused by the run itself
    (4 would put one client on each device, whose training loss XLA computes unbatched, in other last
    bits), so the chain grows back to 2; the library test below re-places onto 3."""
    run = tmp_path_factory.mktemp("elastic") / "run"
    run_two(*RUN, "--rounds", 2, "--out", run)
    assert main(["run", "--resume", str(run), "--rounds", "4", "--client-store", "disk", "--no-progress"]) == 0
    resumed = run_two("--resume", run, "--rounds", SCAFFOLD_ROUNDS, "--client-store", "auto", "--no-progress")
    return scaffold_reference, run, resumed


def test_a_run_resumed_on_one_process_then_two_writes_the_uninterrupted_runs_figures(chain):
    one, run, resumed = chain
    assert_same_records(records(one), records(run), SCAFFOLD_ROUNDS)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["status"] == "completed" and summary["client_store"] == "host"
    assert "done: " in resumed[0][1]
    # each layout saved its own processes' snapshots, and the one process its disk rows
    layouts = {rounds: sorted(p.name for p in (run / "checkpoints" / str(rounds) / "client_states").glob("client_*"))
               for rounds in (4, 6)}
    assert layouts == {4: ["client_states.0-of-1"], 6: ["client_states.0-of-2", "client_states.1-of-2"]}
    assert (run / "client_store" / "client_rows.0-of-1.bin").is_file()
    assert not [p for p in (run / "client_store").iterdir() if p.name.startswith(".replaced")]


def test_the_re_placed_client_states_are_the_uninterrupted_runs_bytes(chain):
    """After round 6, process p of 2 holds a row for each of its clients (id % 2 == p) ever sampled, and
    each row is the uninterrupted run's final state of that client, byte for byte."""
    one, run, _ = chain
    final = np.load(one / "checkpoints" / str(SCAFFOLD_ROUNDS) / "client_states" / "client_states.0-of-1" / "rows.npy")
    sampled = set(np.concatenate([sample_clients_host(0, r, NUM_CLIENTS, PER_ROUND)
                                  for r in range(SCAFFOLD_ROUNDS)]).tolist())
    held = []
    for p in range(2):
        snapshot = run / "checkpoints" / str(SCAFFOLD_ROUNDS) / "client_states" / f"client_states.{p}-of-2"
        slots, rows = np.load(snapshot / "slots.npy"), np.load(snapshot / "rows.npy")
        for local in np.flatnonzero(slots >= 0):
            held.append(local * 2 + p)
            np.testing.assert_array_equal(rows[slots[local]], final[local * 2 + p])
    assert sorted(held) == sorted(sampled)


def test_a_checkpoint_missing_a_process_snapshot_is_refused_in_one_line(chain, tmp_path, capsys):
    _, run, _ = chain
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    lost = copy / "checkpoints" / str(SCAFFOLD_ROUNDS) / "client_states" / "client_states.1-of-2"
    shutil.rmtree(lost)
    assert main(["run", "--resume", str(copy), "--rounds", str(SCAFFOLD_ROUNDS + 1), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{lost / 'meta.json'} is missing from the checkpoint" in err, err
    assert "process 1 of the 2" in err and len(records(copy)) == SCAFFOLD_ROUNDS


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
