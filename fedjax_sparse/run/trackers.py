"""Trackers: where a run's figures go besides its own files (TensorBoard, MLflow, Weights & Biases).

`--logger tensorboard,mlflow,wandb` names them (`run.tracker_options.TrackerOptions`); the default is TensorBoard alone, what
every run wrote before trackers were chosen, and `--no-tensorboard` still turns it off. Each is one
implementation of `Tracker`: `start(config)`, `log_metrics(round, figures)`, `log_artifacts(paths)` and
`finish(status)`. What each receives:

* every number of every metrics record, at step = its round, as `scalars` reads a record (a dict of
  numbers, e.g. SpaFL's `density_per_layer`, as one figure per key under the dict's name; lists and
  missing values left out): the same figures as metrics.jsonl, `server_<name>` and `client_<name>` ones too;
* the run's config (config.json's values): MLflow's params, W&B's config (TensorBoard: none, as before);
* the plot and summary.json once the run ends, whatever its status: MLflow's artifacts; for W&B, the plot
  as an image and summary.json among the run's files (TensorBoard: none).

TensorBoard writes into the run folder and fails as every file of the run does (one line, the summary
says "failed"). MLflow and W&B are copies of what the folder holds, elsewhere: one that cannot start
stops the run before round 1 in one line (a missing extra before anything is written), and one that
fails later is dropped with one warning line while the run goes on; a call that takes longer than
`SLOW_CALL_SECONDS` says so once. The process that writes the run's files (process 0) alone logs.

Resuming: the MLflow run and the W&B run id are kept in the run folder (`STATE_FILE`), with the last
round each tracker holds, so `--resume` goes on logging into the same runs (MLflow: in the store its
record names unless `--mlflow-tracking-uri` names another; W&B: in the recorded project unless
`--wandb-project` names another). The rounds a killed run logged after its last checkpoint are
recomputed by the resumed run with the same figures (a resume is exact), so a tracker keeps what it
holds and is sent only the rounds it lacks; a tracker added on resume, or one whose recorded run is
gone, starts a new run and is sent every round the checkpoint restored first. MLflow's params cannot
change once logged: a config value that a resume changed (`--rounds`) is set as the tag
`resumed.<name>` instead; W&B's config takes the new value.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

from fedjax_sparse.console import say
from fedjax_sparse.run.outputs import RunWriteError, replace_atomically
from fedjax_sparse.run.tensorboard import TensorBoardWriter, scalars
from fedjax_sparse.run.tracker_options import TrackerError, chosen_trackers, install_hint

if TYPE_CHECKING:
    from fedjax_sparse.run.config import RunConfig
    from fedjax_sparse.run.folder import RunManifest

STATE_FILE = "trackers.json"  # in the run folder: the runs the trackers log into, to continue them on resume
SLOW_CALL_SECONDS = 5.0
ENDING = "ending its run"


class Tracker(Protocol):
    """Where a run's figures go. `log_metrics` gets a metrics record without its round, `log_artifacts`
    the files the run ended with, `finish` the run's status (completed, interrupted, diverged, failed)."""

    name: str

    def start(self, config: dict) -> None: ...

    def log_metrics(self, round: int, metrics: dict) -> None: ...

    def log_artifacts(self, paths: Sequence[Path]) -> None: ...

    def finish(self, status: str) -> None: ...


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _text(value) -> str:
    """A config value as an MLflow param: text as it is, anything else as in config.json."""
    return value if isinstance(value, str) else json.dumps(value)


