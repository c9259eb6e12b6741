"""The driver: clone the official repositories, run the parity checks and write the table, or compare
two runs' tables.

    python -m benchmarks.parity clone --official-root DIR
    python -m benchmarks.parity run --official-root DIR --torch-python PATH [--method M ...] [--out DIR]
    python -m benchmarks.parity same A.json B.json

`clone` fetches each method's repository at its pinned commit into DIR/<method> (needs git and a
network; the harness itself never downloads). `run` expects DIR/<method> (a checkout of REPOSITORY
at COMMIT; `--checkout METHOD=PATH` points one elsewhere), runs the PyTorch phases in `--torch-python`
(an interpreter whose environment has torch; README.md) and the JAX phases here, and writes
<out>/<name>.json and <name>.md, and exits 1 if a row of a method it ran is UNEXPLAINED or its inputs
stay near a tie (verdicts.py). Methods not run keep their section from an existing <name>.json, so a
method added later is run alone. `same` exits 1 unless two runs have the same rows and verdicts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.parity import arrays as A
from benchmarks.parity import verdicts as V
from benchmarks.parity.methods import METHODS, get

DRAWS = 4  # inputs redrawn at most this many times while a decision sits within its margin of a tie

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


def torch_phase(torch_python: str, phase: str, method: str, checkout: Path, workdir: Path, seed: int,
                case: str | None = None, floor: bool = False) -> None:
    command = [torch_python, "-m", "benchmarks.parity.worker", phase, method, "--checkout", str(checkout),
               "--workdir", str(workdir), "--seed", str(seed)] + (["--case", case] if case else []) + \
        (["--floor"] if floor else [])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{method} {phase} {case or ''} failed in {torch_python}:\n{done.stderr[-6000:]}")


def run_draw(method, name: str, checkout: Path, torch_python: str, work: Path, seed: int,
             chosen: list[str]) -> tuple[dict, dict]:
    """The `chosen` cases of a method from the inputs drawn with `seed`: ({case: {description, aligns, rows}},
    seconds)."""
    seconds = {}
    start = time.perf_counter()
    torch_phase(torch_python, "setup", name, checkout, work, seed)
    seconds["torch setup"] = time.perf_counter() - start
    setup = A.load(work / "setup.npz")
    start = time.perf_counter()
    library = method.library(setup, [method.CASES[c].official or c for c in chosen])
    seconds["library"] = time.perf_counter() - start
    A.save(work / "library.npz", library)
    specs = {case: method.CASES[case] for case in chosen}
    for case, spec in specs.items():
        if spec.official is None:
            start = time.perf_counter()
            torch_phase(torch_python, "official", name, checkout, work, seed, case)
            seconds[f"official {case}"] = time.perf_counter() - start
        elif spec.official not in specs:
            raise ValueError(f"{name}: case {case} reuses the official run of {spec.official}, which is not run")
    floors = {}
    for case in V.terminal(specs):  # the round-off floor (verdicts.py)
        run = specs[case].official or case
        start = time.perf_counter()
        torch_phase(torch_python, "official", name, checkout, work, seed, run, floor=True)
        seconds[f"floor {run}"] = time.perf_counter() - start
        floors[case] = A.Floor(A.load(work / f"official_{run}.npz"), A.load(work / f"official_{run}_floor.npz"))
    cases = {}
    for case, spec in specs.items():
        with floors[V.floor_case(specs, case)]:
            rows = method.compare(setup, library, A.load(work / f"official_{spec.official or case}.npz"), case)
        cases[case] = {"description": spec.description, "aligns": list(spec.aligns), "rows": rows}
    return cases, seconds


def near_ties(cases: dict) -> list[str]:
    return [f"{case}: {row['compared']} {V.figure(row)}" for case, body in cases.items() for row in body["rows"]
            if V.near_tie(row)]


def run_method(name: str, folder: Path, torch_python: str, workdir: Path, cases: list[str] | None = None) -> dict:
    """A method's cases (all, or those named), judged (verdicts.py). Inputs whose decisions sit within a
    margin of a tie (`margin` rows) are redrawn, seed after seed, up to DRAWS times; the table names the
    draws."""
    method = get(name)
    chosen = list(method.CASES) if cases is None else [c for c in method.CASES if c in cases]
    checkout = folder / method.CHECKOUT if method.CHECKOUT else folder
    if not checkout.is_dir():
        raise SystemExit(f"{name}: no checkout at {checkout}; run `python -m benchmarks.parity clone "
                         f"--official-root DIR` or pass --checkout {name}=PATH")
    work = workdir / name
    work.mkdir(parents=True, exist_ok=True)
    redrawn = []
    for draw in range(DRAWS):
        seed = method.SEED + draw
        cases, seconds = run_draw(method, name, checkout, torch_python, work, seed, chosen)
        near = near_ties(cases)
        if not near:
            break
        redrawn.append({"seed": seed, "near_ties": near})
        print(f"  seed {seed}: near a tie ({'; '.join(near)}); redrawing", flush=True)
    failing = V.judge(cases, method.CAUSES)
    return {"repository": method.REPOSITORY, "pinned_commit": method.COMMIT, "checkout_commit": checkout_commit(folder),
            "model": method.MODEL, "setup": method.SETUP, "library_options": method.LIBRARY_OPTIONS,
            "causes": method.CAUSES, "seed": seed, "redrawn": redrawn, "cases": cases, "failing": failing,
            "torch": json.loads((work / "torch.json").read_text()),
            "seconds": {k: round(v, 1) for k, v in seconds.items()}}


def fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def verdict_text(row: dict) -> str:
    verdict = row["verdict"]
    if verdict == V.EXPLAINED:
        return (f"explained: {', '.join(row['explained_by'])} (aligned in `{row['removed_in']}`: "
                f"{row['removed_at']})")
    if verdict == V.ROUND:
        return {"exact": "the same", "margin": "clear of a tie", "aligned": "none beyond the margin"}.get(
            row.get("kind"), "round-off")
    return f"**{verdict}**"


def figures(row: dict) -> str:
    kind = row.get("kind", "numeric")
    if kind == "numeric":
        beyond = f"{row['beyond']:,} of {row['entries']:,}" if "beyond" in row else ""
        return (f"{row['tensors']} | {fmt(row['max_abs'])} | {fmt(row['max_rel'])} | "
                f"{fmt(row.get('tolerance', V.ROUND_OFF))} | {beyond} | `{row['worst']}`")
    return f"{row['tensors'] or ''} | {V.figure(row)} | | | |"


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = ["# Parity with the authors' code", "",
             "Each method's rounds run in the official PyTorch code (unchanged, fed by `benchmarks/parity`) and in "
             "this library from the same initial weights, data and random draws, and every updated tensor is "
             "compared: max rel = max |library - official| / max |official| of a tensor (the worst of a row's "
             f"tensors). A row is at float32 round-off when no entry is beyond its tolerance: {V.FLOOR_FACTOR:g} "
             "times its measured round-off floor (how far the official run moves under one ulp of random noise in "
             "every parameter after every optimizer step: the larger of the entry's and its tensor's typical, the "
             f"0.999 quantile), at least {V.ROUND_OFF:g} of its tensor's largest magnitude; the tolerance column "
             "gives the worst tensor's typical one. A method's first case is its code as published; each other case aligns named "
             "causes (the causes list says how). A row above round-off is **explained** only where a case aligning "
             "more causes brings the same row to round-off (the verdict names the causes and that case), else it "
             "is **UNEXPLAINED**, which fails the run (`python -m benchmarks.parity run` exits non-zero); so the "
             "case aligning every cause must be at round-off throughout. Margin rows check the inputs: no top-k or "
             "threshold decision within its margin of a tie (else redrawn), and no row whose official run moves by "
             f"more than {V.CHAOTIC_FLOOR:g} of its scale under the floor's noise (such a row is NEAR A TIE, and "
             "the inputs are redrawn); ReLU and max-pool decisions within "
             "1e-4 of a tie (too many to redraw away) are taken the library's way in the official run "
             "(`decisions.py`), counted per case.", "",
             f"Host: {env['host']}. Versions: jax {env['jax']}, flax {env['flax']}, optax {env['optax']}; torch "
             f"{env['torch']}; Python {env['python']}. "
             + ("Each method's section names the command and host that made it; the last: "
                if len({m.get("command") for m in results["methods"].values()}) > 1 else "Command: ")
             + f"`{env['command']}` ({env['date']}).", "",
             "| method | case | aligns | rows | round-off | explained | UNEXPLAINED |", "|---|---|---|---|---|---|---|"]
    for name, method in results["methods"].items():
        for case, body in method["cases"].items():
            counts = V.summary(body)
            by = sorted({c for r in body["rows"] if r["verdict"] == V.EXPLAINED for c in r["explained_by"]},
                        key=list(method["causes"]).index)
            failing = counts[V.UNEXPLAINED] + counts[V.NEAR_TIE]
            lines.append(f"| [{name}](#{name}) | {case} | {', '.join(body['aligns']) or '-'} | {len(body['rows'])} | "
                         f"{counts[V.ROUND]} | {counts[V.EXPLAINED]}" + (f" ({', '.join(by)})" if by else "")
                         + f" | {'**' + str(failing) + '**' if failing else 0} |")
    for name, method in results["methods"].items():
        commit, pinned = method["checkout_commit"], method["pinned_commit"]
        redrawn = "".join(f" Seed {r['seed']} was redrawn: {'; '.join(r['near_ties'])}." for r in method["redrawn"])
        lines += ["", f"## {name}", "",
                  f"Official code: {method['repository']} at {pinned}"
                  + ("" if commit == pinned else f" (checkout reports {commit})") + f". Model: {method['model']}.",
                  "", f"Setup: {method['setup']} Inputs drawn with seed {method['seed']}.{redrawn}", "",
                  *([f"Run: `{method['command']}` on {method['host']} ({method['date']}).", ""]
                    if "command" in method else []),
                  "Library options: " + ", ".join(f"`{k}={v}`" for k, v in method["library_options"].items()) + ".",
                  "", "Causes (what differs, and how a case aligns it):", ""]
        lines += [f"- `{cause}`: {text}" for cause, text in method["causes"].items()]
        lines.append("")
        for case, body in method["cases"].items():
            aligns = ", ".join(f"`{c}`" for c in body["aligns"]) or "nothing"
            lines += [f"<a id=\"{name}-{case}\"></a>**{case}** (aligns {aligns}): {body['description']}.", "",
                      "| compared | tensors | max abs | max rel | tolerance | entries beyond | worst tensor | verdict "
                      "| note |", "|---|---|---|---|---|---|---|---|---|"]
            for row in body["rows"]:
                lines.append(f"| {row['compared']} | {figures(row)} | {verdict_text(row)} | {row.get('note', '')} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def same(first: Path, second: Path) -> int:
    """Whether two runs' tables agree: the same methods, cases, rows and verdicts (the figures may differ
    by round-off); prints the largest change of a numeric row's max rel."""
    a, b = (json.loads(p.read_text())["methods"] for p in (first, second))
    differences, largest = [], (0.0, "")
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            differences.append(f"{name}: in one run only")
            continue
        for case in sorted(set(a[name]["cases"]) | set(b[name]["cases"])):
            rows_a = {r["compared"]: r for r in a[name]["cases"].get(case, {}).get("rows", [])}
            rows_b = {r["compared"]: r for r in b[name]["cases"].get(case, {}).get("rows", [])}
            for key in sorted(set(rows_a) | set(rows_b)):
                ra, rb = rows_a.get(key), rows_b.get(key)
                if ra is None or rb is None:
                    differences.append(f"{name} {case}: {key}: in one run only")
                elif (ra["verdict"], ra.get("explained_by"), ra.get("removed_in")) != \
                        (rb["verdict"], rb.get("explained_by"), rb.get("removed_in")):
                    differences.append(f"{name} {case}: {key}: {verdict_text(ra)} vs {verdict_text(rb)}")
                elif ra.get("kind", "numeric") == "numeric":
                    change = abs(ra["max_rel"] - rb["max_rel"])
                    if change > largest[0]:
                        largest = (change, f"{name} {case}: {key}: {fmt(ra['max_rel'])} vs {fmt(rb['max_rel'])}")
    print("\n".join(differences) if differences else "the same methods, cases, rows and verdicts")
    print(f"largest change of a row's max rel: {fmt(largest[0])}" + (f" ({largest[1]})" if largest[1] else ""))
    return 1 if differences else 0


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def host() -> str:
    """The processor and system the run was made on (the table is kept per host kind)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {platform.machine()}, {platform.system()}, {os.cpu_count()} logical CPUs"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parity")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("clone", help="clone each method's official repository at its pinned commit")
    c.add_argument("--official-root", type=Path, required=True)
    c.add_argument("--method", nargs="+", default=list(METHODS), choices=METHODS)
    r = sub.add_parser("run", help="run the parity checks and write the table; exits 1 on an UNEXPLAINED row")
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
    r.add_argument("--case", nargs="+", default=None, help="run these cases only (of every method run; the "
                                                           "planted-bug check runs the published and terminal ones)")
    s = sub.add_parser("same", help="whether two runs (their .json) have the same rows and verdicts")
    s.add_argument("first", type=Path)
    s.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    if args.command == "clone":
        clone(args.official_root, args.method)
        return 0
    if args.command == "same":
        return same(args.first, args.second)
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

    import fedjax_sparse

    from benchmarks.parity import jax_side
    jax_side.self_check()
    out_json = args.out / f"{args.name}.json"
    results = json.loads(out_json.read_text()) if out_json.exists() else {"methods": {}}
    command = " ".join(["python -m benchmarks.parity", *(argv if argv is not None else sys.argv[1:])])
    with tempfile.TemporaryDirectory(prefix="parity_") as scratch:  # SPATL's arrays alone take ~0.7 GB
        workdir = args.workdir or Path(scratch)
        for name in args.method:
            print(f"{name} ...", flush=True)
            # a method run alone keeps its own command and host: the others' sections may come from other runs
            results["methods"][name] = {**run_method(name, folders[name], args.torch_python, workdir, args.case),
                                        "command": command, "host": host(), "date": now()}
    results["methods"] = {m: results["methods"][m] for m in METHODS if m in results["methods"]}
    torch_versions = sorted({m["torch"]["torch"] for m in results["methods"].values()})
    results["environment"] = {
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
        "torch": ", ".join(torch_versions), "host": host(), "library": str(Path(fedjax_sparse.__file__).parent),
        "python": sys.version.split()[0], "layout_self_check": "passed", "command": command, "date": now()}
    args.out.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(results))
    failing = [f"{name} {line}" for name in args.method for line in results["methods"][name]["failing"]]
    print(markdown(results))
    if failing:
        print(f"{len(failing)} failing rows:\n" + "\n".join(failing), file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    raise SystemExit(main())
