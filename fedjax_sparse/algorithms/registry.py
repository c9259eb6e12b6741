"""The algorithms a run can name: the library's own, those registered by a script, and those installed packages
declare, one live registry that the command line, run configs, `--resume` and the experiment modules read.

* `register(spec)`: an `AlgorithmSpec` defined anywhere (a script, a notebook) joins the registry; its
  options become flags (`fedjax-sparse run --help` lists them with the algorithms that read them), and a
  script that registers and then calls `fedjax_sparse.run.cli.main` runs it like any other.
* Entry points: a package declaring, in its pyproject.toml,

      [project.entry-points."fedjax_sparse.algorithms"]
      topk_fedavg = "my_package.topk:SPEC"

  has `my_package.topk.SPEC` (an `AlgorithmSpec`, or a tuple of them) registered the first time the
  registry is read, once the package is installed: no patch of the library.
One flag, one declaration: an option that several algorithms declare must be declared identically (same
default, range and type), checked as each algorithm registers. Algorithms from outside the library have
their contract checked on shapes before their first round (`core.contract`).
"""

from __future__ import annotations

import dataclasses
import typing
from importlib import metadata
from typing import Iterable

from fedjax_sparse.core.algorithm import AlgorithmSpec
from fedjax_sparse.core.options import option_fields

ENTRY_POINT_GROUP = "fedjax_sparse.algorithms"
ALGORITHMS: dict[str, AlgorithmSpec] = {}
BUILT_IN: set[str] = set()
_entry_points_loaded = False


class UnknownAlgorithm(ValueError):
    """A name no registered algorithm has; the message lists the registered ones."""


def _declarations(spec: AlgorithmSpec) -> dict:
    hints = typing.get_type_hints(spec.options)  # `float` and "float" (postponed annotations) alike
    return {f.name: (f.default, f.metadata["option"], hints[f.name]) for f in option_fields(spec.options)}


def register(spec: AlgorithmSpec, *, replace: bool = False) -> AlgorithmSpec:
    """Adds `spec` to the registry (again: nothing, if it is the same spec) and returns it.

    Refused in one line: a spec that is no `AlgorithmSpec`, a name taken by another spec (unless
    `replace`), options that are not a dataclass, or an option declared differently by another algorithm.
    """
    if not isinstance(spec, AlgorithmSpec):
        raise TypeError(f"register takes an AlgorithmSpec (fedjax_sparse.core.algorithm), got {type(spec).__name__}")
    if not spec.name or not spec.name.replace("_", "").isalnum():
        raise ValueError(f"an algorithm's name is letters, digits and underscores (a --algorithm value), got "
                         f"{spec.name!r}")
    if not dataclasses.is_dataclass(spec.options):
        raise TypeError(f"algorithm {spec.name!r}: its options must be a dataclass (NoOptions for none), got "
                        f"{spec.options!r}")
    known = ALGORITHMS.get(spec.name)
    if known is not None and known is not spec and known != spec and not replace:
        raise ValueError(f"algorithm {spec.name!r} is registered already (by {known.build.__module__}); choose another "
                         f"name, or register(spec, replace=True)")
    mine = _declarations(spec)
    for other in ALGORITHMS.values():
        if other.name == spec.name:
            continue
        for name, declaration in _declarations(other).items():
            if name in mine and mine[name] != declaration:
                raise TypeError(f"option {name!r} is declared differently by {spec.name} and {other.name}; one flag "
                                f"needs one declaration (rename {spec.name}'s, or declare it as {other.name} does)")
    ALGORITHMS[spec.name] = spec
    return spec


def _specs_of(value, where: str) -> Iterable[AlgorithmSpec]:
    specs = value if isinstance(value, (tuple, list)) else (value,)
    for spec in specs:
        if not isinstance(spec, AlgorithmSpec):
            raise TypeError(f"entry point {where} gives a {type(spec).__name__}; it must name an AlgorithmSpec (or a "
                            f"tuple of them)")
    return specs


def load_entry_points() -> None:
    """Registers the algorithms installed packages declare (group `fedjax_sparse.algorithms`), once."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"{entry.name} = {entry.value!r} (group {ENTRY_POINT_GROUP})"
        try:
            value = entry.load()
        except Exception as err:  # noqa: BLE001 - an installed package's import may fail any way
            raise ImportError(f"entry point {where} cannot be loaded: {type(err).__name__}: {err}") from None
        for spec in _specs_of(value, where):
            register(spec)


def registered() -> dict[str, AlgorithmSpec]:
    """The live registry, installed packages' algorithms included."""
    load_entry_points()
    return ALGORITHMS


def algorithm_names() -> tuple[str, ...]:
    return tuple(registered())


def get_spec(name: str) -> AlgorithmSpec:
    specs = registered()
    if name not in specs:
        raise UnknownAlgorithm(f"unknown algorithm {name!r}; registered: {', '.join(specs)} (an algorithm from outside "
                               f"the library joins with fedjax_sparse.algorithms.register or the entry point group "
                               f"{ENTRY_POINT_GROUP})")
    return specs[name]


def option_users() -> dict[str, tuple[str, ...]]:
    """Option name -> the algorithms that read it."""
    users: dict[str, list[str]] = {}
    for spec in registered().values():
        for field in option_fields(spec.options):
            users.setdefault(field.name, []).append(spec.name)
    return {k: tuple(v) for k, v in users.items()}
