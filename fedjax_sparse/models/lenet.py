"""`lenet5_caffe`: the Caffe variant of LeNet-5, SpaFL's FMNIST model.

conv 20@5x5 VALID -> ReLU -> maxpool 2 -> conv 50@5x5 VALID -> ReLU -> maxpool 2
-> flatten -> dense 500 -> ReLU -> dense num_classes. No biases and no
normalization (SpaFL's masked layers have no bias). The ReLUs after the
convolutions follow the SpaFL authors' released LeNet (the original Caffe
model has none there).

On 28x28x1 with 10 classes (28 -> 24 -> 12 -> 8 -> 4, so 4*4*50 = 800 inputs
to fc1):
  conv1 5*5*1*20 = 500, conv2 5*5*20*50 = 25,000, fc1 800*500 = 400,000,
  fc2 500*10 = 5,000: 430,500 weights, 20+50+500+10 = 580 units,
exactly SpaFL's stated 430,500 parameters and 580 thresholds (appendix A.1).

The smallest input that keeps a positive map is 16x16 (16 -> 12 -> 6 -> 2 -> 1);
other sizes only change fc1's fan-in (`input_repeat` = final H*W).
SpaFL shares thresholds of every layer; for SPATL (whose paper does not use this
model) the hidden layers are the encoder and fc2 the predictor.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_sparse.models import layers as L
from fedjax_sparse.models.structure import Model, ModelStructure


class LeNet5Caffe(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        del train, mask

        def out(y, name, activation=None):
            return L.unit_output(self, y, unit_masks, name, activation)

        x = out(L.conv(20, 5, use_bias=False, name="conv1")(x), "conv1", L.relu_pool2)
        x = out(L.conv(50, 5, use_bias=False, name="conv2")(x), "conv2", L.relu_pool2)
        x = out(L.dense(500, use_bias=False, name="fc1")(L.flatten(x)), "fc1", nn.relu)
        return out(L.dense(self.num_classes, use_bias=False, name="fc2")(x), "fc2")


def _sizes(side: int) -> list[int]:
    c1 = L.conv_out(side, 5)
    p1 = L.pool_out(c1)
    c2 = L.conv_out(p1, 5)
    return [c1, p1, c2, L.pool_out(c2)]


def lenet5_caffe(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    L.check_input("lenet5_caffe", input_shape, _sizes)
    L.check_classes("lenet5_caffe", num_classes)
    h, w, c = input_shape
    (c1h, _, c2h, ph), (c1w, _, c2w, pw) = _sizes(h), _sizes(w)
    layers = (
        L.conv_layer(("conv1",), kernel=5, in_units=c, units=20, output_hw=c1h * c1w,
                     inputs_from=("input",), bias=False, norm=None, part="encoder"),
        L.conv_layer(("conv2",), kernel=5, in_units=20, units=50, output_hw=c2h * c2w,
                     inputs_from=("conv1",), bias=False, norm=None, part="encoder"),
        L.dense_layer(("fc1",), in_units=50, units=500, input_repeat=ph * pw,
                      inputs_from=("conv2",), bias=False, norm=None, part="encoder"),
        L.dense_layer(("fc2",), in_units=500, units=num_classes, inputs_from=("fc1",),
                      bias=False, norm=None, part="predictor"),
    )
    return Model(
        name="lenet5_caffe", module=LeNet5Caffe(num_classes=num_classes),
        input_shape=tuple(input_shape), num_classes=num_classes,
        structure=ModelStructure(layers),
        description=(f"LeNet-5-Caffe (SpaFL FMNIST): conv 20@5x5 VALID, ReLU, maxpool 2, "
                     f"conv 50@5x5 VALID, ReLU, maxpool 2, flatten {ph}x{pw}x50, dense 500, ReLU, "
                     f"dense {num_classes}; no biases, no BatchNorm."))
