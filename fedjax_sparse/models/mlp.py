"""`mlp`: a two-hidden-layer perceptron, the small model for quick runs.

flatten -> Dense 256 -> ReLU -> Dense 256 -> ReLU -> Dense num_classes, all
with biases, no normalization. On 8x8x1 digits with 10 classes:
64*256+256 + 256*256+256 + 256*10+10 = 85,002 parameters. No paper splits it
into SPATL's encoder and predictor: the hidden layers are the encoder, the
output layer the predictor. The first layer consumes the image channels,
each H*W times (`input_repeat`), or the features of a [B, features] vector
(FedProx's Synthetic: 60 features, 10 classes, 83,978 parameters).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_sparse.models import layers as L
from fedjax_sparse.models.structure import Model, ModelStructure

HIDDEN = (256, 256)


class MLP(nn.Module):
    num_classes: int
    hidden: tuple[int, ...] = HIDDEN

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        del train, mask  # no normalization
        x = L.flatten(x)
        for i, width in enumerate(self.hidden):
            x = L.unit_output(self, L.dense(width, name=f"fc{i + 1}")(x), unit_masks, f"fc{i + 1}", nn.relu)
        last = f"fc{len(self.hidden) + 1}"
        return L.unit_output(self, L.dense(self.num_classes, name=last)(x), unit_masks, last)


def mlp(input_shape: tuple[int, ...], num_classes: int) -> Model:
    """On (H, W, C) images or (features,) vectors."""
    if len(input_shape) == 1 and int(input_shape[0]) >= 1:
        (c,), positions, shown = input_shape, 1, f"{int(input_shape[0])} features"
    else:
        L.check_input("mlp", input_shape)  # one line for anything but images
        (h, w, c), shown = input_shape, "x".join(map(str, input_shape))
        positions = h * w
    L.check_classes("mlp", num_classes)
    widths = HIDDEN + (num_classes,)
    layers, prev, prev_units, repeat = [], "input", int(c), positions
    for i, width in enumerate(widths):
        layer = L.dense_layer((f"fc{i + 1}",), in_units=prev_units, units=width, inputs_from=(prev,),
                              input_repeat=repeat, bias=True, norm=None,
                              part="predictor" if i == len(widths) - 1 else "encoder")
        layers.append(layer)
        prev, prev_units, repeat = layer.name, width, 1
    return Model(
        name="mlp", module=MLP(num_classes=num_classes), input_shape=tuple(int(d) for d in input_shape),
        num_classes=num_classes, structure=ModelStructure(tuple(layers)),
        description=(f"MLP: flatten {shown} -> dense 256 -> ReLU -> dense 256 -> ReLU -> "
                     f"dense {num_classes}; biases, no normalization."))
