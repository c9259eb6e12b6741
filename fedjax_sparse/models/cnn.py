"""Plain convolutional networks: `spafl_cnn`, `cnn4`, `cnn2`.

`spafl_cnn` -- SpaFL's CIFAR-10 model (appendix A.1, Table 6; the authors'
`masked_Conv4`, the 4-conv net of Zhou et al. 2019):
  conv 64@5x5 VALID, BN, ReLU; conv 64@5x5 VALID, BN, ReLU, maxpool 2;
  conv 128@5x5 VALID, BN, ReLU; conv 128@5x5 VALID, BN, ReLU, maxpool 2;
  flatten (2x2x128 = 512 on 32x32); dense 128, BN, ReLU; dense 128, BN, ReLU;
  dense num_classes. No biases on convs/denses (BN carries scale and bias).
  On 32x32x3 (32 -> 28 -> 24 -> 12 -> 8 -> 4 -> 2) with 10 classes:
    kernels 4,800 + 102,400 + 204,800 + 409,600 + 65,536 + 16,384 + 1,280
            = 804,800 weights;
    BN scale+bias 2 * (64+64+128+128+128+128) = 1,280; running mean+var 1,280.
  The paper's "807,366 model parameters" is 804,800 + 1,280 + 1,280 + 6: the
  PyTorch state dict also holds one `num_batches_tracked` counter per BN (6).
  Discrepancy: the paper states 1,418 trainable thresholds, but the model has
  64+64+128+128+128+128+10 = 650 units, and the authors' released masked
  layers define one threshold per output filter/neuron, i.e. 650. We keep one
  threshold per unit (650). (1,418 - 650 = 768 = 512+128+128, the input widths
  of the three dense layers, which suggests per-input thresholds on the dense
  layers were counted somewhere; this is a guess the paper does not confirm.)
  Smallest input: 28x28. No paper splits it for SPATL: the hidden layers are
  the encoder, the output layer the predictor.

`cnn4` -- the "Conv" model of HeteroFL / FedGSE with widths 64, 128, 256, 512:
  [conv 3x3 pad 1 (bias) -> BN -> ReLU -> maxpool 2] x 3, conv 3x3 -> BN -> ReLU
  (no pool), global average pool, dense num_classes. Works on 8x8 digits
  (8 -> 4 -> 2 -> 1); smallest input 8x8. HeteroFL/FedGSE put a `Scaler`
  (division by the width rate during training) before each norm and use
  "static" BN without running statistics; those are sub-model-training
  choices left to the algorithms: here it is the ordinary masked BatchNorm.
  For SPATL (no split in the papers): convs = encoder, dense = predictor.

`cnn2` (also `femnist_cnn`) -- SPATL's 2-layer CNN for FEMNIST, FedAvg's CNN (McMahan et al. 2017):
  conv 32@5x5 pad 2 -> ReLU -> maxpool 2 -> conv 64@5x5 pad 2 -> ReLU ->
  maxpool 2 -> flatten -> dense 512 -> ReLU -> dense num_classes, with biases,
  no normalization. On 28x28x1 with 62 classes (28 -> 14 -> 7):
  832 + 51,264 + 1,606,144 + 31,806 = 1,690,046 parameters.
  SPATL's paper does not spell the network out (and its released code only
  has a LeNet-style `SimpleCNN` with 6/16 channels), so FedAvg's 2-layer CNN is
  used; LEAF's FEMNIST CNN (models/femnist/cnn.py) is the same with a dense
  layer of 2,048 (6.6 M parameters). Convs are part='encoder', denses
  part='predictor' (SPATL's split).
  Smallest input 4x4.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_sparse.models import layers as L
from fedjax_sparse.models.structure import Model, ModelStructure

# ------------------------------------------------------------------ spafl_cnn

SPAFL_CONVS = (64, 64, 128, 128)
SPAFL_DENSE = (128, 128)


class SpaFLCNN(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        for i, width in enumerate(SPAFL_CONVS):
            x = L.conv(width, 5, use_bias=False, name=f"conv{i + 1}")(x)
            x = L.batch_norm(train, f"bn{i + 1}")(x, mask=mask)
            x = L.unit_output(self, x, unit_masks, f"conv{i + 1}", L.relu_pool2 if i % 2 == 1 else nn.relu)
        x = L.flatten(x)
        for j, width in enumerate(SPAFL_DENSE):
            x = L.dense(width, use_bias=False, name=f"fc{j + 1}")(x)
            x = L.batch_norm(train, f"bn{len(SPAFL_CONVS) + j + 1}")(x, mask=mask)
            x = L.unit_output(self, x, unit_masks, f"fc{j + 1}", nn.relu)
        last = f"fc{len(SPAFL_DENSE) + 1}"
        return L.unit_output(self, L.dense(self.num_classes, use_bias=False, name=last)(x), unit_masks, last)


def _spafl_sizes(side: int) -> list[int]:
    c1 = L.conv_out(side, 5)
    c2 = L.conv_out(c1, 5)
    p2 = L.pool_out(c2)
    c3 = L.conv_out(p2, 5)
    c4 = L.conv_out(c3, 5)
    return [c1, c2, p2, c3, c4, L.pool_out(c4)]


def spafl_cnn(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    L.check_input("spafl_cnn", input_shape, _spafl_sizes)
    L.check_classes("spafl_cnn", num_classes)
    h, w, c = input_shape
    sh, sw = _spafl_sizes(h), _spafl_sizes(w)
    conv_hw = [sh[0] * sw[0], sh[1] * sw[1], sh[3] * sw[3], sh[4] * sw[4]]
    final_hw = sh[5] * sw[5]
    layers, prev, prev_units = [], "input", c
    for i, width in enumerate(SPAFL_CONVS):
        layer = L.conv_layer((f"conv{i + 1}",), kernel=5, in_units=prev_units, units=width,
                             output_hw=conv_hw[i], inputs_from=(prev,), bias=False,
                             norm=(f"bn{i + 1}",), part="encoder")
        layers.append(layer)
        prev, prev_units = layer.name, width
    repeat = final_hw
    for j, width in enumerate(SPAFL_DENSE + (num_classes,)):
        last = j == len(SPAFL_DENSE)
        layer = L.dense_layer((f"fc{j + 1}",), in_units=prev_units, units=width,
                              input_repeat=repeat, inputs_from=(prev,), bias=False,
                              norm=None if last else (f"bn{len(SPAFL_CONVS) + j + 1}",),
                              part="predictor" if last else "encoder")
        layers.append(layer)
        prev, prev_units, repeat = layer.name, width, 1
    return Model(
        name="spafl_cnn", module=SpaFLCNN(num_classes=num_classes),
        input_shape=tuple(input_shape), num_classes=num_classes,
        structure=ModelStructure(tuple(layers)),
        description=("SpaFL CIFAR-10 CNN (masked_Conv4): [conv 5x5 VALID, BN, ReLU] x 4 with "
                     "widths 64, 64, 128, 128 and maxpool 2 after the 2nd and 4th; flatten "
                     f"{sh[5]}x{sw[5]}x128; dense 128, BN, ReLU; dense 128, BN, ReLU; "
                     f"dense {num_classes}. No conv/dense biases."))


# ------------------------------------------------------------------ cnn4

CNN4_WIDTHS = (64, 128, 256, 512)


class CNN4(nn.Module):
    num_classes: int
    widths: tuple[int, ...] = CNN4_WIDTHS

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        for i, width in enumerate(self.widths):
            x = L.conv(width, 3, padding=1, name=f"conv{i + 1}")(x)
            x = L.batch_norm(train, f"bn{i + 1}")(x, mask=mask)
            pooled = i < len(self.widths) - 1
            x = L.unit_output(self, x, unit_masks, f"conv{i + 1}", L.relu_pool2 if pooled else nn.relu)
        return L.unit_output(self, L.dense(self.num_classes, name="fc")(L.global_avg_pool(x)), unit_masks, "fc")


def _cnn4_sizes(side: int) -> list[int]:
    sizes = []
    for i in range(len(CNN4_WIDTHS)):
        side = L.conv_out(side, 3, padding=1)
        sizes.append(side)
        if i < len(CNN4_WIDTHS) - 1:
            side = L.pool_out(side)
            sizes.append(side)
    return sizes


def cnn4(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    L.check_input("cnn4", input_shape, _cnn4_sizes)
    L.check_classes("cnn4", num_classes)
    h, w, c = input_shape
    sh, sw = _cnn4_sizes(h), _cnn4_sizes(w)
    layers, prev, prev_units = [], "input", c
    for i, width in enumerate(CNN4_WIDTHS):
        layer = L.conv_layer((f"conv{i + 1}",), kernel=3, in_units=prev_units, units=width,
                             output_hw=sh[2 * i] * sw[2 * i], inputs_from=(prev,), bias=True,
                             norm=(f"bn{i + 1}",), part="encoder")
        layers.append(layer)
        prev, prev_units = layer.name, width
    layers.append(L.dense_layer(("fc",), in_units=prev_units, units=num_classes,
                                inputs_from=(prev,), bias=True, norm=None, part="predictor"))
    return Model(
        name="cnn4", module=CNN4(num_classes=num_classes), input_shape=tuple(input_shape),
        num_classes=num_classes, structure=ModelStructure(tuple(layers)),
        description=("HeteroFL/FedGSE Conv: [conv 3x3 pad 1 (bias), BN, ReLU, maxpool 2] with "
                     "widths 64, 128, 256, then conv 512 3x3, BN, ReLU; global average pool; "
                     f"dense {num_classes}."))


# ------------------------------------------------------------------ cnn2

CNN2_CONVS = (32, 64)
CNN2_HIDDEN = 512


class CNN2(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        del train, mask
        for i, width in enumerate(CNN2_CONVS):
            x = L.conv(width, 5, padding=2, name=f"conv{i + 1}")(x)
            x = L.unit_output(self, x, unit_masks, f"conv{i + 1}", L.relu_pool2)
        x = L.unit_output(self, L.dense(CNN2_HIDDEN, name="fc1")(L.flatten(x)), unit_masks, "fc1", nn.relu)
        return L.unit_output(self, L.dense(self.num_classes, name="fc2")(x), unit_masks, "fc2")


def _cnn2_sizes(side: int) -> list[int]:
    sizes = []
    for _ in CNN2_CONVS:
        side = L.conv_out(side, 5, padding=2)
        sizes.append(side)
        side = L.pool_out(side)
        sizes.append(side)
    return sizes


def cnn2(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    L.check_input("cnn2", input_shape, _cnn2_sizes)
    L.check_classes("cnn2", num_classes)
    h, w, c = input_shape
    sh, sw = _cnn2_sizes(h), _cnn2_sizes(w)
    layers = (
        L.conv_layer(("conv1",), kernel=5, in_units=c, units=32, output_hw=sh[0] * sw[0],
                     inputs_from=("input",), bias=True, norm=None, part="encoder"),
        L.conv_layer(("conv2",), kernel=5, in_units=32, units=64, output_hw=sh[2] * sw[2],
                     inputs_from=("conv1",), bias=True, norm=None, part="encoder"),
        L.dense_layer(("fc1",), in_units=64, units=CNN2_HIDDEN, input_repeat=sh[3] * sw[3],
                      inputs_from=("conv2",), bias=True, norm=None, part="predictor"),
        L.dense_layer(("fc2",), in_units=CNN2_HIDDEN, units=num_classes, inputs_from=("fc1",),
                      bias=True, norm=None, part="predictor"),
    )
    return Model(
        name="cnn2", module=CNN2(num_classes=num_classes), input_shape=tuple(input_shape),
        num_classes=num_classes, structure=ModelStructure(layers),
        description=("FedAvg/LEAF 2-layer CNN (SPATL FEMNIST): conv 32@5x5 pad 2, ReLU, maxpool 2, "
                     f"conv 64@5x5 pad 2, ReLU, maxpool 2, flatten {sh[3]}x{sw[3]}x64, dense 512, "
                     f"ReLU, dense {num_classes}; biases; convs = encoder, denses = predictor."))
