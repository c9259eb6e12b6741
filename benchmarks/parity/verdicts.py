"""Verdicts: a difference is explained by a measurement, never by a label.

Round-off. A numeric row is at round-off within its tolerance: max(ROUND_OFF, FLOOR_FACTOR x its
floor), the floor being measured (`tolerances`): the official run of a terminal case (one no other
case aligns more than) against the same run with one ulp of random noise added to every parameter after
every optimizer step. Over tens of steps a float32 difference grows (BatchNorm's statistics, the
momentum, a control variate's (w_g - w) / (K lr)); the floor shows by how much, row by row.

A method's cases are runs of the same comparison. The first is the code as published; each other case
aligns one or more named causes (`Case.aligns`): the official code run with the tie broken the same
way, their estimator swapped for the library's, the library's option that reproduces the code, ...
Every case yields the same rows (keyed by `compared`). A row is
  * `round-off`: within ROUND_OFF (numbers) or equal (exact facts, `mismatched_entries` 0);
  * `explained`: above that, but a case aligning a strict superset of this case's causes shows the
    same row within it; the row names the causes that case adds (the fewest such) and where it fell;
  * `UNEXPLAINED`: otherwise. The case aligning every cause has no superset, so every row of it must
    be at round-off.
Rows of kind `aligned` (ReLU and max-pool decisions near a tie the official run took the library's
way, `decisions.py`) are above round-off when a decision differed beyond the margin, and judged as
numbers are. Rows of kind `margin` (how far the inputs' top-k and threshold decisions sit from a tie,
in the terminal cases, whose runs every other case's differences are measured by) are `NEAR A TIE`
below their required margin, which no alignment explains (the driver redraws the inputs). Any
UNEXPLAINED or NEAR A TIE fails the run.

Imports numpy only (the PyTorch side imports the method files, which import this).
"""

from __future__ import annotations

import dataclasses

ROUND_OFF = 1e-5  # relative to the tensor's largest entry: float32 round-off accumulated over a few steps
# a row's tolerance: ROUND_OFF, or this many times its measured round-off floor (the official run against
# itself with one ulp of noise in every parameter after every step) where that is larger. The two sides'
# steps differ by more than one ulp: by tens where large logits or a BatchNorm's statistics amplify a
# reduction's rounding (at most 18 floors in the aligned cases of this harness's first run)
FLOOR_FACTOR = 30.0

ROUND = "round-off"
EXPLAINED = "explained"
UNEXPLAINED = "UNEXPLAINED"
NEAR_TIE = "NEAR A TIE"
FAILING = (UNEXPLAINED, NEAR_TIE)


@dataclasses.dataclass(frozen=True)
class Case:
    """A run of a method's comparison: `aligns` the causes it removes; `official`, the case whose official
    run it compares with when it changes only the library's side or the comparison (default: its own)."""

    description: str
    aligns: tuple[str, ...] = ()
    official: str | None = None


def within(row: dict) -> bool:
    """A row at float32 round-off (numbers), equal (exact facts), or clear of its margin."""
    kind = row.get("kind", "numeric")
    if kind == "exact":
        return row["mismatched_entries"] == 0
    if kind == "margin":
        return row["margin"] >= row["required"]
    if kind == "aligned":
        return row["beyond"] == 0
    return row["max_rel"] <= row.get("tolerance", ROUND_OFF)


def terminal(cases: dict[str, "Case"]) -> list[str]:
    """The cases no other case aligns a strict superset of: where the round-off floor is measured."""
    return [name for name, case in cases.items()
            if not any(set(other.aligns) > set(case.aligns) for other in cases.values())]


def tolerances(cases: dict[str, dict], floors: dict[str, float]) -> None:
    """Sets each numeric row's `floor` and `tolerance` from `floors` ({row name: floor}, measured in the
    terminal cases); a row no floor names keeps ROUND_OFF."""
    for body in cases.values():
        for row in body["rows"]:
            if row.get("kind", "numeric") == "numeric" and floors.get(row["compared"]) is not None:
                row["floor"] = floors[row["compared"]]
                row["tolerance"] = max(ROUND_OFF, FLOOR_FACTOR * row["floor"])


def judge(cases: dict[str, dict], causes: dict[str, str]) -> list[str]:
    """Sets each row's `verdict` (and `explained_by`, `removed_in`, `removed_at` where explained) in
    `cases` ({case: {"aligns": [...], "rows": [...]}}, rows in place); returns the failing rows as
    'case: compared' lines."""
    for case, body in cases.items():
        unknown = set(body["aligns"]) - set(causes)
        if unknown:
            raise ValueError(f"case {case} aligns {sorted(unknown)}, not among the causes {sorted(causes)}")
        keys = [r["compared"] for r in body["rows"]]
        if len(keys) != len(set(keys)):
            raise ValueError(f"case {case}: rows share a name: {sorted(k for k in keys if keys.count(k) > 1)}")
    failing = []
    for case, body in cases.items():
        aligned = set(body["aligns"])
        supersets = sorted(((set(other["aligns"]) - aligned, name) for name, other in cases.items()
                            if set(other["aligns"]) > aligned), key=lambda pair: len(pair[0]))
        for row in body["rows"]:
            for key in ("explained_by", "removed_in", "removed_at"):
                row.pop(key, None)
            kind = row.get("kind", "numeric")
            if within(row):
                row["verdict"] = ROUND
            elif kind == "margin":
                row["verdict"] = NEAR_TIE
            else:
                row["verdict"] = UNEXPLAINED
                for added, name in supersets:
                    there = next((r for r in cases[name]["rows"] if r["compared"] == row["compared"]), None)
                    if there is not None and within(there):
                        row.update(verdict=EXPLAINED, explained_by=sorted(added, key=list(causes).index),
                                   removed_in=name, removed_at=figure(there))
                        break
            if row["verdict"] in FAILING:
                failing.append(f"{case}: {row['compared']} ({row['verdict']})")
    return failing


def figure(row: dict) -> str:
    """A row's measured difference in words (for the table)."""
    kind = row.get("kind", "numeric")
    if kind == "exact":
        return f"{row['mismatched_entries']:,} entries differ" if row["mismatched_entries"] else "the same"
    if kind == "margin":
        return f"{row['margin']:.1e} (needs {row['required']:.0e})"
    if kind == "aligned":
        return f"{row['aligned']:,} aligned, {row['beyond']:,} beyond the margin"
    return f"{row['max_rel']:.2e}" + (f" (tolerance {row['tolerance']:.1e})" if "tolerance" in row else "")


def summary(body: dict) -> dict[str, int]:
    """How many rows of a case have each verdict."""
    counts = {ROUND: 0, EXPLAINED: 0, UNEXPLAINED: 0, NEAR_TIE: 0}
    for row in body["rows"]:
        counts[row["verdict"]] += 1
    return counts
