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
from pathlib import Path
from typing import Any

from fedjax_sparse.core.options import check_value, coerce

FORMATS = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}


def _parse(path: Path) -> Any:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"--config {path}: unknown file type {path.suffix or '(none)'}; valid: "
                         f"{', '.join(FORMATS)}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--config {path}: not a text file (byte {err.object[err.start]:#04x} at offset {err.start} "
                         f"is not UTF-8); give a JSON, YAML or TOML file") from None
    try:
        if kind == "JSON":
            return json.loads(text)
        if kind == "TOML":
            return tomllib.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as err:  # each parser has its own error types; all mean the same here
        raise ValueError(f"--config {path}: not valid {kind}: {' '.join(str(err).split())}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's options as flat, typed values, each checked as its flag would be."""
    path = Path(path)
    raw = _parse(path)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values, got a "
                         f"{type(raw).__name__}")
    from fedjax_sparse.run.config import declared_options

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
