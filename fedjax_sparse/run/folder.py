"""A run folder belongs to one run: its lock, the files that make it a run's, and what a killed run left.

* `hold_run_folder` takes an advisory lock (flock on the run folder itself) for the whole run, so a
  second process into the same folder fails at once, naming the holder's pid. The pid is kept in
  `LOCK_FILE`, a name of the library's own, written only once the run has taken the folder (never in a
  folder it refuses: `HeldFolder.announce`) and removed when the run ends. The kernel drops the lock
  when its process dies, kill -9 included, so a crashed run never leaves a stale lock (its pid file, if
  any, names no holder: the next run replaces it); and since the lock is the folder's, deleting the pid
  file by hand cannot let a second run in.
* `RunManifest` records, in RUN_DIR/fedjax_sparse_files.json, the name of every file the run writes
  there, before it is first written: what this library provably wrote (a kill between the record and
  the write leaves a name recorded and no file, never a file unrecorded).
* `claim_run_folder` refuses a new run in a folder holding a run's files (`RUN_FILES`, TensorBoard
  event files) unless told to delete them first (--overwrite), which deletes only what the manifest
  records; a file of those names that it does not record (the user's own) is refused in one line
  naming it, --overwrite or not.
* `recover_metrics` and `read_saved_config` read what a kill may have cut short: a torn last
  metrics line is dropped (the checkpoint decides which rounds stand, and restores those it covers:
  `run.resume`), an unusable config.json is replaced by the config saved with the checkpoint. Every
  error names the file and what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator

from fedjax_sparse.core.round.distributed import agree, broadcast_text, gather_texts
from fedjax_sparse.run.checkpoints import io_reason
from fedjax_sparse.run.outputs import dumps, replace_atomically
from fedjax_sparse.run.signals import undo_at_once

LOCK_FILE = ".fedjax_sparse.lock"  # hidden, and no user's: a user's own .lock in --out is left alone
# "client_store": the disk client store's rows (`core.client_state.store.DiskStore`), part of the run's state;
# "trackers.json": the MLflow and W&B runs a resume goes on logging into (`run.trackers`)
RUN_FILES = ("config.json", "metrics.jsonl", "partition.json", "summary.json", "accuracy.png", "checkpoints",
             "client_store", "trackers.json")
TENSORBOARD_EVENTS = "events.out.tfevents.*"  # `run.tensorboard.TensorBoardWriter`'s files
# Visible, not hidden: it is the run's own account of the folder, and a user clearing a folder by hand
# should see it go with the rest.
MANIFEST = "fedjax_sparse_files.json"


class RunFolderError(ValueError):
    """The run folder cannot be used as asked; the message names it and the choices."""


class HeldFolder:
    """A run folder whose lock this process holds (`hold_run_folder`)."""

    def __init__(self, path: Path):
        self.path, self._announced = path, False

    def announce(self) -> None:
        """Writes this process's pid into `LOCK_FILE`, for a second run's refusal to name: called once the
        run has taken the folder, so that a folder the run refuses never gets the file."""
        try:
            (self.path / LOCK_FILE).write_text(f"{os.getpid()}\n")
        except OSError:
            return  # a folder we cannot write says so at the run's first write, naming the file
        self._announced = True
        undo_at_once.append(self.withdraw)  # a signal in start-up ends the process at once

    def withdraw(self) -> None:
        if self._announced:
            with contextlib.suppress(OSError):
                (self.path / LOCK_FILE).unlink()
            self._announced = False
            with contextlib.suppress(ValueError):
                undo_at_once.remove(self.withdraw)


@contextlib.contextmanager
def hold_run_folder(out: str | Path) -> Iterator[HeldFolder]:
    """Creates `out` if needed and holds its lock until the block ends (removing its pid file, where
    `HeldFolder.announce` wrote one)."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        raise RunFolderError(f"--out {out} cannot be used as a run folder ({err.strerror}: {err.filename}); "
                             f"choose another --out") from None
    held = HeldFolder(out)
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = (out / LOCK_FILE).read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise RunFolderError(f"--out {out} is in use by another run (pid {holder}); wait for it to end, "
                                 f"or choose another --out") from None
        yield held
    finally:
        held.withdraw()  # before the lock goes: the next holder's pid file is never removed
        os.close(folder)  # releases the lock


