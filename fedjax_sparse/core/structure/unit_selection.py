"""Choosing unit masks: per layer, the units with the highest scores, with residual groups tied.

Every sub-model rule of the library is "keep the k best units of each layer"
for some score: HeteroFL's prefix (score = -index), FedRolex's rolling window
(score = -((index + round) mod N)), Federated Dropout's random subset (random
scores), FedGSE's gradient scores, SPATL's L2 norms of the incoming weights.
`keep_top_units` is that one operation, with static shapes (the number kept
may be traced, so clients of different capacities vmap together).

Residual sums: layers sharing a `unit_group` add their outputs together, so
they must keep the same units or the sum would mix kept and dropped channels;
a group ranks its units by the members' summed scores and every member takes
the group's mask. The output layer (the last, whose units are the classes)
always keeps every unit.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from fedjax_sparse.models.structure import Layer, ModelStructure


def selectable_groups(structure: ModelStructure, layers: tuple[str, ...] | None = None) -> list[tuple[Layer, ...]]:
    """The units' decision groups: the selectable members of a unit_group together, other layers alone.

    `layers` restricts the choice to these layer names (default: every layer but the
    output layer). A group only partly inside (ResNet-20's stage-1 stream, which the
    private stem feeds too) ties its selectable members; the others keep every unit, so
    the stream keeps its channels and only the selected branches drop theirs together.
    """
    names = set(l.name for l in structure.layers[:-1]) if layers is None else set(layers)
    groups: dict[str, list[Layer]] = {}
    for layer in structure.layers:
        if layer.name in names:
            groups.setdefault(layer.unit_group or f"layer:{layer.name}", []).append(layer)
    return [tuple(members) for members in groups.values()]


def kept_units(num_units: int, fraction: jax.Array | float) -> jax.Array:
    """ceil(fraction x num_units), at least 1 (HeteroFL's count; traced fractions allowed).

    A tiny tolerance keeps float rounding from adding a unit: 0.1 x 30 is 3, not 4.
    """
    count = jnp.ceil(jnp.asarray(fraction, jnp.float32) * num_units - 1e-4)
    return jnp.clip(count, 1, num_units).astype(jnp.int32)


def keep_top_units(structure: ModelStructure, scores: dict[str, jax.Array], fractions: dict[str, jax.Array] | jax.Array,
                   layers: tuple[str, ...] | None = None) -> dict[str, jax.Array]:
    """{layer: [units] float32 0/1}: per selectable group, its ceil(fraction x units) highest-scored units.

    `scores` maps layer names to [units] scores (a group sums its members'); `fractions`
    is one fraction for every group or {layer: fraction} (a group takes the mean of its
    members' fractions). Ties go to the lower unit index. Layers outside the selection keep all.
    """
    masks = {l.name: jnp.ones((l.num_units,), jnp.float32) for l in structure.layers}
    for members in selectable_groups(structure, layers):
        for m in members:
            chex.assert_shape(scores[m.name], (m.num_units,))
        total = sum(jnp.asarray(scores[m.name], jnp.float32) for m in members)
        fraction = (sum(jnp.asarray(fractions[m.name], jnp.float32) for m in members) / len(members)
                    if isinstance(fractions, dict) else fractions)
        count = kept_units(members[0].num_units, fraction)
        order = jnp.argsort(-total, stable=True)
        rank = jnp.argsort(order, stable=True)
        keep = (rank < count).astype(jnp.float32)
        for m in members:
            masks[m.name] = keep
    return masks


def prefix_scores(structure: ModelStructure) -> dict[str, jax.Array]:
    """HeteroFL: lower unit indices first, so the kept units are [0, k)."""
    return {l.name: -jnp.arange(l.num_units, dtype=jnp.float32) for l in structure.layers}


def rolling_scores(structure: ModelStructure, offset: jax.Array) -> dict[str, jax.Array]:
    """FedRolex: unit u ranks (u + offset) mod N, so the kept units are {(j - offset) mod N : j < k}."""
    return {l.name: -jnp.mod(jnp.arange(l.num_units) + offset, l.num_units).astype(jnp.float32)
            for l in structure.layers}


def random_scores(structure: ModelStructure, key: jax.Array) -> dict[str, jax.Array]:
    """Federated Dropout: a uniformly random subset of each layer (group) of the chosen size."""
    keys = jax.random.split(key, len(structure.layers))
    groups = {}
    out = {}
    for k, layer in zip(keys, structure.layers):
        # members of a group share one draw, so their summed score is still a uniform ranking
        name = layer.unit_group or layer.name
        groups.setdefault(name, jax.random.uniform(k, (layer.num_units,)))
        out[layer.name] = groups[name]
    return out
