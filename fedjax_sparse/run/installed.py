"""`fedjax-sparse experiment ...` and `fedjax-sparse benchmark ...`: the repository's experiment and benchmark
modules, from any folder.

The repository's top-level `experiments/` and `benchmarks/` folders ship inside the package as
`fedjax_sparse.experiments` and `fedjax_sparse.benchmarks` (pyproject.toml's package-dir), so an installed
package, editable or not, runs them wherever it is called; a source checkout that is only on the path
(PYTHONPATH, not installed) has them as its top-level packages instead. They sit above the run layer (they run
experiments), so they are imported by name once the command names one, never at this module's import. What they
write goes where their `--out` says, by default a folder under the current one (runs/experiments,
benchmarks/results), never beside the installed package.

An experiment module runs as its own `python -m` would: its `run(argv)`, else `experiments.common.main` on its
`SETTINGS`, else (a check with flags of its own) its `main(argv)`; a benchmark module's `main(argv)`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

FOLDERS = {"experiment": "experiments", "benchmark": "benchmarks"}
USAGE = {
    "experiment": "fedjax-sparse experiment NAME [--setting S] [--arms A,B,...] [--seeds 0,1,2] [--quick] "
                  "[--rounds N] [--out DIR]",
    "benchmark": "fedjax-sparse benchmark NAME [--quick] [--out DIR] [its own flags: NAME --help]",
}


def package(kind: str) -> ModuleType:
    """The experiments or benchmarks package: the installed package's, else a source checkout's top-level one."""
    folder = FOLDERS[kind]
    try:
        return importlib.import_module(f"fedjax_sparse.{folder}")
    except ModuleNotFoundError as e:
        if e.name != f"fedjax_sparse.{folder}":
            raise
    return importlib.import_module(folder)


def in_clone(pkg: ModuleType) -> bool:
    """Whether `pkg`'s folder is a clone's top-level folder (an editable install's too), beside pyproject.toml."""
    return (Path(pkg.__file__).resolve().parents[1] / "pyproject.toml").is_file()


def commands(pkg: ModuleType) -> list[str]:
    """The package's command modules, by name: its modules but its helpers."""
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in pkg.HELPERS and not m.ispkg)


def clone_only(pkg: ModuleType) -> dict[str, str]:
    """Commands this command does not run -> why: those that need a clone beside them, where the package is not
    a clone's own folder, and those that are no module (a package run as `python -m` from a clone)."""
    runnable = commands(pkg) if in_clone(pkg) else []
    return {name: why for name, why in getattr(pkg, "CLONE_ONLY", {}).items() if name not in runnable}


def _first_line(pkg: ModuleType, name: str) -> str:
    """The first line of a module's docstring, read without importing it (a benchmark sets JAX's devices as it
    is imported)."""
    spec = importlib.util.find_spec(f"{pkg.__name__}.{name}")
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def listing(kind: str) -> str:
    """What `fedjax-sparse KIND --list` prints: each command with its first docstring line; an experiment's
    settings with their arms, and the registered algorithms, each of which may be an arm too."""
    pkg = package(kind)
    lines = [f"usage: {USAGE[kind]}", ""]
    needs_clone = clone_only(pkg)
    for name in commands(pkg):
        if name in needs_clone:
            continue
        lines.append(f"{name}: {_first_line(pkg, name)}")
        module = importlib.import_module(f"{pkg.__name__}.{name}") if kind == "experiment" else None
        if module is not None and hasattr(module, "SETTINGS"):
            lines += [f"  --setting {s.name}: --arms {','.join(arm.label for arm in s.arms)}"
                      for s in module.SETTINGS.values()]
        elif kind == "experiment":
            lines.append(f"  (flags of its own: fedjax-sparse experiment {name} --help)")
    if needs_clone:
        lines += ["", f"From a clone only (python -m {FOLDERS[kind]}.NAME there):"]
        lines += [f"{name}: {why}" for name, why in needs_clone.items()]
    if kind == "experiment":
        from fedjax_sparse.algorithms import algorithm_names

        lines += ["", "Registered algorithms, each an arm of any setting too (--arms): it runs in the setting's "
                      "config, its own options at their defaults but those the setting sets",
                  "  " + ", ".join(algorithm_names())]
    return "\n".join(lines)


def command(kind: str, name: str) -> ModuleType:
    """The command module `name`; a name that is none, or one that needs a clone, is refused in one line."""
    pkg = package(kind)
    names = commands(pkg)
    needs_clone = clone_only(pkg)
    if name in needs_clone:
        raise ValueError(f"{kind} {name} is not run by this command: {needs_clone[name]}; run "
                         f"`python -m {FOLDERS[kind]}.{name}` from a clone")
    if name not in names:
        raise ValueError(f"no {kind} named {name!r}; valid: {', '.join(n for n in names if n not in needs_clone)} "
                         f"(`fedjax-sparse {kind} --list` describes them)")
    return importlib.import_module(f"{pkg.__name__}.{name}")


def run(kind: str, module: ModuleType, argv: list[str]) -> int:
    """Runs the command module with `argv`, as its own `python -m` would; its exit code."""
    if kind == "benchmark" or not hasattr(module, "SETTINGS"):
        code = module.main(argv)
    elif hasattr(module, "run"):
        code = module.run(argv)
    else:
        common = importlib.import_module(f"{module.__package__}.common")
        code = common.main(module.SETTINGS, f"experiments.{module.__name__.split('.')[-1]}", argv)
    return code if isinstance(code, int) else 0  # a benchmark's main returns its records


def main(kind: str, argv: list[str]) -> int:
    """`fedjax-sparse KIND --list`, `fedjax-sparse KIND NAME [ARGS...]` (KIND: experiment or benchmark)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE[kind]}\n       fedjax-sparse {kind} --list   (each {kind}, and what it takes)",
              file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--list":
        print(listing(kind))
        return 0
    if argv[0].startswith("-"):
        print(f"fedjax-sparse: error: {argv[0]}: name the {kind} first (`fedjax-sparse {kind} --list` lists them)",
              file=sys.stderr)
        return 2
    try:
        module = command(kind, argv[0])
    except ValueError as e:
        print(f"fedjax-sparse: error: {e}", file=sys.stderr)
        return 2
    return run(kind, module, argv[1:])
