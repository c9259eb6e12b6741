"""Unit masks: structured sparsity as one keep/drop flag per output unit of each prunable layer.

A unit mask is `{layer_name: [num_units]}` (bool, or float in {0, 1}) over the
layers of a `ModelStructure`. SpaFL's threshold masks, FedGSE/HeteroFL
sub-models and SPATL's salient channels are all unit masks; this module turns
them into weight-shaped masks, applies them to a `params` tree, measures the
density they leave and which input units their consumers still see.

What a unit owns (the convention of every function here):
  * its kernel slice `kernel[..., i]` -- the unit's incoming weights (Flax puts
    output units on a kernel's last axis; SpaFL's "row" of W);
  * its bias entry `bias[i]`, and the `scale[i]` / `bias[i]` of the
    normalization applied to its outputs (`Layer.norm`).
A dropped unit therefore outputs exactly zero before its activation (and after
a ReLU), as if it were removed from the network: its consumers then really see
fewer input units, which is what the FLOP count of a sub-model assumes
(`live_input_fraction`). BatchNorm running statistics are left alone (they are
not parameters and a dropped channel's statistics are never used: its scale is
zero).

Gradients: the kernel is multiplied by the mask as given, so a differentiable
(straight-through) float mask passes its gradient on through the kernel product
only; bias and normalization entries are multiplied by `stop_gradient(mask)`,
so a mask's gradient is exactly the one its kernel product defines (SpaFL's
eq. 9). For constant masks (sub-models) this makes no difference.

Density (`density`) counts kernel weights of the prunable layers only: a kept
unit keeps its `fan_in` weights, a dropped one none, following SpaFL's
||p||_0 / |W| (a weight whose input unit was dropped upstream still counts as
kept here, as in the paper; the FLOP count does take that effect into account).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sparse.models.structure import Layer, ModelStructure, Params, get_path, set_path

UnitMasks = dict  # {layer_name: [num_units] bool or float array}


def full_unit_masks(structure: ModelStructure, dtype=jnp.float32) -> UnitMasks:
    """Masks that keep every unit."""
    return {l.name: jnp.ones((l.num_units,), dtype) for l in structure.layers}


def check_params(structure: ModelStructure, params: Params) -> None:
    """Raises a one-line ValueError unless every kernel matches its layer's units and fan-in."""
    for layer in structure.layers:
        try:
            kernel = get_path(params, layer.kernel)
        except (KeyError, TypeError):
            raise ValueError(f"layer {layer.name!r}: no kernel at {'/'.join(layer.kernel)} in params") from None
        fan_in = 1
        for d in kernel.shape[:-1]:
            fan_in *= d
        if kernel.shape[-1] != layer.num_units or fan_in != layer.fan_in:
            raise ValueError(f"layer {layer.name!r}: kernel shape {tuple(kernel.shape)} does not match "
                             f"{layer.num_units} units of fan-in {layer.fan_in}")


def _check_masks(structure: ModelStructure, unit_masks: UnitMasks) -> None:
    for layer in structure.layers:
        if layer.name not in unit_masks:
            raise ValueError(f"unit masks lack layer {layer.name!r}")
        shape = jnp.shape(unit_masks[layer.name])
        if shape != (layer.num_units,):
            raise ValueError(f"unit mask of layer {layer.name!r} has shape {shape}, "
                             f"expected ({layer.num_units},)")


def _unit_owned(layer: Layer) -> list[tuple[tuple[str, ...], bool]]:
    """(path, is_kernel) of every params leaf indexed by this layer's output units."""
    owned = [(layer.kernel, True)]
    if layer.bias is not None:
        owned.append((layer.bias, False))
    return owned


def _norm_leaves(params: Params, layer: Layer) -> list[tuple[str, ...]]:
    if layer.norm is None:
        return []
    try:
        module = get_path(params, layer.norm)
    except (KeyError, TypeError):
        return []  # a norm without parameters (e.g. use_scale=False, use_bias=False)
    return [layer.norm + (k,) for k in ("scale", "bias") if k in module]


def apply_unit_masks(structure: ModelStructure, params: Params, unit_masks: UnitMasks) -> Params:
    """`params` with every dropped unit's kernel slice, bias and norm scale/bias set to zero.

    Leaves of non-prunable parts are returned unchanged; see the module
    docstring for how gradients flow through a float mask.
    """
    _check_masks(structure, unit_masks)
    out = params
    for layer in structure.layers:
        m = unit_masks[layer.name]
        for path, is_kernel in _unit_owned(layer):
            leaf = get_path(params, path)
            mask = m if is_kernel else jax.lax.stop_gradient(m)
            out = set_path(out, path, leaf * mask.astype(leaf.dtype))
        for path in _norm_leaves(params, layer):
            leaf = get_path(params, path)
            out = set_path(out, path, leaf * jax.lax.stop_gradient(m).astype(leaf.dtype))
    return out


def weight_masks(structure: ModelStructure, params: Params, unit_masks: UnitMasks) -> Params:
    """A boolean tree shaped like `params`: False on the entries `apply_unit_masks` zeroes.

    Leaves outside the prunable layers are all True (e.g. for `masked_mean`).
    """
    _check_masks(structure, unit_masks)
    out = jax.tree_util.tree_map(lambda leaf: jnp.ones(jnp.shape(leaf), bool), params)
    for layer in structure.layers:
        keep = jnp.asarray(unit_masks[layer.name]).astype(bool)
        paths = [p for p, _ in _unit_owned(layer)] + _norm_leaves(params, layer)
        for path in paths:
            shape = jnp.shape(get_path(params, path))
            out = set_path(out, path, jnp.broadcast_to(keep, shape))
    return out


def layer_density(structure: ModelStructure, unit_masks: UnitMasks) -> dict[str, jax.Array]:
    """Per layer, the kept fraction of its kernel weights (= of its units: every unit has fan_in weights)."""
    _check_masks(structure, unit_masks)
    return {l.name: jnp.mean(jnp.asarray(unit_masks[l.name]).astype(jnp.float32)) for l in structure.layers}


def density(structure: ModelStructure, unit_masks: UnitMasks) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(overall, per layer): kept kernel weights / all kernel weights of the prunable layers."""
    per_layer = layer_density(structure, unit_masks)
    kept = sum(per_layer[l.name] * l.num_weights for l in structure.layers)
    return kept / structure.num_prunable_weights, per_layer


def live_input_fraction(structure: ModelStructure, unit_masks: UnitMasks) -> dict[str, jax.Array]:
    """Per layer, the fraction of its input units that some producer still keeps.

    A layer reading the data ('input') sees all of it. A layer reading several
    producers (a residual sum) sees a unit while any of them keeps it. Each
    input unit occupies the same number of input positions (kernel taps or
    `input_repeat`), so this fraction scales the layer's effective fan-in.
    """
    _check_masks(structure, unit_masks)
    out = {}
    for layer in structure.layers:
        producers = [structure[n] for n in layer.inputs_from if n != "input"]
        if len(producers) < len(layer.inputs_from) or not producers:
            out[layer.name] = jnp.ones((), jnp.float32)
            continue
        sizes = {p.num_units for p in producers}
        if len(sizes) != 1:
            raise ValueError(f"layer {layer.name!r} sums producers of different widths "
                             f"{sorted(sizes)}; cannot tell which input units are live")
        live = jnp.zeros((sizes.pop(),), bool)
        for p in producers:
            live = live | jnp.asarray(unit_masks[p.name]).astype(bool)
        out[layer.name] = jnp.mean(live.astype(jnp.float32))
    return out

