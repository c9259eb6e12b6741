"""Independent random streams of a run, each derived from the seed under its own tag.

A run draws randomness for several unrelated purposes; each gets its own
stream so that no two share (or shift) each other's numbers: changing how many
draws the model's initialization makes cannot change which clients are sampled.
JAX streams are `fold_in(key(seed), tag)`; numpy streams (the partition and the
local test split, drawn on the host) use the seed sequence `[seed, tag]`.
"""

from __future__ import annotations

import zlib

import jax

STREAMS = ("partition", "local_test", "public_data", "model_init", "algorithm_init", "sampling", "clients",
           "server", "capacities", "agent_validation", "predictor_fit", "evaluation", "population",
           "availability", "devices", "dropout")


def _tag(name: str) -> int:
    if name not in STREAMS:
        raise ValueError(f"unknown random stream {name!r}; streams are {', '.join(STREAMS)}")
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def stream_key(seed: int, name: str) -> jax.Array:
    """The JAX key of stream `name` of a run with this seed."""
    return jax.random.fold_in(jax.random.key(seed), _tag(name))


def stream_seed(seed: int, name: str) -> list[int]:
    """The numpy seed sequence of stream `name` (for `np.random.default_rng`)."""
    return [int(seed), _tag(name)]
