"""Trackers: every figure of metrics.jsonl, the config and the plot reach MLflow and W&B, read back from
MLflow's local store (its client) and W&B's offline files; a resumed run goes on in the same runs; a
tracker that fails is one line. No test here reaches the network."""

import dataclasses
import ipaddress
import json
import math
import socket
import struct
import sys
import time
import zlib

import pytest

from fedjax_sparse.run import RunConfig, RunFailed, run_experiment
from fedjax_sparse.run import faults, trackers
from fedjax_sparse.run.cli import main
from test_tensorboard import assert_same_scalars, expected_scalars, read_scalars

TINY = dict(num_clients=4, clients_per_round=2, local_epochs=1, max_train_examples=200, max_test_examples=100)


@pytest.fixture
def local_only(monkeypatch):
    """Connections to this machine alone (W&B's Python side talks to its own service over a local socket);
    any other address, or a name to resolve, fails the test."""
    connect = socket.socket.connect

    def here(sock, address):
        if sock.family != socket.AF_UNIX and not ipaddress.ip_address(address[0]).is_loopback:
            raise AssertionError(f"a test tried to reach {address}")
        return connect(sock, address)

    def resolve(host, *args, **kwargs):
        raise AssertionError(f"a test tried to resolve {host}")

    monkeypatch.setattr(socket.socket, "connect", here)
    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def wandb_records(path) -> list:
    """The records of an offline W&B run's .wandb file, each decoded by W&B's own protocol buffers.

    W&B has no public reader of an offline run: `wandb.Api` reads the server, `wandb sync` only uploads,
    and the Python reader of these files (`wandb.sdk.internal.datastore`) left the package when its
    backend moved to wandb-core. The framing is read here: a 7-byte header (":W&B", 0xBEE1, version 0),
    then LevelDB-log chunks in 32 KiB blocks (CRC-32 of type and data, length, type: 1 whole, 2 first,
    3 middle, 4 last), each whole record one `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2  # (imported where used: MLflow and W&B take seconds to import)

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        if kind == 0 and length == 0:  # zeros: the end of what was written
            break
        assert zlib.crc32(bytes([kind]) + chunk) == checksum, f"{path}: a damaged chunk at byte {position}"
        pending += chunk
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@dataclasses.dataclass
class WandbRun:
    """What an offline W&B run's file holds: its id, config, history (step -> {key: value}) and exit code."""

    run_id: str
    project: str
    config: dict
    history: dict
    exit_code: int | None


def read_wandb_run(path) -> WandbRun:
    run_id = project = exit_code = None
    config, history = {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, project = record.run.run_id, record.run.project
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            history[record.history.step.num] = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                                for item in record.history.item}
        elif kind == "exit":
            exit_code = record.exit.exit_code
    config.pop("_wandb", None)
    return WandbRun(run_id, project, config, history, exit_code)


def reporting_fedavg(monkeypatch):
    """FedAvg whose server step reports what it did (`server_<name>` figures), registered for this test."""
    import jax.numpy as jnp

    from fedjax_sparse.algorithms import registry
    from fedjax_sparse.algorithms.fedavg import FedAvgOptions, fedavg
    from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, ServerStep

    def build(context, options):
        base = fedavg(context.local)

        def server_update(server_state, ups, weights, info):
            return ServerStep(base.server_update(server_state, ups, weights, info),
                              {"clients": jnp.sum(weights > 0).astype(jnp.float32)})

        return dataclasses.replace(base, name="fedavg_reporting", server_update=server_update)

    monkeypatch.setitem(registry.ALGORITHMS, "fedavg_reporting", AlgorithmSpec("fedavg_reporting", FedAvgOptions, build))


