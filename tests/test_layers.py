"""The package's layers, top to bottom (design.md): no module imports from a layer above its own,
at module level or inside a function."""

import ast
from pathlib import Path

import fedjax_sparse

PACKAGE = Path(fedjax_sparse.__file__).parent
# the plug-in loader, data and models below core, core below the algorithms and the agent, the run layer on top;
# building_blocks gathers the core's pieces for algorithm authors (the library's own FedDyn among
# them) and holds the reusable ones (server optimizer, control variates), so it sits with the core; privacy
# (mechanism, accounting, a run's ledger) sits beside the algorithms; console (what the library says, and keeps
# others from saying) and the package's version (its __init__, which imports nothing) are below everything; the
# package's entry points gather from all of them
LAYERS = {"__version__": 0, "plugins": 0, "console": 0, "data": 0, "models": 0, "core": 1, "building_blocks": 1, "algorithms": 2,
          "agent": 2, "privacy": 2, "run": 3}
TOP = 4


def layer(parts: tuple[str, ...]) -> int:
    """The layer of a module given by its path parts below the package (a subpackage's or the top)."""
    return LAYERS.get(parts[0].removesuffix(".py"), TOP)


def imported_modules(tree: ast.AST):
    """(line, parts below the package) of every import of the package's own modules in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "fedjax_sparse" else [f"fedjax_sparse.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = tuple(name.split("."))
            if parts[0] == "fedjax_sparse" and len(parts) > 1:
                yield node.lineno, parts[1:]


def test_no_module_imports_from_a_layer_above_its_own():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50 and any(f.parent.name == "algorithms" for f in files)
    upward = []
    for path in files:
        own = layer(path.relative_to(PACKAGE).parts)
        for line, parts in imported_modules(ast.parse(path.read_text(), filename=str(path))):
            if layer(parts) > own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports fedjax_sparse.{'.'.join(parts)}")
    assert not upward, "\n".join(upward)


def test_building_blocks_holds_only_the_cores_pieces_and_its_own():
    for path in (PACKAGE / "building_blocks").glob("*.py"):
        tree = ast.parse(path.read_text())
        assert {parts[0] for _, parts in imported_modules(tree)} <= {"core", "building_blocks"}, path.name


def test_the_rule_sees_an_upward_import_inside_a_function():
    tree = ast.parse("def f():\n    from fedjax_sparse.core.round.distributed import ProcessLayout\n")
    ((line, parts),) = imported_modules(tree)
    assert line == 2 and layer(parts) == LAYERS["core"] > layer(("data", "windows.py"))
    ((_, parts),) = imported_modules(ast.parse("from fedjax_sparse import run"))
    assert layer(parts) == LAYERS["run"]


def modules() -> dict[str, Path]:
    """The package's modules by dotted name below the package ('' for the package, 'core.round' for a package's
    __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def module_imports(text: str, known: set[str]) -> set[str]:
    """The package's modules `text` imports, at module level, inside a function or for type checking alike.
    `from fedjax_sparse.models import layers` imports the module models.layers, not the package's __init__."""
    deps = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("fedjax_sparse"):
                continue
            base = node.module.split(".")[1:]
            targets = [".".join([*base, a.name]) for a in node.names]
            deps |= {t if t in known else ".".join(base) for t in targets}
        elif isinstance(node, ast.Import):
            deps |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.startswith("fedjax_sparse.")}
    return {d for d in deps if d in known}


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (`module_imports`)."""
    known = modules()
    return {name: module_imports(path.read_text(), set(known)) - {name} for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph()) == []


def test_the_circle_rule_sees_a_circle_through_a_function_and_a_type_check():
    graph = {"run.folder": {"run.outputs"}, "run.outputs": {"run.folder"}, "data.sources": {"data.mapped"},
             "data.mapped": {"core.round.step"}, "core.round.step": {"data.sources"}, "models": set()}
    assert circles(graph) == [["core.round.step", "data.mapped", "data.sources"], ["run.folder", "run.outputs"]]
    text = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fedjax_sparse.run.folder import RunManifest\n"
            "def f():\n    from fedjax_sparse.models import layers\n")
    assert module_imports(text, {"run.folder", "models", "models.layers"}) == {"run.folder", "models.layers"}


def test_a_module_past_400_lines_says_why_it_is_one_module():
    """One concern a module (issue 56): a longer one states why in its docstring."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 410 and "Why one module past 400 lines:" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(PACKAGE.parent)}: {text.count(chr(10))} lines")
    assert not long, "\n".join(long)


def test_the_import_paths_before_the_move_reach_the_same_modules_and_names():
    """Issue 56 moved modules into rooms; what a user imported by the old paths (the API reference and
    docs/library.md named them) is the same object by the new ones."""
    import importlib

    from fedjax_sparse import MOVED

    assert len(MOVED) >= 30
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from fedjax_sparse.core.contract import check_contract
    from fedjax_sparse.core.contract.check import check_contract as checked
    from fedjax_sparse.core.evaluation import global_evaluator
    from fedjax_sparse.core.evaluation.evaluators import global_evaluator as evaluator
    from fedjax_sparse.core.local_training import LocalSGD
    from fedjax_sparse.core.messages import SparseArray, message_bytes
    from fedjax_sparse.core.messages.pricing import SparseArray as sparse, message_bytes as priced
    from fedjax_sparse.core.round import build_round
    from fedjax_sparse.core.round.local_training import LocalSGD as local
    from fedjax_sparse.core.round.step import build_round as built
    assert (check_contract, global_evaluator, LocalSGD, SparseArray, message_bytes, build_round) == (
        checked, evaluator, local, sparse, priced, built)
