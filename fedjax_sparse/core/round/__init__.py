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
