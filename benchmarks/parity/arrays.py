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


class Floor:
    """The round-off floor in force while comparing a case: per official array, how far the official run
    moves under one ulp of noise per step (`torch_side.round_off_noise`): |official - noisy|, entry by
    entry, computed once per key. Entered with `with floor:` around a method's `compare`."""

    active: "Floor | None" = None

    def __init__(self, official: dict[str, np.ndarray], noisy: dict[str, np.ndarray]):
        self.official, self.noisy, self.cache = official, noisy, {}

    def moved(self, key: str) -> np.ndarray | None:
        if key not in self.cache:
            a, b = self.official.get(key), self.noisy.get(key)
            ok = a is not None and b is not None and a.shape == b.shape and np.issubdtype(a.dtype, np.floating)
            self.cache[key] = np.abs(a.astype(np.float64) - b).astype(np.float32) if ok else None
        return self.cache[key]

    def __enter__(self):
        Floor.active = self
        return self

    def __exit__(self, *exc):
        Floor.active = None


def tolerances(moved: np.ndarray, scale: float) -> np.ndarray:
    """Each entry's tolerance: FLOOR_FACTOR times the larger of how far the noise moved it and how far it
    moved 999 entries in 1,000 of its tensor (its tensor's typical floor), and at least ROUND_OFF of
    the tensor's scale. An entry round-off moves far (Adam's step on a gradient near its epsilon) gets
    its own allowance without loosening its tensor's."""
    from benchmarks.parity.verdicts import FLOOR_FACTOR, ROUND_OFF
    moved = moved.astype(np.float64)
    typical = float(np.quantile(moved, 0.999)) if moved.size else 0.0
    return np.maximum(ROUND_OFF * scale, FLOOR_FACTOR * np.maximum(moved, typical))


def difference(name: str, ours: np.ndarray, theirs: np.ndarray, start: np.ndarray | None = None, *,
               key: str | None = None, scale: float | None = None) -> dict:
    """max |ours - theirs| and that over max |theirs| (the tensor's scale: an elementwise ratio would
    blow up at entries near zero; `scale` overrides it), in float64; with `start` (what the tensor was
    updated from) also `moved`, max |theirs - start| / max |theirs|: how far the update took it, which
    the error is to be read against (a step that barely moves a tensor would hide any error). `key`:
    the official array `theirs` is: under a `Floor`, the entries beyond their tolerance (`tolerances`)
    are counted (`beyond`) and the tensor's typical floor given (`floor`, relative to the scale)."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if ours.shape != theirs.shape:
        raise ValueError(f"{name}: shapes differ, library {ours.shape} vs official {theirs.shape}")
    err = np.abs(ours - theirs)
    if scale is None:
        scale = float(np.max(np.abs(theirs))) if theirs.size else 0.0
    max_abs = float(err.max()) if err.size else 0.0
    out = {"tensor": name, "shape": list(theirs.shape), "max_abs": max_abs,
           "max_rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf")), "scale": scale}
    moved = Floor.active.moved(key) if Floor.active is not None and key is not None else None
    if moved is not None and moved.shape == theirs.shape and scale > 0:
        tolerance = tolerances(moved, scale)
        out.update(key=key, beyond=int(np.sum(err > tolerance)),
                   floor=float(np.quantile(moved, 0.999)) / scale if moved.size else 0.0,
                   tolerance=float(np.min(tolerance)) / scale)
    if start is not None and scale > 0:
        out["moved"] = float(np.max(np.abs(theirs - np.asarray(start, np.float64)))) / scale
    return out


def group(what: str, diffs: Iterable[dict], note: str = "") -> dict:
    """One table row: the worst of a group of tensor comparisons. `what` names the row in every case of
    a method (verdicts.py matches rows across cases by it); `note` says what the figures mean, never why
    they differ (that is measured). Under a `Floor`: `beyond`, the entries past their tolerance, and
    `tolerance`, the worst tensor's (FLOOR_FACTOR x its typical floor, at least ROUND_OFF)."""
    diffs = list(diffs)
    if not diffs:
        raise ValueError(f"{what}: no tensor compared")
    worst = max(diffs, key=lambda d: d["max_rel"])
    moved = [d["moved"] for d in diffs if "moved" in d]
    row = {"compared": what, "tensors": len(diffs), "entries": int(sum(np.prod(d["shape"]) for d in diffs)),
           "max_abs": max(d["max_abs"] for d in diffs), "max_rel": worst["max_rel"], "worst": worst["tensor"],
           "moved_median": float(np.median(moved)) if moved else None, "note": note, "details": diffs}
    floored = [d for d in diffs if "beyond" in d]
    if floored:
        row.update(beyond=sum(d["beyond"] for d in floored), floor=max(d["floor"] for d in floored),
                   tolerance=worst.get("tolerance", min(d["tolerance"] for d in floored)))
    return row


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


def margin_row(what: str, margin: float, required: float, note: str = "") -> dict:
    """A row of how far the run's decisions of one kind sat from a tie (the smallest gap, relative),
    against the margin that keeps them the same on any host (verdicts.py: NEAR A TIE below it)."""
    return {"compared": what, "kind": "margin", "tensors": 0, "margin": float(margin), "required": required,
            "max_rel": 0.0, "max_abs": 0.0, "note": note}
