"""Client-state snapshots on disk: a folder with meta.json and .npy arrays, written atomically
(a temporary folder renamed, every file fsynced), and their errors named for the user.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from fedjax_sparse.core.distributed import ProcessLayout


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_snapshot(directory: Path, name: str, meta: dict, arrays: dict[str, np.ndarray]) -> Path:
    """Writes meta.json and the arrays into directory/name atomically (a temporary folder renamed)."""
    final = Path(directory) / name
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for filename, array in arrays.items():
        with open(tmp / filename, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def read_rows_snapshot(path: Path, meta: dict) -> tuple[np.ndarray, np.ndarray]:
    if meta["backend"] not in ("device", "host"):
        raise ValueError(f"the client-state snapshot in {path} is a {meta['backend']} store's (rows kept in "
                         f"its folder); restore it with the {meta['backend']} store")
    return np.load(path / "slots.npy"), np.load(path / "rows.npy", mmap_mode="r")


class SnapshotError(ValueError):
    """A client-state snapshot cannot be used; the message names the file and what to do."""


class ClientRowsLost(SnapshotError):
    """The disk store's rows file, which every checkpoint's client states live in, is missing or cut short."""


def read_snapshot_meta(path: Path) -> dict:
    """A snapshot's meta.json, or a SnapshotError naming it (a truncated or garbled file)."""
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict) or "backend" not in meta:
            raise ValueError("it holds no snapshot description")
        return meta
    except (ValueError, UnicodeDecodeError) as err:
        raise SnapshotError(f"the client-state snapshot {path} cannot be read ({' '.join(str(err).split())}); "
                            f"delete its checkpoint folder {path.parents[1]} to resume from the one before, or "
                            f"start again with --overwrite") from None


def snapshot_backend(directory: str | Path, process: ProcessLayout) -> str | None:
    """The backend of the store whose snapshot of `process`'s clients is in `directory` (None: none there)."""
    meta = Path(directory) / f"client_states.{process.tag()}" / "meta.json"
    return read_snapshot_meta(meta)["backend"] if meta.exists() else None
