"""An MkDocs hook: a path of the repository named in a page (`benchmarks/results/cpu_full.md`) links to it,
at the place a fragment names where it has one (`benchmarks/results/parity.md#spatl-distinct`).

The pages cite result files, scripts and tests by their path in the repository, which the site does not
hold. Every code span in a page's text that is such a path (a file or folder outside docs/, or a glob
whose folder exists) becomes a link to it under `repo_url`; the path stays the link's text, so the page
still says where the file is. Code blocks are left as they are.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BRANCH = "main"
# a path, and optionally a fragment naming a place in the file (`benchmarks/results/parity.md#spatl-distinct`)
CODE_SPAN = re.compile(r"(?<![`\[])`([A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-/*]*)(#[A-Za-z0-9_\-]+)?`(?![`\]])")


def repository_path(text: str) -> str | None:
    """The repository path a code span names (a glob's folder for a glob), or None."""
    path = text.split("*", 1)[0].rsplit("/", 1)[0] if "*" in text else text.rstrip("/")
    if not path or path.split("/", 1)[0] in ("docs", "..", ".") or not (ROOT / path).exists():
        return None
    return path


def link_paths(markdown: str, repo_url: str) -> str:
    """`markdown` with every code span naming a repository path linked to it under `repo_url`."""
    def link(match: re.Match) -> str:
        path = repository_path(match.group(1))
        if path is None:
            return match.group(0)
        kind = "tree" if (ROOT / path).is_dir() else "blob"
        return f"[{match.group(0)}]({repo_url.rstrip('/')}/{kind}/{BRANCH}/{path}{match.group(2) or ''})"

    lines, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith(("    ", "\t")):
            line = CODE_SPAN.sub(link, line)
        lines.append(line)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not config.get("repo_url"):
        return markdown
    return link_paths(markdown, config["repo_url"])
