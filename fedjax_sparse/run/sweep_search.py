"""A sweep's Optuna search (`--search NAME=KIND:...`): TPE's ask and tell over the sweep's runner, each trial run
over every seed, its value the mean final accuracy; the study in the sweep's folder, so a resumed search goes on."""

from __future__ import annotations

import json
from typing import Protocol

from fedjax_sparse.run.sweep_plan import STUDY_FILE, STUDY_NAME, Plan, expected_config
from fedjax_sparse.run.sweep_table import run_figures


class Runs(Protocol):
    """What the search needs of the sweep's runner (`run.sweep.Runner`)."""

    running: dict
    has_room: bool

    def start(self, key: tuple, run_dir, flags: list[str], expected: dict, retry: bool = True) -> bool: ...

    def wait(self) -> tuple[tuple, bool]: ...


def search(plan: Plan, runner: Runs) -> None:
    """Optuna's ask-and-tell loop: a new trial whenever a run can start and no trial waits for one."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{plan.out / STUDY_FILE}"
    try:
        earlier = len(optuna.load_study(study_name=STUDY_NAME, storage=storage).trials)
    except KeyError:
        earlier = 0
    # seeded by the trials so far: a resumed search does not draw its first trials' points again
    study = optuna.create_study(study_name=STUDY_NAME, storage=storage, direction="maximize", load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=earlier))
    space = {name: (CategoricalDistribution(s["choices"]) if s["kind"] == "choice" else
                    IntDistribution(s["low"], s["high"]) if s["kind"] == "int" else
                    FloatDistribution(s["low"], s["high"], log=s["kind"] == "log")) for name, s in plan.search.items()}
    waiting: list[tuple[int, str, dict, int]] = []  # (trial, point, values, seed) not started yet
    open_runs: dict[int, list[bool]] = {}  # trial -> its runs' outcomes so far
    points: dict[int, tuple[str, dict]] = {}

    def add(number: int, values: dict) -> None:
        name = f"trial_{number}"
        points[number] = (name, values)
        open_runs[number] = []
        waiting.extend((number, name, values, seed) for seed in plan.seeds)

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # the stopped sweep's
        add(trial.number, dict(trial.params))
    asked = len(study.trials)
    while waiting or runner.running or asked < plan.trials:
        while runner.has_room and (waiting or asked < plan.trials):
            if not waiting:
                trial = study.ask(space)
                asked += 1
                add(trial.number, dict(trial.params))
            number, name, values, seed = waiting.pop(0)
            command = plan.run_command(values, seed, name)
            if not runner.start((number, seed), plan.run_dir(name, seed), command, expected_config(command)):
                told(study, number, open_runs, points, plan, True)
        if runner.running:
            (number, _), done = runner.wait()
            told(study, number, open_runs, points, plan, done)
    finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
    if finished:
        best = study.best_trial
        (plan.out / "best.json").write_text(json.dumps(
            {"trial": best.number, "point": f"trial_{best.number}", "params": best.params,
             "mean_final_accuracy": best.value, "seeds": plan.seeds}, indent=2) + "\n")


def told(study, number: int, open_runs: dict, points: dict, plan: Plan, done: bool) -> None:
    """Records one run's outcome; once all of a trial's runs are in, tells Optuna the trial's value."""
    from optuna.trial import TrialState

    open_runs[number].append(done)
    if len(open_runs[number]) < len(plan.seeds):
        return
    if not all(open_runs.pop(number)):
        study.tell(number, state=TrialState.FAIL)
        return
    name, _ = points[number]
    finals = [run_figures(json.loads((plan.run_dir(name, s) / "summary.json").read_text()))["final_accuracy"]
              for s in plan.seeds]
    study.tell(number, sum(finals) / len(finals))


def search_points(plan: Plan) -> list[tuple[str, dict]]:
    import optuna

    study = optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{plan.out / STUDY_FILE}")
    return [(f"trial_{t.number}", dict(t.params)) for t in study.trials]
