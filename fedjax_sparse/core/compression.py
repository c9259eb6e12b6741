"""Compressed messages: top-k and random-k sparsification, stochastic quantization, error feedback.

The field's standard uplink compressors, each a pure function from a pytree of arrays to a message
that `core.messages.message_bytes` prices by what it holds:

  top_k                  the ceil(ratio x n) entries of largest magnitude of each leaf (Stich et al.
                         2018's top-k): a `SparseArray`, its values plus the cheaper of a bitmask and
                         an index list;
  random_k               ceil(ratio x n) entries of each leaf drawn from `key`: a `KnownMaskArray`,
                         values only, since the receiver draws the same entries from the shared key;
  stochastic_quantization  QSGD (Alistarh et al. 2017) with s = 2^bits - 1 levels: each entry becomes
                         norm x sign x l / s, l drawn so that the result is unbiased; a `QuantizedArray`
                         (bits + 1 per entry and the norm);
  error_feedback         compresses x + residual and keeps what the message left out as the next
                         residual (Seide et al. 2014; Stich et al. 2018), so nothing is lost, only delayed.
`decompressed` turns any such message back into dense arrays.

    >>> import jax, jax.numpy as jnp
    >>> message = top_k({"w": jnp.array([0.1, -3.0, 2.0, 0.0])}, 0.5)
    >>> decompressed(message)["w"].tolist()
    [0.0, -3.0, 2.0, 0.0]
    >>> message, residual = error_feedback({"w": jnp.array([0.1, -3.0, 2.0, 0.0])},
    ...                                    {"w": jnp.zeros(4)}, lambda t: top_k(t, 0.25))
    >>> residual["w"].tolist()  # what the single entry sent left out, carried into the next round
    [0.10000000149011612, 0.0, 2.0, 0.0]
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.core.messages import KnownMaskArray, QuantizedArray, SparseArray

tree_map = jax.tree_util.tree_map
COMPRESSORS = ("none", "topk", "randk", "qsgd")


def _kept(size: int, ratio: float) -> int:
    if not 0 < ratio <= 1:
        raise ValueError(f"--compression-ratio must be in (0, 1], got {ratio}")
    return max(1, math.ceil(ratio * size - 1e-9))


def top_k(tree: Any, ratio: float) -> Any:
    """Each leaf as a `SparseArray` of its ceil(ratio x n) largest-magnitude entries (ties: lower index)."""
    def leaf(x):
        flat = x.reshape(-1)
        _, indices = jax.lax.top_k(jnp.abs(flat), _kept(flat.size, ratio))
        return SparseArray.from_indices(indices, flat[indices], x.shape)

    return tree_map(leaf, tree)


def random_k(tree: Any, ratio: float, key: jax.Array) -> Any:
    """Each leaf as a `KnownMaskArray` of ceil(ratio x n) entries drawn uniformly from `key`, which the
    receiver shares (values only are paid). Leaves draw from their own fold of the key."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)

    def leaf(i, x):
        flat = x.reshape(-1)
        order = jax.random.permutation(jax.random.fold_in(key, i), flat.size)
        mask = jnp.zeros((flat.size,), bool).at[order[:_kept(flat.size, ratio)]].set(True)
        return KnownMaskArray(x, mask.reshape(x.shape))

    return jax.tree_util.tree_unflatten(treedef, [leaf(i, x) for i, x in enumerate(leaves)])


def stochastic_quantization(tree: Any, bits: int, key: jax.Array) -> Any:
    """QSGD: each leaf x as norm(x) x sign(x) x l / s with s = 2^bits - 1 and l in {floor(s|x|/norm),
    that + 1}, the upper with probability s|x|/norm - floor(...), so the dense result is x in
    expectation."""
    if not 1 <= bits <= 16:
        raise ValueError(f"--quantization-bits must be in [1, 16], got {bits}")
    levels = 2 ** bits - 1
    leaves, treedef = jax.tree_util.tree_flatten(tree)

    def leaf(i, x):
        x = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(x * x))
        scaled = jnp.where(norm > 0, jnp.abs(x) / jnp.where(norm > 0, norm, 1.0), 0.0) * levels
        low = jnp.floor(scaled)
        up = jax.random.uniform(jax.random.fold_in(key, i), x.shape) < scaled - low
        level = (low + up).astype(jnp.int32) * jnp.sign(x).astype(jnp.int32)
        return QuantizedArray(level, norm, bits)

    return jax.tree_util.tree_unflatten(treedef, [leaf(i, x) for i, x in enumerate(leaves)])


def _is_message_leaf(x) -> bool:
    return isinstance(x, (SparseArray, KnownMaskArray, QuantizedArray))


def decompressed(message: Any) -> Any:
    """The dense arrays a compressed message stands for (plain arrays pass as they are)."""
    return tree_map(lambda x: x.dense() if _is_message_leaf(x) else x, message, is_leaf=_is_message_leaf)


def error_feedback(tree: Any, residual: Any, compress: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(compress(tree + residual), what that message left out): the residual to add next time."""
    corrected = tree_map(jnp.add, tree, residual)
    message = compress(corrected)
    return message, tree_map(jnp.subtract, corrected, decompressed(message))
