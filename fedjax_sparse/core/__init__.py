"""The engine, in rooms by concern (each package's docstring says what it owns and what it may import):

- `contract`: what an algorithm is (FederatedAlgorithm and its types), its declared options, the contract's
  check on shapes and what wrappers share;
- `round`: the round as one jitted computation (its step, local training, its placements on devices, stores and
  processes, how it is compiled, its random streams);
- `client_state`: the clients' persistent states between rounds (device, host and disk stores, snapshots);
- `evaluation`: the global and personalized evaluators;
- `messages`: what travels and its bytes (pricing, compression, aggregation, secure aggregation's cost);
- `structure`: a model's units (masks, selection, layer groups, parts) and their FLOPs;
- `federation`: who takes part (samplers), how long each client takes (the clock), capacities from devices.

Below core: data and models. Above it: the building blocks an algorithm author imports, the algorithms, the
agent, privacy, and the run layer.
"""