def run_files(out: str | Path) -> list[str]:
    """The files of a run (`RUN_FILES`, and its TensorBoard event files) present in `out`, whoever wrote them."""
    out = Path(out)
    events = sorted(p.name for p in out.glob(TENSORBOARD_EVENTS)) if out.is_dir() else []
    return [name for name in RUN_FILES if os.path.lexists(out / name)] + events


def recorded_files(out: str | Path) -> tuple[set[str], str | None]:
    """The names `out`'s manifest records, and, where it records none, why (in words)."""
    path = Path(out) / MANIFEST
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        return set(), f"there is no {path}"
    except (OSError, ValueError) as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return set(), f"{path} cannot be read ({' '.join(str(err).split())[:200]})"
    names = values.get("files") if isinstance(values, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return set(), f"{path} is not a list of files"
    return set(names), None


class RunManifest:
    """The names of the files this library wrote in a run folder (`MANIFEST`), kept with the folder.

    `record(name)` adds a name before its file is first written, replacing the manifest atomically,
    so whatever a kill leaves, every run file in the folder is recorded. A resumed run records into
    its folder's manifest (and starts one in a folder from before manifests, vouching then only for
    what it writes itself). Only the process writing the run's files records.
    """

    def __init__(self, out: str | Path):
        self.out = Path(out)
        names, _ = recorded_files(self.out)
        self.names = sorted(names)

    def record(self, *names: str) -> None:
        new = [name for name in names if name not in self.names]
        if not new:
            return
        self.names = sorted([*self.names, *new])
        text = dumps({"written_by": "fedjax-sparse", "files": self.names}, indent=2) + "\n"
        replace_atomically(self.out / MANIFEST, lambda tmp: tmp.write_text(text))


def _listed(names: list[str]) -> str:
    events = [name for name in names if name not in RUN_FILES]
    return ", ".join([name for name in names if name in RUN_FILES] + (
        [f"{len(events)} TensorBoard event file{'s' if len(events) > 1 else ''}"] if len(events) > 1 else events))


def claim_run_folder(out: str | Path, overwrite: bool) -> None:
    """Makes `out` a new run's folder: refused when a run's files are there, unless `overwrite` (which
    deletes them, and only them, and the manifest recording them); refused in any case when a file of
    a run's name is there that the manifest does not record (the user's own), naming it."""
    out = Path(out)
    present = run_files(out)
    if not present:
        return
    recorded, why = recorded_files(out)
    foreign = [name for name in present if name not in recorded]
    if foreign:
        raise RunFolderError(f"--out {out} holds {_listed(foreign)}, which fedjax-sparse has no record of writing "
                             f"({why or f'{out / MANIFEST} does not list them'}): "
                             + ("--overwrite deletes only what it wrote; " if overwrite else "")
                             + f"move them out of {out}, or choose another --out")
    if not overwrite:
        raise RunFolderError(f"--out {out} holds the files of an earlier run ({_listed(present)}); continue that "
                             f"run with --resume {out}, choose a new --out, or pass --overwrite to delete them "
                             f"first")
    for name in [*present, MANIFEST]:  # the manifest last: what could not be deleted stays recorded
        path = out / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:  # a file, or a link (to a folder too): the link goes, never what it points to
                path.unlink(missing_ok=True)
        except OSError as err:
            raise RunFolderError(f"--overwrite cannot delete {path} ({err.strerror}); delete it by hand or "
                                 f"choose a new --out") from None


def check_run_files(out: str | Path) -> None:
    """Refuses, in one line, a run folder whose files are not what a run writes (a directory where
    metrics.jsonl or summary.json belong)."""
    for name in ("config.json", "metrics.jsonl", "partition.json", "summary.json", "accuracy.png"):
        path = Path(out) / name
        if path.is_dir():
            raise RunFolderError(f"{path} is a directory, not the run's {name}; move it out of the run folder and "
                                 f"run again")


def recover_metrics(path: Path, rounds_done: int, warn: Callable[[str], None]) -> list[dict]:
    """The records of `path` for rounds up to `rounds_done`, the rounds a checkpoint covers.

    A last line cut short by a kill is dropped with a warning; any other unreadable line, or
    rounds out of order (two runs' records mixed), is an error naming the file and line.
    """
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        last = number == len(lines)  # a complete file ends with "\n": its last element is ""
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("round"), int):
                raise ValueError("not a record with a round number")
        except ValueError as err:
            if last:
                warn(f"{path}: dropped its last line, cut short ({' '.join(str(err).split())}); the "
                     f"checkpoint of round {rounds_done} decides which rounds stand")
                break
            raise RunFolderError(f"{path} line {number} is not a metrics record ({' '.join(str(err).split())}); "
                                 f"repair or delete that line, or start the run again with --overwrite") from None
        if records and record["round"] <= records[-1]["round"]:
            raise RunFolderError(f"{path} line {number} is round {record['round']} after round "
                                 f"{records[-1]['round']}: it mixes the records of two runs; start the run "
                                 f"again with --overwrite, or choose a new --out")
        records.append(record)
    return [r for r in records if r["round"] <= rounds_done]


