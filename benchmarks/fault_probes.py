"""The fault sweep's probes of issues 36 and 55, each a real `fedjax-sparse run` (or `convert`) process
(`python -m fedjax_sparse.run.cli run ...`): the run folder and its writers (a file-size limit with TensorBoard
on, an immutable metrics.jsonl, a full tmpfs under the disk store, --overwrite into a user's folder), signals in
the first 1.5 s and under nohup, broken or conflicting installed plug-ins, bad data and config files, damaged
store rows and checkpoints on --resume; and issue 55's: checkpoints without their checksums, runs killed before
their first checkpoint was complete (on default settings too), SIGUSR1 and SIGUSR2, and files the run never
wrote (a user's checkpoints/ and client_store/ in a run folder, a user's .lock, a convert target).

The faults are made by the tests' own builders (tests/test_faults*.py, imported as plain modules; the
plug-ins' dist-infos by benchmarks/plugin_dists.py, which the plug-in test uses too), and each probe is judged
against what its test requires, as a real process shows it: the exit code, one stderr line naming what the
test names (at most 400 characters, each path of the run's folder counted as "$RUN"), no traceback, the end
within a minute (within 10 s of a signal), and summary.json. A run that fails in its rounds leaves summary.json
"failed"; a run refused before its first round leaves its folder's summary as it was -- none in a new folder
(tests/test_faults_folder.py: "a run that fails before its first round leaves its folder as it was"), the
finished run's "completed" where a --resume is refused -- and a full disk may leave no room for summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:  # the tests' fault builders: plain modules in a plain folder
    sys.path.insert(0, str(ROOT / "tests"))

from test_faults import TINY  # noqa: E402
from test_faults_checkpoints import flip  # noqa: E402
from test_faults_data import ALIAS_BOMB, BAD_LEAF, leaf_folder  # noqa: E402
from test_faults_data import test_36_11_config_files_refuse_repeated_keys_quoted_numbers_and_alias_bombs \
    as config_file_test  # noqa: E402
from test_faults_folder import MANIFEST, TENSORBOARD, contents, users_folder  # noqa: E402
from test_faults_plugins import PLUGINS, WARNINGS  # noqa: E402

from fedjax_sparse.data.mapped import WRITING  # noqa: E402
from fedjax_sparse.run.folder import LOCK_FILE  # noqa: E402
from fedjax_sparse.run.signals import SIGNALS  # noqa: E402

from .plugin_dists import install_plugins  # noqa: E402

CLI = [sys.executable, "-m", "fedjax_sparse.run.cli"]
B = ["--dataset", "digits", "--model", "mlp", "--num-clients", "10", "--clients-per-round", "5",  # the review's B
     "--local-epochs", "1", "--no-progress"]
MAX_SECONDS = 60.0  # "within seconds": a run of these sizes takes 5-20 s on 2 loaded cores; a hang does not end
MAX_LINE = 400
# seconds after the process was started. Not earlier: the interpreter's own start-up (site, the editable
# install's import finder) runs before any line of the library, 40 ms on an idle machine and over 50 ms on a
# loaded one (the 2026-11-27 sweep's 0.05 s signals all arrived inside importlib: Python's default handling)
SIGNAL_TIMES = (0.25, 0.5, 1.0, 1.5)


def command(args, faults=None, limit=None, env=None, prefix=(), timeout=900, sub="run"):
    """`fedjax-sparse run *args` (or another `sub`command) in a process of its own, under a file-size `limit`
    (bytes) and with `faults` injected (FEDJAX_SPARSE_FAULT) if given: (CompletedProcess, seconds)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    if faults:
        env["FEDJAX_SPARSE_FAULT"] = faults
    preexec = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None
    start = time.perf_counter()
    done = subprocess.run([*prefix, *CLI, sub, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT,
                          preexec_fn=preexec, timeout=timeout)
    return done, time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a probe must show. `summary`: the statuses summary.json may have (None: no summary.json; empty:
    not checked); `check(done)`: '' if what else the probe needs holds, else what does not."""
    exit: int = 2
    lines: int = 1
    words: tuple = ()
    summary: tuple = ("failed",)
    check: Callable | None = None
    within: float = MAX_SECONDS


@dataclasses.dataclass
class Done:
    returncode: int | str  # "timeout" where the probe ended the process
    stdout: str
    stderr: str


def summary_of(run: Path | None) -> dict:
    path = run / "summary.json" if run is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def shown(args, root: Path, prefix="", sub="run") -> str:
    """The probe's command as a user types it, the temporary folder as $ROOT."""
    return (prefix + f"fedjax-sparse {sub} " + shlex.join(map(str, args))).replace(str(root), "$ROOT")


def not_run(kind: str, name: str, why) -> dict:
    text = " ".join(str(why).split())
    if isinstance(why, subprocess.CalledProcessError) and why.stderr:
        text += ": " + " ".join(str(why.stderr).split())
    return {"class": kind, "probe": name, "ran": False, "verdict": "not run", "why": text[:300]}


def judge(kind: str, name: str, cmd: str, done: Done, seconds: float, root: Path, run: Path | None,
          expect: Expect) -> dict:
    """The probe's record, and its verdict against `expect`."""
    short = lambda line: (line.replace(str(run), "$RUN") if run is not None else line).replace(  # noqa: E731
        str(root), "$ROOT")
    lines = done.stderr.strip().splitlines()
    last = lines[-1] if lines else (done.stdout.strip().splitlines() or [""])[-1]
    summary = summary_of(run)
    status = summary.get("status")
    wrong = []
    if done.returncode != expect.exit:
        wrong.append(f"exit {done.returncode}, not {expect.exit}")
    if len(lines) != expect.lines:
        wrong.append(f"{len(lines)} stderr lines, not {expect.lines}")
    if "Traceback" in done.stderr:
        wrong.append(f"{done.stderr.count('Traceback')} tracebacks")
    wrong += [f"stderr lacks {w!r}" for w in expect.words if w not in done.stderr]
    if any(len(short(line)) > MAX_LINE for line in lines):
        wrong.append(f"a stderr line over {MAX_LINE} characters (each path of the run's folder counted as $RUN)")
    if seconds > expect.within:
        wrong.append(f"{seconds:.1f} s, over {expect.within:.1f} s")
    if expect.summary and status not in expect.summary:
        wrong.append(f"summary.json status {status!r}, not {' or '.join(map(repr, expect.summary))}")
    if expect.check is not None:
        wrong += [w for w in [expect.check(done)] if w]
    record = {"class": kind, "probe": name, "ran": True, "command": cmd, "exit": done.returncode,
              "seconds": round(seconds, 1), "stderr_lines": len(lines), "tracebacks": done.stderr.count("Traceback"),
              "summary_status": status, "last_checkpoint": summary.get("last_checkpoint"),
              "last_line": last.replace(str(root), "$ROOT")[:MAX_LINE],
              "verdict": "fail" if wrong else "pass", "why": "; ".join(wrong)}
    if wrong:  # the evidence
        record["stderr_tail"] = done.stderr[-3000:].replace(str(root), "$ROOT")
    return record


def probe(kind: str, name: str, root: Path, args, expect: Expect, *, run: Path | None = None, prepare=None,
          cleanup=None, limit=None, env=None, prefix=(), shown_prefix="", timeout=300, sub="run") -> dict:
    """Makes the fault (`prepare()`; a probe this machine cannot make is recorded as not run, with why), runs
    the command in its own process, undoes what must be undone (`cleanup()`), and judges what it showed."""
    try:
        if prepare is not None:
            prepare()
    except (OSError, subprocess.CalledProcessError, AssertionError) as err:
        return not_run(kind, name, err)
    try:
        completed, seconds = command(args, limit=limit, env=env, prefix=prefix, timeout=timeout, sub=sub)
        done = Done(completed.returncode, completed.stdout, completed.stderr)
    except subprocess.TimeoutExpired as err:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        done, seconds = Done("timeout", text(err.stdout), text(err.stderr)), float(timeout)
    finally:
        if cleanup is not None:
            cleanup()
    return judge(kind, name, shown(args, root, shown_prefix, sub), done, seconds, root, run, expect)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def finished_run(run: Path, *args: str) -> None:
    done, _ = command([*args, "--out", str(run)])
    assert done.returncode == 0, f"the run to damage failed: {done.stderr[-500:]}"


# ------------------------------------------------------------------ run folder and writers (items 1, 5, 12)

def folder_probes(root: Path) -> list[dict]:
    kind, base = "run folder", root / "folder"
    out = []
    for name, folder, extra, words in (
            ("ulimit -f 16 KiB, TensorBoard on, no checkpoints", "ulimit", ["--checkpoint-minutes", "0"],
             ("File too large [errno 27]",)),
            ("ulimit -f 16 KiB, TensorBoard on, --checkpoint-every 1", "ulimit_checkpoints",
             ["--checkpoint-every", "1"], ())):
        run = base / folder
        # without the compilation cache: a cache entry cut short by the limit would outlive the probe
        out.append(probe(kind, name, root, [*TENSORBOARD, *extra, "--rounds", "20", "--no-compilation-cache",
                                            "--out", str(run)],
                         Expect(words=("fedjax-sparse: error: cannot ", str(run), *words)), run=run,
                         limit=16 * 1024, shown_prefix="ulimit -f 16; "))

    finished, before = base / "immutable_metrics", {}
    metrics = finished / "metrics.jsonl"

    def immutable_metrics():
        finished_run(finished, *TINY, "--rounds", "2", "--checkpoint-every", "2")
        before["metrics"] = metrics.read_bytes()
        subprocess.run(["chattr", "+i", str(metrics)], check=True, capture_output=True)

    out.append(probe(kind, "--resume, metrics.jsonl immutable (chattr +i)", root,
                     ["--resume", str(finished), "--rounds", "3", "--no-progress"],
                     Expect(words=(f"cannot write {metrics}", "Operation not permitted [errno 1]"),
                            check=lambda done: "" if metrics.read_bytes() == before["metrics"] else
                            "metrics.jsonl changed"),
                     run=finished, prepare=immutable_metrics, shown_prefix="chattr +i metrics.jsonl; ",
                     cleanup=lambda: subprocess.run(["chattr", "-i", str(metrics)], capture_output=True)))

    for attempt in (1, 2, 3):  # orbax writes a checkpoint from several threads: a full disk is a race
        mount = base / f"tmpfs_{attempt}"
        run = mount / "run"

        def full_tmpfs(mount=mount):
            mount.mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6000k", "tmpfs", str(mount)], check=True,
                           capture_output=True)
            (mount / "fill").write_bytes(b"\0" * 1_500_000)  # room for the rows and a checkpoint or two, not all

        out.append(probe(kind, f"full tmpfs, disk store, SCAFFOLD, TensorBoard on (run {attempt} of 3)", root,
                         [*TENSORBOARD, "--algorithm", "scaffold", "--client-store", "disk", "--rounds", "20",
                          "--checkpoint-every", "2", "--out", str(run)],
                         Expect(words=("fedjax-sparse: error: ", str(run)), summary=("failed", None)),
                         run=run, prepare=full_tmpfs, shown_prefix="mount -t tmpfs -o size=6000k (1.5 MB filled); "))

    user, before_user = base / "users_folder", {}
    out.append(probe(kind, "--overwrite into a folder with the user's config.json, checkpoints/model.pt", root,
                     [*B, "--rounds", "1", "--out", str(user), "--overwrite"],
                     Expect(words=(f"--out {user} holds config.json, checkpoints, which fedjax-sparse has no record "
                                   f"of writing",), summary=(None,),
                            check=lambda done: "" if contents(user) == before_user else "the user's files changed"),
                     run=user, prepare=lambda: before_user.update(users_folder(user))))
    return out


