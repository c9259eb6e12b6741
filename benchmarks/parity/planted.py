"""The harness checked against planted bugs: each patch in `plants/` plants one departure in a copy of
the library (a scaling constant, an aggregation weight, a mask rule, a learning rate); the method's
parity run against that copy must report it UNEXPLAINED, in a row the table without the plant does not
fail (`--table`), and exit non-zero.

    python -m benchmarks.parity.planted --official-root DIR --torch-python PY [--plant NAME ...]

A plant `<method>-<what>.patch` (a unified diff against the repository, its first line a comment saying
what it plants) is applied to a copy of `fedjax_sparse` in a temporary folder, which the run imports
first (it checks that it did: the run records the library's path). The run takes the method's
terminal cases (those aligning the most causes): there nothing known is left to differ, so a row above
round-off is UNEXPLAINED whatever the other cases show, and the full run, which includes them, fails
too; the other cases would only say how the plant reads against the code as published. Writes
<out>/parity_plants.{json,md}; exits 1 if a plant was not caught.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.parity import verdicts as V
from benchmarks.parity.methods import METHODS, get

REPO_ROOT = Path(__file__).resolve().parents[2]
PLANTS = Path(__file__).resolve().parent / "plants"


def plants() -> dict[str, Path]:
    out = {p.stem: p for p in sorted(PLANTS.glob("*.patch"))}
    for name in out:
        if name.split("-")[0] not in METHODS:
            raise ValueError(f"plant {name}: its name must start with a method ({', '.join(METHODS)})")
    return out


def unplanted_failing(table: Path, method: str, cases: list[str]) -> set[str]:
    """The failing rows of the terminal cases in the table without a plant (`table`, a parity.json): a
    plant is caught only by a row failing beyond those, or a row failing already would catch every plant."""
    if not table.exists():
        return set()
    body = json.loads(table.read_text())["methods"].get(method)
    if body is None:
        return set()
    return {line for line in body["failing"] if line.split(":", 1)[0] in cases}


def run_plant(name: str, patch: Path, official_root: Path, torch_python: str, table: Path) -> dict:
    method = name.split("-")[0]
    cases = V.terminal(get(method).CASES)
    with tempfile.TemporaryDirectory(prefix=f"plant_{name}_") as scratch:
        root = Path(scratch)
        shutil.copytree(REPO_ROOT / "fedjax_sparse", root / "fedjax_sparse",
                        ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)
        command = [sys.executable, "-m", "benchmarks.parity", "run", "--official-root", str(official_root),
                   "--torch-python", torch_python, "--method", method, "--case", *cases, "--out", str(root / "out"),
                   "--name", "plant"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO_ROOT)])}
        start = time.perf_counter()
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        result = root / "out" / "plant.json"
        if not result.exists():
            raise RuntimeError(f"plant {name}: the run wrote nothing (exit {done.returncode}):\n{done.stderr[-4000:]}")
        run = json.loads(result.read_text())
        library = run["environment"]["library"]
        if Path(library) != root / "fedjax_sparse":
            raise RuntimeError(f"plant {name}: the run imported the library from {library}, not the planted copy")
    body = run["methods"][method]
    failing = body["failing"]
    already = unplanted_failing(table, method, cases)
    new = [line for line in failing if line not in already]
    numeric = [r for c in body["cases"].values() for r in c["rows"] if r.get("kind", "numeric") == "numeric"]
    shown = {line.rsplit(" (", 1)[0] for line in new}
    # the row that shows the plant: the largest difference over its tolerance among the new UNEXPLAINED ones
    worst = max([r for c, b in body["cases"].items() for r in b["rows"]
                 if r in numeric and r["verdict"] == V.UNEXPLAINED and f"{c}: {r['compared']}" in shown] or numeric,
                key=lambda r: r["max_rel"] / r.get("tolerance", V.ROUND_OFF))
    return {"plant": name, "method": method, "what": patch.read_text().splitlines()[0].lstrip("# "),
            "cases": cases, "exit_code": done.returncode, "failing_rows": failing,
            "failing_without_the_plant": sorted(already),
            # caught: an UNEXPLAINED row (not merely inputs near a tie) the table without the plant does not
            # have, and the run's non-zero exit
            "caught": done.returncode == 1 and any(line.endswith(f"({V.UNEXPLAINED})") for line in new),
            "worst": {"case": next(c for c, b in body["cases"].items() if worst in b["rows"]),
                      "compared": worst["compared"], "max_rel": worst["max_rel"], "verdict": worst["verdict"],
                      "tolerance": worst.get("tolerance", V.ROUND_OFF), "beyond": worst.get("beyond"),
                      "entries": worst["entries"]},
            "seconds": round(seconds, 1)}


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = ["# Planted bugs against the parity harness", "",
             "Each plant (`benchmarks/parity/plants/<plant>.patch`) plants one departure in a copy of the library; "
             "the method's parity run against that copy (its terminal cases: those aligning every known cause) must report "
             "it UNEXPLAINED and exit non-zero, in a row that does not fail without the plant. The same runs "
             "without a plant are the table in `benchmarks/results/parity.md`.", "",
             f"Host: {env['host']}. Run with "
             + "; ".join(f"`{c}`" for c in dict.fromkeys(r.get("command", env["command"]) for r in results["plants"]))
             + f" (the last on {env['date']}; each plant's date and host are in parity_plants.json).", "",
             "| plant | what it plants | exit code | UNEXPLAINED rows the table without it lacks | failing rows | the row that shows it most "
             "(case: row) | max rel (tolerance) | entries beyond | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["plants"]:
        w = r["worst"]
        already = set(r.get("failing_without_the_plant", []))
        unexplained = sum(line.endswith(f"({V.UNEXPLAINED})") and line not in already for line in r["failing_rows"])
        beyond = f"{w['beyond']:,} of {w['entries']:,}" if w.get("beyond") is not None else ""
        lines.append(f"| `{r['plant']}` | {r['what']} | {r['exit_code']} | {unexplained} | {len(r['failing_rows'])} | "
                     f"{w['case']}: {w['compared']} ({w['verdict']}) | {w['max_rel']:.2e} ({w['tolerance']:.1e}) | "
                     f"{beyond} | {'caught' if r['caught'] else '**MISSED**'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parity.planted")
    parser.add_argument("--official-root", type=Path, required=True)
    parser.add_argument("--torch-python", default=os.environ.get("PARITY_TORCH_PYTHON", "python"))
    parser.add_argument("--plant", nargs="+", default=None, help="these plants only (default: every one)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--table", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "parity.json",
                        help="the table without a plant: rows failing there catch no plant")
    args = parser.parse_args(argv)
    available = plants()
    chosen = args.plant or list(available)
    unknown = [p for p in chosen if p not in available]
    if unknown:
        parser.error(f"unknown plant {', '.join(unknown)}; valid: {', '.join(available)}")
    from benchmarks.parity.__main__ import host, now
    command = " ".join(["python -m benchmarks.parity.planted", *(argv if argv is not None else sys.argv[1:])])
    out_json = args.out / "parity_plants.json"
    results = json.loads(out_json.read_text()) if out_json.exists() else {"plants": []}
    kept = [r for r in results["plants"] if r["plant"] not in chosen and r["plant"] in available]
    done = []
    for name in chosen:
        print(f"{name} ...", flush=True)
        # plants run alone keep their own command and host: the others' rows may come from other runs
        done.append({**run_plant(name, available[name], args.official_root.resolve(), args.torch_python,
                                 args.table),
                     "command": command, "host": host(), "date": now()})
        print(f"  {'caught' if done[-1]['caught'] else 'MISSED'}: exit {done[-1]['exit_code']}, "
              f"{len(done[-1]['failing_rows'])} failing rows", flush=True)
    order = list(available)
    results["plants"] = sorted(kept + done, key=lambda r: order.index(r["plant"]))
    results["environment"] = {"host": host(), "python": sys.version.split()[0], "command": command, "date": now()}
    args.out.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "parity_plants.md").write_text(markdown(results))
    print(markdown(results))
    return 0 if all(r["caught"] for r in done) else 1


if __name__ == "__main__":
    raise SystemExit(main())
