"""The README's test command is what CI runs, the documentation's pages name what exists, and the built site
documents what a reader of the tutorial and the contract needs."""

import ast
import builtins
import dataclasses
import html
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_test_command_verbatim():
    command = next(line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                   if "pytest" in line and line.startswith("    "))
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    assert "mkdocs build --strict" in command


def test_every_page_the_readme_and_the_navigation_name_exists():
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)]+)\)", readme):
        assert (ROOT / link).is_file(), link
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in re.findall(r":\s*([\w/]+\.md)\s*$", nav, flags=re.M):
        assert (ROOT / "docs" / page).is_file(), page


# Each built-in algorithm by the name its paper gives it (a sub-row of another method's table maps to that method).
METHOD_NAMES = {
    "fedadp": "FedADP", "fedavg": "FedAvg", "feddropout": "Federated Dropout", "feddyn": "FedDyn", "fedgse": "FedGSE",
    "fedldf": "FedLDF", "fedldf_random": "FedLDF", "fednova": "FedNova", "fedp3": "FedP3", "fedpm": "FedPM",
    "fedprox": "FedProx", "fedrolex": "FedRolex", "fedspa": "FedSpa", "fjord": "Fjord", "hdfl": "HDFL",
    "heterofl": "HeteroFL", "local": "Local", "scaffold": "SCAFFOLD", "spafl": "SpaFL", "spafl_local": "SpaFL",
    "spatl": "SPATL",
}


def test_the_readme_and_the_docs_home_name_every_built_in_method():
    """A new built-in algorithm must be named (by its paper's name) in the README's method list and on
    the documentation's home page, which once listed five baselines of fifteen."""
    from fedjax_sparse.algorithms import BUILT_IN

    assert set(BUILT_IN) == set(METHOD_NAMES), "name the new algorithm in METHOD_NAMES, the README and docs/index.md"
    for page in ("README.md", "docs/index.md"):
        text = (ROOT / page).read_text()
        missing = sorted({m for m in METHOD_NAMES.values() if m not in text})
        assert not missing, f"{page} does not name {missing}"


TUTORIAL = ROOT / "docs" / "write_your_own.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The documentation, built as CI builds it (`mkdocs build --strict`)."""
    pytest.importorskip("mkdocstrings", reason="the docs extra ([docs]) builds the site")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1",
                                                                "FEDJAX_SPARSE_SITE_URL": SITE_URL,
                                                                "FEDJAX_SPARSE_REPO_URL": REPO_URL})
    assert build.returncode == 0, build.stderr[-3000:]
    return out


# the addresses a publisher gives when building the site (mkdocs.yml reads them from the environment)
SITE_URL = "https://docs.example.org/fedjax_sparse/"
REPO_URL = "https://git.example.org/fedjax_sparse"


def page_text(page: Path) -> str:
    """A built page's article as a reader sees it: tags dropped, entities decoded, spaces collapsed."""
    text = page.read_text()
    text = text[text.find("<article"):text.find("</article>")]
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())


def rendered_ids(pages) -> set[str]:
    return {i for page in pages for i in re.findall(r'id="([^"]+)"', page.read_text())}


def tutorial_code() -> list[str]:
    return re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), flags=re.S)


def test_an_options_class_shows_every_option_with_its_flag_default_and_help(site):
    """Fields declared with `option(help=...)` carry their help in metadata, which mkdocstrings never shows: the
    Run configuration page said "the fields below" and showed none. Every option of RunConfig and of each
    built-in algorithm's options class is on the page that renders the class, with its flag, help and default."""
    from fedjax_sparse.algorithms import BUILT_IN, get_spec
    from fedjax_sparse.core.contract.options import flag_name, option_fields, spec_of
    from fedjax_sparse.run import RunConfig

    classes = {RunConfig, *(get_spec(name).options for name in BUILT_IN)}
    pages = sorted(site.rglob("*.html"))
    for cls in classes:
        anchor = f'id="{cls.__module__}.{cls.__qualname__}"'
        where = [page for page in pages if anchor in page.read_text()]
        if not option_fields(cls):
            continue
        assert where, f"{cls.__qualname__} is on no page of the site"
        text = page_text(where[0])
        for field in option_fields(cls):
            row = re.search(re.escape(f"{field.name} ( {flag_name(field.name)}") + r".*?(?= \w+ \( --|$)", text)
            assert row, f"{cls.__qualname__}.{field.name} ({flag_name(field.name)}) is not on {where[0]}"
            assert " ".join(spec_of(field).help.split()) in row.group(0), (cls.__qualname__, field.name)
            if not isinstance(field.default, bool):
                default = field.default
                shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
                assert f" {shown} " in row.group(0), (cls.__qualname__, field.name, shown)


