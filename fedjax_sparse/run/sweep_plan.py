"""A sweep's plan: the points of a grid, a list or a search, the seeds, and each run's command and expected
config, saved in the sweep's folder before any run starts (`run.sweep` runs it)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import itertools
import json
from pathlib import Path
from typing import Any, Sequence


PLAN_FILE = "sweep.json"
STUDY_FILE = "study.db"
STUDY_NAME = "sweep"
RUN_OPTIONS_FILE = "run_options.json"  # a --config file's run options, given to every run as its --config
SWEEP_KEYS = ("grid", "points", "seeds", "search", "trials")  # a sweep config file's own keys
NOT_SWEPT = {"seed": "--seeds", "out": "--out"}  # run options the sweep sets itself
SEARCH_KINDS = ("log", "float", "int", "choice")
LAUNCH = ("--coordinator", "--num-processes", "--process-id", "--cluster", "--launch-timeout")
MEMORY_PER_RUN = 4 * 2 ** 30
_POLL_S = 0.2


class SweepError(ValueError):
    """A bad sweep request, said in one line."""


# --- the plan: points, seeds and each run's command ------------------------------------------------


def _declared(name: str, where: str):
    from fedjax_sparse.run.config import declared_options

    declared = declared_options()
    if name in NOT_SWEPT:
        raise SweepError(f"{where}: {name} is set by the sweep; give {NOT_SWEPT[name]} instead")
    if name not in declared:
        close = difflib.get_close_matches(name, declared, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SweepError(f"{where}: unknown option {name!r}{hint}; `fedjax-sparse run --help` lists the options")
    return declared[name]


def _typed(name: str, value: Any, where: str) -> Any:
    """`value` (text from a flag, or a file's typed value) as option `name` holds it, checked."""
    from fedjax_sparse.core.contract.options import check_value, coerce

    spec, annotation = _declared(name, where)
    try:
        try:
            typed = coerce(name, annotation, value)
        except ValueError:
            if not (isinstance(value, str) and value.lower() in ("true", "false")):
                raise
            typed = coerce(name, annotation, value.lower() == "true")  # a bool option's flag text
        check_value(name, spec, typed)
    except ValueError as e:
        raise SweepError(f"{where}: {e}") from None
    return typed


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(_text(v) for v in value)
    return "none" if value is None else str(value)


def value_flags(name: str, value: Any) -> list[str]:
    """The `run` flags that set option `name` to `value`."""
    from fedjax_sparse.core.contract.options import flag_name

    flag = flag_name(name)
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, _text(value)]


def point_name(values: dict[str, Any]) -> str:
    """The point's folder name: its swept values, e.g. 'lr=0.05,mu=0.0' ('base' for none)."""
    return ",".join(f"{k}={_text(v)}" for k, v in values.items()).replace("/", "_") or "base"


def parse_grid(items: Sequence[str]) -> dict[str, list]:
    """`--grid NAME=V1,V2` flags as option -> typed values (their product is the grid)."""
    grid: dict[str, list] = {}
    for item in items:
        where = f"--grid {item}"
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name or not values.strip():
            raise SweepError(f"{where}: expected NAME=V1,V2,... (e.g. --grid lr=0.05,0.1)")
        if name in grid:
            raise SweepError(f"{where}: {name} is swept twice; give its values in one --grid")
        _, annotation = _declared(name, where)
        if "tuple" in str(annotation):
            raise SweepError(f"{where}: {name} takes a list, which a comma-separated --grid cannot give; "
                             f"sweep it from a config file's grid")
        grid[name] = [_typed(name, v.strip(), where) for v in values.split(",")]
    return grid


def grid_points(grid: dict[str, list]) -> list[dict]:
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise SweepError(f"--seeds {text}: expected comma-separated integers (e.g. 0,1,2)") from None
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise SweepError(f"--seeds {text}: expected distinct seeds >= 0")
    return seeds


