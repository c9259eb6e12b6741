"""The launch templates docs/scale.md shows (docs/launch/): the page includes every one of them, and each runs as
it is meant to. The SLURM batch scripts are run by bash with SLURM's commands stubbed; the srun line they run
is then given, task by task, the variables SLURM sets for its tasks, and the layout the library derives from
them (`core.round.distributed.slurm_local_devices`, JAX's own SLURM detection for the rest) must give every process
the same number of GPUs, every GPU of the step to one process, and K a multiple of the devices: under both
readings of SLURM_GPUS_ON_NODE (the step's GPUs on the node, as srun(1) documents it, or the task's). Tasks
split unevenly over nodes sharing their GPUs are refused by every task alike, in one line, before any waits.
The signal, requeue and resume lines run for real on a small run. No SLURM, GPU or TPU needed."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jax._src.clusters import ClusterEnv  # what jax.distributed.initialize asks for what it was not given

from fedjax_sparse.core.round import distributed
from fedjax_sparse.run.run_flags import command_parser, config_from_args

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "docs" / "launch"
SBATCH = sorted(LAUNCH.glob("*.sbatch"))
NODE_GPUS = 4  # the GPUs of every simulated node
VENV, RUN_DIR = "/shared/venvs/fedjax", "/shared/runs/scaffold"  # the templates' paths, moved under tmp_path here


def test_the_page_includes_every_template_whole():
    """docs/scale.md shows each file of docs/launch in a code block of its own (mkdocs' snippets include it
    whole, and `mkdocs build --strict` fails on a missing one), and links it for readers of the Markdown."""
    page = (ROOT / "docs" / "scale.md").read_text()
    included = re.findall(r'^```\w*\n--8<-- "launch/([^"]+)"\n```$', page, flags=re.M)
    assert sorted(included) == sorted(p.name for p in LAUNCH.iterdir()), included
    for name in included:
        assert f"](launch/{name})" in page, name
    assert "check_paths: true" in (ROOT / "mkdocs.yml").read_text()


def test_the_slurm_templates_differ_only_in_their_request():
    """What starts, stops and requeues a run is the same text in every batch script (the run below tests it
    on one of them)."""
    tails = {path.name: path.read_text().split("# The environment", 1)[1] for path in SBATCH}
    assert len(SBATCH) >= 2 and len(set(tails.values())) == 1, sorted(tails)


def directives(text: str) -> dict[str, str]:
    """A batch script's #SBATCH options, by long name."""
    return {m.group(1): m.group(2) or "" for m in re.finditer(r"^#SBATCH\s+--([\w-]+)(?:[= ](\S+))?", text, re.M)}


def stubs(tmp_path: Path, calls: Path) -> Path:
    """A folder of stand-ins for SLURM's commands (and `fedjax-sparse`, `gcloud`): each appends its name
    and arguments to `calls` as a JSON line; `squeue` says the job is $STUB_STATE; `srun` ends with
    $STUB_STATUS or, given $STUB_RUN, runs its command in its place (the run's one process, --cluster
    dropped), its pid in the file $STUB_RUN; `scancel --signal=S` sends S to that run."""
    folder = tmp_path / "stubs"
    folder.mkdir(parents=True, exist_ok=True)
    record = (f'{shlex.quote(sys.executable)} -c "import json, sys; print(json.dumps(sys.argv[1:]))" '
              f'"$(basename "$0")" "$@" >> {shlex.quote(str(calls))}')
    run = f'{shlex.quote(sys.executable)} -c "import sys; from fedjax_sparse.run.cli import main; sys.exit(main())"'
    scripts = {
        "srun": f"""{record}
if [ -n "${{STUB_RUN:-}}" ]; then
    echo $$ > "$STUB_RUN"
    while [ "$1" != fedjax-sparse ]; do shift; done
    shift
    args=()
    for a in "$@"; do [ "$a" = --cluster ] || args+=("$a"); done
    exec {run} "${{args[@]}}"
fi
exit "${{STUB_STATUS:-0}}"
""",
        "scancel": f'kill -s "${{1#--signal=}}" "$(cat "$STUB_RUN")"\n{record}\n',  # signalled, then recorded
        "scontrol": record,
        "squeue": f'{record}\necho "${{STUB_STATE:-RUNNING}}"\n',
        "fedjax-sparse": record,
        "gcloud": record,
    }
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return folder


