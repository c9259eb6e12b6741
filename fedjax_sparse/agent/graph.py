"""What SPATL's selection agent sees: the encoder as a graph (sec. 3.2.1, "Environment States").

The paper models the network as a "simplified computational graph" whose
nodes are hidden features (feature maps) and whose edges are ML operations
(conv 3x3, ReLU, ...). We read it at layer granularity, the granularity of the
actions (one keep ratio per encoder layer):

  * a node per encoder layer, standing for that layer's output map;
  * an edge producer -> consumer per data dependency between encoder layers
    (`Layer.inputs_from`): a consumer of a residual sum (a, b) gets a -> it and
    b -> it; inputs from the data or from non-encoder layers (e.g. ResNet's
    private stem) give no edge. An edge carries one feature, whether its
    consumer reads a residual sum.

No reverse or self-edges: the node update of `jraph.GraphNetwork` aggregates a
node's outgoing and incoming edges separately and sees the node itself, so
information flows both ways while the direction stays known.
(The official code builds a node per filter with random features redrawn at
every build; we use the layer-level graph with the features below.)

Node features, in this order:
  static (per model): kind one-hot (conv, dense), log units, log fan-in,
    log output map size (each natural log / 10, to be O(1) like the ratios
    beside them), share of the encoder's dense forward FLOPs
    (fan_in x units x output_hw, `core.structure.flops`), share of its kernel weights;
  dynamic: the current keep ratio, then the `NUM_NORM_STATS` unit-norm
    statistics of `unit_norm_statistics`.
Globals: [FLOPs kept so far, FLOPs budget], both fractions of the dense
encoder FLOPs (budget = 1 - the required reduction).
"""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import jraph

from fedjax_sparse.core.structure.flops import layer_forward_flops
from fedjax_sparse.core.structure.unit_selection import kept_units
from fedjax_sparse.models.structure import ModelStructure

NUM_STATIC_FEATURES = 7
NUM_NORM_STATS = 3
LOG_SCALE = 0.1


@dataclasses.dataclass(frozen=True)
class GraphTemplate:
    """The static part of an encoder's graph (hashable: a static argument under jit).

    Node i is layer `layer_names[i]`; edge j runs `senders[j] -> receivers[j]`.
    """

    layer_names: tuple[str, ...]
    num_units: tuple[int, ...]
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    edge_is_residual: tuple[bool, ...]
    static_features: tuple[tuple[float, ...], ...]

    @classmethod
    def from_structure(cls, structure: ModelStructure,
                       layer_names: tuple[str, ...] | None = None) -> GraphTemplate:
        """The graph of `layer_names` (default: the layers with part == 'encoder')."""
        if layer_names is None:
            layer_names = tuple(l.name for l in structure.part("encoder"))
        layer_names = tuple(layer_names)
        if not layer_names:
            raise ValueError("the graph needs at least one layer, got none")
        if len(set(layer_names)) != len(layer_names):
            raise ValueError(f"layer names must be unique, got {layer_names}")
        unknown = [n for n in layer_names if n not in structure.names]
        if unknown:
            raise ValueError(f"layers {unknown} are not in the structure; valid layers are {structure.names}")
        index = {n: i for i, n in enumerate(layer_names)}
        layers = [structure[n] for n in layer_names]
        senders, receivers, residual = [], [], []
        for i, layer in enumerate(layers):
            for producer in layer.inputs_from:
                if producer in index:
                    senders.append(index[producer])
                    receivers.append(i)
                    residual.append(len(layer.inputs_from) > 1)
        all_flops = layer_forward_flops(structure)
        flops = [all_flops[n] for n in layer_names]
        weights = [l.num_weights for l in layers]
        static = tuple(
            (float(l.kind == "conv"), float(l.kind == "dense"),
             LOG_SCALE * math.log(l.num_units), LOG_SCALE * math.log(l.fan_in),
             LOG_SCALE * math.log(l.output_hw), f / sum(flops), w / sum(weights))
            for l, f, w in zip(layers, flops, weights))
        return cls(layer_names, tuple(l.num_units for l in layers), tuple(senders), tuple(receivers),
                   tuple(residual), static)

    @property
    def num_nodes(self) -> int:
        return len(self.layer_names)

    @property
    def num_edges(self) -> int:
        return len(self.senders)

    @property
    def num_node_features(self) -> int:
        return NUM_STATIC_FEATURES + 1 + NUM_NORM_STATS

    @property
    def flops_share(self) -> tuple[float, ...]:
        """Each layer's share of the encoder's dense forward FLOPs (sums to 1)."""
        return tuple(f[5] for f in self.static_features)


