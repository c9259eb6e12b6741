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
default, range and type), checked as each algorithm registers, and no algorithm may declare a flag the run
itself declares (`reserve`: the run's shared options such as `--lr`, the command line's own flags), which
would otherwise train with the run's value while config.json recorded the algorithm's.

An installed package is not the library's to vouch for: a plug-in that cannot be imported, names no
`AlgorithmSpec`, takes a built-in's name or another package's, or declares a flag another declaration owns
is skipped with one line saying so (`REFUSED`, and a `PluginSkipped` warning), so that it breaks no other
algorithm; asking for it by name gives that line as the error. Algorithms from outside the library have
their contract checked on shapes before their first round (`core.contract.check`).
"""

from __future__ import annotations

import dataclasses
import typing
import warnings

from fedjax_sparse.core.contract.algorithm import AlgorithmSpec
from fedjax_sparse.core.contract.options import flag_name, option_fields
from fedjax_sparse.plugins import EntryPointGroup, brief, package_of

ENTRY_POINT_GROUP = "fedjax_sparse.algorithms"
ALGORITHMS: dict[str, AlgorithmSpec] = {}
BUILT_IN: set[str] = set()
# a plug-in (or a script's algorithm) not registered -> why, in one line (its package and what it clashes with)
REFUSED: dict[str, str] = {}
_PLUGIN_PACKAGES: dict[str, str] = {}  # a registered plug-in's name -> the package that declares it
_RESERVED: dict[str, str] = {}  # a flag the run declares itself -> who declares it
INSTALLED = EntryPointGroup(ENTRY_POINT_GROUP)


class UnknownAlgorithm(ValueError):
    """A name no registered algorithm has; the message lists the registered ones (or says why it was refused)."""


class PluginSkipped(UserWarning):
    """An installed package's algorithm was not registered; the message says why, in one line."""


def _declarations(spec: AlgorithmSpec) -> dict:
    hints = typing.get_type_hints(spec.options)  # `float` and "float" (postponed annotations) alike
    return {f.name: (f.default, f.metadata["option"], hints[f.name]) for f in option_fields(spec.options)}


def flags_of(options: type) -> dict[str, str]:
    """The flags an options dataclass puts on the command line, as `core.contract.options.add_flags` makes them
    (a bool option both --x and --no-x): flag -> option name."""
    hints = typing.get_type_hints(options)
    flags = {}
    for field in option_fields(options):
        flags[flag_name(field.name)] = field.name
        annotation = hints[field.name]
        if typing.get_origin(annotation) is not tuple and bool in (annotation, *typing.get_args(annotation)):
            flags["--no-" + flag_name(field.name)[2:]] = field.name
    return flags


def _origin(name: str, spec: AlgorithmSpec) -> str:
    if name in BUILT_IN:
        return "fedjax-sparse (built in)"
    if name in _PLUGIN_PACKAGES:
        return f"package {_PLUGIN_PACKAGES[name]!r}"
    return f"module {spec.build.__module__}"


def _reserved_clash(spec: AlgorithmSpec, origin: str) -> str | None:
    for flag, option_name in flags_of(spec.options).items():
        if flag in _RESERVED:
            return (f"option {option_name!r} of algorithm {spec.name} ({origin}) makes the flag {flag}, which "
                    f"{_RESERVED[flag]} declares; one flag needs one declaration: rename {spec.name}'s option")
    return None


def _check(spec: AlgorithmSpec, origin: str, replace: bool) -> None:
    """Raises, in one line naming both declarations, if `spec` cannot join the registry as it stands."""
    if not spec.name or not spec.name.replace("_", "").isalnum():
        raise ValueError(f"an algorithm's name is letters, digits and underscores (a --algorithm value), got "
                         f"{spec.name!r} ({origin})")
    if not dataclasses.is_dataclass(spec.options):
        raise TypeError(f"algorithm {spec.name!r} ({origin}): its options must be a dataclass (NoOptions for none), "
                        f"got {spec.options!r}")
    known = ALGORITHMS.get(spec.name)
    if known is not None and known is not spec and known != spec and not replace:
        raise ValueError(f"algorithm {spec.name!r} ({origin}) is registered already (by "
                         f"{_origin(spec.name, known)}); choose another name, or register(spec, replace=True)")
    clash = _reserved_clash(spec, origin)
    if clash is not None:
        raise TypeError(clash)
    mine = _declarations(spec)
    for other in ALGORITHMS.values():
        if other.name == spec.name:
            continue
        for name, declaration in _declarations(other).items():
            if name in mine and mine[name] != declaration:
                raise TypeError(f"option {name!r} is declared differently by {spec.name} ({origin}) and "
                                f"{other.name} ({_origin(other.name, other)}); one flag needs one declaration "
                                f"(rename {spec.name}'s, or declare it as {other.name} does)")


