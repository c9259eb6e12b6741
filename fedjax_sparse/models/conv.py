"""A 2-D convolution whose gradients are themselves plain NHWC/HWIO convolutions.

Why: JAX differentiates `lax.conv_general_dilated` into convolutions with
non-canonical dimension labels (the filter gradient is `f01b_i01o->01bf`).
Outside a loop XLA:CPU rewrites them with transposes into its fast
convolution; inside a `while` body (every client's local training is one) it
leaves them to a generic emitter that is about 20 times slower
(jax-ml/jax#12868, open). Writing the two gradients by hand as canonical
convolutions keeps every convolution of a training step on the fast path, in
loops and under vmap alike. The gradients are the same sums as JAX's own, in
another order; `tests/test_models.py` checks them against `jax.grad` of
`lax.conv_general_dilated`.

Scope: NHWC inputs, HWIO kernels, equal strides and symmetric integer padding
per spatial axis, no dilation and no feature groups -- every convolution of the
model zoo. Anything else is refused when the module is first called.

With y[n, o] = sum_{t, ci} x_pad[n, o*s + t, ci] w[t, ci, co] (one spatial axis
shown; o < Ho, t < k, x_pad = x padded by p on both sides):
  dL/dx: dy dilated by s (holes between outputs), padded by k-1-p on the low
    side and k-1-p+r on the high side (r = (H + 2p - k) mod s, the input rows
    the last window never reached), convolved with the kernel flipped in space
    and with its in/out axes swapped;
  dL/dw[t, ci, co] = sum_{n, o} x_pad[n, o*s + t, ci] dy[n, o, co]: a
    convolution with the batch as the contracted feature axis, the input
    channels as the batch, and dy as a kernel dilated by s; the first k taps of
    its k + r outputs are the gradient.
dL/dx takes two other forms where the one convolution is slow on a CPU: for an
output smaller than the kernel, tap products (`_input_gradient_by_taps`), and
for a stride-1 gradient padded by 2 or more, a frame of convolutions that skip
the padding (`_input_gradient_by_frame`).
"""

from __future__ import annotations

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NHWC = ("NHWC", "HWIO", "NHWC")


