"""Layers as parameter groups: which leaves of a model's variables belong to which layer.

Layer-wise methods (FedLDF uploads whole layers; others may weigh or select
them) need a partition of the model's variables `{'params', 'batch_stats'}`
into the layers of its `ModelStructure`. Layer l owns

  * its kernel and its bias (in `params`),
  * the normalization module applied to its outputs: that module's `scale` and
    `bias` in `params` and its running `mean` and `var` in `batch_stats`.

Every leaf must belong to exactly one layer. A leaf that no layer claims would
silently never be uploaded or aggregated, so `layer_groups` refuses such a
model (and a leaf claimed twice, and a structure path missing from the
variables) with an error naming the paths.

The grouping is static (python ints per leaf), so a per-layer vector `[..., L]`
is turned into a variables-shaped tree by plain indexing inside jit.

Divergence (FedLDF eq. 3): ||Theta_{k,l} - Theta_hat_l||_2 =
sqrt(sum_{i in l} (Theta_{k,li} - Theta_hat_li)^2), one scalar per layer: the
Euclidean norm over *all* of the layer's parameters at once (kernel, bias and
norm scale/bias flattened together), not a per-neuron norm -- the paper's sum
runs over every parameter i of layer l and yields the L entries of the
divergence vector. By default only the `params` collection enters the norm:
BatchNorm's running mean/var are statistics, not trained parameters (and the
variance, on its own scale, would otherwise dominate a conv layer's
distance); pass `collections=('params', 'batch_stats')` to include them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.models.structure import ModelStructure

COLLECTIONS = ("params", "batch_stats")


def _key_str(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_paths(tree: Any) -> list[tuple[str, ...]]:
    """The path of every leaf of `tree`, as tuples of strings, in flatten order."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [tuple(_key_str(e) for e in path) for path, _ in with_paths]


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """The partition of a model's variables into its structure's layers.

    names: the layer names, in structure order (index l of every [L] vector).
    index: a pytree shaped like the variables whose leaves are python ints,
      the layer of each leaf.
    sizes: entries per layer (all collections).
    nbytes: bytes per layer when sent dense (all collections).
    """

    names: tuple[str, ...]
    index: Any
    sizes: tuple[int, ...]
    nbytes: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def divergence(self, new: dict, old: dict, collections: Sequence[str] = ("params",)) -> jax.Array:
        """[L] float32: per layer, the L2 norm of `new - old` over its leaves in `collections` (eq. 3)."""
        unknown = set(collections) - set(COLLECTIONS)
        if unknown:
            raise ValueError(f"unknown collections {sorted(unknown)}; valid: {COLLECTIONS}")
        squares = [jnp.zeros((), jnp.float32) for _ in self.names]
        for name in collections:
            idx_leaves = jax.tree_util.tree_leaves(self.index[name])
            new_leaves = jax.tree_util.tree_leaves(new[name])
            old_leaves = jax.tree_util.tree_leaves(old[name])
            for l, a, b in zip(idx_leaves, new_leaves, old_leaves, strict=True):
                d = a.astype(jnp.float32) - b.astype(jnp.float32)
                squares[l] = squares[l] + jnp.sum(d * d)
        return jnp.sqrt(jnp.stack(squares))

    def expand(self, per_layer: jax.Array, like: Any) -> Any:
        """Broadcasts `per_layer` ([*batch, L]) to the shapes of `like` ([*batch, *leaf]).

        `like` is a variables tree whose leaves carry the same leading batch
        axes as `per_layer` (e.g. [K] stacked clients); leaf shapes are kept
        exactly (a full-shape mask, as `SparseArray` needs).
        """
        per_layer = jnp.asarray(per_layer)
        if per_layer.shape[-1] != self.num_layers:
            raise ValueError(f"expected a last axis of {self.num_layers} layers, got shape {per_layer.shape}")
        batch = per_layer.shape[:-1]

        def leaf(l, x):
            x_shape = jnp.shape(x)
            if x_shape[:len(batch)] != batch:
                raise ValueError(f"leaf of shape {x_shape} does not start with the batch axes {batch}")
            v = per_layer[..., l].reshape(batch + (1,) * (len(x_shape) - len(batch)))
            return jnp.broadcast_to(v, x_shape)

        return jax.tree_util.tree_map(leaf, self.index, like)


def layer_groups(structure: ModelStructure, variables: dict) -> LayerGroups:
    """Groups the leaves of `variables` ({'params', 'batch_stats'}; arrays or ShapeDtypeStructs) by layer.

    Raises ValueError when a structure path is missing from the variables, when
    a leaf would belong to two layers, or when a leaf belongs to none.
    """
    variables = {c: variables.get(c, {}) for c in COLLECTIONS}
    extra = set(variables) - set(COLLECTIONS)
    if extra:
        raise ValueError(f"variables hold collections {sorted(extra)} beyond {COLLECTIONS}")
    flat, treedef = jax.tree_util.tree_flatten(variables)
    paths = leaf_paths(variables)
    owner: dict[tuple[str, ...], int] = {}

    def claim(prefixes: Sequence[tuple[str, ...]], l: int) -> None:
        hits = [p for p in paths if any(p[:len(prefix)] == prefix for prefix in prefixes)]
        if not hits:
            raise ValueError(f"layer {structure.layers[l].name!r}: no variables at "
                             f"{' or '.join('/'.join(p) for p in prefixes)}; the model's structure "
                             f"does not match its variables")
        for p in hits:
            if p in owner and owner[p] != l:
                raise ValueError(f"variable {'/'.join(p)} belongs to two layers, "
                                 f"{structure.layers[owner[p]].name!r} and {structure.layers[l].name!r}")
            owner[p] = l

    for l, layer in enumerate(structure.layers):
        claim([("params", *layer.kernel)], l)
        if layer.bias is not None:
            claim([("params", *layer.bias)], l)
        if layer.norm is not None:  # scale/bias in params, mean/var in batch_stats
            claim([("params", *layer.norm), ("batch_stats", *layer.norm)], l)
    orphans = [p for p in paths if p not in owner]
    if orphans:
        shown = ", ".join("/".join(p) for p in orphans[:8])
        more = f" and {len(orphans) - 8} more" if len(orphans) > 8 else ""
        raise ValueError(f"{len(orphans)} variables belong to no layer of the model's structure "
                         f"({shown}{more}); they would never be uploaded")
    index = [owner[p] for p in paths]
    sizes = [0] * len(structure.layers)
    nbytes = [0] * len(structure.layers)
    for l, x in zip(index, flat):
        size = math.prod(jnp.shape(x))
        sizes[l] += size
        nbytes[l] += size * np.dtype(x.dtype).itemsize
    return LayerGroups(structure.names, jax.tree_util.tree_unflatten(treedef, index), tuple(sizes),
                       tuple(nbytes))


def model_layer_groups(model) -> LayerGroups:
    """`layer_groups` of a `Model`, from the shapes of its initial variables (nothing is computed)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return layer_groups(model.structure, shapes)
