"""SCAFFOLD (Karimireddy et al., 2020), option II control variates, with a server learning rate.

Local steps follow g - c_i + c. After training, c_i+ = c_i - c + (x - y_i) / (K_i lr)
with K_i the client's real number of steps. The server moves x by lr_g times the
mean model delta and c by (1/N) times the sum of control deltas. Both directions
carry a model-sized tensor twice (model and control variate), which is why its
bytes per round are double FedAvg's. As in the paper, the sampled clients are
averaged uniformly. Control variates cover the trainable weights; BatchNorm
statistics travel with the model and are averaged like it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sparse.core.aggregation import uniform_mean
from fedjax_sparse.core.algorithm import FederatedAlgorithm, replicate
from fedjax_sparse.core.local_training import LocalSGD

tree_map = jax.tree_util.tree_map


def scaffold(local: LocalSGD, num_clients: int, server_lr: float = 1.0) -> FederatedAlgorithm:
    if not server_lr > 0:
        raise ValueError(f"SCAFFOLD server learning rate must be > 0, got {server_lr}")

    def init(key, variables, n):
        del key
        if n != num_clients:
            raise ValueError(f"SCAFFOLD was built for {num_clients} clients, init got {n}")
        zeros = tree_map(jnp.zeros_like, variables["params"])
        return {"variables": variables, "control": zeros}, replicate(zeros, n)

    def client_update(down, client_control, data, key):
        server_control = down["control"]
        x = down["variables"]

        def correct(grads):
            return tree_map(lambda g, c, ci: g + c - ci, grads, server_control, client_control)

        y, stats = local.train(x, data, key, grad_correction=correct)
        scale = 1.0 / (stats["num_steps"].astype(jnp.float32) * local.learning_rate)
        new_control = tree_map(lambda ci, c, w0, w1: ci - c + (w0 - w1) * scale,
                               client_control, server_control, x["params"], y["params"])
        up = {"delta": tree_map(jnp.subtract, y["params"], x["params"]),
              "control_delta": tree_map(jnp.subtract, new_control, client_control),
              "batch_stats": y["batch_stats"]}
        return up, new_control, stats

    def server_update(server_state, ups, weights):
        del weights
        mean = uniform_mean(ups)
        params = tree_map(lambda w, d: w + server_lr * d, server_state["variables"]["params"], mean["delta"])
        sampled = jax.tree_util.tree_leaves(ups["control_delta"])[0].shape[0]
        control = tree_map(lambda c, d: c + (sampled / num_clients) * d,
                           server_state["control"], mean["control_delta"])
        return {"variables": {"params": params, "batch_stats": mean["batch_stats"]}, "control": control}

    return FederatedAlgorithm(
        name="scaffold",
        init=init,
        broadcast=lambda server_state, client_id: server_state,
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: server_state["variables"],
        global_variables=lambda server_state: server_state["variables"],
    )
