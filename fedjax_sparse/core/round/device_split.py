"""Which device trains which sampled client: balanced by the clients' local steps.

Clients trained together (one vmap: a device's whole share of a sharded round, or one chunk of the
`lax.map` of `core.round.cpu`) run as many steps as the busiest of them (`core.round.local_training`), and a
round waits for its slowest device. Splitting the K sampled clients over the devices in slot order (the
`id` split) mixes large and small clients in every group; on a power-law population most vmapped
steps are then padding. The balanced split (pfl-research splits a cohort greedily by user size too):

  1. the clients sorted by local steps, largest first, ties by id, cut into consecutive groups of the
     layout's size: with groups of one size, this leaves the fewest padded steps of any grouping;
  2. the groups placed greedily, longest processing time first (LPT): each to the device that has the
     fewest steps so far among those with room left (a device takes the number of groups its layout
     gives it), ties to the lowest device. With groups of one client (a chunk of 1) this is LPT over the
     sampled ids; with one group per device (a sharded vmap, whose time is its busiest client's steps
     whatever else it holds) step 1 alone decides.

Only the placement changes: each client trains as it would anywhere (a vmap lane's arithmetic does not
depend on its neighbours), and its outputs are put back in client order before the server's update, so
a run's figures are those of the id split and of one device, bit for bit (tests/test_balanced_shares.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.data.federated import padded_step_fraction

SPLITS = ("balanced", "id")


@dataclasses.dataclass(frozen=True)
class BalancedSplit:
    """A sharded round's clients placed by `balanced_order`; a client takes ceil(count / batch_size) steps
    per epoch (the same number of epochs for all, so the epochs change no comparison)."""

    batch_size: int

    def steps(self, counts):
        return (counts + self.batch_size - 1) // self.batch_size


def device_groups(slots: int, *, mesh_size: int | None = None, client_chunk: int | None = None,
                  num_devices: int = 1) -> tuple[int, tuple[int, ...]]:
    """(clients per group, groups per device) of a round's layout: a mesh of `mesh_size` devices vmaps
    one group of slots / mesh_size each; several CPU devices run whole chunks of `client_chunk`, the
    first devices one more where they do not divide (`core.round.cpu.client_shares`)."""
    if mesh_size is not None:
        return slots // mesh_size, (1,) * mesh_size
    chunks = slots // client_chunk
    return client_chunk, tuple(chunks // num_devices + (d < chunks % num_devices) for d in range(num_devices))


@functools.partial(jax.jit, static_argnums=(2, 3))
def balanced_order(steps: jax.Array, ids: jax.Array, group: int, groups_per_device: Sequence[int]) -> jax.Array:
    """[K] slot indices: the slots in the order the devices train them (device 0's groups first, each
    device's groups by size), placed as the module says (traceable; the K steps and ids in slot order)."""
    steps, ids = jnp.asarray(steps, jnp.int32), jnp.asarray(ids, jnp.int32)
    k = steps.shape[0]
    num_groups = k // group
    if group * sum(groups_per_device) != k:
        raise ValueError(f"{len(groups_per_device)} devices taking {tuple(groups_per_device)} groups of {group} "
                         f"clients do not hold the {k} slots")
    by_size = jnp.lexsort((ids, -steps))  # largest first, ties by id (lexsort's last key leads)
    group_steps = steps[by_size[::group]]  # a group's busiest client: its first
    room = jnp.asarray(groups_per_device, jnp.int32)

    def place(carry, cost):
        load, taken = carry
        device = jnp.argmin(jnp.where(taken < room, load, jnp.iinfo(jnp.int32).max))  # argmin: the lowest on ties
        return (load.at[device].add(cost), taken.at[device].add(1)), device

    zeros = jnp.zeros(len(groups_per_device), jnp.int32)
    _, device_of_group = jax.lax.scan(place, (zeros, zeros), group_steps)
    groups = jnp.argsort(device_of_group * num_groups + jnp.arange(num_groups))
    return by_size.reshape(num_groups, group)[groups].reshape(k)


def balanced_padded_step_fraction(split: BalancedSplit, counts: np.ndarray, ids: np.ndarray, dispatched: np.ndarray,
                                  group: int, groups_per_device: tuple[int, ...]) -> float:
    """`data.federated.padded_step_fraction` of a round placed by `balanced_order`: the slots' `counts`
    and `ids` in slot order, the dispatched counted (a slot holding no client trains nothing real)."""
    order = np.asarray(balanced_order(split.steps(np.asarray(counts)), ids, group, tuple(groups_per_device)))
    return padded_step_fraction(np.asarray(counts)[order][np.asarray(dispatched, bool)[order]], split.batch_size,
                                group)
