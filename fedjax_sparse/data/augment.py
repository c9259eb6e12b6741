"""Training-time augmentation that runs inside the jitted client step."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def random_crop_flip(key: jax.Array, images: jax.Array, pad: int = 4) -> jax.Array:
    """Per-example random crop of the zero-padded image and random horizontal flip.

    `images` is a float [B, H, W, C] batch. Each example independently is padded
    with `pad` zeros on every side, cropped back to H x W at a uniformly random
    offset in [0, 2 * pad] along each axis, and mirrored left-right with
    probability 1/2 (the CIFAR recipe). Zeros are zeros in whatever units the
    caller passes (black for raw [0, 1] pixels, the mean after normalisation).
    `pad` is static. Pure and shape-preserving, so it can be jitted and vmapped.
    """
    batch, height, width, channels = images.shape
    offset_key, flip_key = jax.random.split(key)
    offsets = jax.random.randint(offset_key, (batch, 2), 0, 2 * pad + 1)
    flips = jax.random.bernoulli(flip_key, 0.5, (batch,))
    padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))

    def crop(image, offset):
        return jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (height, width, channels))

    cropped = jax.vmap(crop)(padded, offsets)
    return jnp.where(flips[:, None, None, None], cropped[:, :, ::-1, :], cropped)
