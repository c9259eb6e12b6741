"""Evaluation: the global model on the test set and every client's own model on its own test split.

Owns `evaluators` (the global and personalized evaluators, the clients' accuracy distribution, finiteness), `cpu`
(the personalized evaluation shared among CPU devices) and `store` (clients evaluated a round's worth at a time
through a client store).

May import: `contract`, `structure`, `round` (compilation, the CPU placement) and `client_state`.
"""
