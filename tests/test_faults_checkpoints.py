"""Checkpoints under the second fault review (issue 36, items 3 and 10): a byte changed in anything a checkpoint
covers (the disk store's rows, the client-state snapshots, orbax's files) is refused in one line naming the file
and the checkpoint, before it is restored, where it used to resume silently with wrong states or spill tracebacks.
And under the third (issue 55, items 1, 5 and 6): a checkpoint without its checksums is refused as a damaged one;
a save that failed or was cut short leaves nothing that looks complete; an edited config.json is named.
"""

import json
import shutil
import sys

import jax
import numpy as np
import pytest

from fedjax_sparse.algorithms import scaffold
from fedjax_sparse.core.client_state.choice import make_store
from fedjax_sparse.core.client_state.snapshots import SnapshotError
from test_client_store import setting  # noqa: F401 - a fixture
from test_faults import TINY, cli, copy, fresh_fault_counts, one_line, records, summary, three_rounds  # noqa: F401


def flip(path, start=None, count=16):
    """Inverts `count` bytes of a file from `start` (a third of the way in by default), keeping its size."""
    data = bytearray(path.read_bytes())
    start = len(data) // 3 if start is None else start
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def as_before_checksums(step):
    """The checkpoint in `step` as a version before checksums wrote it: no checksums.json, no mark in its meta."""
    (step / "checksums.json").unlink()
    meta = json.loads((step / "meta" / "metadata").read_text())
    del meta["checksummed"]
    (step / "meta" / "metadata").write_text(json.dumps(meta))


def test_36_3_scaled_rows_of_the_disk_store_are_refused_naming_the_file_and_the_checkpoint(copy, capsys):
    """The review scaled the float32s of a SCAFFOLD run's disk-store rows by 50 (same size): --resume exited 0 and
    trained on from the damaged client states (accuracy 0.21/0.31 where the uninterrupted run has 0.88/0.87)."""
    rows = copy / "client_store" / "client_rows.0-of-1.bin"
    (np.fromfile(rows, np.float32) * 50).tofile(rows)
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    latest = copy / "checkpoints" / "3"
    one_line(err, f"in the disk client store's file {rows} differ from the checksums recorded with the checkpoint "
             f"{latest} (damaged since it was saved); delete {latest} to resume")
    shutil.rmtree(latest)  # the checkpoint before refers to rows of the same file, as damaged
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    one_line(err, f"{rows} differ from the checksums recorded with the checkpoint {copy / 'checkpoints' / '2'}")


def test_36_3_each_row_a_disk_snapshot_refers_to_is_checked_through_restores_and_rewrites(setting, tmp_path):
    """The rows' checksums are taken at each snapshot for the rows written since the one before; a restored store
    carries the restored rows' checksums on. A row damaged in the file is refused by the snapshots that refer to it
    and by no other; a snapshot written before the checksums restores unchecked, and the next is checked whole."""
    alg, key, variables = scaffold(setting["local"], 6), jax.random.key(0), setting["variables"]
    store = make_store("disk", alg, key, variables, 6, directory=tmp_path / "rows", keep=2)
    rng = np.random.default_rng(3)
    rows = lambda n: rng.integers(0, 255, (n, store.row_bytes), dtype=np.uint8)  # noqa: E731
    store.write(np.array([0, 1, 2]), rows(3))
    store.snapshot(tmp_path / "c1")
    store.write(np.array([1, 3]), rows(2))
    store.write(np.array([3]), rows(1))  # twice between two snapshots
    store.snapshot(tmp_path / "c2")
    store.close()
    resumed = make_store("disk", alg, key, variables, 6, directory=tmp_path / "rows", keep=2)
    resumed.restore(tmp_path / "c2")
    resumed.write(np.array([4]), rows(1))
    resumed.snapshot(tmp_path / "c3")  # clients 0-3's checksums carried from c2, client 4's taken
    resumed.close()
    fresh = lambda: make_store("disk", alg, key, variables, 6, directory=tmp_path / "rows", keep=2)  # noqa: E731
    fresh().restore(tmp_path / "c3")
    slot_of_4 = np.load(tmp_path / "c3" / "client_states.0-of-1" / "slots.npy")[4]
    flip(tmp_path / "rows" / "client_rows.0-of-1.bin", start=int(slot_of_4) * store.row_bytes + 100, count=1)
    with pytest.raises(SnapshotError, match=f"the rows of client 4 in the disk client store's file "
                                            f".*client_rows.0-of-1.bin differ from the checksums"):
        fresh().restore(tmp_path / "c3")
    fresh().restore(tmp_path / "c2")  # it never referred to client 4's row
    # c2 as a version before the checksums wrote it: restored unchecked, then the next snapshot checks every row
    old = tmp_path / "c2" / "client_states.0-of-1"
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("crc32", "meta_crc32")}))
    (old / "row_crc32.npy").unlink()
    store = fresh()
    store.restore(tmp_path / "c2")
    store.snapshot(tmp_path / "c4")
    slot_of_0 = np.load(old / "slots.npy")[0]
    flip(tmp_path / "rows" / "client_rows.0-of-1.bin", start=int(slot_of_0) * store.row_bytes, count=1)
    with pytest.raises(SnapshotError, match="the rows of client 0 in"):
        fresh().restore(tmp_path / "c4")


