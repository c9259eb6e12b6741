"""FedProx (Li et al., 2020): FedAvg plus (mu / 2) ||w - w_global||^2 in every local step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.core.algorithm import FederatedAlgorithm
from fedjax_sparse.core.local_training import LocalSGD


def proximal_term(params, anchor, mu: float):
    squares = jax.tree_util.tree_map(lambda w, a: jnp.sum((w - a) ** 2), params, anchor)
    return 0.5 * mu * sum(jax.tree_util.tree_leaves(squares))


def fedprox(local: LocalSGD, mu: float) -> FederatedAlgorithm:
    if mu < 0:
        raise ValueError(f"FedProx mu must be >= 0, got {mu}")
    base = fedavg(local)

    def client_update(down, client_state, data, key):
        anchor = down["params"]
        variables, stats = local.train(down, data, key,
                                       extra_loss=lambda params: proximal_term(params, anchor, mu))
        return variables, client_state, stats

    return dataclasses.replace(base, name="fedprox", client_update=client_update)
