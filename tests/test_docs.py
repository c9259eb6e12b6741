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
