"""Run configs kept as files: `fedjax-sparse run --config FILE`.

A JSON (.json), YAML (.yaml, .yml) or TOML (.toml) file holds a flat mapping of the
options the flags set, named as in a run's saved config.json (`lr`, `local_epochs`;
dashes as in the flags are accepted too), so any run's config.json is a valid config.
Flags given with --config override the file. Each value is checked as its flag would
be: an unknown key, a wrong type or a value out of range is a one-line ValueError naming
the key and the file.
"""

from __future__ import annotations

import difflib
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from fedjax_sparse.core.options import check_value, coerce, option_fields, spec_of

FORMATS = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}


def _parse(path: Path) -> Any:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"--config {path}: unknown file type {path.suffix or '(none)'}; valid: "
                         f"{', '.join(FORMATS)}")
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    try:
        if kind == "JSON":
            return json.loads(text)
        if kind == "TOML":
            return tomllib.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as err:  # each parser has its own error types; all mean the same here
        raise ValueError(f"--config {path}: not valid {kind}: {' '.join(str(err).split())}") from None


def declared_options() -> dict[str, tuple[Any, Any]]:
    """Every option a run takes, shared or an algorithm's: name -> (OptionSpec, type annotation)."""
    from fedjax_sparse.algorithms import ALGORITHMS
    from fedjax_sparse.runner import RunConfig

    out = {}
    for cls in (RunConfig, *(spec.options for spec in ALGORITHMS.values())):
        hints = typing.get_type_hints(cls)
        for field in option_fields(cls):
            out.setdefault(field.name, (spec_of(field), hints[field.name]))
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's options as flat, typed values, each checked as its flag would be."""
    path = Path(path)
    raw = _parse(path)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values, got a "
                         f"{type(raw).__name__}")
    declared = declared_options()
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in declared:
            close = difflib.get_close_matches(name, declared, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--config {path}: unknown option {key!r}{hint}; `fedjax-sparse run --help` lists "
                             f"the options")
        spec, annotation = declared[name]
        try:
            values[name] = coerce(name, annotation, value)
            check_value(name, spec, values[name])
        except ValueError as err:
            raise ValueError(f"--config {path}, key {key!r}: {err}") from None
    return values
