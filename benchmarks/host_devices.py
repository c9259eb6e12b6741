"""Forcing several host (CPU) devices for a benchmark, before JAX starts its backend (a CPU has one otherwise)."""

from __future__ import annotations

import os


def force_host_devices(argv: list[str], default: int = 2) -> None:
    """Sets XLA_FLAGS to the device count `--devices D` in `argv` asks for (else `default`)."""
    count = argv[argv.index("--devices") + 1] if "--devices" in argv else str(default)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}")
