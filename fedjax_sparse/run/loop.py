"""The round loop of a run: rounds, evaluations, checkpoints, signals and the files they leave.

The Python loop here is over rounds only; each round is one jitted call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import time
from pathlib import Path

import jax
import numpy as np

from fedjax_sparse.core.round.compilation import release_compiler_memory
from fedjax_sparse.core.round.numerics import numerics
from fedjax_sparse.run.client_metrics import client_metrics
from fedjax_sparse.run.compiling import Compiling
from fedjax_sparse.core.round.device_split import balanced_padded_step_fraction, device_groups
from fedjax_sparse.core.round.distributed import agree, current_process, max_over_processes, process_local
from fedjax_sparse.core.evaluation.evaluators import all_finite
from fedjax_sparse.core.structure.flops import forward_flops
from fedjax_sparse.core.federation.participation import check_drawn
from fedjax_sparse.data.federated import padded_step_fraction
from fedjax_sparse.run.checkpoints import (ROWS_FOLDER, CheckpointError, RunCheckpointer, SaveLostAProcess,
                                           discard_cut_short)
from fedjax_sparse.run.config import RunConfig
from fedjax_sparse.run.experiment import Experiment, build_experiment, load_run_dataset, use_compilation_cache
from fedjax_sparse.run.failures import (STATUSES, DivergenceError, FailedResume, Interrupted, ProcessLost, RunFailed,
                                        likely_culprit, peer_lost, write_failure)
from fedjax_sparse.run.faults import fault_point
from fedjax_sparse.run.federation import federation_record, federation_totals
from fedjax_sparse.run.folder import RunManifest, check_shared_folder, claim_run_folder, hold_run_folder
from fedjax_sparse.console import say
from fedjax_sparse.run.outputs import RunWriteError, RunWriter, progress_bar
from fedjax_sparse.run.records import Counters, evaluate, run_summary, run_totals
from fedjax_sparse.privacy.ledger import privacy_record, privacy_totals, released_record, released_summary
from fedjax_sparse.run.resume import NoCheckpoint, check_resume, restore
from fedjax_sparse.run.signals import StopAfterRound
from fedjax_sparse.run.trackers import Trackers


def run_experiment(config: RunConfig, *, progress: bool = True, resume: bool = False,
                   overwrite: bool = False, allow_data_change: bool = False) -> dict:
    """Runs `config` and writes config.json, metrics.jsonl, partition.json, summary.json and a plot.

    The run holds its folder's lock throughout (`run.folder.hold_run_folder`) and records each file it
    writes there before writing it (`run.folder.RunManifest`). A new run refuses a folder holding an
    earlier run's files unless `overwrite` (which deletes them first, only those recorded), and files
    of a run's names that no record vouches for in any case (`run.folder.claim_run_folder`); `resume=True`
    continues the run in `config.out` from its latest checkpoint, refusing one made with a config
    that would change the results, or `config.rounds` below the rounds done (a run that has no
    checkpoint yet is run again from its first round, as a new run with `overwrite`). The whole run
    state is saved every `config.checkpoint_minutes` of wall time (at the end of the round after),
    every `config.checkpoint_every` rounds and at the end, with every record so far and a fingerprint
    of the data (`run.resume`: a resume rewrites what the checkpoint covers and refuses other data
    unless `allow_data_change`).
    A signal (`run.signals.SIGNALS`) during the rounds finishes the current round, saves it and raises
    `Interrupted` after writing summary.json with status "interrupted". A non-finite loss or model
    stops the run with `DivergenceError` after writing what was measured so far. A file or checkpoint
    that cannot be written stops it with `RunFailed` (one line: the path and the OS's reason) after
    writing summary.json with status "failed" where it still can (the metrics file, the TensorBoard
    events and the summary are written apart, so either's failure still reaches the summary); earlier
    checkpoints stay intact. A refusal, or data that cannot be loaded, leave a new run's folder as it
    was (no summary), so the same command may simply be run again; a resumed run's summary says
    "failed" then, keeping what the run had measured (`FailedResume`).

    Several processes (`core.round.distributed.initialize` first): every process calls this with the
    same config. Process 0 alone holds the lock, claims the folder and writes the run's files;
    every process loads the data, holds its own clients, and takes part in every round,
    evaluation and checkpoint. Where a step fails in some process, all stop (`agree`).
    """
    start = time.perf_counter()
    config.validate()
    out = Path(config.out)
    if resume and not out.is_dir():
        raise FileNotFoundError(f"--resume {out}: no such folder")
    use_compilation_cache(config.compilation_cache)
    process = current_process()
    lead = process.index == 0
    folder = hold_run_folder(out) if lead else contextlib.nullcontext()
    with numerics(config.numerics), folder as held, FailedResume(out, resume and lead) as refused:
        failure, snapshot, dataset, counters, manifest, restart = None, None, None, Counters(), None, False
        try:  # by process 0, before any process reads or writes the folder
            if lead and resume:
                for rounds_done in discard_cut_short(out):
                    say(f"the checkpoint of round {rounds_done} in {out / 'checkpoints'} was cut short while it was "
                        f"saved (a kill, a lost process); deleted it")
            if lead and not resume:
                claim_run_folder(out, overwrite)
        except Exception as e:  # noqa: BLE001 - raised below, in every process
            failure = e
        agree(failure, "taking the run folder")
        try:
            if resume:
                snapshot = check_resume(config, out, process)
        except NoCheckpoint:  # killed before its first checkpoint: its rounds are run again, as a new run's
            restart = True
        except Exception as e:  # noqa: BLE001
            failure = e
        agree(failure, "checking the run to resume")
        try:
            if lead and restart:
                claim_run_folder(out, overwrite=True)  # only what the attempt before wrote, as --overwrite
                say(f"--resume {out}: no checkpoint there yet (the run stopped before its first); running it from "
                    f"round 1 again")
            if lead:
                held.announce()
            fault_point("start_up")
            if lead:  # first, so that a data set prepared on first use is prepared once
                with _logged_only_if_it_works("absl"):
                    dataset = load_run_dataset(config, progress)
                # A new run stopped before here has written nothing (the same command may simply be run again).
                # From here on each run file is recorded before any process may write it: the disk client
                # store's rows before the store is built, the checkpoints before the first save.
                manifest = RunManifest(out)
        except Exception as e:  # noqa: BLE001
            failure = e
        agree(failure, "preparing the run folder")
        if process.count > 1 and (checkpoints_on(config) or resume):
            check_shared_folder(out, process)

        def before_store(backend: str) -> None:
            if lead and backend == "disk":
                manifest.record(ROWS_FOLDER)

        exp, failure = None, None
        try:
            exp = build_experiment(config, progress=progress and lead, process=process, snapshot=snapshot,
                                   dataset=dataset, before_store=before_store)
        except Exception as e:  # noqa: BLE001
            failure = e
        agree(failure, "during start-up")
        try:
            server_state, records = exp.server_state, []
            if resume and not restart:
                server_state, meta, records = restore(exp, out, lead, allow_data_change)
                counters = Counters(**meta["counters"])
            with StopAfterRound(first_round=counters.rounds_done + 1, last_round=config.rounds) as stop:
                refused.recording = False  # the rounds write the run's summary, whatever happens in them
                return _run_rounds(exp, config, out, counters, records, server_state, stop,
                                   progress and lead, start, manifest)
        finally:
            exp.close()


def checkpoints_on(config: RunConfig) -> bool:
    """Whether the run saves checkpoints of its own accord (an interrupted run saves in any case)."""
    return bool(config.checkpoint_every or config.checkpoint_minutes)


@contextlib.contextmanager
def _logged_only_if_it_works(logger_name: str):
    """Holds back what `logger_name` logs in the block and logs it after, unless the block raises:
    then its error is the one line the user sees (TFDS logs through absl on its way to failing,
    e.g. "Variant folder ... has no dataset_info.json" for a data set that is not prepared)."""
    logger, held = logging.getLogger(logger_name), []

    class Hold(logging.Handler):
        def emit(self, record):
            held.append(record)

    hold, propagate = Hold(), logger.propagate
    logger.addHandler(hold)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(hold)
        logger.propagate = propagate
    for record in held:  # reached only when the block did not raise
        logger.handle(record)


def _name_store_file(err: OSError, exp: Experiment) -> None:
    """Makes `err` name the disk client store's rows file, the one file a round reads and writes, where
    the OS gave no name (pwrite on a full disk)."""
    path = getattr(exp.store, "path", None)
    if err.filename is None and path is not None:
        err.filename = str(path)


def _run_rounds(exp: Experiment, config: RunConfig, out: Path, counters: Counters, history: list,
                server_state, stop: StopAfterRound, progress: bool, start: float,
                manifest: RunManifest | None) -> dict:
    """The rounds of `run_experiment` from `counters.rounds_done` on, and the files they leave
    (process 0's, whose `manifest` records them; every process runs the rounds, evaluations and
    checkpoints)."""
    lead = exp.process.index == 0
    title = f"{config.algorithm} / {config.model} / {config.dataset}"
    checkpointer = None
    # saved: rounds done -> the checkpoint this process wrote of them (a resumed run's starting one too)
    saved = {counters.rounds_done: out / "checkpoints" / str(counters.rounds_done)} if counters.rounds_done else {}
    writer = trackers = None
    round_seconds = []  # a round: its step and its loss on the host
    bar = progress_bar(config.rounds, f"{config.algorithm} on {config.dataset}", enabled=progress,
                       initial=counters.rounds_done)

    last_save = time.monotonic()  # for `config.checkpoint_minutes`

    def save() -> Path:
        nonlocal checkpointer, last_save
        if checkpointer is None:  # the folder recorded before any process writes there (`RunManifest`)
            failure = None
            try:
                if lead:
                    manifest.record("checkpoints")
            except Exception as e:  # noqa: BLE001 - raised below, in every process
                failure = e
            agree(failure, "recording the checkpoints folder")
            checkpointer = RunCheckpointer(out)
        before, stop.waiting_for = stop.waiting_for, f"the checkpoint of round {counters.rounds_done} to be saved"
        meta = {"config": config.to_dict(), "counters": dataclasses.asdict(counters), "processes": exp.process.count,
                "history": history, "data": exp.data_fingerprint, **exp.round_fn.saved_meta(),
                **({"sharded_devices": jax.device_count()} if config.shard_clients else {})}
        saved[counters.rounds_done] = checkpointer.save(counters.rounds_done, exp.round_fn.saved_state(server_state),
                                                        exp.store, meta)
        stop.waiting_for, last_save = before, time.monotonic()
        return saved[counters.rounds_done]

    def finish(status: str, **extra) -> dict:
        assert status in STATUSES, status
        bar.close()
        if trackers is not None:
            trackers.close_event_files(status)
        stopped = {"last_checkpoint": max(saved)} if saved and status != "completed" else {}  # where to resume
        first_round_seconds = round_seconds[0] if round_seconds else None
        totals = {**run_totals(counters), **federation_totals(exp.round_fn.conditions, counters),
                  **privacy_totals(exp.privacy, counters.rounds_done)}
        summary = released_summary(exp.privacy, config, {
            **run_summary(exp, history, totals, first_round_seconds, time.perf_counter() - start),
            "median_round_seconds": float(np.median(round_seconds[1:])) if len(round_seconds) > 1 else None,
            "status": status, **stopped, **extra})
        if lead and writer is not None:
            writer.write_summary(summary)
            plot = writer.plot(history, title=title)
            if trackers is not None:
                trackers.finish(status, [out / "summary.json", plot])
        return summary

    def failed(error: RunFailed) -> RunFailed:
        if trackers is not None:  # (its own failure may be the one reported)
            trackers.close_event_files("failed", quietly=True)
        try:  # the summary says so, where it still can be written
            finish("failed", error=str(error))
        except (RunWriteError, OSError):
            pass
        return error

    def diverged(message: str) -> DivergenceError:
        finish("diverged", error=message)
        return DivergenceError(message)

    try:
        if lead:  # the trackers outside the folder first: one that cannot start stops the run before its files
            trackers = Trackers.start(config, out, history, manifest, resume=counters.rounds_done > 0)
            writer = RunWriter(out, manifest)
            writer.start_metrics(history)
            writer.write_config(config.to_dict())
            writer.write_partition(exp.federation.summary())
            trackers.open_event_files(first_round=counters.rounds_done + 1)
        counts = exp.train_counts
        dense_forward = forward_flops(exp.model.structure)
        start_round = counters.rounds_done
        mesh = exp.round_fn.mesh
        # the clients vmapped together: a chunk, or each device's share of a sharded round; the padded
        # fraction is thus a figure of the layout (like the seconds), the one metric that may differ
        # between process counts
        together = exp.client_chunk or (config.clients_per_round // mesh.size if mesh is not None else None)
        split, slots = exp.round_fn.conditions.split, exp.round_fn.conditions.sampler.slots
        groups = (None if split is None else device_groups(slots, mesh_size=mesh.size) if mesh is not None
                  else device_groups(slots, client_chunk=exp.client_chunk, num_devices=len(exp.round_fn.cpu_devices)))
        late = False  # the checkpoint interval has passed: the next round's end saves
        for r in range(counters.rounds_done, config.rounds):
            stop.round, stop.waiting_for = r + 1, f"round {r + 1} to finish"
            t0 = time.perf_counter()
            compiling = Compiling(bar) if r == start_round else None  # until the first figures arrive
            try:
                server_state, round_out = exp.round_fn(server_state, r, prefetch_next=r + 1 < config.rounds)
            except OSError as err:
                _name_store_file(err, exp)
                raise
            ids, dispatched = np.asarray(round_out.client_ids), np.asarray(round_out.dispatched, bool)
            check_drawn(exp.round_fn.conditions.sampler, r, int(round_out.clients_drawn))
            slot_ids, ids = ids, ids[dispatched]  # the clients that trained (a slot not dispatched holds no client this round)
            # None: no client was sampled (a Poisson draw can be empty), so nothing trained
            train_loss = (float(np.average(np.asarray(round_out.metrics["loss"])[dispatched], weights=counts[ids]))
                          if ids.size else None)
            round_seconds.append(time.perf_counter() - t0)
            if train_loss is not None and not math.isfinite(train_loss):
                raise diverged(f"round {r + 1}: the training loss is {train_loss}; the run diverged "
                               f"({likely_culprit(config)})")
            if not bool(all_finite(process_local(server_state))):
                raise diverged(f"round {r + 1}: the server's model is not finite; the run diverged "
                               f"({likely_culprit(config)})")
            uplink = int(np.asarray(round_out.uplink_bytes, np.int64).sum())
            downlink = int(np.asarray(round_out.downlink_bytes, np.int64).sum())
            counters.rounds_done = r + 1
            counters.cumulative_bytes += uplink + downlink
            counters.total_uplink_bytes += uplink
            counters.total_downlink_bytes += downlink
            dense_flops = 3 * dense_forward * config.local_epochs * int(counts[ids].sum())
            counters.dense_train_flops_total += dense_flops
            if "train_flops" in round_out.metrics:  # what the clients' sparse computation cost
                counters.train_flops_total += float(np.asarray(round_out.metrics["train_flops"],
                                                               np.float64)[dispatched].sum())
            else:  # clients that report no figure of their own trained the dense model
                counters.train_flops_total += float(dense_flops)
            counters.padded_step_fractions.append(
                padded_step_fraction(counts[ids], config.batch_size, together) if split is None
                else balanced_padded_step_fraction(split, counts[slot_ids], slot_ids, dispatched, *groups))
            federation = federation_record(round_out, exp.round_fn.conditions, counters)
            if (r + 1) % config.eval_every == 0 or r + 1 == config.rounds:
                figures, finite = evaluate(exp, server_state)
                if not finite:
                    raise diverged(f"round {r + 1}: a client's model is not finite; the run diverged "
                                   f"({likely_culprit(config)})")
                record = {"round": r + 1, "train_loss": train_loss, "uplink_bytes": uplink,
                          "downlink_bytes": downlink, "cumulative_bytes": counters.cumulative_bytes,
                          "cumulative_uplink_bytes": counters.total_uplink_bytes,
                          "dense_train_flops": counters.dense_train_flops_total / config.num_clients,
                          "padded_step_fraction": counters.padded_step_fractions[-1],
                          "train_flops": counters.train_flops_total / config.num_clients,
                          **federation, **privacy_record(exp.privacy, counters.rounds_done),
                          **client_metrics(round_out.metrics, dispatched, config.client_metric_stats,
                                           exp.algorithm.client_metric_stats),
                          **{f"server_{name}": float(np.asarray(value))
                             for name, value in (round_out.server_metrics or {}).items()}, **figures}
                released = released_record(exp.privacy, config, record)  # a private run's: what it releases
                history.append(released)
                if lead:
                    writer.append_metrics(released)
                if trackers is not None:
                    trackers.log_metrics(released)
                if record["test_loss"] is not None and not math.isfinite(record["test_loss"]):
                    raise diverged(f"round {r + 1}: the test loss is {record['test_loss']}; the run diverged "
                                   f"({likely_culprit(config)})")
                if compiling is not None:
                    compiling.stop()
                bar.set_postfix(acc=_fmt(record["test_accuracy"]), pacc=_fmt(record["personalized_accuracy"]),
                                loss=_fmt(train_loss), MB=f"{counters.cumulative_bytes / 1e6:.1f}")
            if compiling is not None:
                compiling.stop()
            bar.update(1)
            if r == start_round:
                release_compiler_memory()  # the round (and, evaluating every round, the evaluators) compiled
            every = config.checkpoint_every
            if late or (every and (r + 1) % every == 0) or (r + 1 == config.rounds and checkpoints_on(config)):
                save()
            fault_point("round_end")
            # a signal to one process stops them all; the interval that passed on one saves after the next round
            signum, late = max_over_processes(stop.signum or 0, int(
                config.checkpoint_minutes > 0 and time.monotonic() - last_save >= 60 * config.checkpoint_minutes))
            if signum and r + 1 < config.rounds:
                path = saved.get(r + 1) or save()
                name = signal.Signals(signum).name
                stop.waiting_for = "the summary to be written"
                finish("interrupted", signal=name)
                raise Interrupted(f"{name}: stopped after round {r + 1} of {config.rounds}; checkpoint saved in "
                                  f"{path}; continue with --resume {out}", signum)
        return finish("completed")
    except SaveLostAProcess as err:
        raise failed(ProcessLost(write_failure(err))) from None
    except (CheckpointError, RunWriteError, OSError) as err:
        raise failed(RunFailed(write_failure(err))) from None
    except (jax.errors.JaxRuntimeError, ValueError) as err:
        if exp.process.count == 1 or not peer_lost(err):
            raise
        # a collective whose peer has gone (gloo reports it at once): this process cannot go on alone
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        message = (f"another process stopped while {stop.waiting_for} ({first[:200]}); every process stops; "
                   + (f"resume from round {max(saved)} with --resume {out}" if saved else
                      f"no checkpoint was saved yet: --resume {out} runs it again from round 1"))
        raise failed(ProcessLost(message)) from None
    finally:  # the trackers elsewhere end their runs whatever ended this one (a no-op where `finish` did)
        if trackers is not None:
            trackers.finish("failed", [])


def _fmt(x):
    return "-" if x is None else f"{x:.3f}"


