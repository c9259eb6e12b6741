"""Declared options: a field, its help, its valid range; validation and command-line flags from them.

Every option of a run -- the shared ones (data, model, local training) and
each algorithm's own, which live beside its math as a small frozen dataclass
-- is a dataclass field made with `option(...)`. From those declarations come
  * `validate(obj)`: one line per bad value, naming the flag and what is valid
    (floats must be finite unless declared otherwise);
  * `add_flags(parser, cls)`: the `--flag` of every field, with its help and
    default (bools become `--name` / `--no-name` switches);
  * `refuse_ignored(obj, given)`: one line for a flag the user gave that these
    values make the algorithm ignore (a class states which, and why, in an
    `ignored()` method, e.g. SPATL's agent settings under its fixed policy);
    `refuse_unread_values(obj)`: the same for any such option set away from its
    default, however it was set (Python, a config file), since the run would
    record a value it never used;
so adding a method adds its dataclass and nothing else to the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import reprlib
import typing
from typing import Any, Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """What an option accepts. `low`/`high` bound numbers (and every element of a tuple)."""

    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple | None = None
    finite: bool = True
    group: str | None = None  # the command line's help group (default: its declaring class's OPTION_GROUP)

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "a finite number" if self.finite else "a number"

    def accepts(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        if self.finite and not math.isfinite(value):
            return False
        if math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True


# A message quotes a value cut to a line: a config file's value can be any size (YAML's aliases expand 340
# bytes into millions of values), and reprlib stops reading where it stops writing.
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxtuple, _QUOTE.maxdict, _QUOTE.maxstring, _QUOTE.maxother = 2, 6, 6, 4, 60, 60


def quoted(value: Any) -> str:
    """`repr(value)`, cut to at most a line's worth."""
    return _QUOTE.repr(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def option(default: Any = dataclasses.MISSING, help: str = "", *, low: float | None = None,
           high: float | None = None, low_open: bool = False, high_open: bool = False,
           choices: Sequence | None = None, finite: bool = True, group: str | None = None) -> Any:
    """A dataclass field carrying its `OptionSpec`."""
    spec = OptionSpec(help, low, high, low_open, high_open, tuple(choices) if choices is not None else None,
                      finite, group)
    return dataclasses.field(default=default, metadata={"option": spec})


def declaring_class(cls: type, name: str) -> type:
    """The class of `cls`'s hierarchy that declares the field `name` (an options mixin, or `cls` itself)."""
    return next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


def option_group(cls: type, field: dataclasses.Field) -> str:
    """The command line's help group of `cls`'s option `field`: its own `group`, else its declaring class's
    `OPTION_GROUPS[name]` or `OPTION_GROUP` (plain class attributes), else the declaring class's name without 'Options', lower case
    (an algorithm's own options: `SPATLOptions` -> 'spatl')."""
    owner = declaring_class(cls, field.name)
    return (spec_of(field).group or owner.__dict__.get("OPTION_GROUPS", {}).get(field.name)
            or owner.__dict__.get("OPTION_GROUP") or owner.__name__.removesuffix("Options").lower())


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def spec_of(field: dataclasses.Field) -> OptionSpec | None:
    return field.metadata.get("option")


def option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if spec_of(f) is not None]


def validate(obj: Any) -> None:
    """Raises a one-line ValueError for the first option of `obj` outside its declared range."""
    for field in option_fields(type(obj)):
        check_value(field.name, spec_of(field), getattr(obj, field.name))


def check_value(name: str, spec: OptionSpec, value: Any) -> None:
    """Raises a one-line ValueError, naming the flag and what is valid, when `value` is outside `spec`."""
    values = value if isinstance(value, tuple) else (value,)
    if isinstance(value, tuple) and not value:
        raise ValueError(f"{flag_name(name)} needs at least one value ({spec.describe()}, comma-separated), "
                         f"got none")
    for v in values:
        if v is None:
            continue
        if not spec.accepts(v):
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(v)
            shown = shown if len(shown) <= _QUOTE.maxother else shown[:_QUOTE.maxother - 3] + "..."
            valid = spec.describe()
            if isinstance(v, float) and spec.finite and not math.isfinite(v) and spec.choices is None \
                    and not valid.startswith("a finite"):
                valid = "a finite number " + valid
            raise ValueError(f"{flag_name(name)} must be {valid}, got {shown}")


def ignored_options(obj: Any) -> dict[str, str]:
    """{option name: why it is ignored} under the values of `obj` (its class's `ignored()`; none without one)."""
    return obj.ignored() if hasattr(obj, "ignored") else {}


