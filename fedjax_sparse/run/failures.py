"""How a run ends when it does not complete: the statuses summary.json may say, the errors a run stops with (each
one line), the advice for a diverged run, and a failed resume's record."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import jax

from fedjax_sparse.run.checkpoints import CheckpointError, io_reason
from fedjax_sparse.run.config import RunConfig
from fedjax_sparse.run.folder import RunManifest, recorded_files
from fedjax_sparse.run.outputs import RunWriteError, RunWriter

# summary.json's "status", each as docs/cli.md says: every failure but a divergence is "failed"
STATUSES = ("completed", "interrupted", "diverged", "failed")


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or model; the run stops instead of going on with NaNs."""


class Interrupted(RuntimeError):
    """A signal (`run.signals.SIGNALS`) stopped the run after a round, whose checkpoint was saved and verified."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class RunFailed(RuntimeError):
    """A run's file or checkpoint could not be written; the message names it and the OS's reason."""


def peer_lost(err: Exception) -> bool:
    """Whether a collective failed for want of another process (`multihost_utils` raises ValueError)."""
    return isinstance(err, jax.errors.JaxRuntimeError) or any(
        word in str(err) for word in ("Gloo", "UNAVAILABLE", "Connection reset", "Connection closed"))


class ProcessLost(RunFailed):
    """Another process of a several-process run died (a kill, a lost node); the rest cannot go on."""


def write_failure(err: BaseException) -> str:
    """The one line of a run file or checkpoint that could not be written."""
    if isinstance(err, (CheckpointError, RunWriteError)):
        return " ".join(str(err).split())
    return f"cannot write the run's files in the run folder: {io_reason(err)}"


def likely_culprit(config: RunConfig) -> str:
    """The flag most likely to blame for a diverged run, as advice."""
    options = config.options
    if options.get("server_lr", 1.0) > 1.0:
        return f"try a smaller --server-lr than {options['server_lr']}"
    if config.momentum >= 0.95:
        return f"try a smaller --momentum than {config.momentum} or a smaller --lr than {config.lr}"
    return f"try a smaller --lr than {config.lr}"


class FailedResume:
    """Where a resume stops before its rounds (refused: a flag that would change the results, a damaged
    checkpoint; or failing to start: data that cannot be loaded), makes the run's summary.json say so,
    "status": "failed" with the one line, instead of the status of the attempt before ("completed", ...),
    which a reader (a script polling the folder) would take for this attempt's.

    Nothing the summary held is lost: the run's rounds are still done and its figures still true (a
    refused resume changes none of the run's files), so the summary keeps them, and keeps the status
    of the run's last attempt that ran as `status_before_resume`. Only a summary this library provably
    wrote is replaced (the folder's manifest records it, `run.folder.RunManifest`), or one added where a
    run's folder has none (a run killed before it); a summary that cannot be written leaves the one line.
    `recording` (set False once the rounds begin, which write the summary themselves) turns it off."""

    def __init__(self, out: Path, recording: bool):
        self.out, self.recording = out, recording

    def __enter__(self) -> "FailedResume":
        return self

    def __exit__(self, kind, err, traceback) -> None:
        if self.recording and isinstance(err, Exception):
            self._record(err)

    def _record(self, err: Exception) -> None:
        path = self.out / "summary.json"
        recorded, _ = recorded_files(self.out)
        if not recorded or (os.path.lexists(path) and path.name not in recorded):
            return  # not provably the run's summary: the user's, or a run's from before the manifest
        try:
            before = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            before = {}
        before = before if isinstance(before, dict) else {}
        status = before.get("status_before_resume", before.get("status"))
        line = io_reason(err) if isinstance(err, OSError) and err.errno else " ".join(str(err).split())
        with contextlib.suppress(RunWriteError, OSError):
            RunWriter(self.out, RunManifest(self.out)).write_summary(
                {**before, "status": "failed", "error": line, **({"status_before_resume": status} if status else {})})
