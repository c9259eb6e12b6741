"""Server-side reductions over the stacked messages of the sampled clients."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp


def normalized(weights: jax.Array) -> jax.Array:
    chex.assert_rank(weights, 1)
    return weights / jnp.sum(weights)


def weighted_mean(stacked: Any, weights: jax.Array) -> Any:
    """sum_k w_k x_k / sum_k w_k over the leading (client) axis of every leaf."""
    p = normalized(weights.astype(jnp.float32))

    def mean(leaf):
        chex.assert_axis_dimension(leaf, 0, p.shape[0])
        return jnp.tensordot(p, leaf.astype(jnp.float32), axes=1).astype(leaf.dtype)

    return jax.tree_util.tree_map(mean, stacked)


def uniform_mean(stacked: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: jnp.mean(leaf, axis=0), stacked)
