"""Where a run's figures go besides its folder, as options: `--logger`, the MLflow store, the W&B project, and
the checks a run makes of them before it touches its folder (`run.trackers` are the trackers themselves).

The checks take a `TrackerOptions`, which the run's config (`run.config.RunConfig`) is, besides the run's own
`tensorboard` switch."""

from __future__ import annotations

import dataclasses
import importlib.util

from fedjax_sparse.core.contract.options import option

LOGGERS = ("tensorboard", "mlflow", "wandb")
DEFAULT_LOGGERS = ("tensorboard",)
# tracker -> (the module it imports, its name in words); the extra of the tracker's name installs it
LIBRARIES = {"mlflow": ("mlflow", "MLflow"), "wandb": ("wandb", "W&B")}

@dataclasses.dataclass(frozen=True)
class TrackerOptions:
    """Where a run's figures, config and plots go besides its folder (docs/tracking.md)."""

    OPTION_GROUP = "output"  # the command line's help group (`core.contract.options.option_group`)

    logger: tuple[str, ...] = option(DEFAULT_LOGGERS, "where every per-round figure, the config and the plots go "
                                                      "besides the run folder's own files: tensorboard (event files "
                                                      "in the run folder), mlflow, wandb; naming them replaces the "
                                                      "default", choices=LOGGERS)
    mlflow_tracking_uri: str | None = option(None, "mlflow: the tracking store or server (default: the one a resumed "
                                                   "run's trackers.json records, else $MLFLOW_TRACKING_URI, else "
                                                   "MLflow's own default)")
    wandb_project: str | None = option(None, "wandb: the project (default: the one a resumed run's trackers.json "
                                             "records, else $WANDB_PROJECT, else W&B's own); WANDB_MODE=offline "
                                             "logs without a network")

    def ignored(self) -> dict[str, str]:
        out = {}
        if "mlflow" not in self.logger:
            out["mlflow_tracking_uri"] = "is read only with --logger naming mlflow"
        if "wandb" not in self.logger:
            out["wandb_project"] = "is read only with --logger naming wandb"
        return out


class TrackerError(ValueError):
    """A tracker cannot start (not installed, its store or service refused it): one line, before round 1."""


def chosen_trackers(config: TrackerOptions) -> tuple[str, ...]:
    """The trackers a run logs to: `--logger`'s, without TensorBoard under `--no-tensorboard`."""
    return tuple(name for name in config.logger if name != "tensorboard" or config.tensorboard)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


def install_hint(name: str) -> str:
    return f'pip install "fedjax_sparse[{name}]"'


def check_trackers(config: TrackerOptions) -> None:
    """One line for a logger list that cannot be what was meant, or a tracker that is not installed,
    before the run touches its folder."""
    names = config.logger
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--logger names {', '.join(twice)} more than once, got {','.join(names)}; give each "
                         f"tracker once")
    if not config.tensorboard and "tensorboard" in names and names != DEFAULT_LOGGERS:
        raise ValueError(f"--no-tensorboard and --logger {','.join(names)} (naming tensorboard) contradict each "
                         f"other; drop tensorboard from --logger or drop --no-tensorboard")
    for name in names:
        if name in LIBRARIES and not _installed(LIBRARIES[name][0]):
            raise ValueError(f"--logger {name} needs {LIBRARIES[name][1]}, which is not installed: "
                             f"{install_hint(name)}")
