"""Server-side reductions over the stacked messages of the sampled clients."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from fedjax_sparse.core.messages.pricing import KnownMaskArray, SparseArray


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


def uniform_mean(stacked: Any, participating: jax.Array | None = None) -> Any:
    """The mean over the leading (client) axis; given `participating` ([K] bool, `RoundInfo`), over those
    clients alone (a round in which none took part gives zeros, which the round then does not use)."""
    if participating is None:
        return jax.tree_util.tree_map(lambda leaf: jnp.mean(leaf, axis=0), stacked)
    present = participating.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(present), 1.0)

    def mean(leaf):
        chex.assert_axis_dimension(leaf, 0, present.shape[0])
        m = present.reshape((-1,) + (1,) * (leaf.ndim - 1))
        return (jnp.sum(m * leaf.astype(jnp.float32), axis=0) / count).astype(leaf.dtype)

    return jax.tree_util.tree_map(mean, stacked)


def present_sum(stacked: Any, participating: jax.Array | None = None) -> Any:
    """The sum over the leading (client) axis, of the participating clients alone where given."""
    return jax.tree_util.tree_map(lambda leaf: jnp.sum(leaf, axis=0), present_only(stacked, participating))


def present_only(stacked: Any, participating: jax.Array | None) -> Any:
    """`stacked` (leading client axis) with every absent client's rows zero (False for masks): what an
    absent client holds or sent counts for nothing, in `any`s, counts and masked means alike. None: as it is."""
    if participating is None:
        return stacked
    return jax.tree_util.tree_map(
        lambda leaf: jnp.where(participating.reshape((-1,) + (1,) * (leaf.ndim - 1)), leaf, jnp.zeros_like(leaf)),
        stacked)


def masked_mean(stacked: Any, masks: Any, weights: jax.Array, fallback: Any) -> Any:
    """Per entry, sum_k w_k m_k x_k / sum_k w_k m_k over the clients that sent it.

    `masks` has the structure and shapes of `stacked` (or broadcasts to them);
    entries no client sent keep their `fallback` value (the previous global
    model), so partial uploads (FedLDF layers, SPATL channels, sub-models)
    aggregate with one function.
    """
    w = weights.astype(jnp.float32)

    def mean(leaf, mask, old):
        chex.assert_axis_dimension(leaf, 0, w.shape[0])
        m = jnp.broadcast_to(mask, leaf.shape).astype(jnp.float32)
        wm = m * w.reshape((-1,) + (1,) * (leaf.ndim - 1))
        total = jnp.sum(wm, axis=0)
        summed = jnp.sum(wm * leaf.astype(jnp.float32), axis=0)
        return jnp.where(total > 0, summed / jnp.where(total > 0, total, 1.0), old).astype(leaf.dtype)

    return jax.tree_util.tree_map(mean, stacked, masks, fallback)


def _has_entries(x) -> bool:
    return isinstance(x, (SparseArray, KnownMaskArray))


def mean_of_sent(sent: Any, weights: jax.Array, fallback: Any,
                 participating: jax.Array | None = None) -> tuple[Any, Any]:
    """(`masked_mean` of stacked partial messages, which entries any client sent).

    `sent` is a tree of `SparseArray`s / `KnownMaskArray`s stacked on the client axis (the
    entries each client sent are its mask); the held tree (bool, shaped like `fallback`) is
    what a server optimizer's step takes as `held`, so an entry nobody sent keeps its value.
    `participating` (`RoundInfo`): what an absent client's mask says is not sent.
    """
    values = jax.tree_util.tree_map(lambda s: s.values, sent, is_leaf=_has_entries)
    masks = present_only(jax.tree_util.tree_map(lambda s: s.mask, sent, is_leaf=_has_entries), participating)
    held = jax.tree_util.tree_map(lambda m: jnp.any(m, axis=0), masks)
    return masked_mean(values, masks, weights, fallback), held
