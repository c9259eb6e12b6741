"""The official SpaFL code's client step where it departs from the paper (`--spafl-variant code`).

Read from news-vt/SpaFL_NeruIPS_2024 at HEAD d3639ab, the CIFAR-10 files that produced Table 2
(`main/cifar10/`; command in `run_command.txt`: lr 0.01, momentum 0.9, batch 16, 5 local epochs,
--th_coeff 0.00015, --clip 3). `spafl.py` composes these pieces; its docstring lists every
difference and which of them the variant reproduces. Paths below are relative to `main/cifar10/`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedjax_sparse.models.structure import Layer, ModelStructure, get_path, set_path

# run_command.txt and the README's CIFAR-10 command: --clip 3 (train_argument.py:33 defaults to 1;
# CIFAR-100 runs with 15; the FMNIST client does not clip)
CODE_GRAD_CLIP = 3.0
# model/binarization.py:61 and :131, `if self.ratio <= 0.01` (at most, where the paper's reading says below)
CODE_RESET_DENSITY = 0.01


@jax.custom_vjp
def code_step(u: jax.Array) -> jax.Array:
    """`BinaryStep` (model/binarization.py:8-19): 1 where u > 0, and a backward pass that lets the
    gradient through only where |u| > 1. u = (mean |w| of the unit) - threshold, so a threshold
    gets no task gradient (and a weight none through its mean magnitude) unless they are more
    than 1 apart."""
    return (u > 0).astype(u.dtype)


def _code_step_fwd(u):
    return code_step(u), u


def _code_step_bwd(u, g):
    return (g * (jnp.abs(u) > 1).astype(g.dtype),)


code_step.defvjp(_code_step_fwd, _code_step_bwd)


def mask_kernels(structure: ModelStructure, params, masks: dict[str, jax.Array]):
    """Each unit's kernel slice times its mask (`weight * mask` before the conv/linear, binarization.py:69,
    :139): a pruned unit's pre-normalization output is zero, so behind BatchNorm it outputs the
    normalization's bias (its shift in evaluation), not zero."""
    for layer in structure.layers:
        params = set_path(params, layer.kernel, get_path(params, layer.kernel) * masks[layer.name])
    return params


def eq13_divisor(layer: Layer, kernel: jax.Array) -> int:
    """What eq. 13 divides dtau by (client/Client_Class.py:132-135): a conv layer's kernel_size[0]**2,
    the kernel's spatial size (k^2, where the paper's reading takes the fan-in, in_channels x k^2);
    a linear layer's in_size, its fan-in, as in the paper's reading."""
    if layer.kind == "conv":
        return int(kernel.shape[0]) * int(kernel.shape[1])
    return layer.fan_in


def uniform_kernels(structure: ModelStructure, params, key: jax.Array):
    """The prunable kernels drawn as PyTorch's `kaiming_uniform_(a=sqrt(5))` draws them
    (binarization.py:39, :106): U(-1/sqrt(n), 1/sqrt(n)), n the unit's fan-in."""
    for i, layer in enumerate(structure.layers):
        kernel = get_path(params, layer.kernel)
        bound = 1.0 / jnp.sqrt(jnp.asarray(layer.fan_in, kernel.dtype))
        drawn = jax.random.uniform(jax.random.fold_in(key, i), kernel.shape, kernel.dtype, -bound, bound)
        params = set_path(params, layer.kernel, drawn)
    return params


def reset_after_collapse(masks: dict[str, jax.Array], thresholds: dict) -> tuple[dict, jax.Array]:
    """The code's 1 % reset (binarization.py:61-66, :131-136): a layer whose mask `masks` (the one
    its previous forward pass used) keeps at most 1 % of its units has its thresholds set to zero.
    Returns the thresholds and how many layers were reset."""
    out, resets = {}, jnp.zeros((), jnp.int32)
    for name, mask in masks.items():
        # counted in integers: float32's kept / units can round 5 / 500 above 0.01, the code's reads 0.01
        collapsed = jnp.sum(mask.astype(jnp.int32)) <= math.floor(CODE_RESET_DENSITY * mask.size)
        out[name] = jnp.where(collapsed, jnp.zeros_like(thresholds[name]), thresholds[name])
        resets = resets + collapsed.astype(jnp.int32)
    return out, resets
