"""Client state: where the clients' persistent states live between rounds, and how they are saved.

Owns `store` (the device, host and disk stores, `choose_store`'s rule and the initial states), `rows` (a disk
store's rows files) and `snapshots` (a store's states as checkpoints hold them, restorable into another number of
processes).

May import: `contract` and `round.distributed` (which process owns which client).
"""
