"""FedNova (Wang et al., 2020): normalized averaging of local progress.

Client i runs tau_i local steps; with SGD momentum rho its cumulative step
weights sum to ||a_i||_1 (`LocalSGD.effective_steps`; = tau_i without
momentum). It sends the normalized update (x - y_i) / ||a_i||_1 and
||a_i||_1; the server steps x <- x - tau_eff * sum_i p_i (x - y_i) / ||a_i||_1
with p_i the data-size weights and tau_eff = sum_i p_i ||a_i||_1. With equal
tau_i this is exactly FedAvg. That step, -tau_eff sum_i p_i d_i, is the mean delta
the server optimizer takes (`building_blocks.server_optimizer`; sgd at lr 1 by default: the
paper's rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sparse.core.messages.aggregation import normalized, weighted_mean
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, FederatedAlgorithm
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.building_blocks.server_optimizer import (STATE_KEY, ServerOptimizer, ServerOptimizerOptions, from_options,
                                                 server_optimizer)

tree_map = jax.tree_util.tree_map


def fednova(local: LocalSGD, server: ServerOptimizer | None = None) -> FederatedAlgorithm:
    server = server or server_optimizer()

    def init(key, variables, num_clients):
        del key, num_clients
        return server.init_state(variables), {}

    def client_update(down, client_state, data, key, info):
        y, stats = local.train(down, data, key, round_index=info.index)
        a_norm = local.effective_steps(stats["num_steps"])
        # times the reciprocal, not divided by a_norm: XLA rewrites a division by a broadcast scalar into this
        # product on one device but not in a program partitioned over several, and the two round apart
        inverse = 1.0 / a_norm
        up = {"normalized_update": tree_map(lambda w0, w1: (w0 - w1) * inverse, down["params"], y["params"]),
              "a_norm": a_norm,
              "batch_stats": y["batch_stats"]}
        return up, client_state, stats

    def server_update(server_state, ups, weights, info):
        del info
        p = normalized(weights)
        tau_eff = jnp.sum(p * ups["a_norm"])
        mean = weighted_mean({"u": ups["normalized_update"], "b": ups["batch_stats"]}, weights)
        params, optimizer_state = server.apply(server_state["variables"]["params"],
                                               tree_map(lambda d: -tau_eff * d, mean["u"]), server_state[STATE_KEY])
        return {"variables": {"params": params, "batch_stats": mean["b"]}, STATE_KEY: optimizer_state}

    return FederatedAlgorithm(
        name="fednova",
        init=init,
        broadcast=lambda server_state, client_id, info: server_state["variables"],
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: server_state["variables"],
        global_variables=lambda server_state: server_state["variables"],
    )


SPEC = AlgorithmSpec("fednova", ServerOptimizerOptions, lambda ctx, o: fednova(ctx.local, from_options(o)),
                     "FedNova: normalized averaging of local progress")
