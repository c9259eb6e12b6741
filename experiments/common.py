"""Paper settings side by side: named configurations, one run per compared algorithm, a table and a plot.

An experiment module defines one or more `Setting`s and calls `main(SETTINGS)`;
`python -m experiments.NAME [--quick] [--setting S] [--arms A,B] [--seeds 0,1,2] [--out DIR]` from a clone,
or `fedjax-sparse experiment NAME ...` from any folder once the package is installed (this folder ships
inside it as `fedjax_sparse.experiments`), then runs every arm of the setting and writes, per setting,
`results.md`, `results.csv` and `comparison.png` (accuracy against rounds and against cumulative bytes).

`--arms` picks arms by name, in the order given: the setting's own, or any registered algorithm (the
library's, a script's, an installed package's), which runs in the setting's config (`select`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from fedjax_sparse.algorithms import algorithm_names, refused
from fedjax_sparse.core.round.cpu import use_cpu_cores
from fedjax_sparse.run import DivergenceError, Interrupted, RunConfig, run_experiment
from fedjax_sparse.run.checkpoints import CheckpointError
from fedjax_sparse.run.outputs import device_description, dumps, plot_accuracy
from fedjax_sparse.run.sweep_table import table_cell

REPO = Path(__file__).resolve().parents[1]
# this folder is the clone's top-level experiments/ (an editable install maps it there too); installed from a
# wheel it is fedjax_sparse/experiments in site-packages, where nothing beside it is the user's
IN_CLONE = (REPO / "pyproject.toml").is_file()


def cifar10_folder() -> str:
    """The CIFAR-10 image folder: $FEDJAX_SPARSE_CIFAR10, else ../shared/data/cifar10-jpeg beside the clone
    (installed from a wheel: cifar10-jpeg in the current folder)."""
    default = REPO.parent / "shared" / "data" / "cifar10-jpeg" if IN_CLONE else Path("cifar10-jpeg")
    return os.environ.get("FEDJAX_SPARSE_CIFAR10", str(default))


def command_prefix(module: str) -> str:
    """How the experiment module `module` ('experiments.spafl') is run: `python -m` where it is the top-level
    package of a clone, else `fedjax-sparse experiment spafl` (the package's own copy, from any folder)."""
    if __package__ == "experiments":
        return f"python -m {module}"
    return f"fedjax-sparse experiment {module.split('.')[-1]}"


@dataclasses.dataclass(frozen=True)
class Arm:
    """One compared algorithm: a label, its config overrides and the paper's figures for it.

    registered: an arm `--arms` added, a registered algorithm that is none of the setting's own arms; it
    runs in the setting's config (`select`), and the setting's `arm_columns` and `run_columns`, which count
    the setting's own methods by their paper's conventions, are left empty for it.
    """

    label: str
    overrides: dict
    paper: dict = dataclasses.field(default_factory=dict)
    registered: bool = False


@dataclasses.dataclass(frozen=True)
class Setting:
    """A paper's experimental setting.

    config: the shared configuration as the paper states it.
    arms: the algorithms compared.
    target_accuracy: for the "rounds to target" column.
    metric: 'test_accuracy' (global model) or 'personalized_accuracy'.
    quick: overrides that make a CPU-sized version of the setting.
    extra_columns: metrics.jsonl/summary keys to report too (e.g. 'density').
    arm_columns: columns computed from each arm's config (e.g. the aggregation it ran with).
    run_columns: columns computed from each run (config, metrics history, summary), e.g. a paper's
      own accounting of its bytes and FLOPs.
    relative_target: (arm label, share): a second target, the share of that arm's final accuracy (its
      mean over the seeds), with its rounds and simulated seconds to it for every arm (time to 90 % of
      FedAvg's accuracy: ("fedavg", 0.9)); left out when `--arms` leaves that arm out.
    rounds_override: every arm's rounds, over the quick version's and the arm's own (`--rounds`, a smoke
      test; options the setting derived from its rounds, such as FedSpa's annealing, keep theirs).
    """

    name: str
    description: str
    config: RunConfig
    arms: tuple[Arm, ...]
    target_accuracy: float
    metric: str = "test_accuracy"
    quick: dict = dataclasses.field(default_factory=dict)
    extra_columns: tuple[str, ...] = ()
    arm_columns: Callable[[RunConfig], dict] | None = None
    run_columns: Callable[[RunConfig, list, dict], dict] | None = None
    relative_target: tuple[str, float] | None = None
    rounds_override: int | None = None

    def arm_config(self, arm: Arm, out: Path, quick: bool) -> RunConfig:
        fields = {**(self.quick if quick else {}), **arm.overrides, "out": str(out / arm.label)}
        if self.rounds_override is not None:
            fields["rounds"] = self.rounds_override
        return self.config.replace(**fields)


def select(setting: Setting, arms: Sequence[str] | None = None, rounds: int | None = None) -> Setting:
    """`setting` with the arms named in `arms`, in that order (None: its own), each run `rounds` rounds if given.

    A name is one of the setting's arms (by label), else a registered algorithm (the library's, a script's,
    an installed package's entry point), which runs as `fedjax-sparse run --algorithm NAME` would with the
    setting's config as its flags: every run option of the setting (data, model, partition, clients, rounds,
    local training, learning rate, seed, federation) and `--quick`'s, and of the algorithm options the
    setting sets (for its own arms) those that the algorithm declares too (one option name, one declaration,
    across all algorithms); its other options at their defaults. The arms' own overrides (a paper's
    per-method learning rate, say) are theirs alone. Any other name is refused in one line listing the
    setting's arms and the registered algorithms.
    """
    own = {arm.label: arm for arm in setting.arms}
    if setting.relative_target is not None and setting.relative_target[0] not in own:
        raise ValueError(f"the setting {setting.name}'s relative target names the arm "
                         f"{setting.relative_target[0]!r}, which it lacks")
    chosen = setting.arms
    if arms is not None:
        names = algorithm_names()
        chosen = []
        for name in arms:
            if name in own:
                chosen.append(own[name])
            elif name in names:
                chosen.append(Arm(name, {"algorithm": name}, registered=True))
            elif name in refused():  # an installed plug-in left out: its one line says why
                raise ValueError(f"--arms {name}: {refused()[name]}")
            else:
                raise ValueError(f"--arms {name}: not an arm of the setting {setting.name} ({', '.join(own)}) "
                                 f"nor a registered algorithm ({', '.join(names)})")
    return dataclasses.replace(setting, arms=tuple(chosen), rounds_override=rounds)


def _arm_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty name in {text!r}; give names separated by commas")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} named twice; each arm runs once")
    return names


