"""Local training only: every client keeps its own model and nothing is communicated.

The lower reference of the personalized methods (SpaFL's and SPATL's "Local").
There is no global model, so only personalized accuracy is reported.
"""

from __future__ import annotations

import jax.numpy as jnp

from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, FederatedAlgorithm, NoOptions, replicate
from fedjax_sparse.core.round.local_training import LocalSGD


def local_only(local: LocalSGD) -> FederatedAlgorithm:
    def init_clients(key, variables, ids):
        del key
        return replicate(variables, len(ids))

    def init(key, variables, num_clients):
        return {}, init_clients(key, variables, jnp.arange(num_clients))

    def client_update(down, client_state, data, key, info):
        del down
        variables, stats = local.train(client_state, data, key, round_index=info.index)
        return {}, variables, stats

    return FederatedAlgorithm(
        name="local",
        init=init,
        init_clients=init_clients,
        broadcast=lambda server_state, client_id, info: {},
        client_update=client_update,
        server_update=lambda server_state, ups, weights, info: server_state,
        client_variables=lambda server_state, client_state: client_state,
        global_variables=None,
    )


SPEC = AlgorithmSpec("local", NoOptions, lambda ctx, o: local_only(ctx.local),
                     "every client trains alone, nothing is sent")
