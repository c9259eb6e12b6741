"""What crosses the network, and what it costs.

Messages are pytrees. A dense leaf costs size x itemsize bytes. A `SparseArray`
keeps a static dense shape (so vmap and jit are happy) plus a mask of the
entries that are sent; its sparse encoding costs nnz x itemsize for the values
plus the cheaper index encoding: a bitmask (ceil(size / 8) bytes) or an index
list (nnz times the smallest of 1, 2, 4 bytes that can address `size`). A
sender picks the cheaper of that and the plain dense encoding, so a leaf sent
whole costs what a dense leaf costs and a leaf not sent costs nothing (the one
bit saying which encoding was used is not counted).

Unit-structured entries (`UnitSparseArray`, built by `unit_sparse`): where
the entries sent are a sub-model chosen by unit masks (SPATL's salient
units), the receiver can rebuild every entry position from the unit masks
alone, so a layer may be sent as its kept units' index instead of per-entry
indices: a bitmask over the layer's units (ceil(units / 8) bytes) or a list
of kept unit ids (kept x the smallest of 1, 2, 4 bytes that can address the
units), whichever is cheaper, paid once per layer however many leaves follow
it (kernel, bias, normalization scale/bias and statistics), plus every
leaf's kept values. Per layer the sender takes the cheapest valid encoding:
that, or each of the layer's leaves on its own as above (entry index or
dense). To rebuild the entries the receiver needs the model's structure,
the unit masks of the layers in the message (a layer priced per entry shows
its kept units in its entries), and those of the layers its kernels read
from (their input units) or whose units a normalization follows: a layer
outside the message must keep every unit, as both sides know by protocol
(SPATL selects encoder layers only). With those,
`core.structure.unit_masks.variable_masks` gives every entry (the receiver runs the
sender's own computation; with `inputs=False`, when the protocol sends each kept
unit's whole incoming weights, it needs only the units of the layers sent).

Two more leaf kinds, for what both sides already know:
  * `KnownMaskArray`: values at entries whose positions the receiver knows
    without being told (the server chose the client's sub-model; the client
    trains a smaller dense model and returns it in the same layout): costs
    nnz x itemsize, no index;
  * `Known`: a value both sides can compute themselves (a sub-model's unit
    masks and capacity, which the simulation hands to the client so that it
    can run the smaller model inside static shapes): costs nothing.
A binary mask sent entropy-coded (`CodedMask`; FedPM's uploaded mask sample):
it costs the size of a static binary arithmetic code of its bits. With k ones
among n bits the coder's model is Bernoulli(k / n), told to the receiver as
the count k (the smallest of 1, 2, 4 bytes that holds n), and the code of the
bits takes at most -log2 P(bits) + 2 = n H(k / n) + 2 bits (H the binary
entropy; arithmetic coding's bound, Cover & Thomas 13.3), rounded up to whole
bytes; a mask of all zeros or all ones is told by its count alone. This is
the bound an exact arithmetic coder meets, not the output of one run here
(tests/test_fedpm.py codes masks with one and checks it stays within it).
Stochastically quantized leaves (`QuantizedArray`, QSGD in buckets) cost a float32
norm per bucket plus bits + 1 (sign) per entry of the leaf, padding not counted.
One function prices every message of every algorithm, inside jit.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.structure.layer_groups import COLLECTIONS, layer_groups
from fedjax_sparse.core.structure.unit_masks import UnitMasks, variable_masks
from fedjax_sparse.models.structure import ModelStructure


@flax.struct.dataclass
class SparseArray:
    """`values` where `mask` is True; zeros elsewhere are not sent.

        >>> import jax.numpy as jnp
        >>> leaf = SparseArray.from_indices(jnp.array([3, 0]), jnp.array([5.0, 7.0]), (4,))
        >>> leaf.dense().tolist(), int(message_bytes(leaf))  # 2 float32 values + a 1-byte bitmask
        ([7.0, 0.0, 0.0, 5.0], 9)
    """

    values: jax.Array
    mask: jax.Array

    def dense(self) -> jax.Array:
        return jnp.where(self.mask, self.values, jnp.zeros_like(self.values))

    @classmethod
    def from_indices(cls, indices: jax.Array, values: jax.Array, shape: tuple[int, ...]) -> "SparseArray":
        """The array of `shape` holding `values` at the flat positions `indices` (distinct), nothing else."""
        size = int(np.prod(shape))
        flat = jnp.zeros((size,), jnp.asarray(values).dtype).at[indices].set(values)
        mask = jnp.zeros((size,), bool).at[indices].set(True)
        return cls(flat.reshape(shape), mask.reshape(shape))


@flax.struct.dataclass
class UnitSparseArray(SparseArray):
    """A `SparseArray` whose entries follow the unit masks: `units` ([units] bool) are the kept
    units of the structure layer `layer` that owns the leaf. Leaves of one layer share one unit
    index in the message's price (see the module docstring); build them with `unit_sparse`."""

    units: jax.Array
    layer: str = flax.struct.field(pytree_node=False)


def unit_sparse(structure: ModelStructure, variables: dict, unit_masks: UnitMasks, *, inputs: bool = True) -> dict:
    """`variables` ({'params', 'batch_stats'}) as `UnitSparseArray`s: the entries of the sub-model
    `unit_masks` selects (`variable_masks`; `inputs=False`: the kept units' own entries), each leaf
    tagged with the layer that owns it (`core.structure.layer_groups`). Take a part of the result (e.g.
    SPATL's encoder) to send only that."""
    variables = {c: variables.get(c, {}) for c in COLLECTIONS}
    owners = layer_groups(structure, variables).index
    entries = variable_masks(structure, variables, unit_masks, inputs=inputs)

    def leaf(owner, value, mask):
        layer = structure.layers[owner]
        return UnitSparseArray(value, mask, jnp.asarray(unit_masks[layer.name]).astype(bool), layer.name)

    return jax.tree_util.tree_map(leaf, owners, variables, entries)


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