def prepared(path: Path, tmp_path: Path, run_flags: str | None = None) -> Path:
    """The template at `path` with its environment and run folder under `tmp_path` (and, given, other run
    flags), as a file to run."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "activate").write_text("")
    text = path.read_text()
    assert VENV in text and RUN_DIR in text
    text = text.replace(VENV, str(venv)).replace(RUN_DIR, str(tmp_path / "run"))
    if run_flags is not None:
        text, found = re.subn(r"RUN_FLAGS=\(.*?\)", f"RUN_FLAGS=({run_flags})", text, flags=re.S)
        assert found == 1
    script = tmp_path / path.name
    script.write_text(text)
    return script


def batch_env(tmp_path: Path, calls: Path, **extra) -> dict:
    return {**os.environ, "PATH": f"{stubs(tmp_path, calls)}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_CPUS_PER_TASK": "8", **extra}


def recorded(calls: Path) -> list[list[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def srun_line(path: Path, tmp_path: Path, **extra) -> tuple[dict, list[str]]:
    """The template's #SBATCH options with those of its srun call, and the command srun runs."""
    calls = tmp_path / "calls.jsonl"
    done = subprocess.run(["bash", prepared(path, tmp_path)], env=batch_env(tmp_path, calls, **extra),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (srun,) = [call[1:] for call in recorded(calls) if call[0] == "srun"]
    start = srun.index("fedjax-sparse")
    options = directives(path.read_text())
    options.update(re.fullmatch(r"--([\w-]+)(?:=(.*))?", o).groups("") for o in srun[:start])
    return options, srun[start:]


def compressed(split: list[int]) -> str:
    """SLURM's form of a tasks-per-node list: [4, 4, 1] is '4(x2),1'."""
    return ",".join(f"{n}(x{len(g)})" if len(g) > 1 else str(n)
                    for n, g in ((n, list(g)) for n, g in itertools.groupby(split)))


def slurm_tasks(options: dict, reading: str, split: list[int] | None = None) -> list[tuple[int, dict, list[int]]]:
    """(node, environment, the node's GPUs it was given) of each task of a step run with `options` on nodes of
    NODE_GPUS GPUs, as SLURM sets them: `split` the tasks per node (default --ntasks-per-node on each of
    --nodes); GPUs bound to each task with --gpus-per-task, else every GPU of the node for each; and
    SLURM_GPUS_ON_NODE by `reading`: 'step', the step's GPUs on the node (srun(1)), or 'task', the task's."""
    nodes = int(options["nodes"])
    default = split is None
    split = [int(options["ntasks-per-node"])] * nodes if default else split
    per_task = int(options["gpus-per-task"]) if "gpus-per-task" in options else None
    common = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"gpu[01-{nodes:02d}]",
              "SLURM_STEP_NODELIST": f"gpu[01-{nodes:02d}]", "SLURM_NNODES": str(nodes),
              "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_NTASKS": str(sum(split)),
              "SLURM_STEP_NUM_TASKS": str(sum(split)), "SLURM_TASKS_PER_NODE": compressed(split),
              "SLURM_STEP_TASKS_PER_NODE": compressed(split)}
    if default and "ntasks-per-node" in options:
        common["SLURM_NTASKS_PER_NODE"] = options["ntasks-per-node"]
    if per_task is not None:
        common.update(SLURM_GPUS_PER_TASK=str(per_task), SLURM_TRES_PER_TASK=f"cpu=8,gres/gpu={per_task}")
    tasks, rank = [], 0
    for node, count in enumerate(split):
        step_gpus = count * per_task if per_task else NODE_GPUS
        assert step_gpus <= NODE_GPUS
        for local in range(count):
            mine = list(range(local * per_task, (local + 1) * per_task)) if per_task else list(range(NODE_GPUS))
            tasks.append((node, {**common, "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local),
                                 "SLURM_PROCID": str(rank), "CUDA_VISIBLE_DEVICES": ",".join(map(str, mine)),
                                 "SLURM_GPUS_ON_NODE": str(step_gpus if reading == "step" else len(mine))}, mine))
            rank += 1
    return tasks


