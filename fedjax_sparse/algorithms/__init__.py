"""Federated algorithms, each a `FederatedAlgorithm` of pure functions, and the name registry."""

from __future__ import annotations

from typing import Any, Callable

from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.algorithms.fedldf import fedldf, fedldf_random, hdfl
from fedjax_sparse.algorithms.fednova import fednova
from fedjax_sparse.algorithms.fedprox import fedprox
from fedjax_sparse.algorithms.local import local_only
from fedjax_sparse.algorithms.scaffold import scaffold
from fedjax_sparse.algorithms.spafl import spafl, spafl_local
from fedjax_sparse.core.algorithm import FederatedAlgorithm
from fedjax_sparse.core.local_training import LocalSGD

# name -> builder(local training, run config with the algorithm's flags)
ALGORITHMS: dict[str, Callable[[LocalSGD, Any], FederatedAlgorithm]] = {
    "fedavg": lambda local, config: fedavg(local),
    "fedprox": lambda local, config: fedprox(local, config.mu),
    "scaffold": lambda local, config: scaffold(local, config.num_clients, config.server_lr),
    "fednova": lambda local, config: fednova(local),
    "local": lambda local, config: local_only(local),
    "spafl": lambda local, config: spafl(local, config.sparsity_coef, weight_bounds=config.weight_bounds,
                                         threshold_update=config.threshold_update),
    "spafl_local": lambda local, config: spafl_local(local, config.sparsity_coef,
                                                     weight_bounds=config.weight_bounds),
    "fedldf": lambda local, config: fedldf(local, config.clients_per_layer, config.clients_per_round),
    "fedldf_random": lambda local, config: fedldf_random(local, config.clients_per_layer,
                                                         config.clients_per_round),
    "hdfl": lambda local, config: hdfl(local, config.clients_per_layer, config.clients_per_round),
}
ALGORITHM_NAMES = tuple(ALGORITHMS)


def make_algorithm(name: str, local: LocalSGD, config: Any) -> FederatedAlgorithm:
    """Builds algorithm `name`; `config` carries its flags (a `RunConfig`)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(ALGORITHM_NAMES)}")
    return ALGORITHMS[name](local, config)


__all__ = ["ALGORITHMS", "ALGORITHM_NAMES", "FederatedAlgorithm", "fedavg", "fedldf", "fedldf_random",
           "fednova", "fedprox", "hdfl", "local_only", "make_algorithm", "scaffold", "spafl", "spafl_local"]
