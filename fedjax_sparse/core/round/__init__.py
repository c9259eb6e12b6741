"""The round: one jitted computation that samples, trains the sampled clients and aggregates, and where it runs.

Owns `step` (the round step every placement runs: broadcast, vmapped client updates, the server step, bytes and
metrics; `build_round` for states on the device), `local_training` (a client's epochs as one loop, LocalSGD),
`driver` (which placement a run uses), the placements `store` (clients' states gathered from a client store and
scattered back), `cpu` (the sampled clients shared among CPU devices) and `buffered` (FedBuff's asynchronous
steps), `device_split` (which device trains which client), `distributed` (several processes under
jax.distributed), `compilation` and `numerics` (how programs are compiled: XLA options, matrix-product
precision, determinism) and `streams` (every random stream of a run, a pure function of its seed).

May import: `contract`, `structure`, `messages`, `federation` and, for the placements, `client_state`.
"""

import importlib

# The names of the module this package replaced (core/round.py before issue 56), from the package as before:
# `from fedjax_sparse.core.round import ...` keeps working, imported when first asked for.
_FROM_STEP = (
    "CLIENTS_AXIS", "RoundOutput", "RoundConditions", "default_conditions", "client_keys", "server_key",
    "round_info", "clients_mesh", "check_clients_per_round", "client_phase", "server_phase", "sent_in_vain",
    "client_flops", "keep_absent", "round_step", "device_round", "build_round", "default_client_chunk",
    "largest_divisor",
)


def __getattr__(name: str):
    if name in _FROM_STEP:
        return getattr(importlib.import_module(f"{__name__}.step"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
