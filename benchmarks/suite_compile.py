"""Where the test suite's time goes: XLA compilation, tracing and lowering per test and per module.

    python -m benchmarks.suite_compile [--quick] [--workers 2] [--target-minutes 6] [--out DIR] [-- PYTEST ARGS]

Runs the clone's tests (`python -m pytest -n WORKERS`, or the pytest arguments given after `--`) with this
module as a pytest plugin: every test process records, per test, its wall time (setup, call and teardown) and
JAX's own compile events (`jax.monitoring`): XLA backend compilation, tracing, lowering to MLIR, and the
persistent cache's hits. Writes `suite_compile_<device>_<date>.{md,json}` in --out.

The figure it exists for is the compilation floor: the seconds XLA spent compiling programs that no cache
held, divided by the workers. No restructuring of the suite that keeps every program it compiles can run in
less wall time than that, whatever else it saves. Processes that tests start themselves (multi-device and
multi-process checks) are not profiled: their time is in their test's wall time only, so the floor is a
lower bound. `--quick` profiles one small module, as the suite's own test does.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

EVENTS = {  # jax.monitoring duration events -> the record's field
    "/jax/core/compile/backend_compile_duration": "compile",  # a persistent cache hit's read included
    "/jax/core/compile/jaxpr_trace_duration": "tracing",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_reads",
}
FIELDS = ("wall", "compile", "compiles", "tracing", "lowering", "cache_reads", "cache_hits")
PARTS_OPTION = "--suite-compile-parts"
QUICK_TESTS = ["tests/test_fedldf.py"]


# The pytest plugin (`-p benchmarks.suite_compile`): jax is imported only once the session starts, after
# tests/conftest.py has set XLA's flags and the compilation cache.

def pytest_addoption(parser):
    parser.addoption(PARTS_OPTION, default=None, help="folder for each test process's per-test compile records")


class _Recorder:
    def __init__(self):
        self.test, self.start = None, 0.0
        self.records = collections.defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))

    def on_duration(self, event: str, seconds: float, **_) -> None:
        field = EVENTS.get(event)
        if self.test is None or field is None:
            return
        record = self.records[self.test]
        record[field] += seconds
        if field == "compile":
            record["compiles"] += 1
        elif field == "cache_reads":
            record["cache_hits"] += 1


_RECORDER = _Recorder()


def pytest_sessionstart(session):
    if session.config.getoption(PARTS_OPTION):
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_RECORDER.on_duration)


def pytest_runtest_setup(item):
    """Called where the test runs: in a worker, not in pytest-xdist's controller, which hears of its end only."""
    _RECORDER.test, _RECORDER.start = item.nodeid, time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    if _RECORDER.test == nodeid:
        _RECORDER.records[nodeid]["wall"] += time.perf_counter() - _RECORDER.start
        _RECORDER.test = None


def pytest_sessionfinish(session):
    folder = session.config.getoption(PARTS_OPTION)
    if folder and _RECORDER.records:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder).mkdir(parents=True, exist_ok=True)
        # the test processes' own XLA flags: tests/conftest.py sets them, not the command's environment
        part = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "records": dict(_RECORDER.records)}
        (Path(folder) / f"{worker}.json").write_text(json.dumps(part))


# The command: runs pytest with the plugin, then sums what its processes recorded.

def module_of(test: str) -> str:
    return test.split("::")[0]


def summarize(records: dict[str, dict], workers: int, pytest_wall: float, target_minutes: float,
              xla_flags: str = "") -> dict:
    """Totals over the tests, per module, and the compilation floor: the compile seconds that no cache held
    (backend compilation less the persistent cache's reads) over `workers`, against the target."""
    total = {f: sum(r[f] for r in records.values()) for f in FIELDS}
    modules = collections.defaultdict(lambda: dict.fromkeys(("tests", *FIELDS), 0.0))
    for test, record in records.items():
        module = modules[module_of(test)]
        module["tests"] += 1
        for f in FIELDS:
            module[f] += record[f]
    uncached = total["compile"] - total["cache_reads"]
    return {
        "tests": len(records), "workers": workers, "pytest_wall_seconds": pytest_wall,
        "test_process_xla_flags": xla_flags, "totals": total,
        "uncached_compile_seconds": uncached,
        "compile_floor_seconds": uncached / workers,
        "target_seconds": 60 * target_minutes,
        "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1]["wall"])),
        "tests_by_wall": dict(sorted(records.items(), key=lambda kv: -kv[1]["wall"])),
    }