def test_every_figure_the_config_and_the_plot_reach_mlflow_and_wandb_and_a_resume_goes_on_in_their_runs(
        tmp_path, monkeypatch, capsys, local_only):
    """A run with all three trackers: W&B fails at round 2 (one warning line, the run goes on without it), and the
    run itself fails after round 3 (its checkpoint is round 2's); resumed to 5 rounds, with MLFLOW_TRACKING_URI
    now naming another store. MLflow then holds one run, in the store the run started in, with every figure of
    rounds 1-5 once (round 3 as the first attempt logged it: the resume recomputes it to the same value and does
    not send it again), the first attempt's config as params, the resume's new --rounds as a tag, the plot and the
    final summary; W&B one run id over two offline files: round 1, then rounds 2 (restored from the checkpoint) to
    5; TensorBoard each round once."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is relative to the working folder
    for name, folder in (("WANDB_DIR", "wandb"), ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_CONFIG_DIR", "wandb_config"),
                         ("WANDB_DATA_DIR", "wandb_data")):
        (tmp_path / folder).mkdir()
        monkeypatch.setenv(name, str(tmp_path / folder))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    # MLflow's file store, which MLflow 3 keeps in maintenance mode (opt in: MLFLOW_ALLOW_FILE_STORE), opens at once
    # where a new sqlite:// store (MLflow's default) takes 3.6 s of schema migrations; the client's calls are the same
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    reporting_fedavg(monkeypatch)
    run = tmp_path / "run"
    config = RunConfig.create(algorithm="fedavg_reporting", **TINY, rounds=4, checkpoint_every=2, out=str(run),
                              logger=("tensorboard", "mlflow", "wandb"), wandb_project="fedjax-sparse-test")

    log = trackers.WandbTracker.log_metrics

    def fails_at_round_2(self, round, metrics):
        if round == 2:
            raise ConnectionError("the W&B service is gone")
        log(self, round, metrics)

    monkeypatch.setattr(trackers.WandbTracker, "log_metrics", fails_at_round_2)
    monkeypatch.setattr(faults, "_reached", {})
    monkeypatch.setenv("FEDJAX_SPARSE_FAULT", "round_end:3:errno=28")
    with pytest.raises(RunFailed, match="No space left on device"):
        run_experiment(config, progress=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning: wandb" in line]
    assert len(warnings) == 1 and "the W&B service is gone" in warnings[0] and "round 2" in warnings[0], warnings
    first_config = json.loads((run / "config.json").read_text())
    monkeypatch.setattr(trackers.WandbTracker, "log_metrics", log)
    monkeypatch.delenv("FEDJAX_SPARSE_FAULT")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "elsewhere").as_uri())
    run_experiment(config.replace(rounds=5), progress=False, resume=True)

    records = metrics(run)
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5]
    figures = expected_scalars(records)  # {figure: [(round, value)]}, as a tracker is sent them
    assert {"server_clients", "test_accuracy", "personalized_accuracy", "train_loss"} <= set(figures)
    state = json.loads((run / "trackers.json").read_text())
    assert state["mlflow"]["logged_through"] == state["wandb"]["logged_through"] == 5

    # MLflow, read back through its client from the store the run started in
    assert not (tmp_path / "elsewhere").exists()
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [state["mlflow"]["run_id"]]
    logged = runs[0]
    assert logged.info.status == "FINISHED" and logged.info.run_name == "run"
    assert set(logged.data.metrics) == set(figures)
    for tag, points in figures.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(logged.info.run_id, tag))
        assert [s for s, _ in history] == [s for s, _ in points], tag
        assert all(same(a, b) for (_, a), (_, b) in zip(history, points)), tag
    assert logged.data.params == {k: v if isinstance(v, str) else json.dumps(v) for k, v in first_config.items()}
    assert logged.data.params["rounds"] == "4" and logged.data.tags["resumed.rounds"] == "5"
    assert sorted(a.path for a in client.list_artifacts(logged.info.run_id)) == ["accuracy.png", "summary.json"]
    summary = client.download_artifacts(logged.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(open(summary).read()) == json.loads((run / "summary.json").read_text())
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"

    # W&B: the two attempts' offline files, one run id
    files = sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    attempts = [read_wandb_run(path) for path in files]
    assert {a.run_id for a in attempts} == {state["wandb"]["run_id"]}
    assert {a.project for a in attempts} == {"fedjax-sparse-test"}
    assert [a.exit_code for a in attempts] == [1, 0]
    assert attempts[0].config == first_config and attempts[1].config == {**first_config, "rounds": 5}
    assert sorted(attempts[0].history) == [1] and sorted(attempts[1].history) == [2, 3, 4, 5]
    history = {**attempts[0].history, **attempts[1].history}
    for tag, points in figures.items():
        assert all(same(history[step][tag], value) for step, value in points), tag
    logged_figures = {k for row in history.values() for k in row if not k.startswith(("_", "plots/"))}
    assert logged_figures == set(figures)
    plots = [row["plots/accuracy/path"] for row in history.values() if "plots/accuracy/path" in row]
    assert len(plots) == 1 and (files[1].parent / "files" / plots[0]).is_file()
    assert json.loads((files[1].parent / "files" / "summary.json").read_text()) == json.loads(
        (run / "summary.json").read_text())

    assert_same_scalars(read_scalars(run), expected_scalars(records))  # TensorBoard beside them, each round once


@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_a_tracker_that_is_not_installed_is_one_line_before_the_run_touches_its_folder(tmp_path, capsys,
                                                                                       monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # what an import finds where the package is missing
    run = tmp_path / "run"
    assert main(["run", "--logger", f"tensorboard,{name}", "--rounds", "1", "--no-progress", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f'pip install "fedjax_sparse[{name}]"' in err[0], err
    assert not run.exists()


@pytest.mark.parametrize("flags,message", [
    (["--logger", "mlflow,wandb,mlflow"], "--logger names mlflow more than once"),
    (["--logger", "tensorboard,mlflow", "--no-tensorboard"], "contradict each other"),
    (["--logger", "comet"], "--logger must be one of tensorboard, mlflow, wandb, got comet"),
    (["--mlflow-tracking-uri", "sqlite:///x.db"], "--mlflow-tracking-uri is read only with --logger naming mlflow"),
    (["--logger", "mlflow", "--wandb-project", "p"], "--wandb-project is read only with --logger naming wandb"),
])
def test_a_logger_list_that_cannot_be_meant_is_one_line(tmp_path, capsys, flags, message):
    run = tmp_path / "run"
    assert main(["run", *flags, "--rounds", "1", "--no-progress", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not run.exists()


def test_the_default_trackers_are_what_a_run_wrote_before_trackers_were_chosen():
    """TensorBoard alone, off with --no-tensorboard; a list names exactly its trackers."""
    assert trackers.chosen_trackers(RunConfig()) == ("tensorboard",)
    assert trackers.chosen_trackers(RunConfig.create(tensorboard=False)) == ()
    assert trackers.chosen_trackers(RunConfig.create(logger=("mlflow",))) == ("mlflow",)
    assert trackers.chosen_trackers(RunConfig.create(logger=("wandb", "mlflow"), tensorboard=False)) == ("wandb",
                                                                                                          "mlflow")


class Recording:
    """A tracker that records its calls; `fail_at` names the call that raises."""

    name = "recording"

    def __init__(self, fail_at: str | None = None, seconds: float = 0.0):
        self.calls, self.fail_at, self.seconds = [], fail_at, seconds
        self.record = {"run_id": "r1"}
        self.resumed = False

    def _call(self, name, *args):
        self.calls.append((name, *args))
        time.sleep(self.seconds)
        if name == self.fail_at:
            raise ConnectionError(f"{name} refused")

    def start(self, config):
        self._call("start")

    def log_metrics(self, round, metrics):
        self._call("log_metrics", round, metrics)

    def log_artifacts(self, paths):
        self._call("log_artifacts", list(paths))

    def finish(self, status):
        self._call("finish", status)


def test_a_tracker_that_fails_is_dropped_with_one_line_and_a_slow_one_is_named_once(tmp_path, capsys, monkeypatch):
    """The run goes on: the failing tracker's run is ended (failed) and it is sent nothing more, the others
    everything; trackers.json keeps the last round each holds, which a resume starts from."""
    from fedjax_sparse.run.folder import RunManifest

    monkeypatch.setattr(trackers, "SLOW_CALL_SECONDS", 0.05)
    failing, slow = Recording(fail_at="log_metrics"), Recording(seconds=0.06)
    failing.name, slow.name = "failing", "slow"
    state = {"failing": {"run_id": "r1", "logged_through": 0}, "slow": {"run_id": "r2", "logged_through": 0}}
    group = trackers.Trackers(RunConfig(), tmp_path, RunManifest(tmp_path), [failing, slow], state)
    for step in (1, 2):
        group.log_metrics({"round": step, "train_loss": 1.0 / step, "test_loss": None})
    group.finish("completed", [tmp_path / "summary.json"])
    assert failing.calls == [("log_metrics", 1, {"train_loss": 1.0, "test_loss": None}), ("finish", "failed")]
    assert [c[0] for c in slow.calls] == ["log_metrics", "log_metrics", "log_artifacts", "finish"]
    assert slow.calls[-1] == ("finish", "completed")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert "warning: failing failed logging round 1 (log_metrics refused)" in err[0]
    assert "warning: slow took" in err[1] and "logging round 1" in err[1]
    saved = json.loads((tmp_path / "trackers.json").read_text())
    assert saved == {"failing": {"run_id": "r1", "logged_through": 0}, "slow": {"run_id": "r2", "logged_through": 2}}
    group.finish("failed", [])  # once only: a second end (the loop's safety net) sends nothing
    assert len(slow.calls) == 4


def test_a_tracker_that_cannot_start_is_one_line_before_round_1_and_the_same_command_may_run_again(
        tmp_path, capsys, monkeypatch):
    from mlflow.exceptions import MlflowException

    from fedjax_sparse.run.folder import claim_run_folder

    def refused(self, config):
        raise MlflowException("API request to endpoint /api/2.0/mlflow/runs/create failed with error code 403")

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setattr(trackers.MlflowTracker, "start", refused)
    run = tmp_path / "run"
    args = ["run", "--logger", "tensorboard,mlflow", "--mlflow-tracking-uri", (tmp_path / "mlruns").as_uri(),
            "--num-clients", "4", "--clients-per-round", "2", "--rounds", "1", "--no-progress", "--out", str(run)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--logger mlflow: cannot start its run: API request" in err[0], err
    assert not (run / "metrics.jsonl").exists() and not list(run.glob("events.out.tfevents.*"))
    claim_run_folder(run, overwrite=False)  # no run file: the same command is not refused


def test_a_sweeps_runs_are_named_by_point_and_seed_and_grouped_by_the_sweep(tmp_path, monkeypatch, local_only):
    """In MLflow (read back from its store) and W&B (what `wandb.init` is given), not `seed_0` for every run."""
    import wandb
    from mlflow.tracking import MlflowClient

    from fedjax_sparse.run.trackers import SWEEP_ENV

    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    given = []
    init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kwargs: given.append(kwargs) or init(**kwargs))
    monkeypatch.setenv(SWEEP_ENV, "lr_sweep")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "lr_sweep" / "lr=0.1" / "seed_2"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    assert main(["run", *flags, "--rounds", "1", "--no-progress", "--logger", "mlflow,wandb", "--mlflow-tracking-uri",
                 uri, "--out", str(out)]) == 0
    (run,) = MlflowClient(tracking_uri=uri).search_runs(["0"])
    assert run.info.run_name == "lr=0.1/seed_2"
    assert {k: run.data.tags[k] for k in ("fedjax_sparse.sweep", "fedjax_sparse.point", "fedjax_sparse.seed")} == {
        "fedjax_sparse.sweep": "lr_sweep", "fedjax_sparse.point": "lr=0.1", "fedjax_sparse.seed": "2"}
    ((kwargs),) = given
    assert (kwargs["name"], kwargs["group"], kwargs["job_type"]) == ("lr=0.1/seed_2", "lr_sweep", "lr=0.1")