class MlflowTracker:
    """An MLflow run, through MLflow's client (`MlflowClient`): one `log_batch` a round, params once.

    The experiment is $MLFLOW_EXPERIMENT_ID, else $MLFLOW_EXPERIMENT_NAME (made where missing), else
    MLflow's default one, as `mlflow.start_run` picks it; the run is named after the run folder (a sweep's
    by its point and seed, tagged with the sweep: `run_identity`).
    Status: completed -> FINISHED, interrupted -> KILLED, diverged and failed -> FAILED."""

    name = "mlflow"
    STATUS = {"completed": "FINISHED", "interrupted": "KILLED"}

    def __init__(self, tracking_uri: str | None, recorded: dict, folder: Path):
        try:
            import mlflow
            from mlflow.entities import Metric, Param, RunTag
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise TrackerError(f"--logger mlflow: MLflow cannot be imported ({_one_line(err)}): "
                               f"{install_hint('mlflow')}") from None
        self._metric, self._param, self._tag = Metric, Param, RunTag
        self.uri = tracking_uri or recorded.get("tracking_uri") or mlflow.get_tracking_uri()
        self._recorded = recorded if recorded.get("tracking_uri") == self.uri else {}
        self._folder = folder
        try:
            self._client = MlflowClient(tracking_uri=self.uri)
        except Exception as err:  # noqa: BLE001 - whatever the store raises is its one line
            raise TrackerError(f"--logger mlflow: cannot open the tracking store {self.uri}: {_one_line(err)}") from None
        self.run_id = None
        self.resumed = False

    def start(self, config: dict) -> None:
        run = self._recorded_run()
        self.resumed = run is not None
        if run is None:
            name, _, tags = run_identity(self._folder)
            run = self._client.create_run(self._experiment_id(), run_name=name,
                                          tags={"fedjax_sparse.run_folder": str(self._folder.resolve()), **tags})
            self.run_id = run.info.run_id
            self._client.log_batch(self.run_id, params=[self._param(k, _text(v)) for k, v in config.items()])
            return
        self.run_id = run.info.run_id
        self._client.update_run(self.run_id, status="RUNNING")
        held = run.data.params
        self._client.log_batch(
            self.run_id, params=[self._param(k, _text(v)) for k, v in config.items() if k not in held],
            tags=[self._tag(f"resumed.{k}", _text(v)) for k, v in config.items()
                  if k in held and held[k] != _text(v)])

    def _recorded_run(self):
        from mlflow.exceptions import MlflowException

        run_id = self._recorded.get("run_id")
        if run_id is None:
            return None
        try:
            run = self._client.get_run(run_id)
        except MlflowException:
            run = None
        if run is None or run.info.lifecycle_stage != "active":
            say(f"warning: mlflow: the run {run_id} that {STATE_FILE} records is not in {self.uri} (deleted?); "
                f"logging every round into a new one")
            return None
        return run

    def _experiment_id(self) -> str:
        from mlflow.tracking.default_experiment import DEFAULT_EXPERIMENT_ID

        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return DEFAULT_EXPERIMENT_ID
        found = self._client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self._client.create_experiment(name)

    @property
    def record(self) -> dict:
        return {"tracking_uri": self.uri, "run_id": self.run_id}

    def log_metrics(self, round: int, metrics: dict) -> None:
        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[self._metric(tag, value, now, round)
                                                     for tag, value in scalars(metrics)])

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        self._client.set_terminated(self.run_id, self.STATUS.get(status, "FAILED"))


SWEEP_ENV = "FEDJAX_SPARSE_SWEEP"  # set for a run a sweep started: the sweep's name (its folder's)


def run_identity(folder: Path) -> tuple[str, str | None, dict]:
    """(name, group, tags) of a run in the trackers: its folder's name, or in a sweep (`SWEEP_ENV`) its point and
    seed (`lr=0.1/seed_0`, not `seed_0` for every run), grouped by the sweep."""
    sweep = os.environ.get(SWEEP_ENV)
    if not sweep:
        return folder.name, None, {}
    point, seed = folder.parent.name, folder.name
    return f"{point}/{seed}", sweep, {"fedjax_sparse.sweep": sweep, "fedjax_sparse.point": point,
                                      "fedjax_sparse.seed": seed.removeprefix("seed_")}


class WandbTracker:
    """A Weights & Biases run (`wandb.init`), named after the run folder (a sweep's by its point and seed, in the
    sweep's group: `run_identity`); online or offline as
    WANDB_MODE says, its local files where WANDB_DIR says (W&B's own defaults otherwise). `wandb.log`
    gets each round at step = the round. The run's console stays its own (W&B copies none of it), and
    a W&B run the calling program has open is left open (`reinit="create_new"`). The run ends with
    exit code 0 when completed, 1 otherwise; its summary's `status` says which. W&B says only what it must
    (`quiet`: where an offline run's files are, how to sync them), not its tables of the run's figures."""

    name = "wandb"

    def __init__(self, project: str | None, recorded: dict, folder: Path):
        try:
            import wandb
        except ImportError as err:
            raise TrackerError(f"--logger wandb: W&B cannot be imported ({_one_line(err)}): "
                               f"{install_hint('wandb')}") from None
        self._wandb = wandb
        same = recorded.get("run_id") is not None and project in (None, recorded.get("project"))
        self._recorded = recorded if same else {}
        self.project = project or self._recorded.get("project")
        self._folder = folder
        self._run = None
        self.resumed = False

    def start(self, config: dict) -> None:
        wandb, recorded = self._wandb, self._recorded
        name, group, tags = run_identity(self._folder)
        self._run = wandb.init(project=self.project, entity=recorded.get("entity"), id=recorded.get("run_id"),
                               resume="allow" if recorded else None, name=name, group=group,
                               job_type=tags.get("fedjax_sparse.point"), reinit="create_new",
                               settings=wandb.Settings(console="off", quiet=True))
        self.resumed = bool(recorded)
        self._run.config.update(config, allow_val_change=True)

    @property
    def record(self) -> dict:
        return {"project": self._run.project, "entity": self._run.entity or None, "run_id": self._run.id}

    def log_metrics(self, round: int, metrics: dict) -> None:
        self._run.log(dict(scalars(metrics)), step=round)

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:
            if path.suffix == ".png":
                self._run.log({f"plots/{path.stem}": self._wandb.Image(str(path))})
            else:  # the files in the run's directory are W&B's files of the run
                shutil.copyfile(path, Path(self._run.dir) / path.name)

    def finish(self, status: str) -> None:
        self._run.summary["status"] = status
        self._run.finish(exit_code=0 if status == "completed" else 1)


