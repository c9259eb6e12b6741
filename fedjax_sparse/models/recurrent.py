"""`char_lstm`: LEAF's Shakespeare model (models/shakespeare/stacked_lstm.py), next character from 80.

  tokens [B, T] -> embedding 8 -> LSTM 256 -> LSTM 256 -> the last step's output -> dense to the
  vocabulary (the characters are also the classes: LEAF's 80).
LSTM layers are TensorFlow's BasicLSTMCell, as LEAF stacks them: one kernel over [x_t, h_{t-1}]
for the four gates i, g, f, o, a forget bias of 1 added to f, c_t = sigmoid(f + 1) c_{t-1} +
sigmoid(i) tanh(g), h_t = sigmoid(o) tanh(c_t), h_0 = c_0 = 0. Initialization as TensorFlow's
defaults there: Glorot-uniform kernels (an LSTM's over its [inputs + units, 4 units] matrix),
zero biases. On T = 80 and 80 characters: embedding 80 x 8 = 640, LSTMs 4 x (8 + 256) x 256 + 4 x 256
= 271,360 and 4 x (256 + 256) x 256 + 4 x 256 = 525,312, dense 256 x 80 + 80 = 20,560: 817,872
parameters.

Structure. The embedding is a dense layer on the one-hot characters (the same values and
gradient as a lookup; its 8 units are the embedding's dimensions), so the structure
describes it like any layer. An LSTM layer's units are its hidden units: unit u owns the four
gate columns [:, :, u] of its kernel [4, consumed units + units, units] (kind 'lstm'; the
input axis holds the consumed units, then the layer's own units fed back through h_{t-1})
and its bias [4, u]. Its unit mask multiplies h_t inside the recurrence, so a dropped unit
outputs exactly zero at every step, to the next layer and to its own layer's next step, and
its weights, the gate columns and the rows reading it, take no part (`core.structure.unit_masks`; the
masked output is also marked for dL/dh, `<layer>_out`, including its recurrent paths). Every
method of the library applies: sub-models and SPATL's salient units select hidden units,
SpaFL thresholds them, FedLDF moves the four layers. Forward FLOPs count each step's kernel
product, fan-in x units x T (the embedding as its product at every step). SPATL's split: the embedding
and the LSTMs are the encoder, the dense layer the predictor.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_sparse.models import layers as L
from fedjax_sparse.models.structure import Layer, Model, ModelStructure

EMBEDDING, HIDDEN = 8, (256, 256)
FORGET_BIAS = 1.0
GATES = 4
glorot = nn.initializers.glorot_uniform()
lstm_kernel_init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=1, out_axis=(0, 2))


class LSTM(nn.Module):
    """One LSTM layer over a sequence: x [B, T, D] -> h [B, T, units] (module docstring).

    `perturbation` ([B, T, units], zeros) is added to every h_t before the unit mask, so that its
    gradient is dL/dh_t through every path; `unit_mask` ([units]) multiplies h_t."""

    units: int

    @nn.compact
    def __call__(self, x: jax.Array, perturbation: jax.Array, unit_mask: jax.Array | None = None) -> jax.Array:
        batch, _, width = x.shape
        kernel = self.param("kernel", lstm_kernel_init, (GATES, width + self.units, self.units))
        bias = self.param("bias", nn.initializers.zeros, (GATES, self.units))
        from_inputs = jnp.einsum("btd,gdu->tbgu", x, kernel[:, :width]) + bias  # every step's at once
        recurrent = kernel[:, width:]
        mask = None if unit_mask is None else jnp.asarray(unit_mask).astype(x.dtype)

        def step(carry, inputs):
            h, c = carry
            z_x, p = inputs
            z = z_x + jnp.einsum("bv,gvu->bgu", h, recurrent)
            c = jax.nn.sigmoid(z[:, 2] + FORGET_BIAS) * c + jax.nn.sigmoid(z[:, 0]) * jnp.tanh(z[:, 1])
            h = jax.nn.sigmoid(z[:, 3]) * jnp.tanh(c) + p
            if mask is not None:
                h = h * mask.astype(h.dtype)
            return (h, c), h

        zeros = jnp.zeros((batch, self.units), x.dtype)
        _, hs = jax.lax.scan(step, (zeros, zeros), (from_inputs, jnp.swapaxes(perturbation, 0, 1)))
        return jnp.swapaxes(hs, 0, 1)


class CharLSTM(nn.Module):
    vocabulary: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        del train, mask  # no normalization
        embed = nn.Dense(EMBEDDING, use_bias=False, kernel_init=glorot, name="embed")
        # one-hot in the dtype the model computes in (`Model.compute_dtype`: its kernel's, once built)
        dtype = jnp.float32 if self.is_initializing() else self.variables["params"]["embed"]["kernel"].dtype
        h = embed(jax.nn.one_hot(x, self.vocabulary, dtype=dtype))
        h = L.unit_output(self, h, unit_masks, "embed")
        for i, units in enumerate(HIDDEN):
            name = f"lstm{i + 1}"
            perturbation = self.perturb(f"{name}_out", jnp.zeros((*h.shape[:2], units), h.dtype))
            h = LSTM(units, name=name)(h, perturbation, None if unit_masks is None else unit_masks[name])
        logits = nn.Dense(self.vocabulary, kernel_init=glorot, name="fc")(h[:, -1])
        return L.unit_output(self, logits, unit_masks, "fc")


def lstm_layer(name: str, *, in_units: int, units: int, steps: int, inputs_from: tuple[str, ...]) -> Layer:
    """An LSTM layer's structure: kernel [4, in_units + units, units], bias [4, units] (module docstring)."""
    return Layer(name=name, kind="lstm", kernel=(name, "kernel"), bias=(name, "bias"), norm=None, num_units=units,
                 fan_in=GATES * (in_units + units), inputs_from=inputs_from, part="encoder", output_hw=steps)


def char_lstm(input_shape: tuple[int, ...], num_classes: int) -> Model:
    """On token sequences of shape (T,) over `num_classes` characters (LEAF: T = 80, 80 characters)."""
    if len(input_shape) != 1 or int(input_shape[0]) < 1:
        raise ValueError(f"char_lstm reads token sequences, an input shape (T,) with T >= 1, got {tuple(input_shape)}")
    L.check_classes("char_lstm", num_classes)
    steps = int(input_shape[0])
    layers = [L.dense_layer(("embed",), in_units=num_classes, units=EMBEDDING, inputs_from=("input",), bias=False,
                            norm=None, part="encoder", positions=steps)]
    width, prev = EMBEDDING, "embed"
    for i, units in enumerate(HIDDEN):
        layers.append(lstm_layer(f"lstm{i + 1}", in_units=width, units=units, steps=steps, inputs_from=(prev,)))
        width, prev = units, f"lstm{i + 1}"
    layers.append(L.dense_layer(("fc",), in_units=width, units=num_classes, inputs_from=(prev,), bias=True, norm=None,
                                part="predictor"))
    return Model(name="char_lstm", module=CharLSTM(vocabulary=num_classes), input_shape=(steps,),
                 num_classes=num_classes, structure=ModelStructure(tuple(layers)), input_kind="tokens",
                 description=(f"LEAF Shakespeare: {num_classes} characters embedded in {EMBEDDING}, LSTM "
                              f"{HIDDEN[0]}, LSTM {HIDDEN[1]} over {steps} steps (TF BasicLSTMCell, forget bias 1), "
                              f"dense {num_classes} on the last step's output."))
