"""Whole-run checkpoints with orbax, for exact resume.

A checkpoint holds the server state, the stacked client states (optimizer and
control variates included, whatever the algorithm keeps), the number of rounds
done and the run's byte counters. Randomness needs no saving: clients, batches
and augmentation are drawn from keys derived from (seed, round, client), so a
resumed run draws exactly what the uninterrupted run would have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

# Config fields a resumed run may change without changing its results.
RESUMABLE_CHANGES = ("rounds", "out", "checkpoint_every", "shard_clients", "compilation_cache", "tensorboard")


def config_mismatches(saved: dict, current: dict) -> list[str]:
    """'name: checkpoint has X, this run has Y' for every field that would change the results."""
    names = sorted((set(saved) | set(current)) - set(RESUMABLE_CHANGES))
    return [f"{name}: checkpoint has {saved.get(name)!r}, this run has {current.get(name)!r}"
            for name in names if saved.get(name) != current.get(name)]


class RunCheckpointer:
    """Keeps the latest checkpoints of one run under RUN_DIR/checkpoints/<rounds done>."""

    def __init__(self, run_dir: str | Path, max_to_keep: int = 2):
        self.directory = Path(run_dir).resolve() / "checkpoints"
        self._manager = ocp.CheckpointManager(self.directory,
                                              options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

    def save(self, rounds_done: int, server_state: Any, client_states: Any, meta: dict) -> None:
        state = {"server_state": server_state, "client_states": client_states}
        self._manager.save(rounds_done, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()

    def latest_round(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, server_like: Any, clients_like: Any) -> tuple[int, Any, Any, dict]:
        """The latest checkpoint, restored into the shapes and dtypes of the given states."""
        rounds_done = self.latest_round()
        if rounds_done is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}; run with --checkpoint-every "
                                    f"to make one")
        like = {"server_state": server_like, "client_states": clients_like}
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
        restored = self._manager.restore(rounds_done, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        state = restored["state"]
        return rounds_done, state["server_state"], state["client_states"], restored["meta"]

    def read_meta(self) -> dict | None:
        rounds_done = self.latest_round()
        if rounds_done is None:
            return None
        return self._manager.restore(rounds_done, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
