"""An MkDocs hook: the layout page's tree is drawn from the package's folders when the site is built.

Where the layout page says `<!-- tree -->`, it gets the package's folders and modules, each with the first
sentence of its docstring (a folder's from its __init__), so the page shows the architecture the code has,
not one written down once. Read with `ast`: nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fedjax_sparse"
MARKER = "<!-- tree -->"


ABBREVIATIONS = ("sec", "secs", "eq", "eqs", "al", "e.g", "i.e", "vs", "cf", "fig", "no", "p")


def first_sentence(path: Path) -> str:
    """The first sentence of `path`'s docstring (a period ending an abbreviation such as "sec." or "e.g."
    does not end it)."""
    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(text.split("\n\n", 1)[0].split())
    for match in re.finditer(r"\.\s", paragraph):
        word = re.split(r"[\s(]", paragraph[:match.start()])[-1].lower()
        if word not in ABBREVIATIONS:
            return paragraph[:match.start() + 1]
    return paragraph


def tree_lines(folder: Path, depth: int = 0) -> list[str]:
    """`folder`'s packages (recursively) and modules, a line each with its docstring's first sentence."""
    indent = "    " * depth
    lines = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and (path / "__init__.py").is_file():
            lines.append(f"{indent}- **`{path.name}/`**: {first_sentence(path / '__init__.py')}")
            lines += tree_lines(path, depth + 1)
        elif path.suffix == ".py" and path.name not in ("__init__.py", "__main__.py"):
            lines.append(f"{indent}- `{path.stem}`: {first_sentence(path)}")
    return lines


def tree_markdown() -> str:
    return "\n".join([f"- **`fedjax_sparse/`**: {first_sentence(PACKAGE / '__init__.py')}",
                      *("    " + line for line in tree_lines(PACKAGE))])


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, tree_markdown()) if MARKER in markdown else markdown