def derived_layout(env: dict, monkeypatch) -> tuple[str, int, int, list[int]]:
    """(coordinator, process count, process id, the node's GPUs it uses) as `distributed.initialize(cluster=True)`
    hands them to JAX, whose own SLURM detection fills in all but the GPUs."""
    devices = distributed.slurm_local_devices(env)
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("SLURM_") or n == "JAX_COORDINATOR_PORT"]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        coordinator, count, index, local = ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, devices, "slurm", None)
    visible = [int(d) for d in env["CUDA_VISIBLE_DEVICES"].split(",")]
    return coordinator, count, index, [visible[i] for i in (local or range(len(visible)))]


@pytest.mark.parametrize("reading", ["step", "task"])
@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_each_slurm_template_gives_every_process_its_gpus(path, reading, tmp_path, monkeypatch):
    """A task per node takes its node's 4 GPUs (JAX alone gives it 1); a task per GPU takes the one SLURM bound to
    it, whatever SLURM_GPUS_ON_NODE counts (counting the task's, the code before read the bound tasks as 4
    sharing 1 GPU and refused them)."""
    options, command = srun_line(path, tmp_path)
    args = command_parser().parse_args(command[1:])
    assert args.cluster and args.out == str(tmp_path / "run")
    config = config_from_args(args)
    tasks = slurm_tasks(options, reading)
    layouts = [derived_layout(env, monkeypatch) for _, env, _ in tasks]
    (coordinator,) = {coordinator for coordinator, *_ in layouts}
    assert coordinator.startswith("gpu01:")  # the step's first node
    assert sorted(index for _, _, index, _ in layouts) == list(range(len(tasks)))
    assert {count for _, count, _, _ in layouts} == {len(tasks)}
    per_process = options.get("gpus-per-task") or str(NODE_GPUS)
    assert {len(gpus) for *_, gpus in layouts} == {int(per_process)}
    for node in {node for node, _, _ in tasks}:  # every GPU of the step on the node used, by one process
        used = [gpu for (where, _, _), (*_, gpus) in zip(tasks, layouts) if where == node for gpu in gpus]
        given = {gpu for where, _, mine in tasks if where == node for gpu in mine}
        assert sorted(used) == sorted(given)
    assert config.clients_per_round % (len(tasks) * int(per_process)) == 0


@pytest.mark.parametrize("reading", ["step", "task"])
def test_tasks_split_unevenly_over_nodes_are_refused_by_every_task_alike(reading, tmp_path, monkeypatch):
    """3 + 2 tasks on two 4-GPU nodes sharing them (the one-task-per-node template run with --ntasks 5): every
    task stops with the same line, before JAX is asked to meet anyone; the code before refused on the node of 3
    only, and the 2 tasks of the other waited out --launch-timeout. Bound to a GPU each, the same split runs."""
    path = LAUNCH / "slurm_node.sbatch"
    options, _ = srun_line(path, tmp_path)
    options.pop("ntasks-per-node")
    refusals = set()
    for _, env, _ in slurm_tasks(options, reading, split=[3, 2]):
        with pytest.raises(distributed.LaunchError) as refused:
            distributed.slurm_local_devices(env)
        refusals.add(str(refused.value))
    (line,) = refusals
    assert "\n" not in line and "SLURM split the 5 tasks 3,2 over 2 nodes" in line
    bound, _ = srun_line(LAUNCH / "slurm_gpu.sbatch", tmp_path / "gpu")
    for _, env, mine in slurm_tasks(bound, reading, split=[3, 2]):
        assert distributed.slurm_local_devices(env) == [] and len(mine) == 1
    _, env, _ = slurm_tasks(options, reading, split=[3, 2])[-1]  # a task of the node of 2, through the launch
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    met = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: met.append(kw))
    with pytest.raises(distributed.LaunchError, match="SLURM split the 5 tasks 3,2"):
        distributed.initialize(cluster=True, timeout_s=5)
    assert met == []