def _add_selection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", type=_arm_names, default=None, metavar="A,B,...",
                        help="run only these arms, in this order: the setting's own (their labels) or any "
                             "registered algorithm, which runs in the setting's config, its own options at their "
                             "defaults but those the setting sets (`fedjax-sparse experiment --list` lists both)")
    parser.add_argument("--rounds", type=int, default=None, metavar="N",
                        help="every arm runs N rounds (a smoke test; the targets and the paper's figures are "
                             "for the setting's own)")


def chosen_setting(setting: Setting, argv: Sequence[str]) -> Setting:
    """`setting` as the command line `argv` selects it (`--arms`, `--rounds`): what `main` ran, for a
    module's own reports after it."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_selection_flags(parser)
    args, _ = parser.parse_known_args(list(argv))
    return select(setting, args.arms, args.rounds)


def rounds_to_target(history: list[dict], metric: str, target: float) -> int | None:
    for record in history:
        if record.get(metric) is not None and record[metric] >= target:
            return record["round"]
    return None


def seconds_to_target(history: list[dict], metric: str, target: float) -> float | None:
    """The simulated seconds (`--device-profile`'s clock) at the end of the first evaluated round whose
    `metric` reached `target`; None where none did or the run had no clock."""
    for record in history:
        if record.get(metric) is not None and record[metric] >= target:
            return record.get("cumulative_simulated_seconds")
    return None


def arm_row(setting: Setting, arm: Arm, config: RunConfig, history: list[dict], summary: dict,
            relative: float | None = None) -> dict:
    """One run's row; `relative`: the value of `setting.relative_target` (an accuracy), where it has one."""
    metric = setting.metric
    values = [h[metric] for h in history if h.get(metric) is not None]
    per_client_round = summary["cumulative_bytes"] / (config.rounds * config.clients_per_round)
    row = {
        "algorithm": arm.label,
        "final_accuracy": values[-1] if values else None,
        "best_accuracy": max(values) if values else None,
        f"rounds_to_{setting.target_accuracy:g}": rounds_to_target(history, metric, setting.target_accuracy),
        "total_gbit": summary["cumulative_bytes"] * 8 / 1e9,
        "uplink_gbit": summary["total_uplink_bytes"] * 8 / 1e9,
        "mb_per_client_round": per_client_round / 1e6,
        # with a clock (`--device-profile`): time to the target, the run's simulated time and its lost updates
        **({f"seconds_to_{setting.target_accuracy:g}": seconds_to_target(history, metric, setting.target_accuracy),
            "simulated_seconds": summary["simulated_seconds_total"],
            "updates_lost_share": summary.get("updates_lost_share")}
           if summary.get("simulated_seconds_total") is not None else {}),
        **(_relative_columns(setting, history, relative) if relative is not None else {}),
        **(setting.arm_columns(config) if setting.arm_columns is not None and not arm.registered else {}),
        **(setting.run_columns(config, history, summary)
           if setting.run_columns is not None and not arm.registered else {}),
    }
    for key in setting.extra_columns:
        last = next((h[key] for h in reversed(history) if key in h), summary.get(key))
        row[key] = last
    for key, value in arm.paper.items():
        row[f"paper: {key}"] = value
    return row


def _relative_columns(setting: Setting, history: list[dict], target: float) -> dict:
    label, share = setting.relative_target
    name = f"{share:g}x_{label}"
    return {f"target_{name}": target, f"rounds_to_{name}": rounds_to_target(history, setting.metric, target),
            f"seconds_to_{name}": seconds_to_target(history, setting.metric, target)}


def combine_seeds(rows: list[dict]) -> dict:
    """One row from the rows of several seeds: numbers averaged, accuracy also as std and per seed."""
    if len(rows) == 1:
        return rows[0]
    out = {}
    for key in rows[0]:
        values = [r.get(key) for r in rows]
        numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out[key] = sum(numeric) / len(numeric) if numeric and len(numeric) == len(values) else values[0]
    finals = [r["final_accuracy"] for r in rows if r["final_accuracy"] is not None]
    if finals:
        mean = sum(finals) / len(finals)
        out["final_accuracy_std"] = (sum((f - mean) ** 2 for f in finals) / len(finals)) ** 0.5
        out["final_accuracy_per_seed"] = " / ".join(f"{f:.4f}" for f in finals)
    out["seeds"] = len(rows)
    return out


def finished_summary(config: RunConfig) -> dict | None:
    """The summary of the run already in `config.out` when it completed with exactly `config`, else None.

    An experiment stopped half-way (a crash, a closed laptop) is run again with the same command and
    redoes only the arms that did not finish; a changed option redoes that arm.
    """
    out = Path(config.out)
    try:
        summary = json.loads((out / "summary.json").read_text())
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if summary.get("status") != "completed" or saved != json.loads(dumps(config.to_dict())):
        return None
    return summary


def run_setting(setting: Setting, out_root: Path, quick: bool, progress: bool = True,
                command: str = "", seeds: Sequence[int] | None = None) -> list[dict]:
    """Runs every arm (for each of `seeds`, default the setting's own seed) and writes the table and plot.

    With several seeds each arm's runs go to ARM/seed_S and its row averages them
    (final accuracy also as its standard deviation and per seed); the plot shows the first seed.
    """
    out = out_root / setting.name
    out.mkdir(parents=True, exist_ok=True)
    runs, histories = [], {}
    for arm in setting.arms:
        per_seed = []
        for seed in seeds or [None]:
            config = setting.arm_config(arm, out, quick)
            if seed is not None:
                config = config.replace(seed=seed, out=str(Path(config.out) / f"seed_{seed}"))
            print(f"[{setting.name}] {arm.label}: {config.algorithm} for {config.rounds} rounds"
                  + (f", seed {seed}" if seed is not None else ""), flush=True)
            summary = finished_summary(config)
            if summary is None:
                # a folder holding anything but this very run, finished, is the experiment's own to redo
                summary = run_experiment(config, progress=progress, overwrite=True)
            else:
                print(f"  kept the finished run in {config.out}", flush=True)
            history = [json.loads(line) for line in (Path(config.out) / "metrics.jsonl").read_text().splitlines()]
            histories.setdefault(arm.label, history)
            per_seed.append((config, history, summary))
        runs.append((arm, per_seed))
    relative = None
    if setting.relative_target is not None and any(arm.label == setting.relative_target[0] for arm, _ in runs):
        label, share = setting.relative_target
        finals = [next(h[setting.metric] for h in reversed(history) if h.get(setting.metric) is not None)
                  for arm, per_seed in runs if arm.label == label for _, history, _ in per_seed]
        relative = share * sum(finals) / len(finals)
    rows = [combine_seeds([arm_row(setting, arm, *run, relative=relative) for run in per_seed])
            for arm, per_seed in runs]
    write_table(rows, out, setting, quick, command)
    plot_accuracy(histories, out / "comparison.png", f"{setting.name}{' (quick)' if quick else ''}",
                  metrics=(setting.metric,))
    return rows


def write_table(rows: list[dict], out: Path, setting: Setting, quick: bool, command: str) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# {setting.name}{' (quick)' if quick else ''}", "", setting.description, "",
             f"Accuracy: {setting.metric}. Device: {device_description()}.", f"Command: `{command}`", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(table_cell(row.get(c)) for c in columns) + " |" for row in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2:]))


