"""FedNova (Wang et al., 2020): normalized averaging of local progress.

Client i runs tau_i local steps; with SGD momentum rho its cumulative step
weights sum to ||a_i||_1 (`LocalSGD.effective_steps`; = tau_i without
momentum). It sends the normalized update (x - y_i) / ||a_i||_1 and
||a_i||_1; the server steps x <- x - tau_eff * sum_i p_i (x - y_i) / ||a_i||_1
with p_i the data-size weights and tau_eff = sum_i p_i ||a_i||_1. With equal
tau_i this is exactly FedAvg.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sparse.core.aggregation import normalized, weighted_mean
from fedjax_sparse.core.algorithm import AlgorithmSpec, FederatedAlgorithm, NoOptions
from fedjax_sparse.core.local_training import LocalSGD

tree_map = jax.tree_util.tree_map


def fednova(local: LocalSGD) -> FederatedAlgorithm:
    def init(key, variables, num_clients):
        del key, num_clients
        return variables, {}

    def client_update(down, client_state, data, key, info):
        y, stats = local.train(down, data, key, round_index=info.index)
        a_norm = local.effective_steps(stats["num_steps"])
        up = {"normalized_update": tree_map(lambda w0, w1: (w0 - w1) / a_norm, down["params"], y["params"]),
              "a_norm": a_norm,
              "batch_stats": y["batch_stats"]}
        return up, client_state, stats

    def server_update(server_state, ups, weights, info):
        del info
        p = normalized(weights)
        tau_eff = jnp.sum(p * ups["a_norm"])
        mean = weighted_mean({"u": ups["normalized_update"], "b": ups["batch_stats"]}, weights)
        params = tree_map(lambda w, d: w - tau_eff * d, server_state["params"], mean["u"])
        return {"params": params, "batch_stats": mean["b"]}

    return FederatedAlgorithm(
        name="fednova",
        init=init,
        broadcast=lambda server_state, client_id, info: server_state,
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: server_state,
        global_variables=lambda server_state: server_state,
    )


SPEC = AlgorithmSpec("fednova", NoOptions, lambda ctx, o: fednova(ctx.local),
                     "FedNova: normalized averaging of local progress")