@pytest.mark.parametrize("asked", [{"SLURM_GPUS_PER_TASK": "a100:1"}, {"SLURM_TRES_PER_TASK": "gres/gpu=1"},
                                   {"SLURM_TRES_PER_TASK": "cpu=8,gres/gpu:a100=1"}])
def test_a_task_per_gpu_is_known_from_what_sbatch_or_srun_sets(asked):
    """--gpus-per-task reaches a task as sbatch's SLURM_GPUS_PER_TASK or srun's SLURM_TRES_PER_TASK; either
    says the task's one GPU is its own, whatever SLURM_GPUS_ON_NODE counts."""
    options = directives((LAUNCH / "slurm_gpu.sbatch").read_text())
    for _, env, _ in slurm_tasks(options, "task"):
        env = {name: value for name, value in env.items() if not name.endswith("_PER_TASK")}
        assert distributed.slurm_local_devices({**env, **asked}) == []


def folder_with_checkpoint(run: Path, committed: bool) -> None:
    """A run folder after some rounds: a committed checkpoint (its round's folder) or only orbax's unfinished one."""
    (run / "checkpoints" / "100.orbax-checkpoint-tmp-7").mkdir(parents=True)
    if committed:
        (run / "checkpoints" / "50").mkdir()


@pytest.mark.parametrize("made_by, state, expected", [
    (None, None, ["--out"]),  # the first start: a new run
    ("4242", "unfinished", ["--out", "--overwrite"]),  # this job's run, requeued before its first checkpoint
    (None, "unfinished", ["--out"]),  # another run's folder without a checkpoint: refused by --out, never overwritten
    ("4141", "unfinished", ["--out"]),  # ... also where another job made it
    ("4242", "committed", ["--resume"]),  # requeued: the run resumes
    (None, "committed", ["--resume"]),  # submitted anew after its time ran out
])
def test_a_requeued_job_resumes_its_run_and_overwrites_only_its_own_folder(made_by, state, expected, tmp_path):
    run = tmp_path / "run"
    if state is not None:
        folder_with_checkpoint(run, committed=state == "committed")
    if made_by is not None:
        (tmp_path / "run.job").write_text(f"{made_by}\n")
    _, command = srun_line(LAUNCH / "slurm_node.sbatch", tmp_path, SLURM_RESTART_COUNT="1")
    assert [a for a in command if a in ("--out", "--overwrite", "--resume")] == expected
    args = command_parser().parse_args(command[1:])
    assert (args.resume or args.out) == str(run)
    marker = tmp_path / "run.job"  # a start in a folder that did not exist marks it as this job's; else it stays
    assert (marker.read_text().strip() if marker.exists() else None) == ("4242" if state is None else made_by)


