"""Whole-run checkpoints with orbax, for exact resume.

A checkpoint holds the server state, the client states (optimizer and control
variates included, whatever the algorithm keeps), the number of rounds done and
the run's byte counters. Randomness needs no saving: clients, batches and
augmentation are drawn from keys derived from (seed, round, client), so a
resumed run draws exactly what the uninterrupted run would have.

The client states are their store's snapshot (`core.client_state.store`), an item of
the checkpoint that every process writes for the clients it holds
(`client_states/client_states.{p}-of-{P}`) before orbax commits the checkpoint;
the disk store's snapshot is its slot map, its rows staying in the store's file
under the run folder. Device and host snapshots restore into any store; a disk
snapshot only into the disk store. With several processes orbax saves the
replicated server state once and every process takes part in each save.

Elastic resume: a checkpoint that P processes wrote restores on P' (a lost node's
survivors, or more machines). The server state is replicated, so it restores as
it is; each process gathers its clients' rows (id % P' == its index) from the P
snapshots (a disk store's from its files) into a host store's snapshot under its
temporary folder, which its store restores (`store_snapshots.replace_rows`). The
rows are bytes, so the states are exactly the saved ones; with P' == P nothing
changes. The old processes' rows files stay in the run's `client_store` folder
for the checkpoints that still refer to them.

A save either commits a checkpoint that reads back or raises `CheckpointError`:
orbax silently skips a step that is not above the latest one on disk, which
would leave a run believing it had saved.

Every byte a checkpoint covers is checksummed (CRC-32) when it is written and
checked before it is read: the client-state snapshots and the disk store's rows
by the store (`core.client_state.snapshots`), orbax's files by `checksums.json`, which
process 0 writes into the checkpoint's folder once orbax has committed it. A
changed byte is refused in one line naming the file and the checkpoint, before
orbax reads it: orbax restores a flipped byte of an array's data silently, and
its reads failing on a damaged index spill tracebacks from their threads. A
checkpoint without `checksums.json` is refused the same way, naming it: its files
cannot be checked. Its meta says whether it was written with checksums (`CHECKSUMMED`,
read from orbax's file as it is); one written by a version before them restores
unchecked, as it always did.

A save is complete once its checksums are written. Process 0 marks the save in the
checkpoints folder (`.saving-R`) before it starts and removes the mark after the
checksums: a checkpoint still marked has no checksums because its save was cut
short (a kill, a lost process, between orbax's commit and the checksums), not
because they were removed. Reads pass over it as if it were not there, and a
resumed run deletes it before anything else (`discard_cut_short`), so it is never
taken for a complete one.

A save that fails (a full disk, a file-size limit, a process lost) is one
`CheckpointError`; what it left is deleted (orbax's unfinished files, the folder
of a checkpoint committed without its checksums), so that the run's summary may
still fit on a full disk and nothing looks complete that is not; and what orbax's
threads print as they fail after it (tensorstore's writes completing into orbax's
closed event loop) is dropped for the rest of the process, as after a failed read
(`_orbax_io`). Where a process of several stopped answering during the save (the
others wait for it at orbax's barriers, which time out after the processes'
meeting time, `core.round.distributed.meeting_timeout`), the error is a `SaveLostAProcess`.

Why one module past 400 lines: saving, verifying and restoring are one protocol (the checksums written at a save are
what a restore checks, the marks a save leaves are what a resume discards), and splitting it would put the two
halves of each rule in different files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from fedjax_sparse.core.client_state.row_store import DiskStore

from fedjax_sparse.core.client_state.store import ClientStore, DeviceStore
from fedjax_sparse.core.round.distributed import meeting_timeout
from fedjax_sparse.console import quieted
from fedjax_sparse.core.client_state.snapshots import SnapshotError, damaged, file_crc32, replace_rows
from fedjax_sparse.run.faults import fault_point
from fedjax_sparse.run.outputs import replace_atomically

# Config fields a resumed run may change without changing its results. The client store may change
# (each holds the same states), except that a disk store's checkpoint restores only into the disk
# store (the run refuses the others, and `auto` picks disk then). Sharding the clients over the
# devices changes the order of the sum over them, hence the results' last bits: it may not change. Which
# device trains which client (`device_split`) may: every device reduces the uploads in client order.
RESUMABLE_CHANGES = ("rounds", "out", "checkpoint_every", "checkpoint_minutes", "compilation_cache", "data_dir",
                     "download", "tensorboard", "client_store", "cpu_devices", "device_split", "logger",
                     "mlflow_tracking_uri", "wandb_project")
ASYNC_TIMEOUT_S = 60  # orbax's waits on its background save (its default: 20 minutes); with several processes,
# the time they have to meet (`core.round.distributed.meeting_timeout`, below JAX's heartbeat)
KEEP = 2  # checkpoints kept; the disk client store never overwrites the rows they refer to
CLIENT_STATES = "client_states"  # the checkpoint's item holding the client-state snapshots
CHECKSUMS = "checksums.json"  # in a checkpoint's folder: the CRC-32 of each of orbax's files there
CHECKSUMMED = "checksummed"  # in a checkpoint's meta: written with its checksums.json
SAVING = ".saving-"  # + the round: in the checkpoints folder while that round's checkpoint is saved (process 0's)
ROWS_FOLDER = "client_store"  # in the run folder: the disk client stores' rows files (`run.experiment`)


class ClientStatesHandler(ocp.CheckpointHandler):
    """A checkpoint's client states: each process saves its store's snapshot into the item's
    folder (durable before orbax commits the checkpoint) and restores its store from it, or,
    from a checkpoint of another number of processes, from its clients' rows re-placed."""

    def save(self, directory, args: "ClientStatesSave") -> None:
        args.store.snapshot(Path(directory))

    def restore(self, directory, args: "ClientStatesRestore") -> str:
        store = args.store
        if args.written_by == store.process.count:
            store.restore(Path(directory))
            return store.backend
        # beside a disk store's rows (the space the run was given for them), else in the system's temporary folder
        near = store.directory if isinstance(store, DiskStore) else None
        with tempfile.TemporaryDirectory(prefix=f".replaced-{store.process.tag()}-", dir=near) as into:
            store.restore(replace_rows(directory, args.written_by, store.process, args.rows_dir, Path(into)))
        return store.backend