def test_36_3_damaged_snapshot_files_and_fields_are_refused(setting, tmp_path):
    """A host (or device) snapshot keeps its rows in the checkpoint: a flipped byte there restored silently; a
    meta.json edited into other valid JSON passed for another run's snapshot."""
    alg, key, variables = scaffold(setting["local"], 6), jax.random.key(0), setting["variables"]
    host = make_store("host", alg, key, variables, 6)
    host.write(np.array([1, 4]), np.random.default_rng(0).integers(0, 64, (2, host.row_bytes), dtype=np.uint8))
    snapshot = host.snapshot(tmp_path / "ckpt" / "client_states")
    flip(snapshot / "rows.npy")
    with pytest.raises(SnapshotError, match=f"the bytes of the client-state snapshot file {snapshot / 'rows.npy'} "
                                            f"differ from the checksums recorded with the checkpoint {tmp_path / 'ckpt'} "):
        make_store("host", alg, key, variables, 6).restore(tmp_path / "ckpt" / "client_states")
    snapshot = host.snapshot(tmp_path / "ckpt" / "client_states")
    meta = json.loads((snapshot / "meta.json").read_text())
    (snapshot / "meta.json").write_text(json.dumps({**meta, "row_bytes": meta["row_bytes"] + 1}))
    with pytest.raises(SnapshotError, match="the fields of the client-state snapshot .*meta.json differ from the "
                                            "checksums"):
        make_store("host", alg, key, variables, 6).restore(tmp_path / "ckpt" / "client_states")


