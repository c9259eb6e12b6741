"""Every `fedjax-sparse run` command the documentation shows runs as written (issue 57, item 4): each on its own,
in this process, for one round (`--rounds 1`, a temporary `--out`), on the data it names, which is the CLI's
default digits for every runnable one. A command that cannot run here is listed below with why (a template with
placeholders, data that is downloaded or read from a folder, several processes); a new command must be one or
the other, and every method page shows at least one that runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fedjax_sparse.run.cli import main

DOCS = Path(__file__).resolve().parents[1] / "docs"
METHOD_PAGES = sorted(p.name for p in (DOCS / "methods").glob("*.md") if p.name != "index.md")

# page -> why its `fedjax-sparse run` commands do not run here
NOT_RUN = {
    "cli.md": "the command line's template (NAME, N, {digits,...}, FILE)",
    "precision.md": "a template (... and the values a flag takes)",
    "data.md": "FEMNIST and Shakespeare are prepared from the network, the others read folders of the user's",
    "scale.md": "two processes started together",
    "tracking.md": "logs to MLflow and W&B (tests/test_trackers.py runs the trackers offline)",
}


def commands(page: Path) -> list[str]:
    """The page's `fedjax-sparse run` commands, continuation lines joined."""
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("fedjax-sparse run"):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            out.append(line)
        i += 1
    return out


def runnable() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        name = str(page.relative_to(DOCS))
        if name not in NOT_RUN:
            found += [(name, command) for command in commands(page)]
    return found


def test_every_command_is_run_or_says_why_not_and_every_method_page_has_one_that_runs():
    pages = {name for name, _ in runnable()}
    for name in NOT_RUN:
        assert commands(DOCS / name), f"{name} is listed as not run but shows no command"
    for name, command in runnable():
        assert not re.search(r"\b[A-Z]{2,}\b|\.\.\.|[{}|\[\]]", command), (name, command)  # no placeholders
    assert {f"methods/{p}" for p in METHOD_PAGES} <= pages, sorted({f"methods/{p}" for p in METHOD_PAGES} - pages)


@pytest.mark.slow
@pytest.mark.parametrize("page,command", runnable(), ids=lambda x: x if "/" in x or x.endswith(".md") else None)
def test_a_documented_command_runs_as_written(page, command, tmp_path, capsys):
    args = shlex.split(command)[1:]
    assert main([*args, "--rounds", "1", "--no-progress", "--no-tensorboard", "--out", str(tmp_path / "run")]) == 0, \
        capsys.readouterr().err
    assert "done: " in capsys.readouterr().out