@ocp.args.register_with_handler(ClientStatesHandler, for_save=True)
@dataclasses.dataclass
class ClientStatesSave(ocp.args.CheckpointArgs):
    store: ClientStore


@ocp.args.register_with_handler(ClientStatesHandler, for_restore=True)
@dataclasses.dataclass
class ClientStatesRestore(ocp.args.CheckpointArgs):
    store: ClientStore
    written_by: int = 1  # the number of processes that wrote the checkpoint
    rows_dir: Path | None = None  # where their disk stores' rows files are (the run's client_store folder)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names it and what to do."""


class SaveLostAProcess(CheckpointError):
    """Another process of the run stopped answering while a checkpoint was saved (a kill, a lost node)."""


# what orbax's barriers raise when a process does not reach them (gone: a kill, a lost node)
_BARRIER_FAILURES = ("Barrier timed out", "Barrier failed", "DEADLINE_EXCEEDED", "UNAVAILABLE", "unhealthy")


def _first_sentence(err: BaseException) -> str:
    """The first sentence of `err`, at most 160 characters, cut between words (never mid-token)."""
    text = " ".join(str(err).split()).split(". ", 1)[0]
    if len(text) <= 160:
        return text
    cut = text.rfind(" ", 0, 157)
    return text[:cut if cut > 0 else 157] + " ..."