@pytest.mark.parametrize("damage", ["state/manifest.ocdbt", "server state data", "meta/metadata"])
def test_36_10_flipped_bytes_in_orbax_files_are_one_line_naming_the_file(copy, capsys, damage):
    """Flipped bytes in a checkpoint's orbax files gave the right first line, then 127 lines and two tracebacks
    from tensorstore's reads; flipped in an array's data file, they resumed silently from a wrong server state
    (or diverged, blaming the learning rate)."""
    latest = copy / "checkpoints" / "3"
    if damage == "server state data":  # the largest file: the model's weights
        path = max((latest / "state" / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)
    else:
        path = latest / damage
    flip(path)
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    one_line(err, f"the bytes of {path} differ from the checksums recorded with the checkpoint {latest} (damaged "
             f"since it was saved); delete {latest} to resume from the checkpoint before")


def test_36_10_a_garbled_snapshot_names_its_checkpoint_folder_and_reads_leave_no_tracebacks(copy, capsys,
                                                                                               monkeypatch):
    """The advice for an unreadable client-state snapshot named .../checkpoints/3/client_states, where the folder
    to delete is .../checkpoints/3. And a checkpoint without checksums (from before them) whose orbax index is
    damaged: tensorstore's reads still in flight printed 'RuntimeError: Event loop is closed' tracebacks after
    the one line."""
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # restored after the test
    latest = copy / "checkpoints" / "3"
    meta = latest / "client_states" / "client_states.0-of-1" / "meta.json"
    meta.write_text(meta.read_text()[:20])
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    one_line(err, f"the client-state snapshot {meta} cannot be read", f"delete its checkpoint folder {latest} to resume")
    shutil.rmtree(latest)
    before = copy / "checkpoints" / "2"
    as_before_checksums(before)
    flip(before / "state" / "manifest.ocdbt")
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    one_line(err, f"the checkpoint {before} cannot be read (DATA_LOSS: Error decoding local file "
                  f"\"{before / 'state' / 'manifest.ocdbt'}\": Error decoding manifest")
    assert "tensorstore_spec" not in err and len(err.replace(str(copy), "$RUN")) <= 400  # the layers and spec dropped

    class LateRead:  # what tensorstore's callbacks raise into orbax's closed event loop
        def __del__(self):
            raise RuntimeError("Event loop is closed")

    LateRead()
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ the third fault review (issue 55)

def largest_data_file(step):
    return max((step / "state" / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)


def test_55_1_a_checkpoint_without_its_checksums_is_refused_naming_it(three_rounds, copy, capsys):
    """The review removed checkpoints/2/checksums.json and flipped bytes of a data file there: the damaged state
    loaded unchecked and the run went NaN, blamed on the learning rate. Refused like a damaged checkpoint, and the
    one before resumes, to the uninterrupted run's records."""
    latest = copy / "checkpoints" / "3"
    (latest / "checksums.json").unlink()
    flip(largest_data_file(latest))
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    one_line(err, f"the checkpoint {latest} has no checksums ({latest / 'checksums.json'} is missing",
             f"delete {latest} to resume from the checkpoint before")
    shutil.rmtree(latest)
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 0, err
    assert records(copy)[:3] == records(three_rounds) and len(records(copy)) == 4


def test_55_5_a_save_that_fails_after_orbax_committed_it_leaves_no_checkpoint(three_rounds, tmp_path, capsys,
                                                                              monkeypatch):
    """A save can fail after orbax committed the checkpoint, before its checksums are written (the review: a
    process lost in the save; here the disk full at the checksums): checkpoints/2 stayed, complete to look at,
    though the summary said its save failed. It is deleted; the run resumes from round 1's, to the records of the
    run that never failed."""
    run = tmp_path / "run"
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT", "write:checksums.json:2:errno=28")
    code, err = cli(capsys, *TINY, "--algorithm", "scaffold", "--rounds", "3", "--checkpoint-every", "1",
                    "--client-store", "disk", "--out", str(run))
    monkeypatch.delenv("FEDJAX_SPARSE_FAULT")
    assert code == 2
    one_line(err, f"cannot save the checkpoint of round 2 in {run / 'checkpoints'}: No space left on device "
                  f"[errno 28]", "the checkpoint of round 1 is intact")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1"]
    assert summary(run)["status"] == "failed" and summary(run)["last_checkpoint"] == 1
    code, err = cli(capsys, "--resume", str(run), "--no-progress")
    assert code == 0, err
    assert records(run) == records(three_rounds)


def test_55_5_a_checkpoint_whose_save_was_cut_short_is_deleted_on_resume(three_rounds, copy, capsys):
    """What a kill between orbax's commit and the checksums leaves (the save's mark, no checksums.json): the
    resume said nothing and took it unchecked. It is deleted, saying so, and the one before resumes."""
    latest = copy / "checkpoints" / "3"
    (latest / "checksums.json").unlink()
    (copy / "checkpoints" / ".saving-3").touch()
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 0, err
    assert f"the checkpoint of round 3 in {copy / 'checkpoints'} was cut short while it was saved" in err
    assert records(copy)[:3] == records(three_rounds) and len(records(copy)) == 4
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["3", "4"]  # round 3's saved anew


def test_55_6_an_edited_config_json_is_named_not_blamed_on_flags(copy, capsys):
    """The review changed lr from 0.1 to 0.3 in config.json and resumed without flags: "... this run has 0.3;
    drop those flags". And a flag on top of the edit is still the flag's to drop."""
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "lr": 0.3}))
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--no-progress")
    assert code == 2
    one_line(err, f"{copy / 'config.json'} was edited after the checkpoint was saved (lr: the checkpoint has 0.1, "
                  f"config.json has 0.3)", "put the checkpoint's values back in it")
    assert "flags" not in err
    code, err = cli(capsys, "--resume", str(copy), "--rounds", "4", "--seed", "7", "--no-progress")
    assert code == 2
    one_line(err, "config.json has 0.3", "(seed: checkpoint has 0, this run has 7): drop those flags")
