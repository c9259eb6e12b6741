"""One federated round as one jitted computation.

    seed, round -> sample clients -> gather their states -> vmap(broadcast, client_update)
                -> server_update -> scatter client states -> per-client bytes and metrics

Clients are sampled by a pure function of (seed, round), so a resumed run
samples the same clients. With a mesh, the sampled-clients axis is sharded over
its `clients` axis and XLA turns the aggregation into a cross-device reduction.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_sparse.core.algorithm import FederatedAlgorithm
from fedjax_sparse.core.messages import message_bytes
from fedjax_sparse.data.federated import FederatedSplit

CLIENTS_AXIS = "clients"


@flax.struct.dataclass
class RoundOutput:
    """Per sampled client: ids, bytes both ways and local-training metrics ([K] each)."""

    client_ids: jax.Array
    uplink_bytes: jax.Array
    downlink_bytes: jax.Array
    metrics: dict


def sample_clients(seed: int, round_index: jax.Array, num_clients: int, clients_per_round: int) -> jax.Array:
    """The clients of a round: a pure function of the seed and the round index."""
    key = jax.random.fold_in(jax.random.key(seed), round_index)
    return jnp.sort(jax.random.choice(key, num_clients, (clients_per_round,), replace=False))


def client_keys(seed: int, round_index: jax.Array, client_ids: jax.Array) -> jax.Array:
    """Each client's randomness for a round, tied to (seed, round, client id)."""
    base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), round_index), 1 << 20)
    return jax.vmap(lambda c: jax.random.fold_in(base, c))(client_ids)


def server_key(seed: int, round_index: jax.Array) -> jax.Array:
    """The server's randomness for a round (e.g. random upload selection)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), round_index), (1 << 20) + 1)


def clients_mesh(devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(devices, (CLIENTS_AXIS,))


def build_round(algorithm: FederatedAlgorithm, train: FederatedSplit, clients_per_round: int, *,
                seed: int, mesh: Mesh | None = None) -> Callable[[Any, Any, jax.Array], tuple[Any, Any, RoundOutput]]:
    """Returns jitted `round(server_state, client_states, round_index)`."""
    num_clients = train.num_clients
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(f"clients per round must be in [1, {num_clients}], got {clients_per_round}")
    if mesh is not None and clients_per_round % mesh.size:
        raise ValueError(f"clients per round ({clients_per_round}) must be a multiple of the "
                         f"{mesh.size} devices of the '{CLIENTS_AXIS}' mesh axis")

    def shard(tree):
        if mesh is None:
            return tree
        spec = NamedSharding(mesh, PartitionSpec(CLIENTS_AXIS))
        return jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, spec), tree)

    def one_client(down, client_state, client_id, key):
        up, client_state, metrics = algorithm.client_update(down, client_state, train.client(client_id), key)
        return up, client_state, metrics, message_bytes(down)

    def round_fn(server_state, client_states, round_index):
        ids = sample_clients(seed, round_index, num_clients, clients_per_round)
        keys = client_keys(seed, round_index, ids)
        sampled = jax.tree_util.tree_map(lambda a: a[ids], client_states)
        ids, keys, sampled = shard((ids, keys, sampled))
        down = jax.vmap(algorithm.broadcast, in_axes=(None, 0))(server_state, ids)
        ups, new_states, metrics, down_bytes = jax.vmap(one_client)(down, sampled, ids, keys)
        weights = train.counts[ids].astype(jnp.float32)
        if algorithm.select_uploads is not None:
            ups = algorithm.select_uploads(ups, weights, server_key(seed, round_index))
        up_bytes = jax.vmap(message_bytes, axis_size=clients_per_round)(ups)
        server_state = algorithm.server_update(server_state, ups, weights)
        client_states = jax.tree_util.tree_map(lambda a, new: a.at[ids].set(new), client_states, new_states)
        return server_state, client_states, RoundOutput(ids, up_bytes, down_bytes, metrics)

    return jax.jit(round_fn, donate_argnums=(1,))