def parse_search(items: Sequence[str]) -> dict[str, dict]:
    """`--search NAME=KIND:...` as option -> {kind, low, high} or {kind: choice, choices}."""
    space: dict[str, dict] = {}
    for item in items:
        where = f"--search {item}"
        name, _, rest = item.partition("=")
        name = name.strip().replace("-", "_")
        kind, _, bounds = rest.partition(":")
        if not name or kind not in SEARCH_KINDS or not bounds:
            raise SweepError(f"{where}: expected NAME=log:LOW:HIGH, NAME=float:LOW:HIGH, NAME=int:LOW:HIGH or "
                             f"NAME=choice:A,B,... (e.g. --search lr=log:0.001:0.3)")
        if kind == "choice":
            space[name] = {"kind": kind, "choices": [_typed(name, v.strip(), where) for v in bounds.split(",")]}
            continue
        low, _, high = bounds.partition(":")
        low, high = _typed(name, low.strip(), where), _typed(name, high.strip(), where)
        if isinstance(low, bool) or not isinstance(low, (int, float)) or (kind == "int") != isinstance(low, int):
            raise SweepError(f"{where}: {kind}: needs a{'n int' if kind == 'int' else ' float'} option's range")
        if not low < high or (kind == "log" and low <= 0):
            raise SweepError(f"{where}: the range must have LOW < HIGH{' and LOW > 0' if kind == 'log' else ''}")
        space[name] = {"kind": kind, "low": low, "high": high}
    return space


def read_sweep_file(path: str) -> tuple[dict, dict]:
    """A sweep config file (JSON, YAML or TOML, as `run --config` reads): its sweep keys (grid: option ->
    list of values, points: a list of option -> value mappings, seeds, search: option -> 'log:LO:HI'...,
    trials) and its run options."""
    from fedjax_sparse.run.config_file import _parse  # the run's own file reading: formats, repeated keys

    raw = _parse(Path(path))
    if not isinstance(raw, dict):
        raise SweepError(f"--config {path}: expected a mapping of option names to values")
    sweep = {k: raw.pop(k) for k in SWEEP_KEYS if k in raw}
    return sweep, raw


def file_points(sweep: dict, path: str) -> list[dict] | None:
    grid, listed = sweep.get("grid"), sweep.get("points")
    if grid is None and listed is None:
        return None
    points = []
    if grid is not None:
        if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
            raise SweepError(f"--config {path}: grid must map each option to a list of values")
        typed = {k.replace("-", "_"): [_typed(k.replace("-", "_"), v, f"--config {path}, grid {k}") for v in vs]
                 for k, vs in grid.items()}
        points += grid_points(typed)
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(p, dict) for p in listed):
            raise SweepError(f"--config {path}: points must be a list of mappings of options to values")
        points += [{k.replace("-", "_"): _typed(k.replace("-", "_"), v, f"--config {path}, points")
                    for k, v in p.items()} for p in listed]
    return points


@dataclasses.dataclass
class Plan:
    """What the sweep runs: the run flags every run shares, the points (None for a search) or the search
    space with its number of trials, and the seeds. Saved as DIR/sweep.json; `--resume DIR` reads it back."""

    out: Path
    run_args: list[str]
    points: list[dict] | None
    seeds: list[int]
    search: dict | None
    trials: int | None
    command: str

    @classmethod
    def load(cls, out: Path) -> "Plan":
        try:
            saved = json.loads((out / PLAN_FILE).read_text())
            return cls(out=out, **saved)
        except (OSError, ValueError, TypeError):
            raise SweepError(f"--resume {out}: no sweep there (no readable {PLAN_FILE})") from None

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        saved = {k: v for k, v in dataclasses.asdict(self).items() if k != "out"}  # --resume DIR gives it
        (self.out / PLAN_FILE).write_text(json.dumps(saved, indent=2) + "\n")

    def run_dir(self, name: str, seed: int) -> Path:
        return self.out / name / f"seed_{seed}"

    def run_command(self, values: dict, seed: int, name: str) -> list[str]:
        flags = [f for k, v in values.items() for f in value_flags(k, v)]
        return [*self.run_args, *flags, "--seed", str(seed), "--out", str(self.run_dir(name, seed))]


@functools.lru_cache(maxsize=1)
def _run_parser() -> argparse.ArgumentParser:
    from fedjax_sparse.run.run_flags import command_parser

    return command_parser()


def expected_config(run_flags: list[str]) -> dict:
    """The config a run with these flags would save (its config.json), checked as `run` checks it: a bad
    combination is refused before any run starts."""
    from fedjax_sparse.run.outputs import dumps
    from fedjax_sparse.run.run_flags import config_from_args

    args = _run_parser().parse_args(["run", *run_flags])
    return json.loads(dumps(config_from_args(args).to_dict()))
