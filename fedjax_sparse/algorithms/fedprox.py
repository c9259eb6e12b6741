"""FedProx (Li et al., 2020): FedAvg plus (mu / 2) ||w - w_global||^2 in every local step."""

from __future__ import annotations

import dataclasses

from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, FederatedAlgorithm
from fedjax_sparse.core.round.local_training import LocalObjective, LocalSGD, proximal_term
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import ServerOptimizer, ServerOptimizerOptions, from_options


@dataclasses.dataclass(frozen=True)
class FedProxOptions(ServerOptimizerOptions):
    mu: float = option(0.01, "FedProx proximal coefficient", low=0.0)


def fedprox(local: LocalSGD, mu: float, server: ServerOptimizer | None = None) -> FederatedAlgorithm:
    if not mu >= 0:
        raise ValueError(f"--mu must be >= 0, got {mu}")
    base = fedavg(local, server=server)

    def client_update(down, client_state, data, key, info):
        anchor = down["params"]
        objective = LocalObjective(extra_loss=lambda trainable: proximal_term(trainable["params"], anchor, mu))
        variables, stats = local.train(down, data, key, round_index=info.index, objective=objective)
        return variables, client_state, stats

    return dataclasses.replace(base, name="fedprox", client_update=client_update)


SPEC = AlgorithmSpec("fedprox", FedProxOptions, lambda ctx, o: fedprox(ctx.local, o.mu, from_options(o)),
                     "FedProx: FedAvg with a proximal term")