def refuse_ignored(obj: Any, given: Iterable[str]) -> None:
    """Raises a one-line ValueError for the first option in `given` (those the user set) that `obj` ignores."""
    ignored = ignored_options(obj)
    for name in given:
        if name in ignored:
            raise ValueError(f"{flag_name(name)} {ignored[name]}")


def refuse_unread_values(obj: Any) -> None:
    """Raises a one-line ValueError for the first option that `obj` ignores but holds away from its default."""
    ignored = ignored_options(obj)
    for field in option_fields(type(obj)):
        value = getattr(obj, field.name)
        if field.name in ignored and value != field.default:
            raise ValueError(f"{flag_name(field.name)} {ignored[field.name]} (it is set to {quoted(value)})")


def _base_type(annotation: Any) -> tuple[Any, bool, bool]:
    """(element type, is optional, is tuple) of a field annotation."""
    optional = False
    args = typing.get_args(annotation)
    if type(None) in args:
        optional = True
        annotation = next(a for a in args if a is not type(None))
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)[0], optional, True
    return annotation, optional, False


def _parser_for(element: type, optional: bool, is_tuple: bool, name: str):
    def parse_one(text: str):
        try:
            return element(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{quoted(text)} is not a valid {element.__name__}")

    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        if is_tuple:
            return tuple(parse_one(t) for t in text.split(",") if t.strip())
        return parse_one(text)

    return parse


def coerce(name: str, annotation: Any, value: Any) -> Any:
    """A typed value (JSON, YAML, TOML) as field `name` of type `annotation` holds it, or a one-line
    ValueError in the flags' words. Text is parsed as its flag would parse it; an int may stand for a
    float; a list for a tuple."""
    element, optional, is_tuple = _base_type(annotation)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{flag_name(name)}: null is not a valid {element.__name__}")
    if isinstance(value, str) and not (element is str and not is_tuple):
        if element is bool and not is_tuple:
            raise ValueError(f"{flag_name(name)}: {quoted(value)} is not a valid bool (true or false)")
        try:
            return _parser_for(element, optional, is_tuple, name)(value)
        except argparse.ArgumentTypeError as err:
            raise ValueError(f"{flag_name(name)}: {err}") from None
    if is_tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{flag_name(name)}: {quoted(value)} is not a list of {element.__name__}")
        return tuple(coerce(name, element, v) for v in value)
    if element is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, element) or (element is int and isinstance(value, bool)):
        raise ValueError(f"{flag_name(name)}: {quoted(value)} is not a valid {element.__name__}")
    return value


def add_flags(parser, cls, *, used_by: dict | None = None, seen: set | None = None,
              container: Any = None) -> None:
    """Adds a `--flag` for every declared field of `cls` not in `seen` (names already added).

    Defaults are shown in the help but not set: the parsed namespace holds exactly the flags
    given, so a caller can tell a given flag from a default (and refuse one its algorithm does
    not read). `used_by` maps field names to the algorithms that read them, shown in the help.
    `container(cls, field)`, where given, is the parser's argument group a field's flag goes in.
    """
    hints = typing.get_type_hints(cls)
    seen = set() if seen is None else seen
    for field in option_fields(cls):
        if field.name in seen:
            continue
        seen.add(field.name)
        target = parser if container is None else container(cls, field)
        spec = spec_of(field)
        default = field.default
        help_text = spec.help.replace("%", "%%")
        if used_by and field.name in used_by:
            help_text += f" [{', '.join(used_by[field.name])}]"
        element, optional, is_tuple = _base_type(hints[field.name])
        kwargs = {"dest": field.name, "default": argparse.SUPPRESS}
        if element is bool and not is_tuple:  # both directions, so a flag can override a config file
            target.add_argument(flag_name(field.name), action=argparse.BooleanOptionalAction,
                                help=help_text + (" (on by default)" if default else " (off by default)"), **kwargs)
            continue
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_text += f" (default: {shown})"
        if spec.choices is not None and not is_tuple:
            kwargs["choices"] = spec.choices
        target.add_argument(flag_name(field.name), type=_parser_for(element, optional, is_tuple, field.name),
                            help=help_text + (" (comma-separated)" if is_tuple else ""),
                            metavar="A,B,..." if is_tuple else None, **kwargs)


def from_mapping(cls, values: dict, *, strict: bool = True):
    """`cls(**values)` for the keys `cls` declares; `strict` refuses any other key."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if strict and unknown:
        raise ValueError(f"unknown options {unknown} for {cls.__name__}")
    kwargs = {}
    hints = typing.get_type_hints(cls)
    for k, v in values.items():
        if k in names:
            _, _, is_tuple = _base_type(hints[k])
            kwargs[k] = tuple(v) if is_tuple and isinstance(v, list) else v
    return cls(**kwargs)
