"""Unit masks: structured sparsity as one keep/drop value per output unit of each prunable layer.

A unit mask is `{layer_name: [num_units]}` (bool, or float in {0, 1}) over the
layers of a `ModelStructure`. SpaFL's threshold masks, FedGSE/HeteroFL/FedRolex/
Federated Dropout sub-models and SPATL's salient units are all unit masks.

One mechanism for every method: a mask multiplies its layer's unit *outputs*,
after the layer's normalization and before its activation or residual sum
(`models.layers.unit_output`; a model runs a sub-model when its variables hold
`'unit_masks'`). So
  * a dropped unit outputs exactly zero, as if removed from the network; its
    consumers see fewer live inputs (`input_unit_masks`, `live_input_fraction`);
  * a float mask gets a gradient, dL/dm_i = sum over examples and positions of
    g * h_i (h_i the unit's normalized output, g = dL/d(m h)). For a layer with
    no bias and no normalization h_i = sum_j w_ij x_j, which makes this exactly
    sum_j (dL/dw~_ij) w_ij, SpaFL's eq. 9. Behind a BatchNorm it is the signal
    eq. 9 intends; masking the kernel instead would give ~0 there, since BN
    undoes any scaling of its input (sum_j g_ij w_ij = 0).
Weights are never multiplied by the mask in the forward pass. Which *weights*
a sub-model consists of (to freeze the rest during local training, to send
only them, to aggregate per entry) is `variable_masks`: a kernel entry belongs
to the sub-model when both its output unit and its input unit do; a bias,
normalization parameter or statistic when its unit does (a normalization of
a residual sum, `Layer.norm_units_from`: when any layer summed into it keeps
the unit). These are exactly the entries the masked forward pass uses, on
every model of the zoo and for group-tied and per-layer masks alike: the
gradient of a masked model is zero outside them and non-zero inside, and
every layer receives exactly the live inputs `input_unit_masks` names
(tests/test_structure.py; `core.structure.flops.measure_layers` reads it off the
computation).

Density (`density`) counts kernel weights of the prunable layers only: a kept
unit keeps its `fan_in` weights, a dropped one none, following SpaFL's
||p||_0 / |W| (a weight whose input unit was dropped upstream still counts as
kept here, as in the paper; the FLOP count can take that into account).
`layer_mean_density` is the plain mean of the layers' densities, the figure
SpaFL's official code reports (`get_density`).
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


def _unit_owned(layer: Layer) -> list[tuple[str, ...]]:
    """Paths (in params) of the bias indexed by this layer's output units."""
    return [layer.bias] if layer.bias is not None else []


def _norm_paths(variables: dict, layer: Layer) -> list[tuple[str, ...]]:
    """(collection, ...path) of the normalization leaves of this layer's outputs that exist."""
    if layer.norm is None:
        return []
    out = []
    for collection, keys in (("params", ("scale", "bias")), ("batch_stats", ("mean", "var"))):
        try:
            module = get_path(variables.get(collection, {}), layer.norm)
        except (KeyError, TypeError):
            continue  # a norm without parameters or statistics
        out += [(collection,) + layer.norm + (k,) for k in keys if k in module]
    return out


def input_unit_masks(structure: ModelStructure, unit_masks: UnitMasks) -> dict[str, jax.Array | None]:
    """Per layer, [input units] bool: the input units some producer keeps (None: reads the data).

    A layer reading several producers (a residual sum) sees a unit while any of
    them keeps it. An LSTM layer's input units are those it consumes (all, for the
    data) and then its own, which it reads back from the previous step.
    """
    _check_masks(structure, unit_masks)
    out = {}
    for layer in structure.layers:
        producers = [structure[n] for n in layer.inputs_from if n != "input"]
        live = None
        if len(producers) == len(layer.inputs_from) and producers:
            sizes = {p.num_units for p in producers}
            if len(sizes) != 1:
                raise ValueError(f"layer {layer.name!r} sums producers of different widths "
                                 f"{sorted(sizes)}; cannot tell which input units are live")
            live = jnp.zeros((sizes.pop(),), bool)
            for p in producers:
                live = live | jnp.asarray(unit_masks[p.name]).astype(bool)
        if layer.kind == "lstm":
            consumed = jnp.ones((layer.consumed_width,), bool) if live is None else live
            live = jnp.concatenate([consumed, jnp.asarray(unit_masks[layer.name]).astype(bool)])
        out[layer.name] = live
    return out


