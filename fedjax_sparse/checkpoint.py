"""Whole-run checkpoints with orbax, for exact resume.

A checkpoint holds the server state, the stacked client states (optimizer and
control variates included, whatever the algorithm keeps), the number of rounds
done and the run's byte counters. Randomness needs no saving: clients, batches
and augmentation are drawn from keys derived from (seed, round, client), so a
resumed run draws exactly what the uninterrupted run would have.

A save either commits a checkpoint that reads back or raises `CheckpointError`:
orbax silently skips a step that is not above the latest one on disk, which
would leave a run believing it had saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from fedjax_sparse.faults import fault_point

# Config fields a resumed run may change without changing its results.
RESUMABLE_CHANGES = ("rounds", "out", "checkpoint_every", "shard_clients", "compilation_cache", "data_dir", "download",
                     "tensorboard")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names it and what to do."""


def config_mismatches(saved: dict, current: dict) -> list[str]:
    """'name: checkpoint has X, this run has Y' for every field that would change the results."""
    names = sorted((set(saved) | set(current)) - set(RESUMABLE_CHANGES))
    return [f"{name}: checkpoint has {saved.get(name)!r}, this run has {current.get(name)!r}"
            for name in names if saved.get(name) != current.get(name)]


def has_checkpoints(run_dir: str | Path) -> bool:
    """Whether RUN_DIR/checkpoints exists (checked without creating it)."""
    return (Path(run_dir) / "checkpoints").is_dir()


class RunCheckpointer:
    """Keeps the latest checkpoints of one run under RUN_DIR/checkpoints/<rounds done>."""

    def __init__(self, run_dir: str | Path, max_to_keep: int = 2):
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir.resolve() / "checkpoints"
        self._manager = ocp.CheckpointManager(self.directory,
                                              options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

    def save(self, rounds_done: int, server_state: Any, client_states: Any, meta: dict) -> Path:
        """Writes the checkpoint of `rounds_done` rounds, waits for it and reads its meta back."""
        latest = self.latest_round()
        state = {"server_state": server_state, "client_states": client_states}
        if not self._manager.save(rounds_done, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))):
            raise CheckpointError(f"cannot save the checkpoint of round {rounds_done} in {self.directory}: it "
                                  f"already holds one of round {latest}, from another run or an earlier "
                                  f"attempt; start again with --overwrite or choose a new --out")
        fault_point("checkpoint_write")
        self._manager.wait_until_finished()
        self._manager.reload()
        path = self.directory / str(rounds_done)
        if self.latest_round() != rounds_done or self.read_meta() != json.loads(json.dumps(meta)):
            raise CheckpointError(f"the checkpoint of round {rounds_done} in {path} did not read back as "
                                  f"written; check the disk (space, permissions) and resume from the one "
                                  f"before with --resume {self.run_dir}")
        return path

    def latest_round(self) -> int | None:
        return self._manager.latest_step()

    def _unreadable(self, rounds_done: int, err: Exception) -> CheckpointError:
        return CheckpointError(f"the checkpoint {self.directory / str(rounds_done)} cannot be read "
                               f"({' '.join(str(err).split())[:160]}); delete that folder to resume from "
                               f"the one before, or start again with --overwrite")

    def restore(self, server_like: Any, clients_like: Any) -> tuple[int, Any, Any, dict]:
        """The latest checkpoint, restored into the shapes and dtypes of the given states."""
        rounds_done = self.latest_round()
        if rounds_done is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}; run with --checkpoint-every "
                                    f"to make one")
        like = {"server_state": server_like, "client_states": clients_like}
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
        try:
            restored = self._manager.restore(rounds_done, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as err:  # orbax raises many kinds; each means this folder cannot be used
            raise self._unreadable(rounds_done, err) from err
        state = restored["state"]
        return rounds_done, state["server_state"], state["client_states"], restored["meta"]

    def read_meta(self) -> dict | None:
        """The meta (config and counters) of the latest checkpoint, None when there is none."""
        rounds_done = self.latest_round()
        if rounds_done is None:
            return None
        try:
            meta = self._manager.restore(rounds_done, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:
            raise self._unreadable(rounds_done, err) from err
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict) or "counters" not in meta:
            raise self._unreadable(rounds_done, ValueError("its meta holds no config and counters"))
        return meta