def _conv(x, w, strides, padding, lhs_dilation=(1, 1), rhs_dilation=(1, 1)):
    return lax.conv_general_dilated(x, w, strides, padding, lhs_dilation=lhs_dilation,
                                    rhs_dilation=rhs_dilation, dimension_numbers=NHWC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv2d(x: jax.Array, kernel: jax.Array, stride: int, padding: int) -> jax.Array:
    """NHWC x HWIO -> NHWC convolution with canonical-convolution gradients (see module docstring)."""
    return _conv(x, kernel, (stride, stride), [(padding, padding)] * 2)


def _conv2d_fwd(x, kernel, stride, padding):
    return conv2d(x, kernel, stride, padding), (x, kernel)


def _input_gradient(dy, kernel, stride, padding, in_hw):
    if dy.shape[1] < kernel.shape[0] or dy.shape[2] < kernel.shape[1]:
        return _input_gradient_by_taps(dy, kernel, stride, padding, in_hw)
    if uses_frame(kernel.shape[:2], dy.shape[1:3], stride, padding):
        return _input_gradient_by_frame(dy, kernel, padding)
    return _input_gradient_by_convolution(dy, kernel, stride, padding, in_hw)


def uses_frame(kernel_hw, out_hw, stride: int, padding: int, platform: str | None = None) -> bool:
    """Whether the input gradient is computed as a frame (`_input_gradient_by_frame`): on a CPU (default:
    JAX's backend), for stride 1, an output no smaller than the kernel (the frame's interior) and a
    gradient padding k-1-p of at least 2. Accelerators keep the one convolution: the frame's thin
    convolutions were measured only on a CPU, and each is a kernel launch there."""
    return ((platform or jax.default_backend()) == "cpu" and stride == 1
            and all(o >= k for o, k in zip(out_hw, kernel_hw)) and min(kernel_hw) - 1 - padding >= 2)


def _input_gradient_by_convolution(dy, kernel, stride, padding, in_hw):
    pads = []
    for size, out, k in zip(in_hw, dy.shape[1:3], kernel.shape[:2]):
        remainder = size + 2 * padding - k - (out - 1) * stride
        pads.append((k - 1 - padding, k - 1 - padding + remainder))
    flipped = jnp.swapaxes(kernel[::-1, ::-1], 2, 3)
    return _conv(dy, flipped, (1, 1), pads, lhs_dilation=(stride, stride))


def _input_gradient_by_frame(dy, kernel, padding):
    """dL/dx of a stride-1 convolution as an interior convolution and a frame of thin ones, none of which
    multiplies padding: for a gradient whose padding k-1-p is at least 2.

    The one-convolution form pads dy by k-1-p on every side, so each input
    position near the border takes all k x k taps, many of them zeros:
    spafl_cnn's 5x5 valid convolutions multiply 36 % (28x28 inputs) and 56 %
    (12x12) zeros there. Here the full correlation of dy with the flipped kernel
    is cut into the rows and columns whose windows are whole (one valid
    convolution) and, for each border row (column), a one-row (one-column)
    convolution over just the dy rows and kernel rows it touches; the p outer
    rows and columns, which the forward pass read from padding, are never
    computed. On 2 CPU cores, timed alone: 24.1-24.5 against 28.0-28.1 ms for
    spafl_cnn's conv2, 7.2-7.8 against 9.8-10.0 ms for its conv3; its whole
    client trains 1.03x (FedAvg) and 1.08x (SpaFL) faster
    (benchmarks/results/conv_gradients/frame/).
    """
    mh, mw = kernel.shape[0] - 1, kernel.shape[1] - 1
    flipped = jnp.swapaxes(kernel[::-1, ::-1], 2, 3)
    ho, wo = dy.shape[1:3]
    whole = [(0, 0), (0, 0)]
    across = [(0, 0), (mw - padding, mw - padding)]
    top = [_conv(dy[:, :r + 1], flipped[mh - r:], (1, 1), across) for r in range(padding, mh)]
    bottom = [_conv(dy[:, r - mh:], flipped[:ho - r + mh], (1, 1), across) for r in range(ho, ho + mh - padding)]
    left = [_conv(dy[:, :, :c + 1], flipped[:, mw - c:], (1, 1), whole) for c in range(padding, mw)]
    right = [_conv(dy[:, :, c - mw:], flipped[:, :wo - c + mw], (1, 1), whole)
             for c in range(wo, wo + mw - padding)]
    middle = jnp.concatenate(left + [_conv(dy, flipped, (1, 1), whole)] + right, axis=2)
    return jnp.concatenate(top + [middle] + bottom, axis=1)


def _input_gradient_by_taps(dy, kernel, stride, padding, in_hw):
    """dL/dx as one product for every tap, then one product that places the taps: for outputs smaller than
    the kernel.

    There the convolution form above has a "kernel" (the flipped weights)
    larger than its input (dy), and XLA swaps the two operands into a
    convolution its CPU backend runs through the generic emitter, about 50
    times slower (spafl_cnn's last 5x5 layer on a 4x4 map). Here
    z[n, o, t, ci] = sum_co dy[n, o, co] w[t, ci, co] is one dense product, and
    dx[n, q, ci] = sum_{o, t} P[(o, t), q] z[n, o, t, ci] a second one, with P
    the constant 0/1 matrix that puts tap t of output o on padded input
    position o*s + t (at most k^2 x k^2 x (2k s)^2 entries, as the output is
    smaller than the kernel). A sum of k*k padded slices of z computes the same
    in fewer operations, but when dx has two consumers (SpaFL's unit masks
    take dy * x besides the gradient's own path) XLA:CPU materializes each
    padded slice and sums them twice: spafl_cnn's SpaFL client trained 4 %
    faster with the product, its FedAvg client as fast.
    """
    kh, kw = kernel.shape[:2]
    (h, w), (ho, wo) = in_hw, dy.shape[1:3]
    hp, wp = h + 2 * padding, w + 2 * padding
    placement = np.zeros((ho, wo, kh, kw, hp, wp), np.float32)
    for o, q, i, j in itertools.product(range(ho), range(wo), range(kh), range(kw)):
        placement[o, q, i, j, o * stride + i, q * stride + j] = 1.0
    z = jnp.einsum("nhwo,ijco->nhwijc", dy, kernel).reshape(dy.shape[0], ho * wo * kh * kw, kernel.shape[2])
    dx = jnp.einsum("npc,pq->nqc", z, jnp.asarray(placement.reshape(ho * wo * kh * kw, hp * wp), z.dtype),
                    precision=lax.Precision.HIGHEST).reshape(dy.shape[0], hp, wp, kernel.shape[2])
    return dx[:, padding:padding + h, padding:padding + w, :]


def _kernel_gradient(x, dy, stride, padding, kernel_hw):
    x_pad = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    lhs = jnp.transpose(x_pad, (3, 1, 2, 0))   # [C_in, H, W, N]: N is the contracted axis
    rhs = jnp.transpose(dy, (1, 2, 0, 3))      # [Ho, Wo, N, C_out]
    taps = _conv(lhs, rhs, (1, 1), [(0, 0), (0, 0)], rhs_dilation=(stride, stride))
    kh, kw = kernel_hw
    return jnp.transpose(taps[:, :kh, :kw, :], (1, 2, 0, 3))  # [kh, kw, C_in, C_out]


def _conv2d_bwd(stride, padding, residuals, dy):
    x, kernel = residuals
    dx = _input_gradient(dy, kernel, stride, padding, x.shape[1:3])
    dw = _kernel_gradient(x, dy, stride, padding, kernel.shape[:2])
    return dx.astype(x.dtype), dw.astype(kernel.dtype)


conv2d.defvjp(_conv2d_fwd, _conv2d_bwd)


class Conv2D(nn.Module):
    """A square-kernel 2-D convolution with Flax's parameter names (`kernel` [k, k, in, out], `bias`)."""

    features: int
    kernel_size: int
    stride: int = 1
    padding: int = 0
    use_bias: bool = True
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel_size
        if self.features < 1 or k < 1 or self.stride < 1:
            raise ValueError(f"Conv2D needs features, kernel_size and stride >= 1, got "
                             f"{self.features}, {k}, {self.stride}")
        if not 0 <= self.padding < k:
            raise ValueError(f"Conv2D padding must be in [0, {k - 1}] for a {k}x{k} kernel, got {self.padding}")
        if x.ndim != 4:
            raise ValueError(f"Conv2D expects NHWC inputs of rank 4, got shape {x.shape}")
        kernel = self.param("kernel", self.kernel_init, (k, k, x.shape[-1], self.features), jnp.float32)
        y = conv2d(x, kernel.astype(x.dtype), self.stride, self.padding)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,), jnp.float32).astype(y.dtype)
        return y
