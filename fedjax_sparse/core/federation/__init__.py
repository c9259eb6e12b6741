"""The federation: who takes part in a round, and how long each client takes.

Owns `participation` (the samplers: uniform, Poisson, by data size, an availability pattern or trace),
`clock` (each client's device and link turning its FLOPs and bytes into simulated seconds; stragglers) and
`capacity` (sub-model capacities chosen from what a client's device finishes by the deadline).

May import: `structure` (FLOPs), `round.streams`, and `contract` for capacity's build context.
"""
