"""Compressed messages: top-k and random-k sparsification, stochastic quantization, error feedback.

The field's standard uplink compressors, each a pure function from a pytree of arrays to a message
that `core.messages.pricing.message_bytes` prices by what it holds:

  top_k                  the ceil(ratio x n) entries of largest magnitude of each leaf (Stich et al.
                         2018's top-k): a `SparseArray`, its values plus the cheaper of a bitmask and
                         an index list;
  random_k               k = ceil(ratio x n) of each leaf's n entries drawn without replacement from
                         `key`: a `KnownMaskArray`, values only, since the receiver draws the same
                         entries from the shared key. Unbiased by default, as the literature defines
                         it (e.g. Wangni et al. 2018; Beznosikov et al. 2020): the kept entries are
                         sent times n / k, so E[C(x)] = x and E||C(x) - x||^2 = (n / k - 1) ||x||^2.
                         `unbiased=False` sends them as they are, Stich et al. 2018's rand-k, a
                         contraction (E||C(x) - x||^2 = (1 - k / n) ||x||^2) whose mean is (k / n) x:
                         the one to use under error feedback, which the scaled one, not a contraction
                         for k < n / 2, makes diverge (it leaves (1 - n / k) times each kept entry in
                         the residual, larger than the entry itself);
  stochastic_quantization  QSGD (Alistarh et al. 2017) in buckets: each leaf, flattened, is cut into
                         buckets of `bucket` consecutive entries (the last one may be shorter; a
                         bucket never spans two leaves), each with its own L2 norm; with s = 2^bits - 1
                         levels an entry becomes norm x sign x l / s, l drawn so that the result is
                         unbiased; a `QuantizedArray` (bits + 1 per entry and a float32 norm per
                         bucket). Lemma 3.1 of the paper bounds its error per bucket of b entries:
                         E||Q(v) - v||^2 <= min(b / s^2, sqrt(b) / s) ||v||^2, which grows with b:
                         at 4 bits, one norm for a whole Gaussian leaf of 100,000 entries rounds 96 %
                         of them to 0 and errs by 15.8 ||v||^2 (bound 21.1); buckets of 512 err by
                         0.38 ||v||^2 (bound 1.5) for 1.2 % more bytes;
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

from fedjax_sparse.core.messages.pricing import KnownMaskArray, QuantizedArray, SparseArray

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
        kept = _kept(flat.size, ratio)
        if 2 * kept <= flat.size:
            _, indices = jax.lax.top_k(jnp.abs(flat), kept)
            return SparseArray.from_indices(indices, flat[indices], x.shape)
        # Keeping most entries: rank the n - k dropped ones instead (top_k's cost grows with k: a k near n is
        # close to a full sort). They are the smallest magnitudes, ties going to the higher index, exactly the
        # complement of the kept set; reversing the leaf makes top_k's lower-index tie rule pick those.
        mask = jnp.ones((flat.size,), bool)
        if kept < flat.size:
            _, reversed_indices = jax.lax.top_k(-jnp.abs(flat[::-1]), flat.size - kept)
            mask = mask.at[flat.size - 1 - reversed_indices].set(False)
        return SparseArray(jnp.where(mask, flat, jnp.zeros_like(flat)).reshape(x.shape), mask.reshape(x.shape))

    return tree_map(leaf, tree)


def random_k(tree: Any, ratio: float, key: jax.Array, *, unbiased: bool = True) -> Any:
    """Each leaf as a `KnownMaskArray` of k = ceil(ratio x n) of its n entries drawn uniformly without
    replacement from `key`, which the receiver shares (values only are paid). Leaves draw from their own
    fold of the key. `unbiased`: the kept entries times n / k (E = x); else as they are (a k / n
    contraction, for error feedback; the module docstring)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)

    def leaf(i, x):
        flat = x.reshape(-1)
        kept = _kept(flat.size, ratio)
        order = jax.random.permutation(jax.random.fold_in(key, i), flat.size)
        mask = jnp.zeros((flat.size,), bool).at[order[:kept]].set(True)
        return KnownMaskArray(x * (flat.size / kept) if unbiased else x, mask.reshape(x.shape))

    return jax.tree_util.tree_unflatten(treedef, [leaf(i, x) for i, x in enumerate(leaves)])


def stochastic_quantization(tree: Any, bits: int, key: jax.Array, bucket: int = 512) -> Any:
    """QSGD in buckets of `bucket` entries (a leaf of fewer entries is one bucket): an entry x of a bucket
    of norm m becomes m x sign(x) x l / s with s = 2^bits - 1 and l in {floor(s|x|/m), that + 1}, the
    upper with probability s|x|/m - floor(...), so the dense result is x in expectation."""
    if not 1 <= bits <= 16:
        raise ValueError(f"--quantization-bits must be in [1, 16], got {bits}")
    if bucket < 1:
        raise ValueError(f"--quantization-bucket must be >= 1, got {bucket}")
    levels = 2 ** bits - 1
    leaves, treedef = jax.tree_util.tree_flatten(tree)

    def leaf(i, x):
        flat = x.astype(jnp.float32).reshape(-1)
        size = max(1, min(bucket, flat.size))
        count = -(-flat.size // size)
        # The short last bucket is padded with zeros, which add nothing to its norm and quantize to 0.
        buckets = jnp.pad(flat, (0, count * size - flat.size)).reshape(count, size)
        norms = jnp.sqrt(jnp.sum(buckets * buckets, axis=1))
        safe = jnp.where(norms > 0, norms, 1.0)[:, None]
        # |x| <= m up to rounding; the clip keeps every level within the s that its bits can code.
        scaled = jnp.minimum(jnp.abs(buckets) / safe * levels, levels)
        low = jnp.floor(scaled)
        up = jax.random.uniform(jax.random.fold_in(key, i), buckets.shape) < scaled - low
        level = (low + up).astype(jnp.int32) * jnp.sign(buckets).astype(jnp.int32)
        return QuantizedArray(level.reshape(-1)[:flat.size].reshape(x.shape), norms, bits, size)

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
