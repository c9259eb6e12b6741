"""Federated algorithms, each a `FederatedAlgorithm` of pure functions, and the name registry.

Every algorithm module declares its options (a frozen dataclass beside its
math) and an `AlgorithmSpec`; the library's join the registry here
(`algorithms.registry`, which scripts and installed packages extend), and the
command line and run config are built from those declarations.
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
from fedjax_sparse.algorithms.registry import (ALGORITHMS, BUILT_IN, ENTRY_POINT_GROUP, PluginSkipped,
                                               UnknownAlgorithm, algorithm_names, flags_of, get_spec,
                                               load_entry_points, option_users, refused, register, registered,
                                               reserve)
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm
from fedjax_sparse.core.contract.options import from_mapping, validate

for _spec in (_fedavg.SPEC, _fedprox.SPEC, _scaffold.SPEC, _fednova.SPEC, _local.SPEC, *_spafl.SPECS,
              *_fedldf.SPECS, _fedadp.SPEC, *_submodels.SPECS, _fedgse.SPEC, _spatl.SPEC, _fedpm.SPEC, _fjord.SPEC,
              _fedp3.SPEC, _fedspa.SPEC, _feddyn.SPEC):
    register(_spec)
BUILT_IN.update(ALGORITHMS)


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


__all__ = ["ALGORITHMS", "BUILT_IN", "ENTRY_POINT_GROUP", "AlgorithmSpec", "BuildContext",
           "FederatedAlgorithm", "PluginSkipped", "UnknownAlgorithm", "algorithm_names", "fedavg", "fedldf",
           "fedldf_random", "fednova", "fedprox", "flags_of", "get_spec", "hdfl", "load_entry_points", "local_only",
           "make_algorithm", "make_options", "option_users", "options_dict", "refused", "register", "registered",
           "reserve", "scaffold", "spafl", "spafl_local"]
