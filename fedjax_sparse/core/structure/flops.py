"""Training FLOPs of a dense or unit-masked model, by SpaFL's appendix A.5 (eq. 50).

The counts here are in the papers' convention, one FLOP per multiply-accumulate (MAC): every `train_flops`,
`forward_flops` and FLOPs figure a run records is a MAC count. A rate in FLOP/s (a device's speed,
`core.federation.clock`) divides `FLOPS_PER_MAC` = 2 FLOPs per MAC, a multiply and an add.

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

Checking a figure: `measure_layers` reads, off a real forward pass of the
(masked) model, which input channels each convolution and dense call
receives non-zero and which of its output channels reach the logits;
`MeasuredLayer.flops` is then the count of the physically smaller layer. On
every model of the zoo it equals `layer_forward_flops` for group-tied and
per-layer masks, with and without `count_inputs` (tests/test_structure.py).
XLA's cost analysis agrees on dense layers and unpadded convolutions; on a
padded one it leaves out the taps that read padding, which the paper's
convention (and ours) counts.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from fedjax_sparse.core.structure.unit_masks import UnitMasks, live_input_fraction
from fedjax_sparse.models.conv import Conv2D
from fedjax_sparse.models.recurrent import LSTM
from fedjax_sparse.models.structure import ModelStructure

FLOPS_PER_MAC = 2  # a multiply-accumulate is a multiply and an add: what a FLOP/s rate counts


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


# ------------------------------------------------------------------ measured on the computation itself

@flax.struct.dataclass
class MeasuredLayer:
    """What one convolution or dense call of a real forward pass computed, read off its arrays.

    live_inputs: [input channels] bool, the channels (a dense layer: the features) of the
      call's input that are non-zero somewhere in the batch;
    live_outputs: [output channels] bool, the channels through which the output depends on
      the call: a random projection of the logits has a non-zero gradient there;
    taps: kernel positions per (input, output) channel pair (kh x kw; 1 for dense; an LSTM's 4
      gates);
    output_hw: positions of the output map (1 for dense; an LSTM's steps).
    """

    live_inputs: jax.Array
    live_outputs: jax.Array
    taps: int = flax.struct.field(pytree_node=False)
    output_hw: int = flax.struct.field(pytree_node=False)

    def flops(self, *, count_inputs: bool = False) -> jax.Array:
        """Forward MACs of one example of the physically smaller layer (live outputs only; with
        `count_inputs`, live inputs only, else every input channel), padding taps included as
        in `layer_forward_flops`."""
        inputs = jnp.sum(self.live_inputs) if count_inputs else self.live_inputs.shape[0]
        return (jnp.asarray(inputs, jnp.float32) * self.taps * jnp.sum(self.live_outputs).astype(jnp.float32)
                * float(self.output_hw))


def measure_layers(model, variables: dict, x: jax.Array, *, train: bool = False,
                   key: jax.Array | None = None) -> dict[str, MeasuredLayer]:
    """{layer: MeasuredLayer} of every convolution and dense call of `model.apply(variables, x)`.

    An independent check of `layer_forward_flops`: it reads the computation, not the
    structure description (used only to name the calls). Every `Conv2D` / `nn.Dense` call is
    intercepted (`flax.linen.intercept_methods`); its input shows which channels are live,
    the gradient of a random projection of the logits (drawn from `key`) at its output shows
    which output channels reach the logits, and its output and kernel give the map size and
    taps. An LSTM call's inputs are its sequence's channels and then its own outputs of the
    previous steps (the state it feeds back, h_0 = 0): their channels are live where non-zero;
    its offset is added where its unit mask applies (through its perturbation argument), since
    the mask acts inside the call. `variables` may hold `'unit_masks'` (a sub-model). Liveness is what this batch
    shows: a channel that is zero on every example and position (e.g. behind a ReLU) counts
    as dead, as a device skipping all-zero channels would on this batch; pass enough varied
    examples to measure the network rather than the batch. Usable inside jit.
    """
    structure = model.structure
    by_path = {layer.kernel[:-1]: layer.name for layer in structure.layers}

    shapes: dict[str, tuple] = {}  # {layer: (output shape, kernel shape)}, static

    def forward(offsets):
        """(logits, {layer: its input}), each call's output plus its offset (None: none)."""
        inputs = {}

        def interceptor(next_fun, args, kwargs, context):
            module = context.module
            if context.method_name != "__call__" or not isinstance(module, (Conv2D, nn.Dense, LSTM)):
                return next_fun(*args, **kwargs)
            name = by_path.get(tuple(module.path))
            if name is None:
                raise ValueError(f"{model.name}: the forward pass calls {'/'.join(module.path)}, "
                                 f"which its structure does not describe")
            if name in inputs:
                raise ValueError(f"{model.name}: layer {name!r} is called twice in one forward pass")
            if isinstance(module, LSTM):  # its offset enters as its own perturbation: before its unit mask
                perturbed = args[1] if offsets is None else args[1] + offsets[name]
                out = next_fun(args[0], perturbed, *args[2:], **kwargs)
                fed_back = jnp.pad(out[:, :-1], ((0, 0), (1, 0), (0, 0)))
                inputs[name] = jnp.concatenate([args[0], fed_back], axis=-1)
                shapes[name] = (out.shape, module.get_variable("params", "kernel").shape)
                return out
            out = next_fun(*args, **kwargs)
            inputs[name] = args[0]
            shapes[name] = (out.shape, module.get_variable("params", "kernel").shape)
            return out if offsets is None else out + offsets[name]

        with nn.intercept_methods(interceptor):
            logits, _ = model.apply(variables, x, train=train)
        return logits, inputs

    logits = jax.eval_shape(lambda: forward(None)[0])
    projection = jax.random.normal(jax.random.key(0) if key is None else key, logits.shape)

    def projected(offsets):
        logits, inputs = forward(offsets)
        return jnp.sum(logits * projection), inputs

    offsets = {name: jnp.zeros(out, logits.dtype) for name, (out, _) in shapes.items()}  # x may be tokens
    grads, inputs = jax.grad(projected, has_aux=True)(offsets)
    out = {}
    for name, (out_shape, kernel_shape) in shapes.items():
        out[name] = MeasuredLayer(live_inputs=jnp.any(inputs[name] != 0, axis=tuple(range(inputs[name].ndim - 1))),
                                  live_outputs=jnp.any(grads[name] != 0, axis=tuple(range(len(out_shape) - 1))),
                                  taps=math.prod(kernel_shape[:-2]), output_hw=math.prod(out_shape[1:-1]))
    return out
