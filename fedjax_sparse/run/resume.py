"""Continuing a run from its latest checkpoint: what is refused, and what is restored.

A run without a checkpoint yet (it stopped before its first) is run again from its first round
(`NoCheckpoint`: `run.loop.run_experiment`). Refused, each in one line naming what to do: a resume
with a config that would change the results (naming config.json where it was edited since the
checkpoint, the flags otherwise), with fewer rounds than done, on other data (the checkpoint keeps a
fingerprint of the data: `run.fingerprint`; `--allow-data-change` accepts it), or with
`--shard-clients` over another number of devices (the sum over the sampled clients takes another
order, and the results differ in their last bits).

Another number of processes is an elastic resume (the survivors of a lost node, or more machines):
each process takes its clients' rows from every process's snapshot in the checkpoint
(`run.checkpoints`), refused in one line naming the file where one of them, or a disk store's rows
file, is missing. Where the figures do not depend on the layout (`docs/scale.md`), they are the ones
the uninterrupted run writes.

Restored: the server and client states, the counters and the metrics records. A checkpoint keeps
every record of the rounds it covers, so metrics.jsonl is rewritten from it whatever happened to the
file (a line cut short by a kill, a line or the whole file deleted, a line edited): nothing the
checkpoint covers is lost, and the run says which rounds it restored. A checkpoint written before
records were kept in it restores from the file alone, and a round missing there is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax

from fedjax_sparse.core.client_state.snapshots import SnapshotError, snapshot_backend, written_snapshots
from fedjax_sparse.core.round.distributed import ProcessLayout, agree, replicated
from fedjax_sparse.run.checkpoints import ROWS_FOLDER, RunCheckpointer, config_mismatches, has_checkpoints
from fedjax_sparse.run.config import RunConfig
from fedjax_sparse.run.experiment import Experiment
from fedjax_sparse.run.fingerprint import data_changes
from fedjax_sparse.run.folder import RunFolderError, check_run_files, recover_metrics
from fedjax_sparse.console import say


class NoCheckpoint(RunFolderError):
    """The run to resume has no checkpoint yet: it stopped before its first (`run_experiment` runs it again)."""


def check_resume(config: RunConfig, out: Path, process: ProcessLayout) -> str | None:
    """Refuses a resume that cannot continue the run in `out` as it was; the backend of this process's
    client-state snapshot in its latest checkpoint (None: a checkpoint from before the client stores;
    'host' where another number of processes wrote it: the rows re-placed are a host store's snapshot)."""
    check_run_files(out)
    checkpointer = RunCheckpointer(out) if has_checkpoints(out) else None
    saved_meta = checkpointer.read_meta() if checkpointer is not None else None
    if saved_meta is None:
        raise NoCheckpoint(f"--resume {out}: no checkpoint in {out / 'checkpoints'} (the run stopped before its "
                           f"first)")
    # normalized first: a config saved by an older version lacks newer options (at their defaults)
    refuse_changes(RunConfig.from_dict(saved_meta["config"]).to_dict(), config.to_dict(), out)
    done = saved_meta["counters"]["rounds_done"]
    if config.rounds < done:
        raise ValueError(f"--rounds {config.rounds} is below the {done} rounds the run in {out} has "
                         f"done; give --rounds {done} or more")
    planned = saved_meta["config"].get("rounds")
    if config.dp_clip is not None and config.dp_target_epsilon is not None and config.rounds != planned:
        raise ValueError(f"--resume {out}: the run's noise was calibrated for --dp-target-epsilon "
                         f"{config.dp_target_epsilon} over its {planned} rounds; other --rounds would change the noise "
                         f"its rounds so far had (or spend more than the target): resume with --rounds {planned}")
    devices = saved_meta.get("sharded_devices")
    if config.shard_clients and devices is not None and devices != jax.device_count():
        raise ValueError(f"--resume {out}: the run sharded its clients over {devices} devices and {jax.device_count()} "
                         f"are here; the sum over the clients would take another order and the results would "
                         f"differ; resume where {devices} devices are visible")
    states = checkpointer.client_states_dir()
    processes = saved_meta.get("processes", 1)
    if states is None or processes == process.count:
        return None if states is None else snapshot_backend(states, process)
    try:  # every snapshot there, before any process builds its store
        written_snapshots(states, processes, out / ROWS_FOLDER)
    except SnapshotError as err:
        raise ValueError(f"--resume {out} on {process.count} process{'es' if process.count > 1 else ''}: {err}") \
            from None
    return "host"


def _saved_file_config(out: Path) -> dict:
    """The run's config.json as a config, {} where it is not one (the run then took the checkpoint's)."""
    try:
        return RunConfig.from_dict(json.loads((out / "config.json").read_text())).to_dict()
    except Exception:  # noqa: BLE001 - whatever makes it unusable, `run.folder.read_saved_config` said it
        return {}


def refuse_changes(saved: dict, current: dict, out: Path) -> None:
    """One line where `current` (config.json, and the flags over it) differs from the checkpoint's `saved`
    config in a way that would change the results: naming config.json for a value it holds (edited after
    the checkpoint), the flags for the rest."""
    mismatches = config_mismatches(saved, current)
    if not mismatches:
        return
    on_file = _saved_file_config(out)
    edited = [name for name in mismatches if name in on_file and on_file[name] == current.get(name)]
    parts = []
    if edited:
        parts.append(f"{out / 'config.json'} was edited after the checkpoint was saved (" + "; ".join(
            f"{name}: the checkpoint has {saved.get(name)!r}, config.json has {on_file[name]!r}" for name in edited)
            + "): put the checkpoint's values back in it (or delete it, and the checkpoint's config is used)")
    flagged = [name for name in mismatches if name not in edited]
    if flagged:
        parts.append("the checkpoint was made with another configuration (" + "; ".join(
            f"{name}: checkpoint has {saved.get(name)!r}, this run has {current.get(name)!r}" for name in flagged)
            + "): drop those flags")
    raise ValueError(f"--resume {out}: {'; and '.join(parts)}; or start a new run with another --out")


def reconcile_records(path: Path, history: list | None, rounds_done: int, logged: Callable[[int], bool],
                      warn: Callable[[str], None]) -> list[dict]:
    """The records of rounds up to `rounds_done`: the checkpoint's `history` (saying which rounds of the
    file at `path` it restores), or, from a checkpoint without one, the file's, refused where a round
    that was `logged` is missing."""
    try:
        on_file = recover_metrics(path, rounds_done, warn)
    except (RunFolderError, OSError) as err:
        if history is None:
            raise
        warn(f"{path} could not be read ({' '.join(str(err).split())}); its records are taken from the checkpoint "
             f"of round {rounds_done}")
        return [r for r in history if r["round"] <= rounds_done]
    if history is not None:
        history = [r for r in history if r["round"] <= rounds_done]
        if on_file != history:
            file_rounds = {r["round"]: r for r in on_file}
            differ = [r["round"] for r in history if file_rounds.get(r["round"]) != r]
            extra = sorted(set(file_rounds) - {r["round"] for r in history})
            shown = ", ".join(map(str, differ + extra))
            warn(f"{path}: rounds {shown} were missing, cut short or altered; rewritten from the checkpoint of "
                 f"round {rounds_done}")
        return history
    expected = [r for r in range(1, rounds_done + 1) if logged(r)]
    missing = sorted(set(expected) - {r["round"] for r in on_file})
    if missing:
        raise RunFolderError(f"{path} lacks rounds {', '.join(map(str, missing))} of the {rounds_done} its checkpoint "
                             f"covers, and the checkpoint (from an older version) holds no copy of them; restore "
                             f"the file, or start the run again with --overwrite")
    return on_file


def restore(exp: Experiment, out: Path, lead: bool, allow_data_change: bool) -> tuple[Any, dict, list]:
    """The latest checkpoint's server state (the store takes its client states), its meta and the records
    it covers; refuses other data unless `allow_data_change`."""
    failure = None
    try:
        # several processes: restored replicated over all of them, as the rounds hold it
        server_like = replicated(exp.server_state, exp.round_fn.mesh) if exp.process.count > 1 else exp.server_state
        if exp.round_fn.mesh is not None and exp.process.count == 1:  # a sharded device store: as its rounds hold it
            server_like = replicated(exp.server_state, exp.round_fn.mesh)
        _, saved, meta = RunCheckpointer(out).restore(exp.round_fn.saved_state(server_like), exp.store)
        server_state = exp.round_fn.resumed(saved, meta)
        changes = data_changes(meta.get("data"), exp.data_fingerprint)
        if changes and not allow_data_change:
            raise ValueError(f"--resume {out}: the data differ from the run's ({changes}); resume with "
                             f"--allow-data-change to go on with these data, or start a new run")
        if changes:
            say(f"the data differ from the run's ({changes}); going on with them (--allow-data-change)")
        eval_every, rounds = exp.config.eval_every, exp.config.rounds
        records = reconcile_records(out / "metrics.jsonl", meta.get("history"), meta["counters"]["rounds_done"],
                                    lambda r: r % eval_every == 0 or r == rounds, say if lead else (lambda m: None))
    except Exception as e:  # noqa: BLE001
        failure = e
    agree(failure, "restoring the checkpoint")
    return server_state, meta, records