def graph_state(template: GraphTemplate, keep_ratios: jax.Array, unit_norm_stats: jax.Array,
                flops_kept: jax.Array, flops_budget: jax.Array | float) -> jraph.GraphsTuple:
    """One graph (n_node=[L], n_edge=[E]) of the encoder pruned to `keep_ratios`.

    `unit_norm_stats` is [L, NUM_NORM_STATS] (see `unit_norm_statistics`);
    `flops_kept` and `flops_budget` are fractions of the dense encoder FLOPs.
    """
    num_nodes, num_edges = template.num_nodes, template.num_edges
    chex.assert_shape(keep_ratios, (num_nodes,))
    chex.assert_shape(unit_norm_stats, (num_nodes, NUM_NORM_STATS))
    chex.assert_rank(flops_kept, 0)
    static = jnp.asarray(template.static_features, jnp.float32)
    nodes = jnp.concatenate([static, keep_ratios[:, None].astype(jnp.float32),
                             unit_norm_stats.astype(jnp.float32)], axis=1)
    return jraph.GraphsTuple(
        nodes=nodes,
        edges=jnp.asarray(template.edge_is_residual, jnp.float32).reshape(num_edges, 1),
        senders=jnp.asarray(template.senders, jnp.int32).reshape(num_edges),
        receivers=jnp.asarray(template.receivers, jnp.int32).reshape(num_edges),
        globals=jnp.stack([jnp.asarray(flops_kept, jnp.float32),
                           jnp.asarray(flops_budget, jnp.float32)])[None],
        n_node=jnp.array([num_nodes]), n_edge=jnp.array([num_edges]))


def unit_norm_statistics(norms: dict[str, jax.Array], layer_names: tuple[str, ...],
                         keep_ratios: jax.Array) -> jax.Array:
    """[L, NUM_NORM_STATS] per layer: mean and std of its unit L2 norms, and top-k norm share.

    `norms[name]` is `[units]` (each unit's L2 norm in the client's trained
    weights). Mean and std are divided by the mean unit norm over all listed
    layers, so they say how salient a layer is relative to the rest of the
    encoder, whatever the weights' scale. The third column is the share of
    the layer's total norm held by its `core.structure.unit_selection.kept_units` units of
    largest norm at the current keep ratio (the count every selection uses): how much of the layer a norm-based selection
    (SPATL's code keeps filters by L2 norm) would retain. A layer whose
    norms are all zero gets share 0.
    """
    chex.assert_shape(keep_ratios, (len(layer_names),))
    encoder_mean = jnp.mean(jnp.concatenate([jnp.ravel(norms[n]) for n in layer_names]))
    encoder_mean = jnp.maximum(encoder_mean, jnp.finfo(jnp.float32).tiny)
    rows = []
    for i, name in enumerate(layer_names):
        layer_norms = jnp.asarray(norms[name], jnp.float32)
        chex.assert_rank(layer_norms, 1)
        relative = layer_norms / encoder_mean
        cumulative = jnp.cumsum(jnp.sort(layer_norms)[::-1])
        top = cumulative[kept_units(layer_norms.shape[0], keep_ratios[i]) - 1]
        share = top / jnp.maximum(cumulative[-1], jnp.finfo(jnp.float32).tiny)
        rows.append(jnp.stack([jnp.mean(relative), jnp.std(relative), share]))
    return jnp.stack(rows)
