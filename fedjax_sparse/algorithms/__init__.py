"""Federated algorithms, each a `FederatedAlgorithm` of pure functions, and the name registry.

Every algorithm module declares its options (a frozen dataclass beside its
math) and an `AlgorithmSpec`; the registry below lists them, and the command
line and run config are built from those declarations.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_sparse.algorithms import fedadp as _fedadp
from fedjax_sparse.algorithms import fedavg as _fedavg
from fedjax_sparse.algorithms import feddyn as _feddyn
from fedjax_sparse.algorithms import fedgse as _fedgse
from fedjax_sparse.algorithms import fedldf as _fedldf
from fedjax_sparse.algorithms import fednova as _fednova
from fedjax_sparse.algorithms import fedp3 as _fedp3
from fedjax_sparse.algorithms import fedpm as _fedpm
from fedjax_sparse.algorithms import fjord as _fjord
from fedjax_sparse.algorithms import fedprox as _fedprox
from fedjax_sparse.algorithms import fedspa as _fedspa
from fedjax_sparse.algorithms import local as _local
from fedjax_sparse.algorithms import scaffold as _scaffold
from fedjax_sparse.algorithms import spafl as _spafl
from fedjax_sparse.algorithms import spatl as _spatl
from fedjax_sparse.algorithms import submodels as _submodels
from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.algorithms.fedldf import fedldf, fedldf_random, hdfl
from fedjax_sparse.algorithms.fednova import fednova
from fedjax_sparse.algorithms.fedprox import fedprox
from fedjax_sparse.algorithms.local import local_only
from fedjax_sparse.algorithms.scaffold import scaffold
from fedjax_sparse.algorithms.spafl import spafl, spafl_local
from fedjax_sparse.core.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm
from fedjax_sparse.core.options import from_mapping, option_fields, validate

ALGORITHMS: dict[str, AlgorithmSpec] = {spec.name: spec for spec in (
    _fedavg.SPEC, _fedprox.SPEC, _scaffold.SPEC, _fednova.SPEC, _local.SPEC, *_spafl.SPECS, *_fedldf.SPECS, _fedadp.SPEC,
    *_submodels.SPECS, _fedgse.SPEC, _spatl.SPEC, _fedpm.SPEC, _fjord.SPEC, _fedp3.SPEC, _fedspa.SPEC, _feddyn.SPEC,
)}
ALGORITHM_NAMES = tuple(ALGORITHMS)


def get_spec(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(ALGORITHM_NAMES)}")
    return ALGORITHMS[name]


def option_users() -> dict[str, tuple[str, ...]]:
    """Option name -> the algorithms that read it."""
    users: dict[str, list[str]] = {}
    for spec in ALGORITHMS.values():
        for field in option_fields(spec.options):
            users.setdefault(field.name, []).append(spec.name)
    return {k: tuple(v) for k, v in users.items()}


def _check_declarations() -> None:
    """An option shared by several algorithms must be declared identically (one flag, one default)."""
    seen: dict[str, tuple] = {}
    for spec in ALGORITHMS.values():
        for field in option_fields(spec.options):
            decl = (field.default, field.metadata["option"], field.type)
            if seen.setdefault(field.name, decl) != decl:
                raise TypeError(f"option {field.name!r} is declared differently by {spec.name} and another "
                                f"algorithm; one flag needs one declaration")


_check_declarations()


def make_options(name: str, values: dict[str, Any]) -> Any:
    """Algorithm `name`'s options from a flat mapping (keys of other algorithms are ignored), validated."""
    options = from_mapping(get_spec(name).options, values, strict=False)
    validate(options)
    return options


def make_algorithm(name: str, context: BuildContext, options: Any = None) -> FederatedAlgorithm:
    """Builds algorithm `name` with its options (defaults when None)."""
    spec = get_spec(name)
    options = spec.options() if options is None else options
    if not isinstance(options, spec.options):
        raise TypeError(f"{name} takes {spec.options.__name__}, got {type(options).__name__}")
    return spec.build(context, options)


def options_dict(options: Any) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


__all__ = ["ALGORITHMS", "ALGORITHM_NAMES", "AlgorithmSpec", "BuildContext", "FederatedAlgorithm", "fedavg",
           "fedldf", "fedldf_random", "fednova", "fedprox", "get_spec", "hdfl", "local_only", "make_algorithm",
           "make_options", "option_users", "options_dict", "scaffold", "spafl", "spafl_local"]
