"""Verdicts: a difference is explained by a measurement, never by a label.

Round-off. A numeric row is at round-off when every entry it compares is within its tolerance
(`arrays.tolerances`): FLOOR_FACTOR times its measured floor, at least ROUND_OFF of its tensor's
scale; without a floor, when its max rel is within ROUND_OFF. The floor is how far the official run
of a terminal case (one no other case aligns more than; a case's `floor` names which, where several
are) moves from the same run with one ulp of random noise added to every parameter after every
optimizer step: over tens of steps a float32 difference grows (BatchNorm's statistics, the momentum,
a control variate's (w_g - w) / (K lr), Adam's step on a gradient near its epsilon), and the floor
shows by how much, entry by entry.

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
below their required margin, which no alignment explains (the driver redraws the inputs); so is a
numeric row whose measured floor is above CHAOTIC_FLOOR (the official run unsteady under round-off
alone: a tie no margin row watches). Any UNEXPLAINED or NEAR A TIE fails the run.

Imports numpy only (the PyTorch side imports the method files, which import this).
"""

from __future__ import annotations

import dataclasses

ROUND_OFF = 1e-5  # relative to the tensor's largest entry: float32 round-off accumulated over a few steps
# an entry's tolerance: this many times its measured round-off floor (the official run against itself
# with one ulp of noise in every parameter after every step), at least ROUND_OFF. The two sides' steps
# differ by more than one ulp: by tens where large logits or a BatchNorm's statistics amplify a
# reduction's rounding (up to 32 floors, entry by entry, in the aligned cases of this harness's first
# runs: FedP3's classifier, fed inputs of standard deviation 4)
FLOOR_FACTOR = 100.0
# a row whose official run moves by more than this (its tensors' typical floor, relative to their scale)
# under one ulp of noise per step is not judged: a decision near a tie somewhere, or training that
# amplifies round-off a thousandfold, makes the row the host's to decide (SpaFL's client 2 in its third
# round moved 0.2 of its scale on the draw with seed 0), and FLOOR_FACTOR times such a floor would pass
# any difference; the row is NEAR A TIE, and the inputs are redrawn
CHAOTIC_FLOOR = 1e-4

ROUND = "round-off"
EXPLAINED = "explained"
UNEXPLAINED = "UNEXPLAINED"
NEAR_TIE = "NEAR A TIE"
FAILING = (UNEXPLAINED, NEAR_TIE)


@dataclasses.dataclass(frozen=True)
class Case:
    """A run of a method's comparison: `aligns` the causes it removes; `official`, the case whose official
    run it compares with when it changes only the library's side (default: its own); `floor`, the
    terminal case whose round-off floor it is judged with where several align a superset of its causes."""

    description: str
    aligns: tuple[str, ...] = ()
    official: str | None = None
    floor: str | None = None


def chaotic(row: dict) -> bool:
    """A numeric row whose measured round-off floor shows the official run itself unsteady (CHAOTIC_FLOOR)."""
    return row.get("kind", "numeric") == "numeric" and row.get("floor", 0.0) > CHAOTIC_FLOOR


def near_tie(row: dict) -> bool:
    """A row that says the inputs sit near a tie: a margin not kept, or a chaotic floor."""
    return (row.get("kind") == "margin" and not within(row)) or chaotic(row)


def within(row: dict) -> bool:
    """A row at float32 round-off (numbers), equal (exact facts), or clear of its margin."""
    kind = row.get("kind", "numeric")
    if kind == "exact":
        return row["mismatched_entries"] == 0
    if kind == "margin":
        return row["margin"] >= row["required"]
    if kind == "aligned":
        return row["beyond"] == 0
    if "beyond" in row:
        return row["beyond"] == 0
    return row["max_rel"] <= ROUND_OFF


def terminal(cases: dict[str, "Case"]) -> list[str]:
    """The cases no other case aligns a strict superset of: where the round-off floor is measured."""
    return [name for name, case in cases.items()
            if not any(set(other.aligns) > set(case.aligns) for other in cases.values())]


def floor_case(cases: dict[str, "Case"], name: str) -> str:
    """The terminal case whose round-off floor judges case `name`: its `floor`, itself if terminal, else
    the one terminal case aligning a superset of its causes."""
    if cases[name].floor is not None:
        return cases[name].floor
    if name in terminal(cases):
        return name
    found = [t for t in terminal(cases) if set(cases[t].aligns) >= set(cases[name].aligns)]
    if len(found) != 1:
        raise ValueError(f"case {name}: terminal cases {found} align its causes; name one as its floor")
    return found[0]


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
            if near_tie(row):
                row["verdict"] = NEAR_TIE
            elif within(row):
                row["verdict"] = ROUND
            else:
                row["verdict"] = UNEXPLAINED
                for added, name in supersets:
                    there = next((r for r in cases[name]["rows"] if r["compared"] == row["compared"]), None)
                    if there is not None and within(there) and not near_tie(there):
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
    if chaotic(row):
        return f"{row['max_rel']:.2e}; round-off floor {row['floor']:.1e} (at most {CHAOTIC_FLOOR:.0e})"
    if "beyond" in row:
        return f"{row['max_rel']:.2e}, {row['beyond']:,} of {row['entries']:,} entries beyond tolerance"
    return f"{row['max_rel']:.2e}"


def summary(body: dict) -> dict[str, int]:
    """How many rows of a case have each verdict."""
    counts = {ROUND: 0, EXPLAINED: 0, UNEXPLAINED: 0, NEAR_TIE: 0}
    for row in body["rows"]:
        counts[row["verdict"]] += 1
    return counts
