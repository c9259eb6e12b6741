"""The driver: clone the official repositories, or run the parity checks and write the table.

    python -m benchmarks.parity clone --official-root DIR
    python -m benchmarks.parity run --official-root DIR --torch-python PATH [--method M ...] [--out DIR]

`clone` fetches each method's repository at its pinned commit into DIR/<method> (needs git and a
network; the harness itself never downloads). `run` expects DIR/<method> (a checkout of REPOSITORY
at COMMIT; `--checkout METHOD=PATH` points one elsewhere), runs the PyTorch phases in `--torch-python`
(an interpreter whose environment has torch; README.md) and the JAX phases here, and writes
<out>/<name>.json and <name>.md. Methods not run keep their section from an existing <name>.json, so
a method added later is run alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.parity import arrays as A
from benchmarks.parity.methods import METHODS, get

REPO_ROOT = Path(__file__).resolve().parents[2]


def checkout_commit(folder: Path) -> str | None:
    """The commit a checkout is at: git's HEAD, or the `.parity-commit` file an export from a mirror
    leaves (`git archive` keeps no history)."""
    try:
        return subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        marker = folder / ".parity-commit"
        return marker.read_text().strip() if marker.exists() else None


def clone(root: Path, methods) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name in methods:
        method = get(name)
        target = root / name
        if not target.exists():
            subprocess.run(["git", "clone", f"https://github.com/{method.REPOSITORY}.git", str(target)], check=True)
        subprocess.run(["git", "-C", str(target), "checkout", "--quiet", method.COMMIT], check=True)
        print(f"{name}: {target} at {method.COMMIT}")


def torch_phase(torch_python: str, phase: str, method: str, checkout: Path, workdir: Path,
                case: str | None = None) -> None:
    command = [torch_python, "-m", "benchmarks.parity.worker", phase, method, "--checkout", str(checkout),
               "--workdir", str(workdir)] + (["--case", case] if case else [])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{method} {phase} {case or ''} failed in {torch_python}:\n{done.stderr[-6000:]}")


def run_method(name: str, folder: Path, torch_python: str, workdir: Path) -> dict:
    method = get(name)
    checkout = folder / method.CHECKOUT if method.CHECKOUT else folder
    if not checkout.is_dir():
        raise SystemExit(f"{name}: no checkout at {checkout}; run `python -m benchmarks.parity clone "
                         f"--official-root DIR` or pass --checkout {name}=PATH")
    commit = checkout_commit(folder)
    work = workdir / name
    work.mkdir(parents=True, exist_ok=True)
    seconds = {}
    start = time.perf_counter()
    torch_phase(torch_python, "setup", name, checkout, work)
    seconds["torch setup"] = time.perf_counter() - start
    setup = A.load(work / "setup.npz")
    start = time.perf_counter()
    library = method.library(setup)
    seconds["library"] = time.perf_counter() - start
    A.save(work / "library.npz", library)
    cases = {}
    for case, description in method.CASES.items():
        start = time.perf_counter()
        torch_phase(torch_python, "official", name, checkout, work, case)
        seconds[f"official {case}"] = time.perf_counter() - start
        rows = method.compare(setup, library, A.load(work / f"official_{case}.npz"), case)
        cases[case] = {"description": description, "rows": rows}
    return {"repository": method.REPOSITORY, "pinned_commit": method.COMMIT, "checkout_commit": commit,
            "model": method.MODEL, "library_options": method.LIBRARY_OPTIONS, "cases": cases,
            "torch": json.loads((work / "torch.json").read_text()),
            "seconds": {k: round(v, 1) for k, v in seconds.items()}}


def fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = ["# Parity with the authors' code", "",
             "One client update per client and one server aggregation, run in the official PyTorch code "
             "(unchanged, fed by `benchmarks/parity`) and in this library from the same initial weights and "
             "batches; every updated tensor compared. max rel = max |library - official| / max |official| of "
             f"a tensor; a row within {A.ROUND_OFF:g} is float32 round-off. The first case of each method is "
             "the code as published; the others are diagnostics that remove one known difference each, but SpaFL's "
             "second, which shows one (the code's evaluation on two batches).", "",
             f"Versions: jax {env['jax']}, flax {env['flax']}, optax {env['optax']}; torch {env['torch']}. "
             f"Command: `{env['command']}` ({env['date']}).", "",
             "| method | case | tensors | max abs | max rel | verdict |", "|---|---|---|---|---|---|"]
    for name, method in results["methods"].items():
        for case, body in method["cases"].items():
            numeric = [r for r in body["rows"] if "mismatched_entries" not in r]
            worst = max(numeric, key=lambda r: r["max_rel"])
            notes = list(dict.fromkeys(r["note"].split(";")[0] for r in numeric
                                       if not r["note"].startswith("float32 round-off")))
            within = sum(r["note"].startswith("float32 round-off") for r in numeric)
            verdict = "float32 round-off" if not notes else \
                f"{within} of {len(numeric)} rows float32 round-off; the others: " + "; ".join(notes)
            lines.append(f"| {name} | {case} | {sum(r['tensors'] for r in numeric)} | "
                         f"{fmt(max(r['max_abs'] for r in numeric))} | {fmt(worst['max_rel'])} | {verdict} |")
    for name, method in results["methods"].items():
        commit = method["checkout_commit"]
        pinned = method["pinned_commit"]
        lines += ["", f"## {name}", "",
                  f"Official code: {method['repository']} at {pinned}"
                  + ("" if commit == pinned else f" (checkout reports {commit})") + f". Model: {method['model']}.",
                  "", "Library options: " + ", ".join(f"`{k}={v}`" for k, v in method["library_options"].items())
                  + ".", ""]
        for case, body in method["cases"].items():
            lines += [f"**{case}**: {body['description']}.", "",
                      "| compared | tensors | max abs | max rel | worst tensor | note |", "|---|---|---|---|---|---|"]
            for row in body["rows"]:
                if "mismatched_entries" in row:
                    lines.append(f"| {row['compared']} | {row['tensors']} | {row['mismatched_entries']} entries "
                                 f"differ | | | {row['note']} |")
                else:
                    lines.append(f"| {row['compared']} | {row['tensors']} | {fmt(row['max_abs'])} | "
                                 f"{fmt(row['max_rel'])} | `{row['worst']}` | {row['note']} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parity")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("clone", help="clone each method's official repository at its pinned commit")
    c.add_argument("--official-root", type=Path, required=True)
    c.add_argument("--method", nargs="+", default=list(METHODS), choices=METHODS)
    r = sub.add_parser("run", help="run the parity checks and write the table")
    r.add_argument("--official-root", type=Path, help="folder holding one checkout per method, named by method")
    r.add_argument("--checkout", action="append", default=[], metavar="METHOD=PATH",
                   help="a method's checkout elsewhere than OFFICIAL_ROOT/METHOD")
    r.add_argument("--method", nargs="+", default=list(METHODS), choices=METHODS)
    r.add_argument("--torch-python", default=os.environ.get("PARITY_TORCH_PYTHON", "python"),
                   help="an interpreter whose environment has torch (default: $PARITY_TORCH_PYTHON or python)")
    r.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    r.add_argument("--name", default="parity", help="output files <out>/<name>.{json,md}")
    r.add_argument("--workdir", type=Path, default=None, help="keep the phases' .npz files there (default: a "
                                                              "temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    if args.command == "clone":
        clone(args.official_root, args.method)
        return 0
    folders = {m: args.official_root / m for m in METHODS} if args.official_root else {}
    for item in args.checkout:
        method, _, path = item.partition("=")
        if method not in METHODS or not path:
            parser.error(f"--checkout takes METHOD=PATH with METHOD one of {', '.join(METHODS)}, got {item!r}")
        folders[method] = Path(path)
    missing = [m for m in args.method if m not in folders]
    if missing:
        parser.error(f"no checkout for {', '.join(missing)}: give --official-root or --checkout METHOD=PATH")

    import flax
    import jax
    import optax

    from benchmarks.parity import jax_side
    jax_side.self_check()
    out_json = args.out / f"{args.name}.json"
    results = json.loads(out_json.read_text()) if out_json.exists() else {"methods": {}}
    with tempfile.TemporaryDirectory(prefix="parity_") as scratch:  # SPATL's arrays alone take ~0.7 GB
        workdir = args.workdir or Path(scratch)
        for name in args.method:
            print(f"{name} ...", flush=True)
            results["methods"][name] = run_method(name, folders[name], args.torch_python, workdir)
    results["methods"] = {m: results["methods"][m] for m in METHODS if m in results["methods"]}
    torch_versions = sorted({m["torch"]["torch"] for m in results["methods"].values()})
    results["environment"] = {
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
        "torch": ", ".join(torch_versions),
        "python": sys.version.split()[0], "layout_self_check": "passed",
        "command": " ".join(["python -m benchmarks.parity", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    args.out.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
