"""What both sides share: flat .npz files of named arrays, and the comparison of two tensors.

Imports numpy only, so the PyTorch side (its own virtual environment, no JAX) can use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

def save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def under(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays named `prefix/...`, keyed by the rest of their name."""
    head = prefix.rstrip("/") + "/"
    return {k[len(head):]: v for k, v in arrays.items() if k.startswith(head)}


def prefixed(prefix: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{prefix}/{k}": v for k, v in arrays.items()}


def difference(name: str, ours: np.ndarray, theirs: np.ndarray, start: np.ndarray | None = None, *,
               key: str | None = None, scale: float | None = None) -> dict:
    """max |ours - theirs| and that over max |theirs| (the tensor's scale: an elementwise ratio would
    blow up at entries near zero; `scale` overrides it), in float64; with `start` (what the tensor was
    updated from) also `moved`, max |theirs - start| / max |theirs|: how far the update took it, which
    the error is to be read against (a step that barely moves a tensor would hide any error). `key`:
    the official array `theirs` is (or is computed from), whose round-off floor the driver measures."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if ours.shape != theirs.shape:
        raise ValueError(f"{name}: shapes differ, library {ours.shape} vs official {theirs.shape}")
    err = np.abs(ours - theirs)
    if scale is None:
        scale = float(np.max(np.abs(theirs))) if theirs.size else 0.0
    max_abs = float(err.max()) if err.size else 0.0
    out = {"tensor": name, "shape": list(theirs.shape), "max_abs": max_abs,
           "max_rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf")), "scale": scale}
    if key is not None:
        out["key"] = key
    if start is not None and scale > 0:
        out["moved"] = float(np.max(np.abs(theirs - np.asarray(start, np.float64)))) / scale
    return out


def group(what: str, diffs: Iterable[dict], note: str = "") -> dict:
    """One table row: the worst of a group of tensor comparisons. `what` names the row in every case of
    a method (verdicts.py matches rows across cases by it); `note` says what the figures mean, never why
    they differ (that is measured)."""
    diffs = list(diffs)
    if not diffs:
        raise ValueError(f"{what}: no tensor compared")
    worst = max(diffs, key=lambda d: d["max_rel"])
    moved = [d["moved"] for d in diffs if "moved" in d]
    return {"compared": what, "tensors": len(diffs), "entries": int(sum(np.prod(d["shape"]) for d in diffs)),
            "max_abs": max(d["max_abs"] for d in diffs), "max_rel": worst["max_rel"], "worst": worst["tensor"],
            "moved_median": float(np.median(moved)) if moved else None, "note": note, "details": diffs}


def identical(what: str, ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray], note: str = "") -> dict:
    """A row for boolean/integer facts that must agree exactly (which entries a sub-model holds)."""
    if set(ours) != set(theirs):
        raise ValueError(f"{what}: library names {sorted(set(ours) ^ set(theirs))} have no counterpart")
    mismatches = {k: int(np.sum(np.asarray(ours[k]) != np.asarray(theirs[k]))) for k in theirs}
    diffs = [{"tensor": k, "shape": list(np.shape(theirs[k])), "max_abs": float(m), "max_rel": float(m),
              "scale": 1.0} for k, m in mismatches.items()]
    row = group(what, diffs, note)
    row["kind"] = "exact"
    row["mismatched_entries"] = sum(mismatches.values())
    return row


def floor(official: dict[str, np.ndarray], noisy: dict[str, np.ndarray], row: dict) -> float | None:
    """A numeric row's round-off floor: the largest relative change, over the official arrays it compares
    (its details' keys), between the official run and the same run under round-off noise (relative to
    each detail's scale, as the row's own figures are); None if it names no array."""
    changes = []
    for d in row.get("details", []):
        key = d.get("key")
        if key in official and key in noisy and d["scale"] > 0:
            a, b = np.asarray(official[key], np.float64), np.asarray(noisy[key], np.float64)
            changes.append(float(np.max(np.abs(a - b))) / d["scale"] if a.size else 0.0)
    return max(changes) if changes else None


def margin_row(what: str, margin: float, required: float, note: str = "") -> dict:
    """A row of how far the run's decisions of one kind sat from a tie (the smallest gap, relative),
    against the margin that keeps them the same on any host (verdicts.py: NEAR A TIE below it)."""
    return {"compared": what, "kind": "margin", "tensors": 0, "margin": float(margin), "required": required,
            "max_rel": 0.0, "max_abs": 0.0, "note": note}
