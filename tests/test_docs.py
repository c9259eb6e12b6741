"""The README's test command is what CI runs, and the documentation's pages name what exists."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_test_command_verbatim():
    command = next(line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                   if "pytest" in line and line.startswith("    "))
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    assert "mkdocs build --strict" in command


def test_every_page_the_readme_and_the_navigation_name_exists():
    import re
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
