"""Decoded data sets cached as .npy arrays, keyed on their sources' contents, written atomically.

Used by the image-folder loader and the LEAF loaders (`data.image_folder`, `data.leaf`): a source is
decoded once and later loads read its arrays. A cache lives in `BASE/KIND/<key>/` (BASE: the
given folder, else $FEDJAX_SPARSE_CACHE, else ~/.cache/fedjax_sparse) and is written into a
temporary sibling then renamed, so a killed run never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std of uint8 NHWC images in [0, 1] units.

    Uses a 256-bin histogram per channel, so it needs no float copy of the data.
    """
    return histogram_stats(channel_histograms(x))


def channel_histograms(x: np.ndarray) -> np.ndarray:
    """[C, 256] int64: how many pixels of each channel of uint8 NHWC images take each value. Counts add
    exactly, so the sum over consecutive chunks is the whole array's (`data.mapped` streams a split)."""
    return np.stack([np.bincount(x[..., c].ravel(), minlength=256) for c in range(x.shape[-1])]).astype(np.int64)


def histogram_stats(histograms: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`channel_stats` of the images whose `channel_histograms` these are."""
    if len(histograms) == 0 or histograms[0].sum() == 0:
        raise ValueError("cannot compute mean/std of an empty training split")
    values = np.arange(256, dtype=np.float64)
    means, stds = [], []
    for counts in histograms:
        hist = counts.astype(np.float64)
        n = hist.sum()
        mean = float((hist * values).sum() / n)
        var = float((hist * values**2).sum() / n - mean**2)
        means.append(mean / 255.0)
        # Guard constant images (std 0) so that normalisation never divides by zero.
        stds.append(max(np.sqrt(max(var, 0.0)) / 255.0, 1e-8))
    return tuple(means), tuple(stds)


def content_key(root: Path, relative_paths: list[str], version: int) -> str:
    """Hash of `version`, the relative file list and every file's bytes (contents, not times)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"v{version}\0".encode())
    h.update("\0".join(relative_paths).encode("utf-8", "surrogateescape"))
    for relative in relative_paths:
        content = (root / relative).read_bytes()
        h.update(len(content).to_bytes(8, "little"))
        h.update(content)
    return h.hexdigest()


def cache_base(cache_dir: str | os.PathLike | None, kind: str) -> Path:
    """BASE/KIND (module docstring)."""
    if cache_dir is not None:
        base = Path(cache_dir)
    elif os.environ.get("FEDJAX_SPARSE_CACHE"):
        base = Path(os.environ["FEDJAX_SPARSE_CACHE"])
    else:
        base = Path("~/.cache/fedjax_sparse")
    return base.expanduser().resolve() / kind


def save_arrays(directory: Path, arrays: dict[str, np.ndarray], meta: dict, version: int) -> None:
    """Writes the arrays and meta.json (which holds `key` and `format`) into a temporary sibling, then
    renames it into place."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{directory.name}-", dir=directory.parent))
    try:
        for key, value in arrays.items():
            np.save(tmp / f"{key}.npy", value, allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache may be shared
        try:
            os.rename(tmp, directory)
        except OSError:
            # The target exists and is not empty. If another process finished the
            # same cache first, keep its (equivalent) copy; if it holds something
            # unreadable, replace it.
            if load_arrays(directory, meta["key"], version, tuple(arrays)) is not None:
                return
            shutil.rmtree(directory, ignore_errors=True)
            os.rename(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_arrays(directory: Path, key: str, version: int, names: tuple[str, ...]
                ) -> tuple[dict[str, np.ndarray], dict] | None:
    """The cached arrays `names` and meta, or None if missing, stale or unreadable (an array whose
    shape meta.json records as `NAME_shape` must have it)."""
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != version or meta.get("key") != key:
            return None
        arrays = {k: np.load(directory / f"{k}.npy", allow_pickle=False) for k in names}
        for name, array in arrays.items():
            if f"{name}_shape" in meta and list(array.shape) != meta[f"{name}_shape"]:
                return None
        return arrays, meta
    except (OSError, ValueError, KeyError) as err:
        log.warning("ignoring unreadable cache %s: %s", directory, err)
        return None
