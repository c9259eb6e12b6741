"""The algorithm contract: a few pure functions over pytrees.

Modelled on optax's `(init, update)` pairs and fedjax's `FederatedAlgorithm`.
The engine (`core.round`) vmaps `broadcast` and `client_update` over the sampled
clients and jits the whole round; an algorithm owns only its math.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.data.federated import ClientData

ServerState = Any
ClientState = Any
Message = Any
Variables = dict


@dataclasses.dataclass(frozen=True)
class FederatedAlgorithm:
    """A federated algorithm as pure functions.

    init(key, variables, num_clients) -> (server_state, client_states)
        `variables` are the initial model variables; client states carry a
        leading [num_clients] axis (use `replicate`).
    broadcast(server_state, client_id) -> down_message
        exactly what the server sends to one sampled client.
    client_update(down_message, client_state, data, key) -> (up_message, client_state, metrics)
        metrics: a dict of scalars, at least 'loss' and 'num_steps'.
    server_update(server_state, up_messages, weights) -> server_state
        up_messages stacked on a leading [K] axis; weights: the sampled clients'
        numbers of training examples.
    client_variables(server_state, client_state) -> the variables a client predicts with.
    global_variables(server_state) -> variables, or None when there is no global model.
    select_uploads(up_messages, weights, key) -> up_messages, optional
        for methods where the server tells clients what to upload after seeing
        their feedback (FedLDF): returns what is really sent, which is what the
        uplink bytes are counted on and what server_update receives.
    diagnostics(server_state, client_states) -> dict of scalars, optional
        extra figures logged with each evaluation (density, FLOPs, ...).
    """

    name: str
    init: Callable[[jax.Array, Variables, int], tuple[ServerState, ClientState]]
    broadcast: Callable[[ServerState, jax.Array], Message]
    client_update: Callable[[Message, ClientState, ClientData, jax.Array], tuple[Message, ClientState, dict]]
    server_update: Callable[[ServerState, Message, jax.Array], ServerState]
    client_variables: Callable[[ServerState, ClientState], Variables]
    global_variables: Callable[[ServerState], Variables] | None = None
    select_uploads: Callable[[Message, jax.Array, jax.Array], Message] | None = None
    diagnostics: Callable[[ServerState, ClientState], dict] | None = None


def replicate(tree: Any, num_clients: int) -> Any:
    """Stacks `num_clients` copies of `tree` on a new leading axis."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients, *jnp.shape(x))), tree)