# ------------------------------------------------------------------------- early signals (item 6)

def as_from_a_terminal():
    """The signals a run handles as a process started from a terminal has them, however the sweep was started
    (a shell's `&` ignores SIGINT in its children, nohup SIGHUP)."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def spawn(args, prefix=()):
    return subprocess.Popen([*prefix, *CLI, "run", *map(str, args)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                            preexec_fn=as_from_a_terminal)


def signal_probes(root: Path) -> list[dict]:
    kind, base = "early signals", root / "signals"
    base.mkdir(parents=True)
    out = []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        for at in SIGNAL_TIMES:
            run = base / f"{signum.name}_{at}"
            args = [*B, "--rounds", "3", "--out", str(run)]
            start = time.perf_counter()
            proc = spawn(args)
            time.sleep(max(0.0, at - (time.perf_counter() - start)))
            proc.send_signal(signum)
            stdout, stderr = proc.communicate(timeout=300)
            seconds = time.perf_counter() - start
            left = sorted(p.name for p in run.iterdir()) if run.exists() else []
            expect = Expect(exit=128 + signum, summary=(None,), within=at + 10,
                            words=(f"fedjax-sparse: {signum.name} during start-up, before the first round: nothing "
                                   f"was run",),
                            check=lambda done, left=left: "" if set(left) <= {MANIFEST} else
                            f"the folder holds {', '.join(left)}")
            record = judge(kind, f"{signum.name} at {at} s", shown(args, root, f"kill -{signum.name[3:]} at {at} s: "),
                           Done(proc.returncode, stdout, stderr), seconds, root, run, expect)
            out.append({**record, "left": left})

    run = base / "nohup"
    args = [*B, "--rounds", "3", "--out", str(run)]
    start, sent = time.perf_counter(), 0
    proc = spawn(args, prefix=["nohup"])
    while proc.poll() is None:  # SIGHUP every half second, in start-up and in the rounds, until it ends
        time.sleep(0.5)
        if proc.poll() is None:
            proc.send_signal(signal.SIGHUP)
            sent += 1
    stdout, stderr = proc.communicate()
    out.append(judge(kind, f"nohup, SIGHUP every 0.5 s ({sent} sent)", shown(args, root, "nohup "),
                     Done(proc.returncode, stdout, stderr), time.perf_counter() - start, root, run,
                     Expect(exit=0, lines=0, summary=("completed",))))
    return out


# ----------------------------------------------------------------------------- plug-ins (items 2, 7)

RESUME_PLUGIN = {"fl-resume": ({"fl_resume.py": textwrap.dedent("""
    import dataclasses
    from fedjax_sparse.building_blocks import option
    from test_faults_plugins import spec

    @dataclasses.dataclass(frozen=True)
    class ResumeOptions:
        resume: str = option("", "a plug-in's own setting, named like the command line's --resume")

    SPEC = spec('with_resume', ResumeOptions)
    """)}, {"with_resume": "fl_resume:SPEC"})}
RESUME_WARNING = ("option 'resume' of algorithm with_resume (plug-in of package 'fl-resume') makes the flag "
                  "--resume")
PLUGIN_CASES = (  # (case, its packages, the algorithm it names, what its one line must say)
    ("import error", ("fl-broken",), "broken", WARNINGS[0]),
    ("non-spec value", ("fl-odd",), "odd", WARNINGS[1]),
    ("named fedavg", ("fl-fedavg",), "fedavg", WARNINGS[2]),
    ("two packages, one name", ("fl-twin-a", "fl-twin-b"), "twin", WARNINGS[3]),
    ("an lr option", ("fl-lr",), "with_lr", WARNINGS[4]),
    ("a resume option", ("fl-resume",), "with_resume", RESUME_WARNING),
    ("mu declared differently", ("fl-mu",), "with_mu", WARNINGS[5]),
)


def plugin_probes(root: Path) -> list[dict]:
    kind, available = "plug-ins", {**PLUGINS, **RESUME_PLUGIN}
    out = []
    for case, packages, name, words in PLUGIN_CASES:
        base = root / "plugins" / slug(case)
        site = install_plugins(base / "site", {p: available[p] for p in packages})
        # the plug-ins' modules import the test's `spec` (FedAvg under another name)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(ROOT / "tests"),
                                                           os.environ.get("PYTHONPATH")]))}
        where = f"PYTHONPATH={site.relative_to(root)}:tests "
        warning = ("fedjax-sparse: warning: ", words, "; skipped")
        out.append(probe(kind, f"{case}: run --help", root, ["--help"],
                         Expect(exit=0, words=warning, summary=(),
                                check=lambda done: "" if "--algorithm" in done.stdout else "no help on stdout"),
                         env=env, shown_prefix=where))
        run = base / "fedavg"
        out.append(probe(kind, f"{case}: --algorithm fedavg", root,
                         [*TINY, "--algorithm", "fedavg", "--rounds", "1", "--out", str(run)],
                         Expect(exit=0, words=warning, summary=("completed",)), run=run, env=env, shown_prefix=where))
        if name == "fedavg":  # asking for it is asking for the built-in: the run above
            continue
        run = base / name
        out.append(probe(kind, f"{case}: --algorithm {name}", root,
                         [*TINY, "--algorithm", name, "--rounds", "1", "--out", str(run)],
                         Expect(words=(f"fedjax-sparse: error: {words}",), summary=(None,),
                                check=lambda done, run=run: f"{run.name}/ was made" if run.exists() else ""),
                         run=run, env=env, shown_prefix=where))
    return out


# -------------------------------------------------------------------- data and config files (items 8, 9, 11)

def _pixel_of_255(train, test):
    train["w1"][0][0][7] = 255


def _fifo_in_train(root: Path) -> None:
    (root / "train" / "a.json").unlink()
    os.mkfifo(root / "train" / "a.json")


def nested_aliases(levels: int) -> str:
    """tests/test_faults_data.py's ALIAS_BOMB (7 levels, 343 bytes) with `levels` levels: 9**levels values."""
    names = "abcdefghijklmnopqrstuvwxyz"[:levels]
    return "capacities:\n  - - &a [" + ", ".join(["0.5"] * 9) + "]\n" + "".join(
        f"    - &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip(names, names[1:]))


def config_cases() -> list[tuple[str, str, str]]:
    """(file name, text, what its line must say: a phrase or a tuple of them): the config-file test's cases, a
    15-level alias bomb and a 100,000-character value."""
    assert nested_aliases(7) == ALIAS_BOMB  # the test's construction, deepened
    marks = [m for m in config_file_test.pytestmark if m.name == "parametrize"]
    return [*marks[0].args[1],
            ("bomb15.yaml", nested_aliases(15), "key 'capacities': more than 10,000 values (YAML's aliases written "
                                                "out)"),
            ("long.yaml", f"lr: \"{'1' * 100_000}x\"\n", ("key 'lr': --lr: '111", "' is not a valid float"))]


def data_probes(root: Path) -> list[dict]:
    kind, base = "data files", root / "data"
    out = []
    leaf = {**{case: (*spec, None) for case, spec in BAD_LEAF.items()},
            "pixel of 255": (_pixel_of_255, "train", "w1", "x",
                             "example 0, pixel 7 is 255; FEMNIST pixels are numbers in [0, 1]", None),
            "FIFO train/a.json": (lambda train, test: None, None, None, None, None, _fifo_in_train)}
    for case, (change, split, user, field, words, then) in leaf.items():
        folder, run = base / slug(case), base / f"{slug(case)}_run"

        def prepare(folder=folder, change=change, then=then):
            leaf_folder(folder, change)
            if then is not None:
                then(folder)

        if then is _fifo_in_train:
            line = (f"LEAF file {folder / 'train' / 'a.json'} is a FIFO, not a regular file",)
        elif user is None:
            line = (str(folder / split), words)
        else:
            line = (f"LEAF file {folder / split / 'a.json'}, user \"{user}\", field {field}: {words}",)
        out.append(probe(kind, f"leaf: {case}", root,
                         ["--dataset", f"leaf:{folder}", "--model", "mlp", *TINY, "--rounds", "1", "--out", str(run)],
                         Expect(words=line, summary=(None,)), run=run, prepare=prepare, timeout=120))

    for dataset, words in (("synthetic:1e308,1e308", ("synthetic:1e+308,1e+308: client ", "features reach |x| = ",
                                                      "alpha = 1e+308, beta = 1e+308")),
                           ("synthetic:1e308,0", ("overflow float64 (alpha = 1e+308, beta = 0 ",))):
        run = base / slug(dataset)
        out.append(probe(kind, dataset, root,
                         ["--dataset", dataset, "--model", "mlp", "--num-clients", "4", "--clients-per-round", "2",
                          "--local-epochs", "1", "--rounds", "1", "--no-progress", "--no-tensorboard",
                          "--out", str(run)],
                         Expect(words=words, summary=(None,),
                                check=lambda done: "blames --lr" if "--lr" in done.stderr else ""), run=run))

    for name, text, words in config_cases():
        path, run = base / "config" / name, base / "config" / f"{slug(name)}_run"

        def write(path=path, text=text):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

        out.append(probe(kind, f"--config {name} ({len(text.encode()):,} bytes)", root,
                         ["--config", str(path), "--out", str(run)],
                         Expect(words=(f"--config {path}", *(words if isinstance(words, tuple) else (words,))),
                                summary=(None,),
                                check=lambda done, run=run: f"{run.name}/ was made" if run.exists() else ""),
                         run=run, prepare=write, timeout=120))
    return out


# ------------------------------------------------------- corrupted store rows and checkpoints (items 3, 10)

def _scale_rows(run: Path) -> Path:
    rows = run / "client_store" / "client_rows.0-of-1.bin"
    (np.fromfile(rows, np.float32) * 50).tofile(rows)
    return rows


def _flipped(path: Path) -> Path:
    flip(path)  # 16 bytes inverted a third of the way in
    return path


def _largest_data_file(run: Path) -> Path:
    return max((run / "checkpoints" / "2" / "state" / "ocdbt.process_0" / "d").iterdir(),
               key=lambda f: f.stat().st_size)


CHECKSUMS = ("differ from the checksums recorded with the checkpoint {latest} (damaged since it was saved); "
             "delete {latest} to resume")
DAMAGES = (  # (case, its folder, store, damage(run) -> the file damaged, what the line says of it)
    ("disk-store rows x50", "rows_x50", "disk", _scale_rows, "in the disk client store's file {path} " + CHECKSUMS),
    ("16 bytes inverted in state/manifest.ocdbt", "manifest", "disk",
     lambda run: _flipped(run / "checkpoints" / "2" / "state" / "manifest.ocdbt"), "the bytes of {path} " + CHECKSUMS),
    ("16 bytes inverted in the largest state/ocdbt.process_0/d file", "data_file", "disk",
     lambda run: _flipped(_largest_data_file(run)), "the bytes of {path} " + CHECKSUMS),
    ("host store: snapshot rows.npy flipped", "host_rows", "host",
     lambda run: _flipped(run / "checkpoints" / "2" / "client_states" / "client_states.0-of-1" / "rows.npy"),
     "the bytes of the client-state snapshot file {path} " + CHECKSUMS),
)


def _kept_status_before_resume(run: Path) -> Callable:
    """A refused resume's summary says "failed" and keeps the status of the run before (issue 36, item 12)."""
    def check(done) -> str:
        before = summary_of(run).get("status_before_resume")
        return "" if before == "completed" else f"summary.json status_before_resume {before!r}, not 'completed'"
    return check


def _no_checksums(run: Path) -> Path:
    (run / "checkpoints" / "2" / "checksums.json").unlink()
    return _flipped(run / "checkpoints" / "2" / "state" / "manifest.ocdbt")


def checkpoint_probes(root: Path) -> list[dict]:
    """Two-round SCAFFOLD runs (a checkpoint a round) whose latest checkpoint, or the rows it refers to, is
    damaged, then resumed to round 4: refused in one line naming the file and checkpoints/2, the run's
    summary left as it was ("completed")."""
    kind, base = "checkpoints", root / "checkpoints"
    runs = {store: base / f"{store}_base" for store in ("disk", "host")}
    try:
        for store, run in runs.items():
            finished_run(run, *TINY, "--algorithm", "scaffold", "--client-store", store, "--rounds", "2",
                         "--checkpoint-every", "1")
    except AssertionError as err:
        return [not_run(kind, "every checkpoint probe", err)]
    out = []
    cases = [(*damage, 1) for damage in DAMAGES]
    cases.append(("manifest.ocdbt flipped, no checksums.json", "no_checksums", "disk", _no_checksums,
                  "the checkpoint {latest} has no checksums", 1))
    for case, folder, store, damage, words, attempts in cases:
        run = base / folder
        shutil.copytree(runs[store], run)
        path = damage(run)
        line = words.format(path=path, latest=run / "checkpoints" / "2")
        for attempt in range(1, attempts + 1):
            out.append(probe(kind, case + (f" (run {attempt} of {attempts})" if attempts > 1 else ""), root,
                             ["--resume", str(run), "--rounds", "4", "--no-progress"],
                             Expect(words=(line,), summary=("failed",), check=_kept_status_before_resume(run)),
                             run=run))
    return out


# ------------------------------------------------------------------------- the third review (issue 55)

def missing_checksum_probes(root: Path) -> list[dict]:
    """A SCAFFOLD run's latest checkpoint without its checksums.json (item 1): refused in one line naming it, as
    a damaged one; deleted, the checkpoint before resumes."""
    kind, base = "missing checksums", root / "checksums"
    finished = base / "base"
    try:
        finished_run(finished, *TINY, "--algorithm", "scaffold", "--client-store", "disk", "--rounds", "2",
                     "--checkpoint-every", "1")
    except AssertionError as err:
        return [not_run(kind, "every missing-checksums probe", err)]
    out = []
    for case, folder, then in (
            ("checksums.json removed, the largest state/ocdbt.process_0/d file flipped (the review's)", "data",
             lambda run: _flipped(_largest_data_file(run))),
            ("checksums.json removed alone", "alone", lambda run: None)):
        run = base / folder
        shutil.copytree(finished, run)
        (run / "checkpoints" / "2" / "checksums.json").unlink()
        then(run)
        latest = run / "checkpoints" / "2"
        out.append(probe(kind, case, root, ["--resume", str(run), "--rounds", "4", "--no-progress"],
                         Expect(words=(f"the checkpoint {latest} has no checksums", f"delete {latest} to resume from "
                                       f"the checkpoint before"), check=_kept_status_before_resume(run)), run=run))
    run = base / "deleted"
    shutil.copytree(finished, run)
    (run / "checkpoints" / "2" / "checksums.json").unlink()
    shutil.rmtree(run / "checkpoints" / "2")
    out.append(probe(kind, "checksums.json removed, then that checkpoint deleted as the line advises", root,
                     ["--resume", str(run), "--rounds", "4", "--no-progress"],
                     Expect(exit=0, lines=0, summary=("completed",),
                            check=lambda done, run=run: "" if len(metrics_lines(run)) == 4 else
                            f"metrics.jsonl holds {len(metrics_lines(run))} rounds, not 4"), run=run))
    return out


def metrics_lines(run: Path) -> list[str]:
    path = run / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


CUT_SHORT = "was cut short while it was saved (a kill, a lost process); deleted it"  # the resume's first line
AGAIN = "no checkpoint there yet (the run stopped before its first); running it from round 1 again"  # its second
KILLS = (  # (case, its folder, flags beyond B, where the run is killed, the lines its resume says)
    ("default settings, kill -9 at the end of round 2", "default_round_2", [], "round_end:2:kill", (AGAIN,)),
    ("default settings, kill -9 inside the end's checkpoint", "default_end", [], "checkpoint_write:1:kill",
     (CUT_SHORT, AGAIN)),
    ("--checkpoint-every 1, kill -9 inside the first checkpoint's write", "first_write", ["--checkpoint-every", "1"],
     "checkpoint_write:1:kill", (CUT_SHORT, AGAIN)),
    ("--checkpoint-every 1, kill -9 between orbax's commit of the first checkpoint and its checksums",
     "first_commit", ["--checkpoint-every", "1"], "write:checksums.json:1:kill", (CUT_SHORT, AGAIN)),
)


def kill_probes(root: Path) -> list[dict]:
    """Runs killed (kill -9, the fault hook) before their first checkpoint was complete, on default settings and
    with --checkpoint-every 1 (item 2): --resume runs them again from round 1, to the uninterrupted run's
    metrics, line for line."""
    kind, base = "kill before the first checkpoint", root / "kills"
    reference = base / "reference"
    args = [*B, "--rounds", "4", "--no-tensorboard"]
    try:
        finished_run(reference, *args)
    except AssertionError as err:
        return [not_run(kind, "every kill probe", err)]
    out = []
    for case, folder, extra, fault, words in KILLS:
        run = base / folder

        def kill(run=run, extra=extra, fault=fault):
            done, _ = command([*args, *extra, "--out", str(run)], faults=fault)
            assert done.returncode == -signal.SIGKILL, f"the run to kill ended with {done.returncode}"

        out.append(probe(kind, case, root, ["--resume", str(run), "--no-progress"],
                         Expect(exit=0, lines=len(words), words=words,
                                summary=("completed",),
                                check=lambda done, run=run: "" if metrics_lines(run) == metrics_lines(reference) else
                                "metrics.jsonl differs from the uninterrupted run's"),
                         run=run, prepare=kill, shown_prefix=f"FEDJAX_SPARSE_FAULT={fault} (killed); "))
    return out


def cluster_signal_probes(root: Path) -> list[dict]:
    """SIGUSR1 and SIGUSR2 (item 4; SLURM's --signal=USR1@90): in the rounds, the run stops after its round with
    a checkpoint, summary "interrupted" and exit 128 + the signal, and its resume writes the uninterrupted
    run's metrics; in start-up, one line."""
    kind, base = "SIGUSR1", root / "usr_signals"
    base.mkdir(parents=True)
    args = [*B, "--rounds", "40", "--no-tensorboard"]
    reference = base / "reference"
    try:
        finished_run(reference, *args)
    except AssertionError as err:
        return [not_run(kind, "every SIGUSR probe", err)]
    out = []
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        run = base / signum.name
        proc = spawn([*args, "--out", str(run)])
        deadline = time.monotonic() + 300
        while len(metrics_lines(run)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signum)
        start = time.perf_counter()
        stdout, stderr = proc.communicate(timeout=300)
        after = summary_of(run)
        out.append(judge(kind, f"{signum.name} in the rounds", shown([*args, "--out", str(run)], root,
                                                                      f"kill -{signum.name[3:]} after round 2: "),
                         Done(proc.returncode, stdout, stderr), time.perf_counter() - start, root, run,
                         Expect(exit=128 + signum, lines=2, summary=("interrupted",), within=10,
                                words=(f"{signum.name}: stopped after round", "checkpoint saved in"),
                                check=lambda done, after=after, signum=signum: "" if after.get("signal") == signum.name
                                and after.get("last_checkpoint") else "no checkpoint or signal in summary.json")))
        out.append(probe(kind, f"--resume after {signum.name}", root, ["--resume", str(run), "--no-progress"],
                         Expect(exit=0, lines=0, summary=("completed",),
                                check=lambda done, run=run: "" if metrics_lines(run) == metrics_lines(reference) else
                                "metrics.jsonl differs from the uninterrupted run's"), run=run))
    for at in (0.5, 1.0):
        run = base / f"SIGUSR1_{at}"
        start = time.perf_counter()
        proc = spawn([*args, "--out", str(run)])
        time.sleep(max(0.0, at - (time.perf_counter() - start)))
        proc.send_signal(signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=300)
        left = sorted(p.name for p in run.iterdir()) if run.exists() else []
        out.append(judge(kind, f"SIGUSR1 at {at} s", shown([*args, "--out", str(run)], root, f"kill -USR1 at {at} s: "),
                         Done(proc.returncode, stdout, stderr), time.perf_counter() - start, root, run,
                         Expect(exit=128 + signal.SIGUSR1, summary=(None,), within=at + 10,
                                words=("fedjax-sparse: SIGUSR1 during start-up, before the first round: nothing was "
                                       "run",),
                                check=lambda done, left=left: "" if set(left) <= {MANIFEST} else
                                f"the folder holds {', '.join(left)}")))
    return out


def foreign_file_probes(root: Path) -> list[dict]:
    """Files the run never wrote (item 3): a user's checkpoints/ and client_store/ in a run folder whose run made
    neither, a user's .lock, a convert target holding the user's files: refused in one line and left as they
    were, never deleted or overwritten."""
    kind, base = "foreign files", root / "foreign"
    out = []
    run, before = base / "run_without_checkpoints", {}

    def users_folders(run=run):
        finished_run(run, *B, "--rounds", "1", "--checkpoint-minutes", "0", "--no-tensorboard")
        for folder in ("checkpoints", "client_store"):
            (run / folder).mkdir()
            (run / folder / "model.pt").write_text("mine\n")
        before.update(contents(run))

    out.append(probe(kind, "--overwrite, the user's checkpoints/model.pt and client_store/model.pt in a run folder "
                           "whose run made neither", root, [*B, "--rounds", "1", "--out", str(run), "--overwrite"],
                     Expect(words=(f"--out {run} holds checkpoints, client_store, which fedjax-sparse has no record "
                                   f"of writing",), summary=("completed",),
                            check=lambda done: "" if contents(run) == before else "the user's files changed"),
                     run=run, prepare=users_folders))

    for case, folder, files, expect in (
            ("a refused run into a folder with the user's .lock and config.json", "lock_refused",
             {".lock": "mine\n", "config.json": '{"app": 1}\n'},
             Expect(words=("holds config.json, which fedjax-sparse has no record of writing",), summary=(None,))),
            ("a run into a folder with the user's .lock", "lock_completed", {".lock": "mine\n"},
             Expect(exit=0, lines=0, summary=("completed",)))):
        run, before_lock = base / folder, {}

        def users_lock(run=run, files=files, before_lock=before_lock):
            run.mkdir(parents=True)
            for name, text in files.items():
                (run / name).write_text(text)
            before_lock.update(contents(run))

        def lock_kept(done, run=run, before_lock=before_lock, refused=expect.exit != 0):
            if (run / ".lock").read_text() != "mine\n":
                return "the user's .lock changed"
            if (run / LOCK_FILE).exists():
                return f"{LOCK_FILE} was left behind"
            return "" if not refused or contents(run) == before_lock else "the refused run changed the folder"

        out.append(probe(kind, case, root, [*B, "--rounds", "1", "--no-tensorboard", "--out", str(run)],
                         dataclasses.replace(expect, check=lock_kept), run=run, prepare=users_lock))

    target, before_target = base / "convert_target", {}

    def users_arrays():
        target.mkdir(parents=True)
        (target / "train_x.npy").write_bytes(b"mine")
        (target / "test_y.npy").write_bytes(b"mine too")
        before_target.update(contents(target))

    out.append(probe(kind, "convert digits into a folder with the user's train_x.npy and test_y.npy", root,
                     ["digits", str(target)],
                     Expect(words=(f"{target} is not empty (test_y.npy, train_x.npy) and fedjax-sparse convert did "
                                   f"not write it",), summary=(),
                            check=lambda done: "" if contents(target) == before_target else "the user's files changed"),
                     prepare=users_arrays, sub="convert"))
    cut = base / "convert_cut_short"

    def cut_short():
        cut.mkdir(parents=True)
        (cut / WRITING).touch()
        (cut / "train_x.npy").write_bytes(b"half")

    out.append(probe(kind, "convert digits into what a conversion cut short left (its mark, half a file)", root,
                     ["digits", str(cut)], Expect(exit=0, lines=0, summary=(),
                                                  check=lambda done: "" if (cut / "manifest.json").is_file() else
                                                  "no manifest.json"), prepare=cut_short, sub="convert"))
    return out