def kernel_mask(layer: Layer, kernel_shape: tuple[int, ...], keep: jax.Array,
                live_inputs: jax.Array | None) -> jax.Array:
    """[kernel] bool: output unit kept and input unit live. A dense kernel's input axis holds
    each input unit `input_repeat` times, channel fastest (as Flax flattens NHWC)."""
    mask = jnp.broadcast_to(keep, kernel_shape)
    if live_inputs is None:
        return mask
    rows = jnp.tile(live_inputs, layer.input_repeat) if layer.kind == "dense" else live_inputs
    return mask & rows.reshape((1,) * (len(kernel_shape) - 2) + (-1, 1))


def variable_masks(structure: ModelStructure, variables: dict, unit_masks: UnitMasks, *,
                   inputs: bool = True) -> dict:
    """Bool trees shaped like `variables` ({'params', 'batch_stats'}): True on the sub-model's entries.

    Kernels: output unit kept and input unit live (`kernel_mask`); biases,
    normalization parameters and statistics: unit kept. Leaves outside the
    prunable layers are all True. `inputs=False`: the kept units' own entries
    instead, every kernel entry of a kept unit whatever its input (a neuron-level
    upload sends a kept neuron's whole incoming weights, FedADP).

        >>> from fedjax_sparse.models import get_model
        >>> import jax, jax.numpy as jnp
        >>> model = get_model("mlp", (8, 8, 1), 10)
        >>> shapes = jax.eval_shape(model.init, jax.random.key(0))
        >>> masks = {"fc1": jnp.arange(256) < 64, "fc2": jnp.arange(256) < 32, "fc3": jnp.ones(10, bool)}
        >>> entries = variable_masks(model.structure, shapes, masks)["params"]
        >>> int(entries["fc2"]["kernel"].sum()), int(entries["fc3"]["kernel"].sum())  # 64 x 32, 32 x 10
        (2048, 320)
    """
    _check_masks(structure, unit_masks)
    live = input_unit_masks(structure, unit_masks) if inputs else {l.name: None for l in structure.layers}
    out = jax.tree_util.tree_map(lambda leaf: jnp.ones(jnp.shape(leaf), bool), dict(variables))
    for layer in structure.layers:
        keep = jnp.asarray(unit_masks[layer.name]).astype(bool)
        shape = jnp.shape(get_path(variables["params"], layer.kernel))
        out = set_path(out, ("params",) + layer.kernel, kernel_mask(layer, shape, keep, live[layer.name]))
        for path in [("params",) + p for p in _unit_owned(layer)]:
            out = set_path(out, path, jnp.broadcast_to(keep, jnp.shape(get_path(variables, path))))
        norm_keep = norm_unit_mask(layer, unit_masks)
        for path in _norm_paths(variables, layer):
            out = set_path(out, path, jnp.broadcast_to(norm_keep, jnp.shape(get_path(variables, path))))
    return out


def norm_unit_mask(layer: Layer, unit_masks: UnitMasks) -> jax.Array:
    """[units] bool: the channels of `layer.norm` the sub-model uses: the layer's kept units, or,
    for a norm of a residual sum (`Layer.norm_units_from`), the units any summed layer keeps."""
    keep = jnp.zeros((layer.num_units,), bool)
    for name in layer.norm_units_from or (layer.name,):
        keep = keep | jnp.asarray(unit_masks[name]).astype(bool)
    return keep


def layer_density(structure: ModelStructure, unit_masks: UnitMasks) -> dict[str, jax.Array]:
    """Per layer, the kept fraction of its kernel weights (= of its units: every unit has fan_in weights)."""
    _check_masks(structure, unit_masks)
    return {l.name: jnp.mean(jnp.asarray(unit_masks[l.name]).astype(jnp.float32)) for l in structure.layers}


def density(structure: ModelStructure, unit_masks: UnitMasks) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(overall, per layer): kept kernel weights / all kernel weights of the prunable layers."""
    per_layer = layer_density(structure, unit_masks)
    kept = sum(per_layer[l.name] * l.num_weights for l in structure.layers)
    return kept / structure.num_prunable_weights, per_layer


def layer_mean_density(structure: ModelStructure, unit_masks: UnitMasks) -> jax.Array:
    """The unweighted mean of the layers' densities (SpaFL's official `get_density`)."""
    per_layer = layer_density(structure, unit_masks)
    return sum(per_layer.values()) / len(per_layer)


def live_input_fraction(structure: ModelStructure, unit_masks: UnitMasks) -> dict[str, jax.Array]:
    """Per layer, the fraction of its input units that some producer still keeps.

    Each input unit occupies the same number of input positions (kernel taps or
    `input_repeat`), so this fraction scales the layer's effective fan-in.
    """
    return {name: jnp.ones((), jnp.float32) if live is None else jnp.mean(live.astype(jnp.float32))
            for name, live in input_unit_masks(structure, unit_masks).items()}
