"""Pieces shared by the model zoo: masked BatchNorm, initializers, shape arithmetic.

Initialization (all models):
  * convolution kernels: He/Kaiming normal with fan_out, untruncated
    (std = sqrt(2 / (kh * kw * out))), as torchvision's ResNets and the SPATL
    code initialize their convolutions;
  * dense kernels: Flax's default (LeCun normal);
  * biases zero, BatchNorm scale one and bias zero.

Padding is written out as explicit symmetric integers (`padding=1` for a 3x3
"same" convolution) rather than Flax's 'SAME', so strided convolutions sample
the same positions as PyTorch's (the option-A shortcut `x[:, ::2, ::2]` of the
CIFAR ResNets relies on it: Flax's 'SAME' would pad only at the bottom/right
for a stride-2 3x3 convolution on an even size).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_sparse.models.batch_norm import normalize
from fedjax_sparse.models.channel_sums import scale_channels
from fedjax_sparse.models.conv import Conv2D
from fedjax_sparse.models.structure import Layer, Part, Path

BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5

conv_kernel_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


class MaskedBatchNorm(nn.BatchNorm):
    """`nn.BatchNorm` (feature axis last) whose batch statistics skip padded examples.

    Call it as `bn(x, mask=mask)` with `mask` a `[B]` boolean array (True for a
    real example): mean and variance are taken over the valid examples (and all
    spatial positions) only. `mask=None` is plain BatchNorm; in eval mode
    (running averages) the mask is ignored and Flax's own BatchNorm runs.

    Under mixed precision (`Model.compute_dtype` bfloat16) the statistics, the
    normalization and the running averages are float32, as in Micikevicius et
    al. (2018): a bfloat16 mean of a large activation loses the small variances
    that the normalization divides by; the output returns to the input's dtype.

    In training mode the normalization is `batch_norm.normalize`, Flax's
    computation with its per-channel sums as matrix products (3-5x faster on a
    CPU, see there). A batch with no valid example at all (a padded no-op
    step) would give 0/0 statistics; there the statistics are taken over the
    whole batch so the outputs stay finite, and the running averages are left
    unchanged.

    Parameters and statistics live exactly where `nn.BatchNorm` puts them
    (`scale`/`bias` in `params`, `mean`/`var` in `batch_stats`).
    """

    @nn.compact
    def __call__(self, x, use_running_average: bool | None = None, *,
                 mask: jax.Array | None = None):
        running = nn.merge_param("use_running_average", self.use_running_average,
                                 use_running_average)
        if running:  # statistics in float32; the output in the dtype the layer computes in
            return super().__call__(x.astype(jnp.float32), use_running_average).astype(x.dtype)
        if self.axis != -1 or self.axis_name is not None or not (self.use_scale and self.use_bias):
            raise ValueError(f"MaskedBatchNorm trains with the feature axis last, scale and bias, and no "
                             f"axis_name; got axis={self.axis}, axis_name={self.axis_name}, "
                             f"use_scale={self.use_scale}, use_bias={self.use_bias}")
        features = (x.shape[-1],)
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), features)
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), features)
        scale = self.param("scale", self.scale_init, features, self.param_dtype)
        bias = self.param("bias", self.bias_init, features, self.param_dtype)
        if mask is None:
            any_valid, weights = jnp.asarray(True), jnp.ones((x.shape[0],), jnp.float32)
        else:
            mask = jnp.reshape(jnp.asarray(mask, bool), (x.shape[0],))
            any_valid = jnp.any(mask)
            weights = jnp.logical_or(mask, ~any_valid).astype(jnp.float32)
        y, mean, var = normalize(x.astype(jnp.float32), scale.astype(jnp.float32), bias.astype(jnp.float32), weights,
                                 self.epsilon)
        if not self.is_initializing():
            keep = self.momentum
            ra_mean.value = jnp.where(any_valid, keep * ra_mean.value + (1 - keep) * mean, ra_mean.value)
            ra_var.value = jnp.where(any_valid, keep * ra_var.value + (1 - keep) * var, ra_var.value)
        return y.astype(x.dtype)


def batch_norm(train: bool, name: str) -> MaskedBatchNorm:
    """The BatchNorm every model uses (PyTorch's momentum 0.1 = Flax 0.9 and eps 1e-5; its running variance
    follows the biased batch variance, as Flax's does, where PyTorch's follows the unbiased one, n / (n - 1)
    times larger: 6.7 % at a batch of 16 (the parity harness's SpaFL cause `bessel`, benchmarks/parity);
    normalization in training uses the biased one in both)."""
    return MaskedBatchNorm(use_running_average=not train, momentum=BN_MOMENTUM,
                           epsilon=BN_EPSILON, name=name)


def conv(features: int, kernel: int, *, name: str, stride: int = 1, padding: int = 0,
         use_bias: bool = True) -> Conv2D:
    return Conv2D(features, kernel, stride=stride, padding=padding, use_bias=use_bias,
                  kernel_init=conv_kernel_init, name=name)


def dense(features: int, *, name: str, use_bias: bool = True) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, name=name)


def unit_output(module: nn.Module, x: jax.Array, unit_masks: dict | None, layer: str,
                activation: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """The point where the units of structure layer `layer` deliver their output.

    Every model calls this right after a layer's normalization (or right after
    the layer itself when it has none), with the activation that follows, if
    any; a layer that feeds a residual sum is called before the sum. Two things
    happen there, for every method at once:
      * a unit mask (`unit_masks[layer]`, one value per output unit) multiplies
        the output, so a dropped unit outputs exactly zero and the mask, being a
        factor of the forward pass, receives a gradient (see core.structure.unit_masks);
      * a Flax perturbation named `<module>_out` (the layer's module name) marks
        the point, so `Model.unit_output_gradients` can read dL/dh there.
    Without masks and perturbations it is `activation(x)`.

    Why the mask goes after the activation (and after a max pool that follows,
    see `relu_pool2`) rather than between normalization and activation: for a {0, 1} mask and ReLU the forward pass is the same
    (ReLU(m h) = m ReLU(h)), but before the ReLU a dropped unit's output sits
    at ReLU's kink, where its derivative is 0, so its mask would get exactly no
    gradient and a dropped unit could never learn to come back. After it, the
    mask gets dL/dm = sum g ReLU(h): for a kept unit the same value as before
    the ReLU, for a dropped one what switching it back on would do.
    """
    if activation is not None:
        x = activation(x)
    x = module.perturb(layer.split(".")[-1] + "_out", x)
    if unit_masks is None:
        return x
    return scale_channels(x, jnp.asarray(unit_masks[layer]).astype(x.dtype))


def any_kept(unit_masks: dict | None, layers: Sequence[str]) -> jax.Array | None:
    """1 where some of `layers` keeps the unit: the live units of a residual stream they all add into.

    Written as 1 - prod(1 - m) so that, for {0, 1} masks, it is the logical OR
    and a float (straight-through) mask still passes a gradient on.
    """
    if unit_masks is None:
        return None
    dead = 1.0
    for name in layers:
        mask = jnp.asarray(unit_masks[name])  # in the dtype the model computes in, where floating
        dead = dead * (1.0 - (mask if jnp.issubdtype(mask.dtype, jnp.floating) else mask.astype(jnp.float32)))
    return 1.0 - dead


def max_pool2(x: jax.Array) -> jax.Array:
    """2x2 max pooling, stride 2, floor (PyTorch's MaxPool2d(2)); the gradient goes to one element of
    each window, the first maximum (as `nn.max_pool`'s and PyTorch's do).

    Written with the window's four strided slices, the index of their maximum and a one-hot
    selection rather than `nn.max_pool`: the same values and gradients, but its gradient is an
    elementwise product, while XLA:CPU runs the window-reduction gradient of `nn.max_pool` as a
    variadic reduce-window over index tensors (about a tenth of a spafl_cnn training step on 2 CPU
    cores, benchmarks/results/cnn_client_cpu.md). The gradient follows the index computed in the
    forward pass, never an equality test between the output and a recomputed input: XLA may
    compute one value in two fusions with different rounding, and a `jnp.max` over a reshape
    (whose gradient tests `x == max(x)`) then lost whole units' gradients under jit.
    """
    n, h, w, c = x.shape
    x = x[:, : h // 2 * 2, : w // 2 * 2, :]
    windows = jnp.stack([x[:, i::2, j::2, :] for i in (0, 1) for j in (0, 1)], axis=-1)
    pick = jax.nn.one_hot(jnp.argmax(windows, axis=-1), 4, dtype=x.dtype)
    return jnp.sum(windows * jax.lax.stop_gradient(pick), axis=-1)


def relu_pool2(x: jax.Array) -> jax.Array:
    """ReLU then 2x2 max pooling: the activation of a unit whose map is pooled next.

    Passed to `unit_output` as one activation, so a unit mask acts after the pool:
    a {0, 1} mask commutes with both (they are positively homogeneous), but a dropped
    unit's all-zero map would send the pool's gradient to an arbitrary position of
    each window instead of the one the unit would win if switched back on.
    """
    return max_pool2(nn.relu(x))


def flatten(x: jax.Array) -> jax.Array:
    """NHWC -> [B, H*W*C], channel fastest (the order `Layer.input_repeat` assumes)."""
    return x.reshape(x.shape[0], -1)


def global_avg_pool(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=(1, 2))


# ---------------------------------------------------------------- shapes

def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Output length of a convolution along one spatial axis (PyTorch's formula)."""
    return (size + 2 * padding - kernel) // stride + 1


def pool_out(size: int) -> int:
    return size // 2


def min_valid_size(sizes: Callable[[int], Sequence[int]], limit: int = 4096) -> int:
    """Smallest input side for which every intermediate size of `sizes(side)` is >= 1."""
    for side in range(1, limit + 1):
        if min(sizes(side)) >= 1:
            return side
    raise ValueError(f"no input side up to {limit} is valid")


def check_input(model_name: str, input_shape: tuple[int, int, int],
                sizes: Callable[[int], Sequence[int]] | None = None) -> None:
    """Raises a one-line ValueError when `input_shape` is malformed or too small.

    `sizes(side)` lists the spatial side after every convolution/pooling of the
    model for an input side `side` (the same chain applies to H and W).
    """
    if len(input_shape) != 3 or any(int(d) < 1 for d in input_shape):
        raise ValueError(f"{model_name} needs an input shape (H, W, C) of positive sizes, "
                         f"got {tuple(input_shape)}")
    if sizes is None:
        return
    h, w, c = input_shape
    if min(sizes(h)) < 1 or min(sizes(w)) < 1:
        side = min_valid_size(sizes)
        raise ValueError(f"{model_name} needs inputs of at least {side}x{side}, got {h}x{w}x{c}")


def check_classes(model_name: str, num_classes: int) -> None:
    if int(num_classes) < 1:
        raise ValueError(f"{model_name} needs num_classes >= 1, got {num_classes}")


# ---------------------------------------------------------------- structure

def layer_name(path: Path) -> str:
    """The structure name of the layer whose module path is `path`: 'stage1_block2.conv1'."""
    return ".".join(path)


def conv_layer(path: Path, *, kernel: int, in_units: int, units: int, output_hw: int,
               inputs_from: Iterable[str], bias: bool, norm: Path | None,
               part: Part = "shared", unit_group: str | None = None,
               norm_units_from: Iterable[str] = ()) -> Layer:
    return Layer(name=layer_name(path), kind="conv", kernel=path + ("kernel",),
                 bias=path + ("bias",) if bias else None, norm=norm, num_units=units,
                 fan_in=kernel * kernel * in_units, inputs_from=tuple(inputs_from),
                 input_repeat=1, unit_group=unit_group, part=part, output_hw=output_hw,
                 norm_units_from=tuple(norm_units_from))


def dense_layer(path: Path, *, in_units: int, units: int, inputs_from: Iterable[str],
                bias: bool, norm: Path | None, input_repeat: int = 1,
                part: Part = "shared", unit_group: str | None = None, positions: int = 1) -> Layer:
    """A dense layer reading `in_units` producer units, each `input_repeat` times, at `positions`
    positions of its input (a sequence's steps; 1 for a vector)."""
    return Layer(name=layer_name(path), kind="dense", kernel=path + ("kernel",),
                 bias=path + ("bias",) if bias else None, norm=norm, num_units=units,
                 fan_in=in_units * input_repeat, inputs_from=tuple(inputs_from),
                 input_repeat=input_repeat, unit_group=unit_group, part=part, output_hw=positions)
