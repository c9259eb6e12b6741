"""What the user waits for before the first round's figures: the progress bar says it is compiling, and for how long.

A run's first round compiles its programs (the round, then the evaluators) before it computes anything: 6 to 30
seconds on 2 CPU cores for the zoo's models, minutes at paper scale. A bar at 0 % for that long looks stuck, so
from the first round's start until its figures arrive the bar's postfix reads, refreshed every half second,

    compiling: 12 s (JAX's cache held 61 programs; 3 read from it, 2 compiled so far)

the persistent cache's entries when the run began (a program compiled before, by this run or another on this
machine, is read, not compiled), and, from JAX's own events, the programs read from it and those compiled.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import jax
from jax import monitoring

_HIT = "/jax/compilation_cache/cache_hits"
_COMPILED = "/jax/core/compile/backend_compile_duration"


def cached_programs() -> int | None:
    """The programs JAX's persistent compilation cache holds now; None where the cache is off."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or not Path(folder).is_dir():
        return None
    return sum(1 for p in Path(folder).iterdir() if p.name.endswith("-cache"))


class _Events:
    """JAX's compile events, counted while some `Compiling` listens (JAX cannot unregister a listener)."""

    lock = threading.Lock()
    listeners: list["Compiling"] = []
    registered = False

    @classmethod
    def on_event(cls, event: str, **kwargs) -> None:
        if event == _HIT:
            with cls.lock:
                for listener in cls.listeners:
                    listener.read += 1

    @classmethod
    def on_duration(cls, event: str, duration: float, **kwargs) -> None:
        if event == _COMPILED:
            with cls.lock:
                for listener in cls.listeners:
                    listener.backend += 1

    @classmethod
    def listen(cls, listener: "Compiling") -> None:
        with cls.lock:
            if not cls.registered:
                monitoring.register_event_listener(cls.on_event)
                monitoring.register_event_duration_secs_listener(cls.on_duration)
                cls.registered = True
            cls.listeners.append(listener)

    @classmethod
    def leave(cls, listener: "Compiling") -> None:
        with cls.lock:
            if listener in cls.listeners:
                cls.listeners.remove(listener)


class Compiling:
    """Shows on `bar` (a tqdm bar; nothing when it is disabled) that the run is compiling, until `stop()` (or the
    bar's closing). Started where the first round starts."""

    def __init__(self, bar: Any, every: float = 0.5):
        self.bar, self.every = bar, every
        self.read = self.backend = 0  # programs read from the cache; backend compilations (a read counts too)
        self.held = cached_programs()
        self._done = threading.Event()
        self._start = time.perf_counter()
        self._thread = None
        if getattr(bar, "disable", True):
            return
        _Events.listen(self)
        self._show()
        self._thread = threading.Thread(target=self._tick, name="compiling", daemon=True)
        self._thread.start()

    def text(self) -> str:
        held = "JAX's cache is off" if self.held is None else f"JAX's cache held {self.held} programs"
        compiled = max(self.backend - self.read, 0)
        return (f"compiling: {time.perf_counter() - self._start:.0f} s ({held}; {self.read} read from it, "
                f"{compiled} compiled so far)")

    def _show(self) -> None:
        self.bar.set_postfix_str(self.text(), refresh=True)

    def _tick(self) -> None:
        while not self._done.wait(self.every):
            if getattr(self.bar, "disable", True):  # closed: the run ended
                break
            self._show()

    def stop(self) -> None:
        """Ends the display (the caller sets the bar's figures next)."""
        if self._done.is_set():
            return
        self._done.set()
        _Events.leave(self)
        if self._thread is not None:
            self._thread.join()
            self.bar.set_postfix_str("", refresh=False)
