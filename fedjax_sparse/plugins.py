"""What installed packages add through Python entry points (algorithms, models, samplers): each group read
once, each entry point loaded where nothing it raises escapes, so a broken package costs its own plug-in
and never the library's other parts. What a group's values must be, and what a refused one is told, is its
registry's (`algorithms.registry`, `models`, `core.federation.participation`)."""

from __future__ import annotations

from importlib import metadata
from typing import Any, Callable


def brief(err: BaseException, limit: int = 300) -> str:
    """An installed package's exception in one line of bounded length (its message may be anything)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text if len(text) <= limit else text[:limit] + ' ...'}"


def package_of(entry: metadata.EntryPoint) -> str:
    """The distribution that declares `entry` (its module's top package where the environment does not say)."""
    dist = getattr(entry, "dist", None)
    return dist.name if dist is not None else entry.value.split(":")[0].split(".")[0]


class EntryPointGroup:
    """One entry-point group, loaded once: `load(take, refuse)` calls `take(entry, value)` for each entry point
    that imports and `refuse(entry, why)` (why: `brief`) for each that raises, SystemExit included; later calls
    do nothing until `reset()` (tests install plug-ins in the middle of a session)."""

    def __init__(self, name: str):
        self.name = name
        self.loaded = False

    def load(self, take: Callable[[metadata.EntryPoint, Any], None],
             refuse: Callable[[metadata.EntryPoint, str], None]) -> bool:
        """Loads the group unless it was; True where this call loaded it."""
        if self.loaded:
            return False
        self.loaded = True
        for entry in metadata.entry_points(group=self.name):
            try:
                value = entry.load()
            except (Exception, SystemExit) as err:  # noqa: BLE001 - an installed package's import may fail any way
                refuse(entry, brief(err))
                continue
            take(entry, value)
        return True

    def reset(self) -> None:
        self.loaded = False
