"""How a run answers SIGINT (Ctrl-C), SIGTERM (what a cluster scheduler sends before it kills a job), SIGHUP
(a closed terminal, a dropped ssh session), SIGUSR1 and SIGUSR2 (what many SLURM setups send ahead of a job's
time limit, `--signal=USR1@90`), all alike.

* During start-up (imports, loading data, building; `stop_start_up_at_once`) a signal ends the
  process where it stands, with one line: nothing was run, and nothing but a complete image-folder
  cache (whose writes are atomic) can have been written (the folder's pid file is removed first).
* During the rounds (`StopAfterRound`) the first signal asks the run to stop after the current
  round; the run then saves its checkpoint and writes its summary. A further signal only says
  what the run is waiting for: nothing, a checkpoint save above all, is ever cut short by it.

A SIGHUP that the process was started ignoring (`nohup`) stays ignored: the user asked that a closed
terminal not stop the run.

This module imports nothing heavy, so the command line installs it before importing JAX and the
algorithms (`fedjax_sparse.run` imports its modules lazily for the same reason): a signal in the first
second gets the same one line as a later one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

# SIGHUP: a closed terminal or a dropped ssh session ends a run the way a scheduler's SIGTERM does; SIGUSR1
# and SIGUSR2: a scheduler's warning before the time limit (Python's default for them ends the process at once)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


_rounds_began = False
# what ending the process at once during start-up undoes first (a run folder's pid file: `run.folder.HeldFolder`)
undo_at_once: list[Callable[[], None]] = []


def _stop_start_up(signum, frame):
    # Exiting at once, not raising: an exception raised here could surface inside an extension
    # module's import or a JAX callback, where it aborts the process with a C++ traceback.
    when = ("after the rounds, every file written" if _rounds_began else
            "during start-up, before the first round: nothing was run")
    sys.stderr.write(f"fedjax-sparse: {signal.Signals(signum).name} {when}\n")
    sys.stderr.flush()
    for undo in list(undo_at_once):
        with contextlib.suppress(Exception):
            undo()
    workers = sys.modules.get("multiprocessing")  # image-decoding workers; none if it was never imported
    for child in workers.active_children() if workers is not None else ():
        child.kill()
    os._exit(128 + signum)


def _install(handler) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    ignored = signal.SIGHUP if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else None  # under nohup
    return {s: signal.signal(s, handler) for s in SIGNALS if s != ignored}


def _restore(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


@contextlib.contextmanager
def stop_start_up_at_once() -> Iterator[None]:
    """In this block (until `StopAfterRound` takes over) each of `SIGNALS` ends the process at once,
    with one line and exit code 128 + the signal. Only the command line uses it: a library
    caller keeps Python's own handling."""
    global _rounds_began
    _rounds_began = False
    previous = _install(_stop_start_up)
    try:
        yield
    finally:
        _restore(previous)


class StopAfterRound:
    """While the rounds run: `signum` is the first signal received (None: none), `round` the round in
    progress (or, before the first, the first to run), `last_round` the run's last, and `waiting_for`
    what the run is doing, for the messages a signal prints."""

    def __init__(self, first_round: int = 1, last_round: int | None = None):
        self.signum: int | None = None
        self.round = first_round
        self.last_round = last_round
        self.waiting_for = "the current round to finish"
        self._previous = {}

    def __enter__(self):
        global _rounds_began
        _rounds_began = True
        self._previous = _install(self._handle)
        return self

    def _handle(self, signum, frame):
        from fedjax_sparse.console import say
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            if self.last_round is not None and self.round >= self.last_round:
                say(f"{name}: round {self.round} is the run's last; the run ends after it, as it would have")
            else:
                say(f"{name}: stopping after round {self.round}, then saving a checkpoint")
        else:
            say(f"{name}: already stopping; waiting for {self.waiting_for} (kill -9 {os.getpid()} stops at "
                f"once, losing the rounds since the last checkpoint)")

    def __exit__(self, *exc):
        _restore(self._previous)