def _written_with_checksums(step: Path) -> bool:
    """Whether the checkpoint in `step` was saved with its checksums, as its meta (orbax's JSON file, read as
    it is) says; True where the meta cannot be read (nothing vouches that it was written without them)."""
    try:
        meta = json.loads((step / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return True
    return not (isinstance(meta, dict) and "config" in meta and CHECKSUMMED not in meta)


def _cut_short(directory: Path, rounds_done: int) -> bool:
    """Whether the checkpoint of `rounds_done` under `directory` is one whose save was cut short (still marked,
    without its checksums)."""
    return (directory / f"{SAVING}{rounds_done}").exists() and not (directory / str(rounds_done) / CHECKSUMS).exists()


def discard_cut_short(run_dir: str | Path) -> list[int]:
    """Deletes what saves cut short left in `run_dir`'s checkpoints (module docstring): the rounds whose
    checkpoint was deleted (process 0 only, before any process reads the checkpoints)."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    discarded = []
    for mark in sorted(directory.glob(f"{SAVING}*")):
        rounds_done = mark.name[len(SAVING):]
        if not rounds_done.isdigit():
            continue
        if _cut_short(directory, int(rounds_done)):
            for unfinished in [directory / rounds_done, *directory.glob(f"{rounds_done}{ocp.utils.TMP_DIR_SUFFIX}*")]:
                if unfinished.exists():
                    discarded.append(int(rounds_done))
                shutil.rmtree(unfinished, ignore_errors=True)
        mark.unlink(missing_ok=True)
    return sorted(set(discarded))


def config_mismatches(saved: dict, current: dict) -> list[str]:
    """The names of the fields that differ and would change the results."""
    names = sorted((set(saved) | set(current)) - set(RESUMABLE_CHANGES))
    return [name for name in names if saved.get(name) != current.get(name)]


def has_checkpoints(run_dir: str | Path) -> bool:
    """Whether RUN_DIR/checkpoints exists (checked without creating it)."""
    return (Path(run_dir) / "checkpoints").is_dir()


def io_reason(err: BaseException) -> str:
    """The OS's words for an I/O failure anywhere in `err`'s causes ('No space left on device [errno 28]'),
    else its own first line."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"{seen.strerror} [errno {seen.errno}]" + (f": {seen.filename}" if seen.filename else "")
        code = re.search(r"os_error_code='?(\d+)", str(seen))
        if code:
            return f"{os.strerror(int(code.group(1)))} [errno {code.group(1)}]"
        seen = seen.__cause__ or seen.__context__
    return " ".join(str(err).split())[:300]


def _orbax_files(step: Path) -> list[Path]:
    """The files orbax wrote for a checkpoint (the client-state snapshots carry their own checksums)."""
    return sorted(f for f in step.rglob("*") if f.is_file() and f.name != CHECKSUMS
                  and f.relative_to(step).parts[0] != CLIENT_STATES)


def _quiet_orbax():
    """Orbax logs each failure of its background threads with a traceback; the run reports it once."""
    return quieted("absl", logging.CRITICAL)


class _UnretrievedFailures(logging.Filter):
    """asyncio's 'Future exception was never retrieved' (or 'Task ...'), with its traceback: what a failed
    write that orbax gathered but did not await logs when the garbage collector takes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Future exception was never retrieved",
                                                   "Task exception was never retrieved"))


@contextlib.contextmanager
def _orbax_io():
    """Orbax's reads or saves, quiet (`_quiet_orbax`). When one fails, tensorstore's reads or writes
    still in flight complete into the event loop orbax has closed, each printing 'RuntimeError: Event
    loop is closed' as unraisable, and the writes it gathered log their unretrieved failures through
    asyncio when they are collected: up to a hundred lines around the run's one-line error, while orbax
    unwinds and after (when is tensorstore's and the collector's: a race). Those are dropped from the
    start of the reads or saves, and for good after a failure; anything else still reaches the hook and
    the log as before."""
    previous, unretrieved = sys.unraisablehook, _UnretrievedFailures()

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(unretrieved)
    with _quiet_orbax():
        yield
    logging.getLogger("asyncio").removeFilter(unretrieved)  # neither is reached when they failed
    sys.unraisablehook = previous


def _orbax_reason(err: Exception) -> str:
    """The cause in an orbax read's error, for one line: tensorstore wraps it in one "Error opening/reading
    ..." per layer of its stack (cast, zarr, OCDBT) and appends its whole spec, 400 characters of which
    named no file; the status code, the innermost layer (the file) and its reason are what a user can act on."""
    text = " ".join(str(err).split()).split(" [tensorstore_spec", 1)[0]
    layers = text.split(": Error ")
    if len(layers) > 3:
        text = f"{layers[0]}: Error {layers[-2]}: Error {layers[-1]}"
    return text if len(text) <= 300 else text[:297] + "..."


class RunCheckpointer:
    """Keeps the latest checkpoints of one run under RUN_DIR/checkpoints/<rounds done>.

    A save fails within seconds, never after orbax's own timeouts: the folder is probed for a
    write first (a read-only, immutable or full disk answers at once), orbax's waits are bounded
    by `ASYNC_TIMEOUT_S`, and its background threads' failures become one `CheckpointError`
    naming the folder and the OS's reason; the checkpoints before stay as they were.
    """

    def __init__(self, run_dir: str | Path, max_to_keep: int = KEEP):
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir.resolve() / "checkpoints"
        wait = ASYNC_TIMEOUT_S if jax.process_count() == 1 else meeting_timeout()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                               async_options=ocp.AsyncOptions(timeout_secs=wait))
        with _quiet_orbax():
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._verified: set[int] = set()  # checkpoints whose files matched their checksums

    def _probe(self, rounds_done: int) -> None:
        probe = self.directory / f".write-probe-{os.getpid()}"
        try:
            fault_point("write:checkpoints")
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.mkdir()
            with open(probe / "bytes", "wb") as f:
                f.write(b"\0" * 4096)
                os.fsync(f.fileno())
            shutil.rmtree(probe)
        except OSError as err:
            shutil.rmtree(probe, ignore_errors=True)
            raise self._unsaved(rounds_done, err) from None

    def _unsaved(self, rounds_done: int, err: BaseException) -> CheckpointError:
        latest = self.latest_round()
        kept = f"the checkpoint of round {latest} is intact" if latest is not None else "no earlier checkpoint"
        if jax.process_count() > 1 and any(words in str(err) for words in _BARRIER_FAILURES):
            return SaveLostAProcess(
                f"cannot save the checkpoint of round {rounds_done} in {self.directory}: a process of the "
                f"{jax.process_count()} stopped answering while it was saved ({_first_sentence(err)}); {kept}; "
                f"every process stops: resume with the processes you have, --resume {self.run_dir} (a checkpoint "
                f"resumes on any number of processes)")
        return CheckpointError(f"cannot save the checkpoint of round {rounds_done} in {self.directory}: "
                               f"{io_reason(err)}; {kept}; free the disk or fix the folder, then --resume "
                               f"{self.run_dir}")

    def save(self, rounds_done: int, server_state: Any, store: ClientStore, meta: dict) -> Path:
        """Writes the checkpoint of `rounds_done` rounds, waits for it and reads its meta back."""
        latest = self.latest_round()
        self._probe(rounds_done)
        meta = {**meta, CHECKSUMMED: True}
        lead = jax.process_index() == 0
        mark = self.directory / f"{SAVING}{rounds_done}"
        waited = False  # for orbax's background save: it has ended (or hangs) once its wait raised
        try:
            if lead:
                mark.touch()
            with _orbax_io():
                saved = self._manager.save(rounds_done, args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"server_state": server_state}), meta=ocp.args.JsonSave(meta),
                    **{CLIENT_STATES: ClientStatesSave(store)}))
                if saved:
                    fault_point("checkpoint_write")
                    waited = True
                    self._manager.wait_until_finished()
            path = self.directory / str(rounds_done)
            if saved and lead:
                self._write_checksums(path)
                mark.unlink()
        except Exception as err:  # noqa: BLE001 - orbax raises many kinds from its threads
            self._discard_unfinished(rounds_done, wait=not waited)
            raise self._unsaved(rounds_done, err) from err
        if not saved:
            if lead:
                mark.unlink(missing_ok=True)
            raise CheckpointError(f"cannot save the checkpoint of round {rounds_done} in {self.directory}: it "
                                  f"already holds one of round {latest}, from another run or an earlier "
                                  f"attempt; start again with --overwrite or choose a new --out")
        self._verified.add(rounds_done)  # its checksums were just taken from its files
        with _quiet_orbax():  # it logs a damaged _CHECKPOINT_METADATA (timestamps only) of any checkpoint kept
            self._manager.reload()
        if self.latest_round() != rounds_done or self.read_meta() != json.loads(json.dumps(meta)):
            raise CheckpointError(f"the checkpoint of round {rounds_done} in {path} did not read back as "
                                  f"written; check the disk (space, permissions) and resume from the one "
                                  f"before with --resume {self.run_dir}")
        return path

    def _discard_unfinished(self, rounds_done: int, wait: bool) -> None:
        """Deletes what a failed save of `rounds_done` left (orbax's temporary folder, never committed; the
        checkpoint itself where orbax committed it but its checksums were not written): on a full disk, the
        space the run's summary needs; and nothing is left that looks complete. Process 0's (it marks the
        save, commits it and writes the checksums); another process's failure leaves the mark, which a
        resumed run reads (`discard_cut_short`). `wait`: for orbax's background save to end first (the
        failure came before its wait; deleting under it would make it fail with tracebacks of its own)."""
        if wait:
            with contextlib.suppress(Exception), _quiet_orbax():
                self._manager.wait_until_finished()
        if jax.process_index() == 0:
            discard_cut_short(self.run_dir)  # (orbax's reload would wait for the other processes: not here)

    def _write_checksums(self, step: Path) -> None:
        text = json.dumps({str(f.relative_to(step)): file_crc32(f) for f in _orbax_files(step)}, indent=0)

        def write(tmp: Path) -> None:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())

        replace_atomically(step / CHECKSUMS, write)

    def _verify(self, rounds_done: int) -> None:
        """Refuses the checkpoint of `rounds_done` if a file orbax wrote differs from its checksum."""
        step = self.directory / str(rounds_done)
        checksums = step / CHECKSUMS
        if rounds_done in self._verified:
            return
        if not checksums.exists():
            if not _written_with_checksums(step):
                return  # a version before checksums wrote it: restored unchecked, as then
            raise CheckpointError(f"the checkpoint {step} has no checksums ({checksums} is missing), so its files "
                                  f"cannot be checked; delete {step} to resume from the checkpoint before, or start "
                                  f"again with --overwrite")
        try:
            recorded = json.loads(checksums.read_text())
            if not isinstance(recorded, dict) or not all(isinstance(c, int) for c in recorded.values()):
                raise ValueError("it holds no file checksums")
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(f"the checksums of the checkpoint {step}, {checksums}, cannot be read "
                                  f"({' '.join(str(err).split())[:200]}); delete {step} to resume from the "
                                  f"checkpoint before, or start again with --overwrite") from None
        for name, crc in recorded.items():
            if not (step / name).is_file():
                raise CheckpointError(f"{step / name} is missing from the checkpoint {step}; delete {step} to "
                                      f"resume from the checkpoint before, or start again with --overwrite")
            if file_crc32(step / name) != crc:
                raise CheckpointError(damaged(f"the bytes of {step / name}", step))
        self._verified.add(rounds_done)

    def latest_round(self) -> int | None:
        """The latest checkpoint's rounds, passing over any whose save was cut short (module docstring) or
        that a failed save deleted."""
        steps = [step for step in self._manager.all_steps() if (self.directory / str(step)).is_dir()
                 and (step in self._verified or not _cut_short(self.directory, step))]
        return max(steps, default=None)

    def client_states_dir(self) -> Path | None:
        """The folder of the latest checkpoint's client-state snapshots (None: no checkpoint, or one
        saved before the client stores, which kept the device's client states in its state item)."""
        rounds_done = self.latest_round()
        path = None if rounds_done is None else self.directory / str(rounds_done) / CLIENT_STATES
        return path if path is not None and path.is_dir() else None

    def _unreadable(self, rounds_done: int, err: Exception) -> CheckpointError:
        if isinstance(err, SnapshotError):  # it names its file and what to do itself
            return CheckpointError(str(err))
        return CheckpointError(f"the checkpoint {self.directory / str(rounds_done)} cannot be read "
                               f"({_orbax_reason(err)}); delete that folder to resume from "
                               f"the one before, or start again with --overwrite")

    def restore(self, server_like: Any, store: ClientStore) -> tuple[int, Any, dict]:
        """The latest checkpoint: (rounds done, the server state restored into the shapes, dtypes and
        shardings of `server_like`, its meta); `store` takes the client states."""
        rounds_done = self.latest_round()
        if rounds_done is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}; run with --checkpoint-every "
                                    f"to make one")
        self._verify(rounds_done)
        like = {"server_state": server_like}
        written_by = (self.read_meta() or {}).get("processes", 1)
        items = {CLIENT_STATES: ClientStatesRestore(store, written_by, self.run_dir / ROWS_FOLDER)}
        if self.client_states_dir() is None:  # saved before the client stores: client states beside the server's
            if not isinstance(store, DeviceStore):
                raise CheckpointError(f"the checkpoint {self.directory / str(rounds_done)} keeps the client states "
                                      f"the way runs before the client stores did; resume it with --client-store "
                                      f"device")
            like["client_states"], items = store.states, {}
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
        try:
            with _orbax_io():
                restored = self._manager.restore(rounds_done, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore(), **items))
        except Exception as err:  # orbax raises many kinds; each means this folder cannot be used
            cause = err
            while cause is not None and not isinstance(cause, SnapshotError):  # orbax may wrap the store's
                cause = cause.__cause__ or cause.__context__
            raise self._unreadable(rounds_done, cause or err) from err
        state = restored["state"]
        if "client_states" in state:
            store.states = state["client_states"]
        return rounds_done, state["server_state"], restored["meta"]

    def read_meta(self) -> dict | None:
        """The meta (config and counters) of the latest checkpoint, None when there is none."""
        rounds_done = self.latest_round()
        if rounds_done is None:
            return None
        self._verify(rounds_done)
        try:
            with _orbax_io():
                meta = self._manager.restore(rounds_done, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:
            raise self._unreadable(rounds_done, err) from err
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict) or "counters" not in meta:
            raise self._unreadable(rounds_done, ValueError("its meta holds no config and counters"))
        return meta
