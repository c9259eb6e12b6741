"""VGG networks for 32x32 inputs: `vgg9` (FedLDF) and `vgg11` (SPATL).

Both share the 8-convolution configuration "A" of Simonyan & Zisserman,
  [64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M],
3x3 convolutions with padding 1 and bias, ReLU, 2x2 max pools (M). Five pools
take 32x32 to 1x1, so the smallest input is 32x32; the flattened map feeds the
classifier (512 features on 32x32; larger inputs give `input_repeat` = H*W).

`vgg9` -- FedLDF: "a VGG-9 network model with 8 Conv layers and 1 linear layer
  (FC), where BN and max-pooling operations are conducted following each Conv
  layer". Pooling after all 8 convolutions is impossible on 32x32 (32 / 2^8 <
  1); we read "9" as 8 convs + 1 FC with BN after every conv and the five pools
  of configuration A: conv -> BN -> ReLU (-> pool), then dense 512 ->
  num_classes. (This is not FedMA's "VGG-9", which has 6 convs and 3 FCs.)
  For SPATL (no split in FedLDF): convs = encoder, dense = predictor. On 32x32x3 with 10 classes: 9,220,480 conv
  weights+biases + 5,504 BN scale/bias + 5,130 dense = 9,231,114 parameters.

`vgg11` -- SPATL: configuration A as the encoder (part='encoder') and a
  three-layer classifier as the predictor (part='predictor'): dense 512,
  ReLU, dense 512, ReLU, dense num_classes. This keeps to SPATL's released
  code (`networks/vgg.py`, `vgg11()`), which builds the convolutions without
  BatchNorm, so `vgg11` has no BN (unlike `vgg9`). SPATL's classifier also has
  two Dropout layers; the model contract carries no RNG, so they are left out.
  On 32x32x3 with 10 classes: 9,220,480 + 262,656 + 262,656 + 5,130 =
  9,750,922 parameters.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_sparse.models import layers as L
from fedjax_sparse.models.structure import Layer, Model, ModelStructure, Part

CONFIG_A = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(nn.Module):
    num_classes: int
    batch_norm: bool
    hidden: tuple[int, ...] = ()  # widths of the hidden classifier layers
    config: tuple = CONFIG_A

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        i = 0
        for k, item in enumerate(self.config):
            if item == "M":
                continue  # pooled inside the previous conv's unit output
            i += 1
            x = L.conv(item, 3, padding=1, name=f"conv{i}")(x)
            if self.batch_norm:
                x = L.batch_norm(train, f"bn{i}")(x, mask=mask)
            pooled = k + 1 < len(self.config) and self.config[k + 1] == "M"
            x = L.unit_output(self, x, unit_masks, f"conv{i}", L.relu_pool2 if pooled else nn.relu)
        x = L.flatten(x)
        if not self.hidden:
            return L.unit_output(self, L.dense(self.num_classes, name="fc")(x), unit_masks, "fc")
        for j, width in enumerate(self.hidden):
            x = L.unit_output(self, L.dense(width, name=f"fc{j + 1}")(x), unit_masks, f"fc{j + 1}", nn.relu)
        last = f"fc{len(self.hidden) + 1}"
        return L.unit_output(self, L.dense(self.num_classes, name=last)(x), unit_masks, last)


def _sizes(side: int) -> list[int]:
    """Side after every conv and pool of CONFIG_A."""
    sizes = []
    for item in CONFIG_A:
        side = L.pool_out(side) if item == "M" else L.conv_out(side, 3, padding=1)
        sizes.append(side)
    return sizes


def _build(name: str, input_shape, num_classes: int, *, batch_norm: bool,
           hidden: tuple[int, ...], conv_part: Part, dense_part: Part,
           description: str) -> Model:
    L.check_input(name, input_shape, _sizes)
    L.check_classes(name, num_classes)
    h, w, c = input_shape
    sh, sw = _sizes(h), _sizes(w)
    layers: list[Layer] = []
    prev, prev_units, i = "input", c, 0
    for k, item in enumerate(CONFIG_A):
        if item == "M":
            continue
        i += 1
        layer = L.conv_layer((f"conv{i}",), kernel=3, in_units=prev_units, units=item,
                             output_hw=sh[k] * sw[k], inputs_from=(prev,), bias=True,
                             norm=(f"bn{i}",) if batch_norm else None, part=conv_part)
        layers.append(layer)
        prev, prev_units = layer.name, item
    widths = hidden + (num_classes,)
    repeat = sh[-1] * sw[-1]
    for j, width in enumerate(widths):
        path = ("fc",) if not hidden else (f"fc{j + 1}",)
        layer = L.dense_layer(path, in_units=prev_units, units=width, input_repeat=repeat,
                              inputs_from=(prev,), bias=True, norm=None, part=dense_part)
        layers.append(layer)
        prev, prev_units, repeat = layer.name, width, 1
    module = VGG(num_classes=num_classes, batch_norm=batch_norm, hidden=hidden)
    return Model(name=name, module=module, input_shape=tuple(input_shape),
                 num_classes=num_classes, structure=ModelStructure(tuple(layers)),
                 description=description)


_CONFIG_TEXT = "64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M (M = maxpool 2)"


def vgg9(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    return _build("vgg9", input_shape, num_classes, batch_norm=True, hidden=(),
                  conv_part="encoder", dense_part="predictor",
                  description=("VGG-9 (FedLDF): 8 conv 3x3 pad 1 (bias) + BN + ReLU, widths "
                               f"{_CONFIG_TEXT}; flatten; dense {num_classes}."))


def vgg11(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    return _build("vgg11", input_shape, num_classes, batch_norm=False, hidden=(512, 512),
                  conv_part="encoder", dense_part="predictor",
                  description=("VGG-11 (SPATL): encoder = 8 conv 3x3 pad 1 (bias) + ReLU, no BN, "
                               f"widths {_CONFIG_TEXT}; predictor = dense 512, ReLU, dense 512, "
                               f"ReLU, dense {num_classes}."))
