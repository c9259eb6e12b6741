"""Capacity from the device: each client trains the largest sub-model its device finishes by the deadline.

Sub-model methods (HeteroFL, FedRolex, Federated Dropout, FedGSE, Fjord) give every client a capacity
level beta. Drawn at random, as their papers evaluate them, a slow client may get the full model and
miss the round's deadline while a fast one trains a sliver. HeteroFL's and FjORD's own framing is the
opposite: a client's capacity is what its device can afford. `device_capacity` is that rule with the
library's clock (`core.federation.clock`) as the device model: client k gets the largest level whose predicted
round time fits the deadline D,

    t_k(beta) = down_bytes(beta) / downlink_k + 2 train_flops_k(beta) / speed_k + up_bytes(beta) / uplink_k
                + latency_k <= D,

where the bytes are those of the sub-model's messages at beta as `core.messages.pricing` prices them, and
train_flops_k(beta) = 3 x (forward FLOPs of one example's step at beta, `core.structure.flops`: multiply-accumulates,
2 FLOPs each at a speed in FLOP/s) x n_k x epochs (n_k the client's examples): the figures the clock itself reads after the round, computed by the same
functions (`client_seconds`), so a client that fits is not late. A client that fits no level gets the
smallest: it will most likely miss the deadline and its update be lost (`updates_late`). Left out of
the round instead, it would change who takes part, which is the sampler's choice
(`core.federation.participation`), not the sub-model's; and a lost update is what such a device costs a
synchronous round, which the run's figures then show.

Nothing is drawn: a client's figures are a pure function of (seed, client id), so its level is the same
every round (`--capacity-mode` has nothing to decide).
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.federation.clock import ClientProfiles, client_seconds


@flax.struct.dataclass
class Price:
    """What a client holding one sub-model computes and sends: `step_flops`, the forward FLOPs of one
    example in one local step; `down_bytes` and `up_bytes`, the bytes of its broadcast and its upload."""

    step_flops: jax.Array
    down_bytes: jax.Array
    up_bytes: jax.Array


def predicted_seconds(profiles: ClientProfiles, prices: Price, train_flops: jax.Array) -> jax.Array:
    """The round time of clients (`profiles`, [M]) at each level (`prices`, [L]): [M, L], the clock's
    `client_seconds` of the level's bytes and the clients' training FLOPs at it (`train_flops`, [M, L])."""
    column = lambda figure: figure[:, None]  # noqa: E731
    return client_seconds(jax.tree_util.tree_map(column, profiles), train_flops, prices.down_bytes[None],
                          prices.up_bytes[None])


def largest_fitting(seconds: jax.Array, deadline: float) -> jax.Array:
    """[...] the index of the last level (levels ascending on the last axis of `seconds`) whose time is
    within the deadline; 0 where none is."""
    levels = jnp.arange(seconds.shape[-1])
    return jnp.max(jnp.where(seconds <= deadline, levels, 0), axis=-1)


def device_capacity(context: BuildContext, levels: Sequence[float], price: Callable[[jax.Array], Price],
                    train_flops: Callable[[jax.Array, jax.Array], jax.Array]
                    ) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`capacity(round_index, client_id) -> beta`: the largest of `levels` whose predicted round time on
    the client's device (`context.device_profile`) fits `context.round_deadline` (see the module docstring).

    price(beta) -> Price: the sub-model at beta (traceable); train_flops(step_flops, examples) -> the
    training FLOPs a client of that many examples reports (the method's own `train_flops` figure).
    The examples are `context.train_counts` (else those of `context.train`)."""
    if context.device_profile is None:
        raise ValueError("--capacity-from device sizes each client's sub-model for its device: give "
                         "--device-profile (phone, iot, edge or a profile file)")
    if context.round_deadline is None:
        raise ValueError("--capacity-from device sizes each client's sub-model to finish by the deadline: give "
                         "--round-deadline S")
    counts = context.train_counts if context.train_counts is not None else np.asarray(context.train.counts)
    counts = jnp.asarray(counts, jnp.int32)
    ascending = jnp.asarray(sorted(set(float(level) for level in levels)), jnp.float32)
    prices = jax.jit(jax.vmap(price))(ascending)
    profile, seed, deadline = context.device_profile, context.seed, context.round_deadline

    def capacity(round_index, client_id):
        del round_index  # a device's figures do not change between rounds
        ids = jnp.reshape(client_id, (1,))
        seconds = predicted_seconds(profile.profiles(seed, ids), prices,
                                    train_flops(prices.step_flops[None], counts[ids][:, None]))
        return ascending[largest_fitting(seconds, deadline)[0]]

    return capacity