def report(summary: dict, env: dict, top: int = 30) -> str:
    from .common import environment_markdown, markdown_table

    fmt = lambda x, digits=0: f"{x:,.{digits}f}"  # noqa: E731
    t, w = summary["totals"], summary["workers"]
    share = lambda x: f"{100 * x / t['wall']:.0f} %" if t["wall"] else "-"  # noqa: E731
    row = lambda name, r: [name, int(r.get("tests", 1)), fmt(r["wall"], 1), fmt(r["compile"], 1),  # noqa: E731
                           fmt(r["tracing"] + r["lowering"], 1), int(r["compiles"]), int(r["cache_hits"])]
    header = ["", "tests", "wall s", "XLA compile s", "tracing + lowering s", "compiles", "cache hits"]
    floor, target = summary["compile_floor_seconds"], summary["target_seconds"]
    return "\n".join([
        "# Where the test suite's time goes", "",
        environment_markdown(env), "",
        f"{summary['tests']} tests on {w} workers; pytest took {fmt(summary['pytest_wall_seconds'], 0)} s of wall "
        f"time, the tests {fmt(t['wall'], 0)} worker-seconds (setup, call and teardown). The test processes' "
        f"XLA flags: `{summary['test_process_xla_flags'] or 'none'}`.", "",
        f"- XLA backend compilation: {fmt(t['compile'], 0)} s ({share(t['compile'])}) over {int(t['compiles'])} "
        f"compilations, of which {int(t['cache_hits'])} were persistent cache hits read in {fmt(t['cache_reads'], 1)} s",
        f"- tracing {fmt(t['tracing'], 0)} s, lowering to MLIR {fmt(t['lowering'], 0)} s "
        f"({share(t['tracing'] + t['lowering'])})",
        f"- **compilation floor**: {fmt(summary['uncached_compile_seconds'], 0)} s of compilation that no cache "
        f"held, over {w} workers: {fmt(floor, 0)} s of wall time at the least, against a target of "
        f"{fmt(target, 0)} s ({'within' if floor <= target else 'over'} it). Processes that tests start are not "
        "counted, so the real floor is higher.", "",
        "## By module", "",
        markdown_table(header, [row(m, r) for m, r in summary["modules"].items()]), "",
        f"## The {top} longest tests", "",
        markdown_table(header, [row(n, r) for n, r in list(summary["tests_by_wall"].items())[:top]]), "",
    ])


def main(argv=None) -> int:
    import tempfile

    from .common import command_line, environment, finish, parser

    argv = sys.argv[1:] if argv is None else argv
    own, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = parser("benchmarks.suite_compile", __doc__, f"profile {' '.join(QUICK_TESTS)} only")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (-n; default 2, as CI runs)")
    p.add_argument("--target-minutes", type=float, default=6.0, help="the suite's target wall time (default 6)")
    args = p.parse_args(own)
    if args.workers < 1:
        p.error(f"--workers must be 1 or more, got {args.workers}")
    root = Path(__file__).resolve().parents[1]
    if not (root / "tests" / "conftest.py").is_file():
        p.error(f"{root} holds no tests/: run this from a clone")
    env = environment(command_line("benchmarks.suite_compile", argv))
    with tempfile.TemporaryDirectory(prefix="suite_compile_") as parts:
        workers = ["-n", str(args.workers)] if args.workers > 1 else ["-p", "no:xdist"]
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers,
                   "-p", "benchmarks.suite_compile", f"{PARTS_OPTION}={parts}",
                   *(pytest_args or (QUICK_TESTS if args.quick else ["tests"]))]
        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        start = time.perf_counter()
        done = subprocess.run(command, cwd=root, env=child_env)
        wall = time.perf_counter() - start
        records, flags = {}, set()
        for part in sorted(Path(parts).glob("*.json")):
            written = json.loads(part.read_text())
            records.update(written["records"])
            flags.add(written["xla_flags"])
    if done.returncode != 0:
        print(f"benchmarks.suite_compile: pytest exited with {done.returncode}; nothing written", file=sys.stderr)
        return done.returncode
    summary = summarize(records, args.workers, wall, args.target_minutes, " | ".join(sorted(flags)))
    finish(args.out, "suite_compile", env, summary,
           lambda env: report(summary, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
