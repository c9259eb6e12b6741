"""SCAFFOLD (Karimireddy et al., 2020), option II control variates, with a server learning rate.

Local steps follow g - c_i + c. After training, c_i+ = c_i - c + (x - y_i) / (a_i lr):
the paper's option II divides the displacement by K_i lr, the displacement of K_i plain
SGD steps per unit gradient. Under momentum rho the same K_i steps move the weights about
1 / (1 - rho) times further, so here a_i is the optimizer's effective number of steps
(`LocalSGD.effective_steps`, FedNova's ||a||_1; = K_i without momentum), which keeps
c_i an estimate of the client's mean gradient whatever the momentum (`building_blocks.control_variates`).
The server moves x by lr_g times the mean model delta (its optimizer's step,
`building_blocks.server_optimizer`: sgd at --server-lr lr_g by default) and c by (1/N) times the sum of
control deltas, both over the round's clients that take part. Both directions carry a
model-sized tensor twice (model and control variate), which is why its bytes per round are
double FedAvg's. As in the paper, the sampled clients are averaged uniformly. Control
variates cover the trainable weights; BatchNorm statistics travel with the model and are
averaged like it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sparse.core.messages.aggregation import uniform_mean
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, FederatedAlgorithm, PrivateSum, StaleUpload, replicate
from fedjax_sparse.building_blocks.control_variates import control_update, corrected_gradients, server_control_update
from fedjax_sparse.core.round.local_training import LocalObjective, LocalSGD
from fedjax_sparse.building_blocks.server_optimizer import (STATE_KEY, ServerOptimizer, ServerOptimizerOptions, from_options,
                                                 server_optimizer, without_optimizer_state)

tree_map = jax.tree_util.tree_map


def _increment(up, down):
    return {**up, "batch_stats": tree_map(jnp.subtract, up["batch_stats"], down["variables"]["batch_stats"])}


def _rebase(increment, down):
    return {**increment, "batch_stats": tree_map(jnp.add, down["variables"]["batch_stats"], increment["batch_stats"])}


# asynchronous rounds: the model's and the control variate's deltas are increments already; the BatchNorm
# statistics travel as values, taken as their change of what the client received. The control delta counts
# whole at any staleness: the client keeps its whole new c_i, so c = mean(c_i) holds only so
STALE_UPLOAD = StaleUpload(_increment, _rebase, unweighted=("control_delta",))


def scaffold(local: LocalSGD, num_clients: int, server: ServerOptimizer | None = None) -> FederatedAlgorithm:
    """`server`: the server optimizer (default: sgd at lr 1; the paper's eta_g is its lr)."""
    server = server or server_optimizer()

    def init_clients(key, variables, ids):
        del key
        return replicate(tree_map(jnp.zeros_like, variables["params"]), len(ids))

    def init(key, variables, n):
        if n != num_clients:
            raise ValueError(f"SCAFFOLD was built for {num_clients} clients, init got {n}")
        zeros = tree_map(jnp.zeros_like, variables["params"])
        return {**server.init_state(variables), "control": zeros}, init_clients(key, variables, jnp.arange(n))

    def client_update(down, client_control, data, key, info):
        server_control = down["control"]
        x = down["variables"]

        def correct(grads):
            return {**grads, "params": corrected_gradients(grads["params"], server_control, client_control)}

        y, stats = local.train(x, data, key, round_index=info.index, objective=LocalObjective(grad_correction=correct))
        new_control = control_update(local, client_control, server_control, x["params"], y["params"],
                                     stats["num_steps"], info.index)
        up = {"delta": tree_map(jnp.subtract, y["params"], x["params"]),
              "control_delta": tree_map(jnp.subtract, new_control, client_control),
              "batch_stats": y["batch_stats"]}
        return up, new_control, stats

    def server_update(server_state, ups, weights, info):
        del weights
        mean = uniform_mean(ups, info.participating)
        params, optimizer_state = server.apply(server_state["variables"]["params"], mean["delta"],
                                               server_state[STATE_KEY])
        control = server_control_update(server_state["control"], ups["control_delta"], num_clients,
                                        info.participating)
        return {"variables": {"params": params, "batch_stats": mean["batch_stats"]}, "control": control,
                STATE_KEY: optimizer_state}

    return FederatedAlgorithm(
        name="scaffold",
        init=init,
        init_clients=init_clients,
        broadcast=lambda server_state, client_id, info: without_optimizer_state(server_state),
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: server_state["variables"],
        global_variables=lambda server_state: server_state["variables"],
        aggregates_mean=True,  # its control update sums the present clients': their number times the mean
        stale_upload=STALE_UPLOAD,
        # differential privacy clips each upload as a change: the deltas are, the statistics are new values
        private_sum=PrivateSum(references=(("batch_stats", "variables/batch_stats"),)),
    )


SPEC = AlgorithmSpec("scaffold", ServerOptimizerOptions,
                     lambda ctx, o: scaffold(ctx.local, ctx.num_clients, from_options(o)),
                     "SCAFFOLD: control variates correct the client drift")
