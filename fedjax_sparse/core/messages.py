"""What crosses the network, and what it costs.

Messages are pytrees. A dense leaf costs size x itemsize bytes. A `SparseArray`
keeps a static dense shape (so vmap and jit are happy) plus a mask of the
entries that are sent; its sparse encoding costs nnz x itemsize for the values
plus the cheaper index encoding: a bitmask (ceil(size / 8) bytes) or an index
list (nnz times the smallest of 1, 2, 4 bytes that can address `size`). A
sender picks the cheaper of that and the plain dense encoding, so a leaf sent
whole costs what a dense leaf costs and a leaf not sent costs nothing (the one
bit saying which encoding was used is not counted).

Two more leaf kinds, for what both sides already know:
  * `KnownMaskArray`: values at entries whose positions the receiver knows
    without being told (the server chose the client's sub-model; the client
    trains a smaller dense model and returns it in the same layout): costs
    nnz x itemsize, no index;
  * `Known`: a value both sides can compute themselves (a sub-model's unit
    masks and capacity, which the simulation hands to the client so that it
    can run the smaller model inside static shapes): costs nothing.
One function prices every message of every algorithm, inside jit.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class SparseArray:
    """`values` where `mask` is True; zeros elsewhere are not sent."""

    values: jax.Array
    mask: jax.Array

    def dense(self) -> jax.Array:
        return jnp.where(self.mask, self.values, jnp.zeros_like(self.values))


@flax.struct.dataclass
class KnownMaskArray:
    """`values` where `mask` is True, at positions the receiver already knows: only values are paid."""

    values: jax.Array
    mask: jax.Array

    def dense(self) -> jax.Array:
        return jnp.where(self.mask, self.values, jnp.zeros_like(self.values))


@flax.struct.dataclass
class Known:
    """A value both sides already know; it costs nothing to 'send'."""

    value: Any


def _is_priced_leaf(x) -> bool:
    return isinstance(x, (SparseArray, KnownMaskArray, Known))


def index_itemsize(size: int) -> int:
    for nbytes in (1, 2, 4):
        if size <= 256 ** nbytes:
            return nbytes
    return 8


def _sparse_bytes(leaf: SparseArray) -> jax.Array:
    size = int(np.prod(leaf.values.shape))
    nnz = jnp.sum(leaf.mask.astype(jnp.int32))
    index_list = nnz * index_itemsize(size)
    bitmask = (size + 7) // 8
    itemsize = leaf.values.dtype.itemsize
    return jnp.minimum(nnz * itemsize + jnp.minimum(index_list, bitmask), size * itemsize)


def message_bytes(message: Any) -> jax.Array:
    """Bytes of one message (int32 scalar; a single message stays far below 2 GiB)."""
    leaves = jax.tree_util.tree_leaves(message, is_leaf=_is_priced_leaf)
    dense = sum(int(np.prod(l.shape)) * l.dtype.itemsize for l in leaves if not _is_priced_leaf(l))
    total = jnp.asarray(dense, jnp.int32)
    for leaf in leaves:
        if isinstance(leaf, SparseArray):
            total = total + _sparse_bytes(leaf)
        elif isinstance(leaf, KnownMaskArray):
            total = total + jnp.sum(leaf.mask.astype(jnp.int32)) * leaf.values.dtype.itemsize
    return total