def main(settings: dict[str, Setting], module: str, argv: Sequence[str] | None = None, *,
         quick_setting: str | None = None) -> int:
    """Command line of an experiment module `module` (e.g. 'experiments.baselines_digits').

    `quick_setting`: the setting `--quick` alone runs (a module's CPU-sized twin); without it,
    or with `--setting`, the named (default: all) settings run.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=command_prefix(module),
                                     description="Runs a paper's setting and tabulates it.")
    parser.add_argument("--quick", action="store_true", help="the reduced, CPU-sized version")
    parser.add_argument("--setting", choices=sorted(settings), action="append",
                        help="run only these settings (default: all)")
    parser.add_argument("--out", default="runs/experiments", help="root directory of the outputs")
    parser.add_argument("--seeds", type=lambda t: [int(v) for v in t.split(",")], default=None,
                        help="run every arm with each of these seeds (comma-separated) and average them")
    _add_selection_flags(parser)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    use_cpu_cores()  # as `fedjax-sparse run`: on a CPU, a device per core where a round's clients pay for it
    try:
        default = [quick_setting] if args.quick and quick_setting else list(settings)
        # every setting's arms are checked before the first runs
        chosen = [select(settings[name], args.arms, args.rounds) for name in args.setting or default]
        for setting in chosen:
            run_setting(setting, Path(args.out), args.quick, progress=not args.no_progress,
                        command=" ".join([command_prefix(module), *argv]), seeds=args.seeds)
    except (ValueError, FileNotFoundError, DivergenceError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # the arm's run saved its checkpoint; the table was not written
        print(f"{e}", file=sys.stderr)
        return 128 + e.signum
    return 0