def read_state(out: Path) -> dict:
    """What `STATE_FILE` records ({} where it is missing or unreadable: the trackers start new runs)."""
    try:
        state = json.loads((out / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


class Trackers:
    """A run's trackers together: TensorBoard's event files (a file of the run: its failure is the run's)
    and the trackers elsewhere (their failures are warnings), with the record that continues them."""

    def __init__(self, config: "RunConfig", out: Path, manifest: "RunManifest", outside: list[Tracker],
                 state: dict):
        self._config, self._out, self._manifest = config, out, manifest
        self._outside, self._state = outside, state
        self._event_files: list[TensorBoardWriter] = []
        self._slow: set[str] = set()

    def open_event_files(self, first_round: int) -> None:
        """TensorBoard's events, where chosen, from `first_round` on (`TensorBoardWriter`)."""
        if "tensorboard" in chosen_trackers(self._config):
            board = TensorBoardWriter(self._out, first_round=first_round, manifest=self._manifest)
            board.start(self._config.to_dict())
            self._event_files.append(board)

    def log_metrics(self, record: dict) -> None:
        """Sends a metrics record to every tracker (`Tracker.log_metrics`)."""
        step, figures = record["round"], {k: v for k, v in record.items() if k != "round"}
        for board in self._event_files:
            board.log_metrics(step, figures)
        self._each(f"logging round {step}", lambda tracker: self._log(tracker, step, figures))
        self._save_state()

    def _log(self, tracker: Tracker, step: int, figures: dict) -> None:
        if step > self._state[tracker.name]["logged_through"]:  # else it holds the round (see the module)
            tracker.log_metrics(step, figures)
            self._state[tracker.name]["logged_through"] = step

    def close_event_files(self, status: str, quietly: bool = False) -> None:
        """Closes TensorBoard's files; `quietly` after a failed write (the one reported) drops their errors."""
        boards, self._event_files = self._event_files, []
        for board in boards:
            try:
                board.finish(status)
            except RunWriteError:
                if not quietly:
                    raise

    def finish(self, status: str, artifacts: Sequence[Path]) -> None:
        """Sends `artifacts` to the trackers elsewhere and ends their runs with `status`; once."""
        if artifacts:
            self._each("logging the plot and summary", lambda tracker: tracker.log_artifacts(artifacts))
        self._each(ENDING, lambda tracker: tracker.finish(status))
        self._outside = []

    def _each(self, what: str, call) -> None:
        for tracker in list(self._outside):
            start = time.perf_counter()
            try:
                call(tracker)
            except Exception as err:  # noqa: BLE001 - a tracker elsewhere never stops the run
                self._outside.remove(tracker)
                say(f"warning: {tracker.name} failed {what} ({_one_line(err)}); it is sent nothing more and the run "
                    f"goes on (its folder holds every figure; --resume sends {tracker.name} the rounds it lacks)")
                with contextlib.suppress(Exception):  # its run ended where it can be (a failed end is not retried)
                    if what != ENDING:
                        tracker.finish("failed")
                continue
            seconds = time.perf_counter() - start
            if seconds > SLOW_CALL_SECONDS and tracker.name not in self._slow:
                self._slow.add(tracker.name)
                say(f"warning: {tracker.name} took {seconds:.1f} s {what}; the run waits for it each round")

    def _save_state(self) -> None:
        if not self._outside:
            return
        self._manifest.record(STATE_FILE)
        text = json.dumps(self._state, indent=2) + "\n"
        replace_atomically(self._out / STATE_FILE, lambda tmp: tmp.write_text(text))

    @classmethod
    def start(cls, config: "RunConfig", out: Path, history: list[dict], manifest: "RunManifest",
              resume: bool) -> "Trackers":
        """Starts the trackers elsewhere (`--resume`: into the runs `STATE_FILE` records) and sends them
        the restored rounds they lack; one that cannot start ends those started and raises `TrackerError`."""
        state = read_state(out) if resume else {}
        outside: list[Tracker] = []
        try:
            for name in chosen_trackers(config):
                if name == "mlflow":
                    outside.append(MlflowTracker(config.mlflow_tracking_uri, state.get(name, {}), out))
                elif name == "wandb":
                    outside.append(WandbTracker(config.wandb_project, state.get(name, {}), out))
                else:
                    continue
                tracker = outside[-1]
                try:
                    tracker.start(config.to_dict())
                except Exception as err:  # noqa: BLE001 - whatever the tracker raises is its one line
                    outside.pop()
                    raise TrackerError(f"--logger {name}: cannot start its run: {_one_line(err)}") from None
                held = state.get(name, {}).get("logged_through", 0) if tracker.resumed else 0
                state[name] = {**tracker.record, "logged_through": held}
        except TrackerError:
            for tracker in outside:
                try:
                    tracker.finish("failed")
                except Exception:  # noqa: BLE001 - the start's error is the one reported
                    pass
            raise
        trackers = cls(config, out, manifest, outside, state)
        for record in history:
            step, figures = record["round"], {k: v for k, v in record.items() if k != "round"}
            trackers._each(f"logging round {step}", lambda tracker: trackers._log(tracker, step, figures))
        trackers._save_state()
        return trackers
