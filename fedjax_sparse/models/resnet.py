"""Residual networks: `resnet20`, `resnet32` (SPATL) and `preresnet18` (HeteroFL/FedGSE).

`resnet20` / `resnet32` -- He et al.'s CIFAR ResNet, depth 6n+2 with n = 3, 5:
  stem conv 16@3x3 + BN + ReLU (part='private': SPATL's code aggregates only
  `encoder` = the three stages, so the stem stays on the client), three stages
  of n basic blocks with 16, 32, 64 channels and strides 1, 2, 2
  (part='encoder'), global average pool, dense num_classes (part='predictor').
  Block: conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut, then ReLU. Convs have
  no bias; the dense layer has one.
  Shortcut option A (no parameters): identity, or on a downsampling block
  x[:, ::2, ::2, :] zero-padded with planes//4 channels on each side.
  (SPATL's released code instead appends all the zero channels after the kept
  ones, i.e. a shift of 0; the parameter count is the same.)
  On 32x32x3 with 10 classes (BN scale/bias counted, running stats not):
    ResNet-20: 432 + 32 (stem) + 13,824 + 192 (stage 1) + 50,688 + 384
               (stage 2) + 202,752 + 768 (stage 3) + 650 (dense) = 269,722;
    ResNet-32: 464 + 23,360 + 88,192 + 351,488 + 650 = 464,154.
  Unit groups: the stem's output and every stage-1 block's second conv are
  added together, so they share group 'stage1'; in stages 2 and 3 the blocks'
  second convs share 'stage2' / 'stage3'. A layer reading the stream lists
  every group member summed into it so far (e.g. stage1_block2.conv1 reads
  ('conv1', 'stage1_block1.conv2')).
  Shortcut under unit masks: option A also carries stage k into stage k+1
  (stage-k unit i lands on stage-(k+1) unit i + planes//4). The padded
  shortcut is multiplied by the unit mask of the conv2 it is added to (the
  downsampling block's), so stage-(k+1) stream channel j is live exactly
  where that conv2 keeps unit j, and the structure's statement is true: the
  consumers after the downsampling block read only stage-(k+1) producers
  (`inputs_from`), and `variable_masks`, bytes and FLOPs count exactly the
  weights the sub-model uses. Why this rather than a channel map in the
  structure: a masked model is then exactly the physically smaller network
  with the kept widths (its shortcut the 0/1 map from kept stage-k units to
  kept stage-(k+1) units), and it holds for any masks, group-tied (sub-models,
  SPATL: the stage's group mask) or per layer (SpaFL). It must be that
  conv2's mask, not an OR over the stage's conv2s: under per-layer masks a
  unit kept only by a later block would then pass the shortcut into block 2's
  conv1, which reads the downsampling conv2 alone. Costs: a dropped stage-
  (k+1) unit also drops the stage-k channel its shortcut would have carried,
  and a float mask's gradient there (SpaFL's threshold) is sum g (h +
  shortcut), the effect of switching the whole stream channel. Without masks,
  or with all-ones masks, the model is unchanged.
  Any input side >= 1 works (global average pooling).

`preresnet18` -- pre-activation ResNet-18 (He et al. 2016) as HeteroFL and
  FedGSE use it: stem conv 64@3x3 stride 1; four stages of 2 pre-activation
  blocks with 64, 128, 256, 512 channels (strides 1, 2, 2, 2); final BN-ReLU,
  global average pool, dense num_classes. Block: BN-ReLU, then
  conv3x3-BN-ReLU-conv3x3, added to the shortcut: identity, or a 1x1 conv
  projection (of the pre-activated input) when the stride or width changes.
  Convs have no bias. For SPATL (no split in HeteroFL/FedGSE): every conv is
  the encoder, the dense layer the predictor. On 32x32x3 with 10 classes: 11,172,170
  parameters ("11.2 M" in HeteroFL's table for CIFAR-10).
  Normalization: in pre-activation nets a BN precedes the conv that reads it.
  Each BN is assigned to the layer whose *output units* it normalizes: a
  block's bn2 belongs to that block's conv1; the bn1 of the next block (or
  the final BN) normalizes the residual stream and belongs to the stream's
  most recent producer, the previous block's conv2 (the stem for
  stage1_block1.bn1). Projection shortcuts share the unit group of their
  stage's conv2s and carry norm=None. Groups: 'stage1'..'stage4' (the stem is
  in 'stage1'); projections cut the stream, so stages are not related.
  Unit masks (see `layers.unit_output`): a conv whose output goes straight into
  the residual sum (stem, conv2, projection) is masked on its raw output, and
  each stream BN's output is masked with the stream's live units (kept by any
  layer summed into it), so a unit dropped by every producer stays exactly zero
  through the following BN; that BN's parameters and statistics belong to the
  sub-model on those same units (`Layer.norm_units_from` = the stream), which
  differs from its owner conv2's units only under per-layer (SpaFL) masks.
  HeteroFL/FedGSE's `Scaler` and static BN are left to the algorithms.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_sparse.models import layers as L
from fedjax_sparse.models.structure import Layer, Model, ModelStructure

# ------------------------------------------------------------------ CIFAR ResNet

CIFAR_WIDTHS = (16, 32, 64)


class BasicBlock(nn.Module):
    planes: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        y = L.conv(self.planes, 3, stride=self.stride, padding=1, use_bias=False, name="conv1")(x)
        y = L.batch_norm(train, "bn1")(y, mask=mask)
        y = L.unit_output(self, y, unit_masks, f"{self.name}.conv1", nn.relu)
        y = L.conv(self.planes, 3, padding=1, use_bias=False, name="conv2")(y)
        y = L.unit_output(self, L.batch_norm(train, "bn2")(y, mask=mask), unit_masks, f"{self.name}.conv2")
        shortcut = x
        if self.stride != 1 or x.shape[-1] != self.planes:
            # Option A: subsample and zero-pad planes // 4 channels on each side.
            pad = self.planes // 4
            if x.shape[-1] + 2 * pad != self.planes:
                raise ValueError(f"option-A shortcut cannot map {x.shape[-1]} to "
                                 f"{self.planes} channels")
            shortcut = x[:, ::self.stride, ::self.stride, :]
            shortcut = jnp.pad(shortcut, ((0, 0), (0, 0), (0, 0), (pad, pad)))
            if unit_masks is not None:  # the stream's channels are conv2's units (see the module docstring)
                shortcut = shortcut * jnp.asarray(unit_masks[f"{self.name}.conv2"]).astype(shortcut.dtype)
        return nn.relu(y + shortcut)


class CifarResNet(nn.Module):
    num_classes: int
    blocks_per_stage: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        x = L.conv(CIFAR_WIDTHS[0], 3, padding=1, use_bias=False, name="conv1")(x)
        x = L.unit_output(self, L.batch_norm(train, "bn1")(x, mask=mask), unit_masks, "conv1", nn.relu)
        for s, planes in enumerate(CIFAR_WIDTHS, start=1):
            for b in range(1, self.blocks_per_stage + 1):
                stride = 2 if s > 1 and b == 1 else 1
                x = BasicBlock(planes, stride, name=f"stage{s}_block{b}")(x, train, mask, unit_masks)
        return L.unit_output(self, L.dense(self.num_classes, name="fc")(L.global_avg_pool(x)), unit_masks, "fc")


def _cifar_resnet(name: str, n: int, input_shape, num_classes: int) -> Model:
    L.check_input(name, input_shape)
    L.check_classes(name, num_classes)
    h, w, c = input_shape
    layers: list[Layer] = [
        L.conv_layer(("conv1",), kernel=3, in_units=c, units=CIFAR_WIDTHS[0], output_hw=h * w,
                     inputs_from=("input",), bias=False, norm=("bn1",), part="private",
                     unit_group="stage1")]
    stream, units = ["conv1"], CIFAR_WIDTHS[0]
    for s, planes in enumerate(CIFAR_WIDTHS, start=1):
        for b in range(1, n + 1):
            stride = 2 if s > 1 and b == 1 else 1
            h, w = L.conv_out(h, 3, stride, 1), L.conv_out(w, 3, stride, 1)
            blk = f"stage{s}_block{b}"
            conv1 = L.conv_layer((blk, "conv1"), kernel=3, in_units=units, units=planes,
                                 output_hw=h * w, inputs_from=stream, bias=False,
                                 norm=(blk, "bn1"), part="encoder")
            conv2 = L.conv_layer((blk, "conv2"), kernel=3, in_units=planes, units=planes,
                                 output_hw=h * w, inputs_from=(conv1.name,), bias=False,
                                 norm=(blk, "bn2"), part="encoder", unit_group=f"stage{s}")
            layers += [conv1, conv2]
            # A downsampling block starts a new stream (see the docstring).
            stream = [conv2.name] if planes != units or stride != 1 else stream + [conv2.name]
            units = planes
    layers.append(L.dense_layer(("fc",), in_units=units, units=num_classes, inputs_from=stream,
                                bias=True, norm=None, part="predictor"))
    return Model(
        name=name, module=CifarResNet(num_classes=num_classes, blocks_per_stage=n),
        input_shape=tuple(input_shape), num_classes=num_classes,
        structure=ModelStructure(tuple(layers)),
        description=(f"ResNet-{6 * n + 2} (CIFAR, He et al.; SPATL): stem conv 16@3x3 + BN + ReLU "
                     f"(private); 3 stages x {n} basic blocks (conv3x3-BN-ReLU-conv3x3-BN + "
                     "option-A shortcut, ReLU), widths 16/32/64, strides 1/2/2 (encoder); "
                     f"global average pool; dense {num_classes} (predictor). No conv biases."))


def resnet20(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    return _cifar_resnet("resnet20", 3, input_shape, num_classes)


def resnet32(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    return _cifar_resnet("resnet32", 5, input_shape, num_classes)


# ------------------------------------------------------------------ PreAct ResNet-18

PRERESNET_WIDTHS = (64, 128, 256, 512)
PRERESNET_BLOCKS = (2, 2, 2, 2)


def _stream_norm(x: jax.Array, bn: nn.Module, mask, unit_masks, stream: tuple[str, ...]) -> jax.Array:
    """BN-ReLU of a residual stream, then the stream's live units: a normalized dropped channel
    would otherwise output the BN bias instead of zero."""
    y = nn.relu(bn(x, mask=mask))
    live = L.any_kept(unit_masks, stream)
    return y if live is None else y * live.astype(y.dtype)


class PreActBlock(nn.Module):
    planes: int
    stride: int
    stream: tuple[str, ...]  # the layers summed into this block's input (for its bn1's unit mask)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        out = _stream_norm(x, L.batch_norm(train, "bn1"), mask, unit_masks, self.stream)
        shortcut = x
        if self.stride != 1 or x.shape[-1] != self.planes:
            shortcut = L.conv(self.planes, 1, stride=self.stride, use_bias=False, name="shortcut")(out)
            shortcut = L.unit_output(self, shortcut, unit_masks, f"{self.name}.shortcut")
        y = L.conv(self.planes, 3, stride=self.stride, padding=1, use_bias=False, name="conv1")(out)
        y = L.batch_norm(train, "bn2")(y, mask=mask)
        y = L.unit_output(self, y, unit_masks, f"{self.name}.conv1", nn.relu)
        y = L.conv(self.planes, 3, padding=1, use_bias=False, name="conv2")(y)
        return L.unit_output(self, y, unit_masks, f"{self.name}.conv2") + shortcut


def _preresnet_blocks() -> list[tuple[str, int, int, int]]:
    """(block name, stage, planes, stride) in forward order."""
    out = []
    for s, (planes, n) in enumerate(zip(PRERESNET_WIDTHS, PRERESNET_BLOCKS), start=1):
        for b in range(1, n + 1):
            out.append((f"stage{s}_block{b}", s, planes, 2 if s > 1 and b == 1 else 1))
    return out


class PreActResNet18(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: jax.Array | None = None,
                 unit_masks: dict | None = None) -> jax.Array:
        x = L.conv(PRERESNET_WIDTHS[0], 3, padding=1, use_bias=False, name="conv1")(x)
        x = L.unit_output(self, x, unit_masks, "conv1")
        stream, width = ("conv1",), PRERESNET_WIDTHS[0]
        for blk, _, planes, stride in _preresnet_blocks():
            x = PreActBlock(planes, stride, stream, name=blk)(x, train, mask, unit_masks)
            projected = stride != 1 or width != planes
            stream = ((f"{blk}.shortcut",) if projected else stream) + (f"{blk}.conv2",)
            width = planes
        x = _stream_norm(x, L.batch_norm(train, "bn_final"), mask, unit_masks, stream)
        return L.unit_output(self, L.dense(self.num_classes, name="fc")(L.global_avg_pool(x)), unit_masks, "fc")


def preresnet18(input_shape: tuple[int, int, int], num_classes: int) -> Model:
    L.check_input("preresnet18", input_shape)
    L.check_classes("preresnet18", num_classes)
    h, w, c = input_shape
    blocks = _preresnet_blocks()
    # The BN that normalizes the stream leaving block k: bn1 of block k+1, or the final BN.
    stream_norm = [(blocks[k + 1][0], "bn1") for k in range(len(blocks) - 1)] + [("bn_final",)]
    layers: list[Layer] = [
        L.conv_layer(("conv1",), kernel=3, in_units=c, units=PRERESNET_WIDTHS[0],
                     output_hw=h * w, inputs_from=("input",), bias=False,
                     norm=(blocks[0][0], "bn1"), unit_group="stage1", part="encoder")]
    stream, units = ["conv1"], PRERESNET_WIDTHS[0]
    for k, (blk, s, planes, stride) in enumerate(blocks):
        h, w = L.conv_out(h, 3, stride, 1), L.conv_out(w, 3, stride, 1)
        group = f"stage{s}"
        if stride != 1 or units != planes:
            shortcut = L.conv_layer((blk, "shortcut"), kernel=1, in_units=units, units=planes,
                                    output_hw=h * w, inputs_from=stream, bias=False, norm=None,
                                    unit_group=group, part="encoder")
            layers.append(shortcut)
            residual = [shortcut.name]
        else:
            residual = stream
        conv1 = L.conv_layer((blk, "conv1"), kernel=3, in_units=units, units=planes,
                             output_hw=h * w, inputs_from=stream, bias=False, norm=(blk, "bn2"),
                             part="encoder")
        name2 = L.layer_name((blk, "conv2"))
        conv2 = L.conv_layer((blk, "conv2"), kernel=3, in_units=planes, units=planes,
                             output_hw=h * w, inputs_from=(conv1.name,), bias=False,
                             norm=stream_norm[k], unit_group=group, part="encoder",
                             norm_units_from=residual + [name2])
        layers += [conv1, conv2]
        stream, units = residual + [conv2.name], planes
    layers.append(L.dense_layer(("fc",), in_units=units, units=num_classes, inputs_from=stream,
                                bias=True, norm=None, part="predictor"))
    return Model(
        name="preresnet18", module=PreActResNet18(num_classes=num_classes),
        input_shape=tuple(input_shape), num_classes=num_classes,
        structure=ModelStructure(tuple(layers)),
        description=("Pre-activation ResNet-18 (HeteroFL/FedGSE): stem conv 64@3x3; 4 stages x 2 "
                     "blocks (BN-ReLU-conv3x3-BN-ReLU-conv3x3 + identity or 1x1 projection), "
                     "widths 64/128/256/512, strides 1/2/2/2; final BN-ReLU; global average pool; "
                     f"dense {num_classes}. No conv biases."))
