"""FedAvg (McMahan et al., 2017): local SGD from the global model, data-size-weighted mean.

The message both ways is the model's variables: weights and, for models with
BatchNorm, its running statistics, without which the aggregate cannot predict.
"""

from __future__ import annotations

from fedjax_sparse.core.aggregation import weighted_mean
from fedjax_sparse.core.algorithm import FederatedAlgorithm
from fedjax_sparse.core.local_training import LocalSGD


def fedavg(local: LocalSGD) -> FederatedAlgorithm:
    def init(key, variables, num_clients):
        del key, num_clients
        return variables, {}

    def client_update(down, client_state, data, key):
        variables, stats = local.train(down, data, key)
        return variables, client_state, stats

    return FederatedAlgorithm(
        name="fedavg",
        init=init,
        broadcast=lambda server_state, client_id: server_state,
        client_update=client_update,
        server_update=lambda server_state, ups, weights: weighted_mean(ups, weights),
        client_variables=lambda server_state, client_state: server_state,
        global_variables=lambda server_state: server_state,
    )
