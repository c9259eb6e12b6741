"""Federated algorithms, each a `FederatedAlgorithm` of pure functions."""

from __future__ import annotations

from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.algorithms.fednova import fednova
from fedjax_sparse.algorithms.fedprox import fedprox
from fedjax_sparse.algorithms.local import local_only
from fedjax_sparse.algorithms.scaffold import scaffold
from fedjax_sparse.core.algorithm import FederatedAlgorithm
from fedjax_sparse.core.local_training import LocalSGD

ALGORITHM_NAMES = ("fedavg", "fedprox", "scaffold", "fednova", "local")


def make_algorithm(name: str, local: LocalSGD, *, num_clients: int, mu: float = 0.01,
                   server_lr: float = 1.0) -> FederatedAlgorithm:
    """Builds algorithm `name` from the command line's flags."""
    if name == "fedavg":
        return fedavg(local)
    if name == "fedprox":
        return fedprox(local, mu)
    if name == "scaffold":
        return scaffold(local, num_clients, server_lr)
    if name == "fednova":
        return fednova(local)
    if name == "local":
        return local_only(local)
    raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(ALGORITHM_NAMES)}")


__all__ = ["ALGORITHM_NAMES", "FederatedAlgorithm", "fedavg", "fednova", "fedprox", "local_only",
           "make_algorithm", "scaffold"]
