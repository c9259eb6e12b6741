"""A Griffe extension for the reference pages: an options class shows its options as a table.

An option is a dataclass field declared with `option(default, help, ...)` (`fedjax_sparse.core.contract.options`).
Such fields carry their help in metadata, not in a docstring, so mkdocstrings would show none of them.
This extension appends to the docstring of every class that declares options (itself or through its bases)
a table of each option: its flag, default, valid values and help, read from the imported class, so the page
says exactly what `fedjax-sparse run --help` says. Options a class inherits are listed under the class that
declares them.

mkdocs.yml loads it as a mkdocstrings extension (`docs/hooks/options_tables.py:OptionsTables`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import typing
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[2]


def _declares_options(cls: griffe.Class) -> bool:
    """Whether `cls` or one of its bases (those Griffe resolves: the loaded packages') has a field whose value is
    `option(...)`."""
    return any(member.is_attribute and member.value is not None and str(member.value).startswith("option(")
               for klass in (cls, *cls.mro()) for member in klass.members.values() if not member.is_alias)


def _escape(text: str) -> str:
    """Text for a Markdown table cell."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|").replace("*", "\\*")


def _shown(value) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _row(field: dataclasses.Field, annotation) -> str:
    # the flags' own reading of an annotation, so that the table says what `--help` says
    from fedjax_sparse.core.contract.options import _base_type, flag_name, spec_of

    spec = spec_of(field)
    element, optional, is_tuple = _base_type(annotation)
    flag = flag_name(field.name)
    if element is bool and not is_tuple:
        name = f"`{field.name}` (`{flag}` / `--no-{flag[2:]}`)"
        default, valid = ("on" if field.default else "off"), "on or off"
    else:
        name = f"`{field.name}` (`{flag}`)"
        default = f"`{_shown(field.default)}`"
        if spec.choices is not None or element in (int, float):
            valid = spec.describe()
        else:
            valid = "text"
        if is_tuple:
            valid = f"comma-separated, each {valid}"
        if optional:
            valid += ", or none"
    return f"| {name} | {default} | {_escape(valid)} | {_escape(spec.help)} |"


def options_table(cls: type) -> str:
    """Markdown: the options `cls` declares, then those of each base class, as tables."""
    from fedjax_sparse.core.contract.options import option_fields

    hints = typing.get_type_hints(cls)
    fields = option_fields(cls)
    # a field belongs to the most derived class that annotates it
    owners: dict[type, list[dataclasses.Field]] = {}
    for field in fields:
        owner = next(klass for klass in cls.__mro__ if field.name in inspect.get_annotations(klass))
        owners.setdefault(owner, []).append(field)
    parts = []
    for owner in sorted(owners, key=cls.__mro__.index):
        if owner is cls:
            title = "**Options**"
        else:
            title = f"**Options from `{owner.__module__}.{owner.__qualname__}`**"
        rows = [_row(field, hints[field.name]) for field in owners[owner]]
        parts.append("\n".join([title, "", "| option (flag) | default | valid | what it sets |",
                                "|---|---|---|---|", *rows]))
    return "\n\n".join(parts)


class OptionsTables(griffe.Extension):
    """Appends `options_table` to the docstring of every class that declares options."""

    def on_class(self, *, cls: griffe.Class, **kwargs) -> None:
        if not cls.path.startswith("fedjax_sparse.") or not _declares_options(cls):
            return
        if str(ROOT) not in sys.path:  # the checkout's code, as the static pages read it
            sys.path.insert(0, str(ROOT))
        runtime = importlib.import_module(cls.module.path)
        for name in cls.path[len(cls.module.path) + 1:].split("."):
            runtime = getattr(runtime, name)
        table = options_table(runtime)
        if not table:
            return
        text = f"{cls.docstring.value}\n\n{table}" if cls.docstring else table
        cls.docstring = griffe.Docstring(text, parent=cls)
