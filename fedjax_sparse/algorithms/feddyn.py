"""FedDyn (Acar et al., ICLR 2021): each client's local loss is corrected by a dynamic linear term so that
the clients' optima line up with the global one.

Client k keeps the gradient state g_k (zeros at first) and, from the server's model theta, minimizes
    L_k(w) - <g_k, w> + (alpha / 2) ||w - theta||^2
by the run's local SGD; then g_k <- g_k - alpha (w_k - theta). It uploads w_k.
Server (the paper's Algorithm 1, m = all clients, P = the round's that take part):
    h <- h - alpha (1/m) sum_{k in P} (w_k - theta)
    theta <- (1/|P|) sum_{k in P} w_k - h / alpha.
Only trainable weights carry the dynamic terms; BatchNorm statistics are averaged as FedAvg's.
Written from the library's building blocks (`fedjax_sparse.building_blocks`), as the tutorial "Write
your own algorithm" teaches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_sparse.building_blocks import (AlgorithmSpec, BuildContext, FederatedAlgorithm, LocalObjective, option,
                                           present_sum, proximal_term, replicate, uniform_mean, weighted_mean)
from fedjax_sparse.core.contract.algorithm import MODEL_UPLOAD

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class FedDynOptions:
    feddyn_alpha: float = option(0.01, "FedDyn: alpha, the weight of the dynamic regularizer", low=0.0, low_open=True)


def feddyn(context: BuildContext, options: FedDynOptions) -> FederatedAlgorithm:
    local, alpha, num_clients = context.local, options.feddyn_alpha, context.num_clients

    def init_clients(key, variables, ids):
        return replicate({"gradient": tree_map(jnp.zeros_like, variables["params"])}, len(ids))

    def init(key, variables, n):
        return ({"variables": variables, "h": tree_map(jnp.zeros_like, variables["params"])},
                init_clients(key, variables, jnp.arange(n)))

    def client_update(down, state, data, key, info):
        theta, g = down["params"], state["gradient"]

        def dynamic_term(trainable):
            linear = sum(jnp.sum(a * w) for a, w in zip(jax.tree_util.tree_leaves(g),
                                                        jax.tree_util.tree_leaves(trainable["params"])))
            return proximal_term(trainable["params"], theta, alpha) - linear

        trained, stats = local.train(down, data, key, round_index=info.index,
                                     objective=LocalObjective(extra_loss=dynamic_term))
        g = tree_map(lambda g, w, t: g - alpha * (w - t), g, trained["params"], theta)
        return trained, {"gradient": g}, stats

    def server_update(server_state, ups, weights, info):
        theta = server_state["variables"]["params"]
        # P = the clients taking part: an absent slot is in neither the drift's sum nor the mean's count
        drift = present_sum(tree_map(lambda w, t: w - t, ups["params"], theta), info.participating)
        h = tree_map(lambda h, d: h - alpha / num_clients * d, server_state["h"], drift)
        mean = uniform_mean(ups["params"], info.participating)
        params = tree_map(lambda m, h: m - h / alpha, mean, h)
        stats = weighted_mean(ups["batch_stats"], weights)
        return {"variables": {"params": params, "batch_stats": stats}, "h": h}

    return FederatedAlgorithm(
        name="feddyn", init=init, init_clients=init_clients,
        broadcast=lambda server_state, client_id, info: server_state["variables"],
        client_update=client_update, server_update=server_update,
        client_variables=lambda server_state, client_state: server_state["variables"],
        global_variables=lambda server_state: server_state["variables"], aggregates_mean=True,
        stale_upload=MODEL_UPLOAD)


SPEC = AlgorithmSpec("feddyn", FedDynOptions, feddyn,
                     "FedDyn: a dynamic linear term aligns the clients' local optima with the global one")
