"""A run's per-round figures as TensorBoard event files (read by TensorBoard; tensorboardX's protocol buffers).

TensorBoard is one of the run's trackers (`run.trackers`), the default one, and the one whose files
are the run's own. The event files lie in the run folder itself, so `tensorboard --logdir runs`
shows every run under `runs/` by its folder name. Each number of a metrics
record becomes a scalar at step = the record's round; a dict of numbers
(e.g. SpaFL's `density_per_layer`) becomes one scalar per key under the
dict's name; lists and missing values (`None`) are left out.

The events are written here, in the run's own thread, not by tensorboardX's
`SummaryWriter`: that one writes from a background thread and an exit hook, so
a full disk or a file-size limit gave two tracebacks, no file named and no
summary; and it logs a warning for every NaN, which a diverged run has. Here
each round's events are written and flushed to the disk before the run goes on,
and a failed write is one `RunWriteError` naming the file, as for every file
of the run.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from fedjax_sparse.run.outputs import writing

if TYPE_CHECKING:
    from fedjax_sparse.run.folder import RunManifest

FAULT_POINT = "events.out.tfevents"  # `run.faults`: write:events.out.tfevents fails this writer's writes


def scalars(record: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every real number in `record` (NaN too), nested dicts flattened with '/'."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalars(value, f"{tag}/")
        elif isinstance(value, Real) and not isinstance(value, bool):
            yield tag, float(value)


class TensorBoardWriter:
    """Appends each round's figures to a new event file of the run folder `out` (a `run.trackers.Tracker`;
    the config and the plots stay in the run folder, as config.json and accuracy.png).

    `first_round` is the first round this process will write (a resumed run's
    rounds_done + 1): events a previous process wrote for that round or later
    are discarded by TensorBoard (a session-start event at that step, what
    tensorboardX's `purge_step` writes), so a resumed run shows each round once.
    The file's name goes to `manifest` before the file is made.
    """

    def __init__(self, out: str | Path, first_round: int = 1, manifest: "RunManifest | None" = None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        # The time (in seconds) orders a run's files; the suffix orders and keeps apart two processes'
        # that start within the same second. TensorBoard reads every file whose name holds "tfevents".
        self.path = Path(out) / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
                                 f".from_round_{first_round:06d}")
        if manifest is not None:
            manifest.record(self.path.name)
        self._file = None
        with writing(self.path, FAULT_POINT):
            self._file = open(self.path, "wb")
        first = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if first_round > 1:
            first.append(Event(wall_time=time.time(), step=first_round,
                               session_log=SessionLog(status=SessionLog.START)))
        self._append(first)

    def _append(self, events) -> None:
        if self._file is None:  # a write failed before: the run is ending
            return
        with writing(self.path, FAULT_POINT):
            try:
                for event in events:
                    self._file.write(_record(event.SerializeToString()))
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError:
                self._abandon()
                raise

    def _abandon(self) -> None:
        """Closes the file after a failed write without trying its buffer again (each try would fail
        anew, the last at the interpreter's exit)."""
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass  # the buffer is dropped; the write's own error is the one reported

    def start(self, config: dict) -> None:
        """Nothing: TensorBoard shows the figures; the config is config.json beside them."""

    def log_metrics(self, round: int, metrics: dict) -> None:
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in scalars(metrics)]
        self._append([self._event(wall_time=time.time(), step=int(round), summary=self._summary(value=values))])

    def log_artifacts(self, paths) -> None:
        """Nothing: the plot is accuracy.png beside the events."""

    def finish(self, status: str) -> None:
        if self._file is not None:
            with writing(self.path, FAULT_POINT):
                file, self._file = self._file, None
                file.close()


def _record(data: bytes) -> bytes:
    """`data` framed as one TFRecord: its length, the length's masked CRC-32C, the data, its masked CRC-32C."""
    from tensorboardX.record_writer import masked_crc32c

    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))
