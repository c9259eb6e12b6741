"""What every benchmark records beside its figures, and how it times them.

Figures on a shared machine are noisy, so benchmarks compare variants by
interleaving them (`interleaved`: A, B, A, B, ...) in one process and report
ratios taken in the same run, with the load averages before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import flax
import jax
import numpy as np
import optax

from fedjax_sparse.run.outputs import strict_json


def device_name() -> str:
    d = jax.devices()[0]
    return f"{jax.device_count()} x {getattr(d, 'device_kind', d.platform)} ({d.platform})"


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(command: str) -> dict:
    """Device, versions, command, date and the machine's load when the benchmark started."""
    try:
        import jaxlib
        jaxlib_version = jaxlib.__version__
    except Exception:  # noqa: BLE001
        jaxlib_version = None
    from fedjax_sparse.core.round.compilation import compiler_options
    return {
        "device": device_name(),
        "platform": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": _processor(),
        "jax": jax.__version__, "jaxlib": jaxlib_version, "flax": flax.__version__, "optax": optax.__version__,
        "numpy": np.__version__, "python": platform.python_version(),
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load_average(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "library_compiler_options": compiler_options(),
    }


def _proc_field(path: str, name: str) -> str | None:
    """The value of the first `name: value` line of a /proc file; None where there is none (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _processor() -> str:
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor()


def command_prefix(module: str) -> str:
    """How the benchmark module `module` ('benchmarks.suite') is run: `python -m` where it is the top-level
    package of a clone, else `fedjax-sparse benchmark suite` (the package's own copy, from any folder)."""
    if __package__ == "benchmarks":
        return f"python -m {module}"
    return f"fedjax-sparse benchmark {module.split('.')[-1]}"


def command_line(module: str, argv: Sequence[str]) -> str:
    return " ".join([command_prefix(module), *argv])


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far: Linux's VmHWM, the high-water mark of this
    program's own address space. Not `ru_maxrss`, which Linux carries over from the parent across
    fork and exec: a process started by a driver that had grown to 1.6 GB (writing a million
    clients' data) reported 1.6 GB whatever it used itself. Elsewhere `ru_maxrss` (macOS: bytes)."""
    high_water = _proc_field("/proc/self/status", "VmHWM:")
    if high_water is not None:
        return int(high_water.split()[0]) * 1024  # "123456 kB"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def interleaved(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict]:
    """Runs every variant once to warm up, then `repeats` rounds of A, B, ... in turn.

    Returns per variant {'wall': [seconds], 'cpu': [process CPU seconds]}: CPU
    time counts what the process itself used, which other processes' load
    disturbs less than wall time.
    """
    for run in runs.values():
        jax.block_until_ready(run())
    out = {name: {"wall": [], "cpu": []} for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(run())
            out[name]["wall"].append(time.perf_counter() - wall)
            out[name]["cpu"].append(time.process_time() - cpu)
    return out


def stepping(step: Callable, server_state: Any, client_states: Any) -> Callable[[], Any]:
    """A variant for `interleaved`: each call runs the next round of `step(server, clients, round)` (a round
    `core.round.driver.build_round` built) from the states the last call left, on its own copy of the
    clients' states, and returns the server state."""
    state = {"server": server_state, "clients": jax.tree_util.tree_map(lambda a: a.copy(), client_states), "round": 0}

    def one_round():
        state["server"], state["clients"], _ = step(state["server"], state["clients"], state["round"])
        state["round"] += 1
        return state["server"]

    return one_round


def best(times: dict) -> dict:
    """The fastest repeat (the one least disturbed by other work) of wall and CPU time."""
    return {"wall": min(times["wall"]), "cpu": min(times["cpu"])}


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def environment_markdown(env: dict) -> str:
    load = env.get("load_average_at_start")
    end = env.get("load_average_at_end")
    return "\n".join([
        f"- Command: `{env['command']}`",
        f"- Date: {env['date']}",
        f"- Device: `{env['device']}`, {env['cpu_count']} CPU cores ({env['processor']}, {env['machine']})",
        f"- Software: jax {env['jax']}, jaxlib {env['jaxlib']}, flax {env['flax']}, optax {env['optax']}, "
        f"numpy {env['numpy']}, Python {env['python']}; XLA_FLAGS `{env['xla_flags'] or 'unset'}`; "
        f"the library's compiler options {env['library_compiler_options']}",
        f"- Load averages (1, 5, 15 min) at start {load}, at end {end}: on {env['cpu_count']} cores, a 1-minute "
        "load above the core count means other processes shared the CPU and wall times are inflated; "
        "ratios within a row are taken in the same run",
    ])


def write(out: Path, stem: str, env: dict, records: Any, text: str) -> tuple[Path, Path]:
    """`<stem>_<device>_<date>.{md,json}` in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    device = env["device"].split(" (")[0].replace(" x ", "x").replace(" ", "-").lower()
    name = f"{stem}_{device}_{env['date'][:10]}"
    md, js = out / f"{name}.md", out / f"{name}.json"
    md.write_text(text)
    js.write_text(json.dumps(strict_json({"environment": env, "records": records}), indent=1, default=str))
    return md, js


def parser(module: str, doc: str, quick_help: str) -> argparse.ArgumentParser:
    """The options every benchmark command takes: --quick and --out."""
    p = argparse.ArgumentParser(prog=command_prefix(module), description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", default="benchmarks/results",
                   help="folder for the .md and .json results (default: benchmarks/results under the current folder)")
    return p


def finish(out: str, stem: str, env: dict, records: Any, text: Callable[[dict], str]) -> None:
    """Records the load at the end, writes `<stem>_<device>_<date>.{md,json}` and prints the markdown."""
    env["load_average_at_end"] = load_average()
    md, js = write(Path(out), stem, env, records, text(env))
    print(md.read_text())
    print(f"wrote {md} and {js}", file=sys.stderr)
