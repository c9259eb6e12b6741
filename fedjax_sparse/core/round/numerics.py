"""A run's numerical choices: how float32 products are computed, and whether the accelerator may reorder sums.

Matrix-product precision (`--matmul-precision`). JAX leaves a float32 matrix
product or convolution to the backend's default, which differs by device: a
CPU computes it in float32, an Ampere or Hopper GPU in TF32 (inputs rounded to
a 10-bit mantissa), a TPU in one bfloat16 pass. The same run then gives other
figures on a GPU than on a CPU, beyond the order of its sums (jax-ml/jax#12008:
JAX's own suite failed on an A100 for this). The library therefore names the
precision, records it in config.json and summary.json, and applies it to every
program a run compiles (JAX's `jax_default_matmul_precision`):

  float32        (default) XLA's HIGHEST: float32 on every backend (a TPU
                 takes 6 bfloat16 passes, a GPU its float32 units);
  tensorfloat32  XLA's HIGH: TF32 on Ampere and newer GPUs, 3 bfloat16 passes
                 on a TPU, float32 on a CPU;
  bfloat16       XLA's DEFAULT: one bfloat16 pass on a TPU, TF32 on Ampere and
                 newer GPUs, float32 on a CPU;
  default        whatever JAX is set to (JAX_DEFAULT_MATMUL_PRECISION, else
                 XLA's DEFAULT), for a user who configures JAX themselves.

float32 is the default because a run's figures should not depend on which
machine ran it; the speed an accelerator offers comes from `--compute-dtype
bfloat16` (mixed precision, `models.structure.Model`), whose products are
bfloat16 whatever the precision, and tensorfloat32 is one flag away. A product
written with its own precision (BatchNorm's float32 sums, `models.channel_sums`)
keeps it.

Determinism (`--deterministic`). XLA's GPU backend may pick convolution
algorithms and reduction orders (atomics in scatters and reductions) that
differ from run to run; `xla_gpu_deterministic_ops` forbids those, at some
cost in speed. A CPU and a TPU compute the same program the same way every
time already, so there the option changes nothing. It is recorded with the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import jax

MATMUL_PRECISIONS = ("float32", "tensorfloat32", "bfloat16", "default")
PRECISION_ALIASES = {"highest": "float32", "high": "tensorfloat32"}  # XLA's names for two of JAX's
_XLA_NAMES = {"float32": "HIGHEST", "tensorfloat32": "HIGH", "bfloat16": "DEFAULT"}

GPU_DETERMINISM = {"xla_gpu_deterministic_ops": "true"}


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The matrix-product precision (one of MATMUL_PRECISIONS) and determinism a run compiles with."""

    matmul_precision: str = "float32"
    deterministic: bool = False

    def __post_init__(self):
        name = PRECISION_ALIASES.get(self.matmul_precision, self.matmul_precision)
        if name not in MATMUL_PRECISIONS:
            raise ValueError(f"--matmul-precision {self.matmul_precision!r} is not one of "
                             f"{', '.join(MATMUL_PRECISIONS)} (or {', '.join(PRECISION_ALIASES)})")
        object.__setattr__(self, "matmul_precision", name)

    def describe(self) -> dict:
        """What summary.json records: the names asked for and XLA's precision they became on this backend."""
        name = self.matmul_precision
        if name == "default":  # JAX's own setting, in force while the run builds and runs
            jax_name = jax.config.jax_default_matmul_precision or "bfloat16"
            xla = _XLA_NAMES.get(PRECISION_ALIASES.get(jax_name, jax_name), str(jax_name))
        else:
            xla = _XLA_NAMES[name]
        return {"matmul_precision": name, "xla_precision": xla, "deterministic": self.deterministic,
                "backend": jax.default_backend()}


_ACTIVE = Numerics()


def active() -> Numerics:
    """The numerics of the run being built or run in this process (`Numerics()` outside one)."""
    return _ACTIVE


@contextlib.contextmanager
def numerics(choice: Numerics) -> Iterator[Numerics]:
    """Everything compiled inside compiles with `choice`; JAX's setting before is restored after.

    The precision is set in JAX's process-wide configuration rather than its
    thread-local context, so that work a run hands to other threads (a client
    store's prefetch) compiles the same way.
    """
    global _ACTIVE
    before, previous = jax.config.jax_default_matmul_precision, _ACTIVE
    jax.config.update("jax_default_matmul_precision",
                      before if choice.matmul_precision == "default" else choice.matmul_precision)
    _ACTIVE = choice
    try:
        yield choice
    finally:
        _ACTIVE = previous
        jax.config.update("jax_default_matmul_precision", before)


def deterministic_options(platform: str) -> dict[str, str]:
    """The XLA options that make `platform` compute a program the same way every time, under `active()`."""
    return dict(GPU_DETERMINISM) if _ACTIVE.deterministic and platform in ("gpu", "cuda", "rocm") else {}
