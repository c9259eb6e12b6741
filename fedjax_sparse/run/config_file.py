"""Run configs kept as files: `fedjax-sparse run --config FILE`.

A JSON (.json), YAML (.yaml, .yml) or TOML (.toml) file holds a flat mapping of the
options the flags set, named as in a run's saved config.json (`lr`, `local_epochs`;
dashes as in the flags are accepted too), so any run's config.json is a valid config.
Flags given with --config override the file. Each value is checked as its flag would
be: an unknown key, a wrong type or a value out of range is a one-line ValueError naming
the key and the file. The file's types are its own: a number, a bool, a list or null
written as text (TOML's `rounds = "6"`) is refused, not parsed as its flag would parse
it (YAML reads `1e-3` as a number, as YAML 1.2 does, where PyYAML's YAML 1.1 reads
text). A key given twice (`rounds` twice, or `num-clients` beside `num_clients`) is
refused rather than the last one winning, as is a value of more than `MAX_VALUES` values
once YAML's aliases are expanded (seven nested aliases make 340 bytes 5 million values,
and a message quoting them 25 MB); a message quotes a value cut to a line.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from fedjax_sparse.core.contract.options import check_value, coerce, flag_name, quoted

FORMATS = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}
MAX_VALUES = 10_000  # a run's options hold a few dozen values; a value near this is no option's
_PARSER_MESSAGE = 300  # characters kept of a parser's error (YAML's quotes the offending line)
# YAML 1.2's floats without a dot (1e-3, 5E+2), which PyYAML's YAML 1.1 resolver leaves as text
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _Repeated(ValueError):
    """A mapping in the file names one key twice."""


def _once(pairs: list[tuple[Any, Any]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Repeated(f"key {quoted(key)} is given twice; give it once")
        out[key] = value
    return out


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            lines = {}
            for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
                if key_node.tag == "tag:yaml.org,2002:merge":  # a merged mapping's keys may be overridden
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in lines:
                        raise _Repeated(f"key {quoted(key)} is given twice (lines {lines[key]} and {line}); "
                                        f"give it once")
                    lines[key] = line
                except TypeError:  # an unhashable key: the constructor's own error names it
                    pass
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))
    return Loader


def _parse(path: Path) -> Any:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"--config {path}: unknown file type {path.suffix or '(none)'}; "
                         f"valid: {', '.join(FORMATS)}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--config {path}: not a text file (byte {err.object[err.start]:#04x} at offset {err.start} "
                         f"is not UTF-8); give a JSON, YAML or TOML file") from None
    try:
        if kind == "JSON":
            return json.loads(text, object_pairs_hook=_once)
        if kind == "TOML":
            return tomllib.loads(text)  # TOML refuses a repeated key itself
        import yaml

        return yaml.load(text, Loader=_yaml_loader())
    except _Repeated as err:
        raise ValueError(f"--config {path}: {err}") from None
    except Exception as err:  # each parser has its own error types; all mean the same here
        message = " ".join(str(err).split())
        if len(message) > _PARSER_MESSAGE:
            message = message[:_PARSER_MESSAGE - 3] + "..."
        raise ValueError(f"--config {path}: not valid {kind}: {message}") from None


def _expanded_size(value: Any, limit: int) -> int:
    """How many values `value` holds with every alias written out (YAML shares one object among its aliases),
    counted in time linear in the shared graph; `limit + 1` once past `limit` or on a cycle."""
    sizes: dict[int, int] = {}

    def size(v, depth):
        if not isinstance(v, (list, dict)):
            return 1
        if id(v) in sizes:
            return sizes[id(v)]
        if depth > 100:  # nesting no option has (and the recursion would meet Python's limit)
            return limit + 1
        sizes[id(v)] = limit + 1  # reached again while open: a cycle (YAML allows `&a [*a]`)
        sizes[id(v)] = 1 + sum(size(item, depth + 1) for item in (v.values() if isinstance(v, dict) else v))
        return sizes[id(v)]

    return min(size(value, 0), limit + 1)


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
    values, keys = {}, {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in declared:
            close = difflib.get_close_matches(name, declared, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--config {path}: unknown option {quoted(key)}{hint}; `fedjax-sparse run --help` "
                             f"lists the options")
        if name in keys:
            raise ValueError(f"--config {path}: keys {keys[name]!r} and {key!r} both set {flag_name(name)}; "
                             f"give it once")
        keys[name] = key
        if _expanded_size(value, MAX_VALUES) > MAX_VALUES:
            raise ValueError(f"--config {path}, key {key!r}: more than {MAX_VALUES:,} values (YAML's aliases written "
                             f"out); an option holds a number, a word or a short list")
        spec, annotation = declared[name]
        try:
            values[name] = coerce(name, annotation, value)
            if isinstance(value, str) and not isinstance(values[name], str):
                raise ValueError(f"{flag_name(name)}: {quoted(value)} is text, {_unquoted(value, values[name])}")
            check_value(name, spec, values[name])
        except ValueError as err:
            raise ValueError(f"--config {path}, key {key!r}: {err}") from None
    return values


def _unquoted(text: str, value: Any) -> str:
    """What the file should hold instead of `text`, which parses as `value`."""
    if value is None:
        return "not null; write null, or leave the key out for its default"
    if isinstance(value, tuple):
        return f"not a list; write {quoted(list(value))}"
    return f"not a number; write {quoted(text.strip())[1:-1]} without quotes"