def test_every_public_name_the_tutorial_imports_is_on_the_reference_pages(site):
    """A reader of "Write your own algorithm" finds each name it imports documented under API reference
    (`run_experiment` and `fedavg` were on none)."""
    imported = [(node.module, alias.name) for block in tutorial_code() for node in ast.walk(ast.parse(block))
                if isinstance(node, ast.ImportFrom) and node.module.startswith("fedjax_sparse")
                for alias in node.names]
    assert len(imported) > 10, imported
    ids = rendered_ids((site / "reference").rglob("*.html"))
    missing = []
    for module, name in imported:
        obj = getattr(importlib.import_module(module), name)
        if not {f"{module}.{name}", f"{obj.__module__}.{obj.__qualname__}"} & ids:
            missing.append(f"{module}.{name}")
    assert not missing, f"not on the reference pages: {missing}"


def test_the_tutorial_defines_every_name_its_code_uses():
    """The tutorial's code is whole for a reader: every name it reads is imported, defined or a builtin
    (it once read `TUTORIAL_RUNS`, which only the test defined)."""
    trees = [ast.parse(block) for block in tutorial_code()]
    bound = set(dir(builtins))
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    read = {n.id for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert not read - bound, f"the tutorial reads {sorted(read - bound)} without defining them"


def test_the_contracts_types_document_every_field(site):
    """Each field of what an algorithm builds on and receives is named in its class's docstring (BuildContext's
    once listed 7 of its 10; ClientData and Batch none), those classes are on the contract's page, and the
    contract says what a stateless algorithm's `init` returns for its clients."""
    from fedjax_sparse.core.contract.algorithm import BuildContext, FederatedAlgorithm, RoundInfo, ServerStep, StaleUpload
    from fedjax_sparse.core.round.local_training import LocalObjective
    from fedjax_sparse.data.federated import Batch, ClientData

    for cls in (BuildContext, FederatedAlgorithm, RoundInfo, ServerStep, StaleUpload, LocalObjective, ClientData,
                Batch):
        doc = cls.__doc__
        undocumented = [f.name for f in dataclasses.fields(cls)
                        if not re.search(rf"(?<![\w.]){f.name}(?=[:(,]| \(|`| and )|`{f.name}`", doc)]
        assert not undocumented, f"{cls.__name__}'s docstring does not name {undocumented}"
    assert "`{}`" in FederatedAlgorithm.__doc__
    ids = rendered_ids([site / "reference" / "contract" / "index.html"])
    for cls in (BuildContext, RoundInfo, ClientData, Batch):
        assert f"{cls.__module__}.{cls.__qualname__}" in ids or f"fedjax_sparse.core.contract.algorithm.{cls.__name__}" in ids


def test_the_site_knows_its_address_and_links_the_repositorys_files(site):
    """Built with the published addresses (FEDJAX_SPARSE_SITE_URL, FEDJAX_SPARSE_REPO_URL), the 404 page (served at
    any missing address) links to absolute paths under the site's own, and a repository path a page cites
    (`benchmarks/results/...`) links to the file under the repository's address."""
    base = urlparse(SITE_URL).path
    links = re.findall(r'(?:href|src)="([^"]+)"', (site / "404.html").read_text())
    local = [link for link in links if not link.startswith(("http://", "https://", "#", "data:"))]
    assert local and all(link.startswith(base) for link in local), [l for l in local if not l.startswith(base)]
    cited = 0
    for page in site.rglob("*.html"):
        text = page.read_text()
        for match in re.finditer(r"(<a [^>]*>)?<code>(benchmarks/results/[^<]*)</code>", text):
            cited += 1
            assert match.group(1) and REPO_URL in match.group(1), (page, match.group(2))
    assert cited > 5


def test_a_cited_place_in_a_result_file_links_to_that_place():
    """`benchmarks/results/parity.md#spatl-distinct` (a method page citing its rows of the parity table) links to
    the file at that anchor; a path that is not in the repository stays plain text, fragment or not."""
    spec = importlib.util.spec_from_file_location("repository_links", ROOT / "docs" / "hooks" / "repository_links.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    text = hook.link_paths("`benchmarks/results/parity.md#spatl-distinct` and `no/such.md#x`", REPO_URL)
    assert text == (f"[`benchmarks/results/parity.md#spatl-distinct`]({REPO_URL}/blob/main/benchmarks/results/"
                    "parity.md#spatl-distinct) and `no/such.md#x`")


def test_the_layout_page_draws_every_package_and_module_from_the_folders():
    """docs/layout.md's tree is the hook's (docs/hooks/layout_tree.py), drawn when the site is built: every
    package with its __init__'s first sentence, every module with its docstring's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layout_tree", ROOT / "docs" / "hooks" / "layout_tree.py")
    layout_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout_tree)
    assert layout_tree.MARKER in (ROOT / "docs" / "layout.md").read_text()
    tree = layout_tree.tree_markdown()
    package = ROOT / "fedjax_sparse"
    for init in package.rglob("__init__.py"):
        if init.parent != package:
            assert f"**`{init.parent.name}/`**: {layout_tree.first_sentence(init)}" in tree, init
            assert layout_tree.first_sentence(init), f"{init} has no docstring"
    for module in package.rglob("*.py"):
        if module.name not in ("__init__.py", "__main__.py"):
            assert f"`{module.stem}`: " in tree, module
    assert "- **`round/`**: The round:" in tree and "`step`: One federated round as one jitted computation." in tree