def read_saved_config(run_dir: Path, usable: Callable[[dict], object], checkpoint_config: Callable[[], dict | None],
                      warn: Callable[[str], None], fatal: tuple[type, ...] = ()) -> dict:
    """The config of the run in `run_dir`: its config.json, or, when that file is missing, unreadable,
    not a JSON object or not `usable` (raises ValueError or TypeError), the config saved with its
    latest checkpoint (`checkpoint_config()`, None when there is no checkpoint). An exception of a
    `fatal` type from `usable` (the checkpoint's config would raise it too) passes as it is."""
    path = run_dir / "config.json"
    try:
        values = json.loads(path.read_text())
        if not isinstance(values, dict):
            raise ValueError(f"it holds a JSON {type(values).__name__}, not an object")
        usable(values)
        return values
    except fatal:
        raise
    except FileNotFoundError:
        problem = "is missing"
    except (OSError, ValueError, TypeError) as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = f"cannot be used ({' '.join(str(err).split())[:200]})"
    saved = checkpoint_config()
    if saved is None:
        if not path.exists() and not run_files(run_dir):
            raise RunFolderError(f"--resume {run_dir}: no run there (no config.json, no checkpoints); give the "
                                 f"folder of a run, or start one with --out {run_dir}")
        recorded, why = recorded_files(run_dir)
        foreign = [name for name in run_files(run_dir) if name not in recorded]
        if foreign:  # not (provably) a run's folder: --overwrite would refuse it too
            raise RunFolderError(f"--resume {run_dir}: {path} {problem}, there is no checkpoint to take the "
                                 f"config from, and fedjax-sparse has no record of writing {_listed(foreign)} ("
                                 f"{why or f'{run_dir / MANIFEST} does not list them'}); give the folder of a run")
        raise RunFolderError(f"--resume {run_dir}: {path} {problem} and there is no checkpoint to take the "
                             f"config from; start the run again with --overwrite")
    warn(f"{path} {problem}; using the config saved with the checkpoint")
    return saved


SHARED_CHECK = ".shared_check"


def shared_folder_problem(out: Path, lead: bool, token: str) -> str | None:
    """Whether this process sees process 0's run folder: process 0 (`lead`) has written `token` to
    `out`/.shared_check; None when this process reads it there, else what it found, in words."""
    if lead:
        return None
    try:
        seen = (out / SHARED_CHECK).read_text()
    except OSError as err:
        return f"{out / SHARED_CHECK} cannot be read ({err.strerror})"
    return None if seen == token else f"{out / SHARED_CHECK} holds another run's mark"


def check_shared_folder(out: Path, process) -> None:
    """Checkpoints of several processes need one folder they all reach under one path (each writes
    its part, process 0 commits them): refused in one line, in every process, where some process
    sees another folder there (a TPU pod slice's workers, each with its own disk)."""
    lead = process.index == 0
    token = broadcast_text(uuid.uuid4().hex if lead else "")
    failure = None
    if lead:
        try:
            (out / SHARED_CHECK).write_text(token)
        except OSError as err:
            failure = RunFolderError(f"cannot write {out / SHARED_CHECK}: {io_reason(err)}")
    agree(failure, "writing the run folder's mark")
    problem = shared_folder_problem(out, lead, token)
    problems = gather_texts(problem or "")
    if lead:
        (out / SHARED_CHECK).unlink(missing_ok=True)
    lost = [f"process {p}: {text}" for p, text in enumerate(problems) if text]
    if lost:
        raise RunFolderError(
            f"--out {out} is not one folder for all {process.count} processes ({'; '.join(lost)}): checkpoints "
            f"and --resume need a file system every process reaches under the same path (NFS; on a TPU pod "
            f"slice a bucket mounted with gcsfuse, or Filestore); without checkpoints (--checkpoint-minutes 0, no "
            f"--checkpoint-every) process 0 alone writes the run's files and each process's own disk is enough")
