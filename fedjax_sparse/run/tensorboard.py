"""A run's per-round figures as TensorBoard event files (written by tensorboardX, read by TensorBoard).

The event files lie in the run folder itself, so `tensorboard --logdir runs`
shows every run under `runs/` by its folder name. Each number of a metrics
record becomes a scalar at step = the record's round; a dict of numbers
(e.g. SpaFL's `density_per_layer`) becomes one scalar per key under the
dict's name; lists and missing values (`None`) are left out.
"""

from __future__ import annotations

from numbers import Real
from pathlib import Path
from typing import Iterator


def scalars(record: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every real number in `record` (NaN too), nested dicts flattened with '/'."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalars(value, f"{tag}/")
        elif isinstance(value, Real) and not isinstance(value, bool):
            yield tag, float(value)


class TensorBoardWriter:
    """Appends each round's metrics record to the run's TensorBoard event files.

    `first_round` is the first round this process will write (a resumed run's
    rounds_done + 1): events a previous process wrote for that round or later
    are discarded by TensorBoard (tensorboardX's `purge_step`), so a resumed
    run shows each round once.
    """

    def __init__(self, out: str | Path, first_round: int = 1):
        from tensorboardX import SummaryWriter

        # The suffix orders the files of one run chronologically also when two processes start within
        # the same second (the files' names carry the time in seconds), and keeps them apart.
        self._writer = SummaryWriter(logdir=str(out), purge_step=first_round if first_round > 1 else None,
                                     filename_suffix=f".from_round_{first_round:06d}")

    def write(self, record: dict) -> None:
        step = int(record["round"])
        for tag, value in scalars({k: v for k, v in record.items() if k != "round"}):
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
