"""BatchNorm's training-mode normalization, with every per-channel sum taken as a matrix product.

Why: BatchNorm's statistics and their gradients are per-channel sums of an
activation, which XLA:CPU runs far faster as products (`channel_sums`); under
autodiff the transposes of the statistics' broadcasts would be reductions
again. spafl_cnn's first BatchNorm ([64, 28, 28, 64]), forward and
backward, takes 2.7-3.1 ms here and 11.6-14.1 ms as Flax's BatchNorm on 2 CPU
cores (`python -m benchmarks.local_training` times each BatchNorm of a model
both ways; `benchmarks/results/quiet/local_training_*.md`).

`normalize` is written with its own gradient, so that autodiff adds no
reductions of its own; it is the same function as Flax's `BatchNorm` in
training mode with a mask over the batch (the statistics are E[x] and
E[x^2] - E[x]^2 over the valid examples, the variance clipped at 0) and
agrees with it to float32 rounding (`tests/test_models.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_sparse.models.channel_sums import channel_sum


def _statistics(x, weights):
    count = jnp.sum(weights) * (x.size // (x.shape[0] * x.shape[-1]))
    mean = channel_sum(x, weights) / count
    raw_var = channel_sum(x * x, weights) / count - mean * mean
    return mean, raw_var, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def normalize(x: jax.Array, scale: jax.Array, bias: jax.Array, weights: jax.Array,
              epsilon: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(y, mean, var): x [N, ..., C] normalized per channel with the statistics of the examples whose
    weight is 1 (weights [N], 0 or 1; at least one 1), then scaled and shifted."""
    return _forward(x, scale, bias, weights, epsilon)[0]


def _forward(x, scale, bias, weights, epsilon):
    mean, raw_var, count = _statistics(x, weights)
    var = jnp.maximum(0.0, raw_var)
    r = lax.rsqrt(var + epsilon)
    y = (x - mean) * (r * scale) + bias
    return (y, mean, var), (x, mean, raw_var, r, scale, weights, count)


def _backward(epsilon, residuals, cotangents):
    """With xhat = (x - mean) r and w_n = weights[n] / count, every y depends on x through mean and var:
    dx = scale r (dy - w_n (sum dy + xhat sum dy xhat)) + w_n (d_mean + 2 (x - mean) d_var)."""
    del epsilon
    x, mean, raw_var, r, scale, weights, count = residuals
    dy, d_mean, d_var = cotangents
    d_bias = channel_sum(dy)
    d_scale = (channel_sum(dy * x) - mean * d_bias) * r
    d_var = jnp.where(raw_var > 0.0, d_var, 0.0)
    w = (weights / count).astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
    centred = x - mean
    dx = (scale * r) * (dy - w * (d_bias + centred * (r * d_scale))) + w * (d_mean + 2.0 * centred * d_var)
    return dx, d_scale, d_bias, jnp.zeros_like(weights)


normalize.defvjp(_forward, _backward)