@flax.struct.dataclass
class QuantizedArray:
    """Stochastic quantization in buckets (QSGD, Alistarh et al. 2017): the leaf, flattened, is cut into
    buckets of `bucket` consecutive entries (the last one may be shorter), and an entry of bucket j is
    `norms[j] x sign x level / s` with s = 2^bits - 1 levels per sign.

    Its price: a float32 norm per bucket plus `bits` + 1 bits per entry of the leaf (the padding of a short
    last bucket is not sent), rounded up to whole bytes. The sign bit and the norm are QSGD's own (its
    message is the norm, the signs and the levels, Section 3.1); the fixed-length code of `bits` bits a
    level is not: the paper Elias-codes the positions and levels of the nonzero entries, which is cheaper
    when most levels are zero and is not counted here. Build it with
    `core.messages.compression.stochastic_quantization`."""

    levels: jax.Array  # signed integer levels in [-s, s], the leaf's shape
    norms: jax.Array  # [buckets] float32, one L2 norm per bucket
    bits: int = flax.struct.field(pytree_node=False)
    bucket: int = flax.struct.field(pytree_node=False)

    def dense(self) -> jax.Array:
        # Leading axes of `norms` before its bucket axis are batch axes (a stack of clients' messages).
        batch = self.norms.shape[:-1]
        count = self.norms.shape[-1]
        size = int(np.prod(self.levels.shape[len(batch):]))
        flat = self.levels.reshape(*batch, size).astype(jnp.float32)
        padded = jnp.pad(flat, [(0, 0)] * len(batch) + [(0, count * self.bucket - size)])
        values = padded.reshape(*batch, count, self.bucket) * self.norms[..., None] / (2 ** self.bits - 1)
        return values.reshape(*batch, count * self.bucket)[..., :size].reshape(self.levels.shape)


def quantized_bytes(leaf: QuantizedArray) -> int:
    return 4 * int(np.prod(leaf.norms.shape)) + (int(np.prod(leaf.levels.shape)) * (leaf.bits + 1) + 7) // 8


@flax.struct.dataclass
class CodedMask:
    """A binary mask sent arithmetic-coded: it costs its count of ones plus n H(k / n) + 2 bits
    (see the module docstring)."""

    bits: jax.Array


PRICED_LEAVES = (SparseArray, KnownMaskArray, Known, CodedMask, QuantizedArray)


def _is_priced_leaf(x) -> bool:
    return isinstance(x, PRICED_LEAVES)


def index_itemsize(size: int) -> int:
    for nbytes in (1, 2, 4):
        if size <= 256 ** nbytes:
            return nbytes
    return 8


def _index_bytes(mask: jax.Array) -> jax.Array:
    """The cheaper index of the True positions of `mask`: a bitmask or a list of their ids."""
    size = int(np.prod(mask.shape))
    return jnp.minimum(jnp.sum(mask.astype(jnp.int32)) * index_itemsize(size), (size + 7) // 8)


def _value_bytes(leaf) -> jax.Array:
    return jnp.sum(leaf.mask.astype(jnp.int32)) * leaf.values.dtype.itemsize


def _sparse_bytes(leaf: SparseArray) -> jax.Array:
    dense = int(np.prod(leaf.values.shape)) * leaf.values.dtype.itemsize
    return jnp.minimum(_value_bytes(leaf) + _index_bytes(leaf.mask), dense)


def coded_mask_bytes(bits: jax.Array) -> jax.Array:
    """Bytes of a binary mask under a static arithmetic code (see the module docstring)."""
    n = int(np.prod(bits.shape))
    ones = jnp.sum(bits.astype(jnp.float32))
    p = ones / n
    safe = jnp.clip(p, 1e-12, 1 - 1e-12)
    entropy = -(safe * jnp.log2(safe) + (1 - safe) * jnp.log2(1 - safe))
    code_bits = jnp.where((ones > 0) & (ones < n), n * entropy + 2.0, 0.0)
    return index_itemsize(n + 1) + jnp.ceil(code_bits / 8).astype(jnp.int32)


def _unit_layer_bytes(leaves: list[UnitSparseArray]) -> jax.Array:
    """One layer's leaves: its unit index once plus their values, or each leaf on its own."""
    unit_coded = _index_bytes(leaves[0].units) + sum(_value_bytes(l) for l in leaves)
    return jnp.minimum(unit_coded, sum(_sparse_bytes(l) for l in leaves))


def message_bytes(message: Any) -> jax.Array:
    """Bytes of one message (int32 scalar; a single message stays far below 2 GiB)."""
    leaves = jax.tree_util.tree_leaves(message, is_leaf=_is_priced_leaf)
    dense = sum(int(np.prod(l.shape)) * l.dtype.itemsize for l in leaves if not _is_priced_leaf(l))
    total = jnp.asarray(dense, jnp.int32)
    layers: dict[str, list[UnitSparseArray]] = {}
    for leaf in leaves:
        if isinstance(leaf, UnitSparseArray):
            layers.setdefault(leaf.layer, []).append(leaf)
        elif isinstance(leaf, SparseArray):
            total = total + _sparse_bytes(leaf)
        elif isinstance(leaf, KnownMaskArray):
            total = total + _value_bytes(leaf)
        elif isinstance(leaf, CodedMask):
            total = total + coded_mask_bytes(leaf.bits)
        elif isinstance(leaf, QuantizedArray):
            total = total + quantized_bytes(leaf)
    for members in layers.values():
        total = total + _unit_layer_bytes(members)
    return total