def test_the_time_limits_signal_stops_saves_requeues_and_the_requeued_job_resumes(tmp_path):
    """A batch script run for real (with a small run's flags; srun runs its one process): SIGTERM to the batch
    shell, as --signal=B:TERM sends it, reaches the run (through scancel: srun would SIGKILL it), which finishes
    its round, saves and exits 143; the script requeues the job; run again as requeued, it resumes the run
    to its end."""
    flags = ("--num-clients 4 --clients-per-round 2 --local-epochs 1 --max-train-examples 200 --max-test-examples "
             "100 --rounds 4 --checkpoint-every 3 --no-progress --no-tensorboard")
    script = prepared(LAUNCH / "slurm_node.sbatch", tmp_path, run_flags=flags)
    calls, pid, flag = tmp_path / "calls.jsonl", tmp_path / "run.pid", tmp_path / "paused"
    env = batch_env(tmp_path, calls, STUB_RUN=str(pid), FEDJAX_SPARSE_FAULT="round_end:1:pause",
                    FEDJAX_SPARSE_FAULT_FLAG=str(flag), PYTHONPATH=str(ROOT))
    batch = subprocess.Popen(["bash", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not flag.exists() and batch.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), batch.communicate()[0][-3000:]
    batch.send_signal(signal.SIGTERM)  # the time limit's warning, to the batch shell alone
    while not any(call[0] == "scancel" for call in recorded(calls)) and time.monotonic() < deadline:
        time.sleep(0.05)
    flag.unlink()
    output = batch.communicate(timeout=120)[0]
    assert batch.returncode == 143, output[-3000:]
    assert "SIGTERM: stopping after round 1, then saving a checkpoint" in output
    assert [call for call in recorded(calls) if call[0] == "scontrol"] == [["scontrol", "requeue", "4242"]]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_done"] == 1
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()  # saved on the signal (none was due before round 3)

    calls.unlink()
    del env["FEDJAX_SPARSE_FAULT"]
    again = subprocess.run(["bash", script], env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    (srun,) = [call for call in recorded(calls) if call[0] == "srun"]
    assert srun[srun.index("--resume") + 1] == str(tmp_path / "run")
    assert not [call for call in recorded(calls) if call[0] == "scontrol"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_done"] == 4
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in metrics] == [1, 2, 3, 4]


def test_the_multi_host_lines_start_one_run_of_distinct_processes(tmp_path):
    """On machines without a scheduler: each machine's line names the same coordinator and process count and its
    own id (checked as the run checks them), the same run flags; once there is a checkpoint, they resume."""
    path = LAUNCH / "multi_host.sh"
    script, calls = prepared(path, tmp_path), tmp_path / "calls.jsonl"
    for process_id in ("0", "1"):
        done = subprocess.run(["bash", script, process_id], env=batch_env(tmp_path, calls), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    lines = [call[1:] for call in recorded(calls)]
    parsed = [command_parser().parse_args(line) for line in lines]
    assert [a.process_id for a in parsed] == [0, 1]
    assert all(distributed.check_launch(a.coordinator, a.num_processes, a.process_id) for a in parsed)
    assert {a.num_processes for a in parsed} == {2}
    assert lines[0][:lines[0].index("--process-id")] == lines[1][:lines[1].index("--process-id")]
    assert lines[0][lines[0].index("--process-id") + 2:] == lines[1][lines[1].index("--process-id") + 2:]
    assert parsed[0].out == str(tmp_path / "run") and parsed[0].resume is None
    config_from_args(parsed[0])
    folder_with_checkpoint(tmp_path / "run", committed=True)
    calls.unlink()
    subprocess.run(["bash", script, "0"], env=batch_env(tmp_path / "again", calls), check=True, timeout=60)
    assert command_parser().parse_args(recorded(calls)[0][1:]).resume == str(tmp_path / "run")


def test_the_tpu_pod_command_runs_the_same_cluster_line_on_every_worker(tmp_path):
    """The TPU pod script copies the library to every worker, sets up its environment, and runs one --cluster
    line on all workers, which the run's parser takes, into the mounted bucket."""
    path = LAUNCH / "tpu_pod.sh"
    calls = tmp_path / "calls.jsonl"
    subprocess.run(["bash", path], env=batch_env(tmp_path, calls), check=True, timeout=60)
    scp, setup, run = [call[1:] for call in recorded(calls)]
    assert scp[:4] == ["compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in scp
    assert all(call[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and "--worker=all" in call for call in (setup, run))
    remote = next(a for a in run if a.startswith("--command="))[len("--command="):]
    home = tmp_path / "home"
    (home / "fedjax" / "bin").mkdir(parents=True)
    (home / "fedjax" / "bin" / "activate").write_text("")
    calls.unlink()
    subprocess.run(["bash", "-c", remote], env={**batch_env(tmp_path / "worker", calls), "HOME": str(home)},
                   check=True, timeout=60)
    (line,) = [call[1:] for call in recorded(calls)]
    args = command_parser().parse_args(line)
    assert args.cluster and args.out == "/mnt/bucket/runs/fedavg"
    config_from_args(args)
