"""Training FLOPs of a dense or unit-masked model, by SpaFL's appendix A.5 (eq. 50).

SpaFL counts, for N training examples (one multiply-accumulate = one FLOP):
  convolution  forward  N x (C x R x S) x F x H x W   (C R S = the filter's fan-in,
                                                       F filters, H x W output map)
  dense        forward  N x X x Y                     (X inputs, Y neurons)
  backward = 2 x forward, so one training pass costs 3 x forward;
  a sparse layer scales its count by its density rho = ||p||_0 / |W|;
  the weight update from the global thresholds (Algorithm 1, line 6, eq. 13)
  costs 1.5 x d (d model parameters): a sum over each unit's weights, then a
  multiply-add per weight.
Layers without weights (pooling, activations, normalization) are not counted.

In `Layer` terms the forward count of one example is fan_in x num_units x
output_hw (output_hw = 1 for a dense layer). With unit masks, F (Y) becomes
the layer's kept units, which is exactly the paper's rho x F for a structured
mask, and the paper's formula (the default) stops there. With
`count_inputs=True`, C x R x S (X) also shrinks to the input units some
producer still keeps (`unit_masks.live_input_fraction`): a dropped unit
outputs zero (see `unit_masks`), so a device could skip it in its consumers
too; that count is lower than the paper's.

Where the paper writes eq. 50 "per local epoch" with the 1.5 d term inside,
we count 1.5 d once per participation, which is when line 6 of Algorithm 1
runs (outside the epoch loop); the difference is negligible (1.5 d against
3 N d-sized passes).

Dense counts (no masks, a Python int of examples) are exact Python numbers;
masked counts are float32 jax scalars, usable inside jit.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from fedjax_sparse.core.unit_masks import UnitMasks, live_input_fraction
from fedjax_sparse.models.structure import ModelStructure


def layer_forward_flops(structure: ModelStructure, unit_masks: UnitMasks | None = None, *,
                        count_inputs: bool = False) -> dict[str, Any]:
    """Per layer, forward FLOPs of one example."""
    if unit_masks is None:
        return {l.name: l.fan_in * l.num_units * l.output_hw for l in structure.layers}
    live_in = live_input_fraction(structure, unit_masks) if count_inputs else None
    out = {}
    for layer in structure.layers:
        kept = jnp.sum(jnp.asarray(unit_masks[layer.name]).astype(jnp.float32))
        fan_in = layer.fan_in * (live_in[layer.name] if count_inputs else 1.0)
        out[layer.name] = fan_in * kept * float(layer.output_hw)
    return out


def forward_flops(structure: ModelStructure, unit_masks: UnitMasks | None = None, *,
                  count_inputs: bool = False) -> Any:
    """Forward FLOPs of one example through all prunable layers."""
    return sum(layer_forward_flops(structure, unit_masks, count_inputs=count_inputs).values())


def training_flops(structure: ModelStructure, num_examples: Any, unit_masks: UnitMasks | None = None, *,
                   update_params: int = 0, count_inputs: bool = False) -> Any:
    """SpaFL eq. 50: 3 x forward FLOPs per training example, plus 1.5 x `update_params`.

    `num_examples` counts example passes (examples x epochs); `update_params`
    is d when the eq. 13 weight update runs (0 otherwise).
    """
    forward = forward_flops(structure, unit_masks, count_inputs=count_inputs)
    if unit_masks is None and isinstance(num_examples, int):
        return 3 * num_examples * forward + (1.5 * update_params if update_params else 0)
    return 3.0 * jnp.asarray(num_examples, jnp.float32) * forward + 1.5 * update_params
