"""Test-only fault injection: stop a run process at a precise point, so crash tests never depend on timing.

`FEDJAX_SPARSE_FAULT="point:n:action[,point:n:action...]"` makes the n-th time this process
reaches `point` do `action`:

* `kill`: SIGKILL itself (what kill -9 or a lost machine does);
* `pause`: write the point's name into the file `$FEDJAX_SPARSE_FAULT_FLAG` and wait until a
  test deletes that file (at most 120 s), so the test can act while the run stands there;
* `errno=N`: raise the OSError the OS raises with errno N (28: the disk is full, 27: the file is
  too large, 30: a read-only file system, 13: permission denied) where the point stands.

Points: `start_up` (the run folder locked, the data not loaded yet), `round_end` (a round done, its
metrics written and any checkpoint due saved), `checkpoint_write` (a checkpoint's files being written
in the background, not yet committed), `metrics_write` (half of a metrics line written and flushed),
`write:NAME` (the run is about to write its file NAME, or, for `write:checkpoints`, a checkpoint, for
`write:events.out.tfevents`, its TensorBoard event file).
Without the variable nothing happens.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_reached: dict[str, int] = {}


def fault_point(point: str) -> None:
    spec = os.environ.get("FEDJAX_SPARSE_FAULT")
    if not spec:
        return
    _reached[point] = _reached.get(point, 0) + 1
    for item in spec.split(","):
        name, count, action = item.rsplit(":", 2)
        if name == point and int(count) == _reached[point]:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action.startswith("errno="):
                code = int(action.split("=", 1)[1])
                raise OSError(code, os.strerror(code), point.split(":", 1)[-1])
            elif action == "pause":
                flag = Path(os.environ["FEDJAX_SPARSE_FAULT_FLAG"])
                written = flag.with_name(f".{flag.name}.{os.getpid()}")
                written.write_text(point)
                os.replace(written, flag)  # a test that sees the flag reads the point, never an empty file
                deadline = time.monotonic() + 120
                while flag.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            else:
                raise ValueError(f"FEDJAX_SPARSE_FAULT: unknown action {action!r} in {item!r}; valid: kill, pause, "
                                 f"errno=N")
