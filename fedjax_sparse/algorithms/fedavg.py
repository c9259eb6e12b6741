"""FedAvg (McMahan et al., 2017): local SGD from the global model, then the mean of the clients' models.

The message both ways is the model's variables: weights and, for models with
BatchNorm, its running statistics, without which the aggregate cannot predict.
The mean is weighted by the clients' numbers of examples (`data`, McMahan et
al.) or uniform over the sampled clients that take part (`uniform`, as SpaFL's
appendix A.1.1 runs its FedAvg baseline). The server steps toward it with its optimizer
(`building_blocks.server_optimizer`; default sgd at lr 1: the mean replaces the global
model, McMahan et al.'s rule; adam: FedAdam).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fedjax_sparse.core.messages.aggregation import weighted_mean
from fedjax_sparse.core.contract.algorithm import MODEL_UPLOAD, AlgorithmSpec, FederatedAlgorithm
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import ServerOptimizer, ServerOptimizerOptions, from_options, server_optimizer


@dataclasses.dataclass(frozen=True)
class FedAvgOptions(ServerOptimizerOptions):
    aggregation_weights: str = option("data", "weights of the clients' models in the mean: their numbers of "
                                              "examples (data) or equal (uniform)", choices=("data", "uniform"))


def fedavg(local: LocalSGD, aggregation_weights: str = "data",
           server: ServerOptimizer | None = None) -> FederatedAlgorithm:
    """`server`: the server optimizer (default: sgd at lr 1, whose step is the mean itself)."""
    if aggregation_weights not in ("data", "uniform"):
        raise ValueError(f"--aggregation-weights must be data or uniform, got {aggregation_weights!r}")
    server = server or server_optimizer()

    def init(key, variables, num_clients):
        del key, num_clients
        return server.init_state(variables), {}

    def client_update(down, client_state, data, key, info):
        variables, stats = local.train(down, data, key, round_index=info.index)
        return variables, client_state, stats

    def server_update(server_state, ups, weights, info):
        if aggregation_weights == "uniform":  # equal weights for the clients taking part, none for the absent
            weights = jnp.ones_like(weights) if info.participating is None else info.participating.astype(weights.dtype)
        return server.step_toward(server_state, weighted_mean(ups, weights))

    return FederatedAlgorithm(
        name="fedavg",
        init=init,
        broadcast=lambda server_state, client_id, info: server_state["variables"],
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: server_state["variables"],
        global_variables=lambda server_state: server_state["variables"],
        stale_upload=MODEL_UPLOAD,
        aggregates_mean=True,
    )


SPEC = AlgorithmSpec("fedavg", FedAvgOptions,
                     lambda ctx, o: fedavg(ctx.local, o.aggregation_weights, from_options(o)),
                     "FedAvg: local SGD, mean of the clients' models")