def register(spec: AlgorithmSpec, *, replace: bool = False) -> AlgorithmSpec:
    """Adds `spec` to the registry (again: nothing, if it is the same spec) and returns it.

    Refused in one line: a spec that is no `AlgorithmSpec`, a name taken by another spec (unless
    `replace`), options that are not a dataclass, an option declared differently by another algorithm,
    or a flag the run declares itself (`reserve`).
    """
    if not isinstance(spec, AlgorithmSpec):
        raise TypeError(f"register takes an AlgorithmSpec (fedjax_sparse.core.contract.algorithm), got {type(spec).__name__}")
    _check(spec, f"module {spec.build.__module__}", replace)
    ALGORITHMS[spec.name] = spec
    REFUSED.pop(spec.name, None)
    _PLUGIN_PACKAGES.pop(spec.name, None)  # (a script's, replacing a plug-in's)
    return spec


def _refuse(name: str, why: str) -> None:
    REFUSED.setdefault(name, why)
    warnings.warn(f"{why}; skipped", PluginSkipped, stacklevel=3)


def reserve(flags: typing.Iterable[str], owner: str) -> None:
    """Marks `flags` as declared by `owner` (the run's shared options, the command line's own flags): an
    algorithm declaring one is refused when it registers, and one registered before (a script may register
    before it imports the run layer) is taken out of the registry, asking for it then giving the line."""
    for flag in flags:
        _RESERVED.setdefault(flag, owner)  # the first owner named stays (the command line reserves the run's too)
    for name, spec in list(ALGORITHMS.items()):
        clash = _reserved_clash(spec, _origin(name, spec))
        if clash is not None:
            del ALGORITHMS[name]
            _refuse(name, clash)


def load_entry_points() -> None:
    """Registers the algorithms installed packages declare (group `fedjax_sparse.algorithms`), once.

    Nothing an installed package does raises here: each plug-in that fails is skipped (`REFUSED`). Two
    packages offering one name are both skipped, whatever order the environment lists them in."""
    offers: dict[str, list[tuple[AlgorithmSpec, str]]] = {}

    def where(entry):
        return (f"plug-in algorithm {entry.name!r} of package {package_of(entry)!r} (entry point {entry.name} = "
                f"{entry.value!r})")

    def take(entry, value):
        specs = value if isinstance(value, (tuple, list)) else (value,)
        odd = next((spec for spec in specs if not isinstance(spec, AlgorithmSpec)), None)
        if odd is not None or not specs:
            what = f"an object of type {type(odd).__name__}" if specs else "an empty tuple"
            _refuse(entry.name, f"{where(entry)} gives {what}, not an AlgorithmSpec (or a tuple of them)")
            return
        for spec in specs:
            offers.setdefault(spec.name, []).append((spec, package_of(entry)))

    if not INSTALLED.load(take, lambda entry, why: _refuse(entry.name, f"{where(entry)} cannot be loaded: {why}")):
        return
    for name, offered in offers.items():
        distinct = [(spec, package) for i, (spec, package) in enumerate(offered)
                    if all(spec != before for before, _ in offered[:i])]
        if len(distinct) > 1:
            packages = sorted({package for _, package in distinct})
            by = (f"packages {' and '.join(map(repr, packages))}" if len(packages) > 1 else
                  f"package {packages[0]!r} twice")
            _refuse(name, f"plug-in algorithm {name!r} is declared by {by}; uninstall one")
            continue
        spec, package = distinct[0]
        if name in ALGORITHMS and ALGORITHMS[name] != spec:
            _refuse(name, f"plug-in algorithm {name!r} of package {package!r} takes the name of algorithm {name} "
                          f"of {_origin(name, ALGORITHMS[name])}; rename it")
            continue
        try:
            _check(spec, f"plug-in of package {package!r}", replace=False)
        except (ValueError, TypeError) as err:
            _refuse(name, str(err))
            continue
        except Exception as err:  # noqa: BLE001 - e.g. its options' annotations name what its module lacks
            _refuse(name, f"plug-in algorithm {name!r} of package {package!r}: its options cannot be read: "
                          f"{brief(err)}")
            continue
        ALGORITHMS[name] = spec
        _PLUGIN_PACKAGES[name] = package


def registered() -> dict[str, AlgorithmSpec]:
    """The live registry, installed packages' algorithms included."""
    load_entry_points()
    return ALGORITHMS


def algorithm_names() -> tuple[str, ...]:
    return tuple(registered())


def refused() -> dict[str, str]:
    """Installed (or registered) algorithms left out of the registry -> why, one line each."""
    load_entry_points()
    return REFUSED


def get_spec(name: str) -> AlgorithmSpec:
    specs = registered()
    if name not in specs and name in REFUSED:
        raise UnknownAlgorithm(REFUSED[name])
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
