"""How the library's computations are compiled: `jit` is `jax.jit` with XLA options chosen per platform.

On a CPU, XLA (jaxlib 0.10) hands convolutions to YNNPACK by default. For the
model zoo's shapes those run 2 to 4 times slower than XLA's own (Eigen)
convolutions: spafl_cnn's 28x28x64 -> 24x24x64 layer at batch 64 takes 171 ms
through YNNPACK against 40 ms, its weight gradient 142 against 53 ms, and a
whole local step of spafl_cnn about 3 times longer (benchmarks/results/
cnn_client_cpu.md). YNNPACK's dot products, by contrast, beat XLA's on the
MLP's small per-client matrices (9 against 13 us per example). So on a CPU
the library keeps YNNPACK for dots only.

The options are passed per computation (`jax.jit(..., compiler_options=...)`)
rather than through `XLA_FLAGS`, so they apply whenever the library compiles,
also when JAX was initialised before it was imported, and leave the user's
other computations alone. A jaxlib that does not know an option compiles
without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.core.round.numerics import deterministic_options

# XLA:CPU's YNNPACK fusion kinds left on: dots (see the module docstring).
CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


@functools.cache
def _accepted(platform: str, options: tuple[tuple[str, str], ...]) -> bool:
    """Whether this jaxlib's compiler for `platform` accepts `options` (tried once on a tiny program)."""
    try:
        jax.jit(jnp.negative, compiler_options=dict(options)).lower(
            jax.ShapeDtypeStruct((1,), jnp.float32)).compile()
    except Exception:  # noqa: BLE001 - an unknown or invalid option: compile without it
        return False
    return True


def compiler_options(platform: str | None = None) -> dict[str, str] | None:
    """The XLA options the library compiles with on `platform` (default: JAX's default backend): on a CPU
    its convolutions (above), on a GPU under `--deterministic` XLA's deterministic ops (`core.round.numerics`)."""
    platform = platform or jax.default_backend()
    options = deterministic_options(platform)
    if platform == "cpu" and _accepted(platform, tuple(CPU_OPTIONS.items())):
        options.update(CPU_OPTIONS)
    return options or None


def release_compiler_memory() -> None:
    """Returns the heap that XLA's compiler has freed to the operating system (glibc only; else nothing).

    glibc keeps freed memory in its arenas, so a process's resident memory
    stays at the compiler's high-water mark: compiling issue 19's SpaFL round
    (spafl_cnn, 100 clients) raised it from 1.13 to 1.89 GB, and trimming
    afterwards brought it back to 1.52 GB with nothing of the run lost.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim
        pass


def jit(fun: Callable, **kwargs: Any):
    """`jax.jit(fun, **kwargs)` with `compiler_options()` for the default backend.

    JAX accepts compiler options only on a computation compiled on its own: a
    jitted function with options that is traced into another one (a user's
    `jax.jit`, `lax.scan` over rounds, `lax.cond`) raises. There the options
    are dropped and the call is plain `jax.jit(fun, **kwargs)`, so the library's
    functions compose the same on every platform; the outer computation is
    compiled with whatever options it was given (wrap it in this `jit` to keep
    XLA's own convolutions on a CPU).
    """
    options = compiler_options()
    if options is None:
        return jax.jit(fun, **kwargs)
    return _TopLevelOptions(jax.jit(fun, compiler_options=options, **kwargs), jax.jit(fun, **kwargs))


class _TopLevelOptions:
    """A jitted function compiled with options when called at top level, without them when traced into
    another computation (see `jit`); `lower`, `trace`, `eval_shape` and the rest are the optioned one's."""

    def __init__(self, optioned, plain):
        self._optioned, self._plain = optioned, plain
        functools.update_wrapper(self, optioned)

    def __call__(self, *args, **kwargs):
        try:
            return self._optioned(*args, **kwargs)
        except ValueError as error:
            if not _is_nested_options_error(error):
                raise
        return self._plain(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_optioned", "_plain"):  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self._optioned, name)


def _is_nested_options_error(error: ValueError) -> bool:
    message = str(error)
    return "compiler_options" in message and "top-level" in message
