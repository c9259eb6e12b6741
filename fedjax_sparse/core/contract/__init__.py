"""The algorithm contract: what an algorithm is, what it declares, and how it is checked and wrapped.

Owns `algorithm` (FederatedAlgorithm, BuildContext, RoundInfo, AlgorithmSpec, ServerStep, PrivateSum: the types an
author implements), `options` (the `option(...)` declarations that become flags and config keys, and their
validation), `check` (the contract evaluated on shapes before a run's first round, one line per breach) and
`wrapping` (what the patterns that wrap any algorithm share: personal layers, compression, privacy).

May import: data (a client's examples), `structure` and `messages` (what a message may hold), and, for the check and
the wrappers alone, `round` (a round's keys and info). `algorithm` and `options` import nothing of core, so every
other room builds on them.
"""

import importlib

# The names of the module this package replaced (core/contract.py before issue 56), from the package as before:
# `from fedjax_sparse.core.contract import ...` keeps working, imported when first asked for.
_FROM_CHECK = (
    "ContractError", "TRACEBACK_VARIABLE", "location", "same_tree", "message_leaves", "check_metrics",
    "check_contract", "check_private_sum", "check_evaluation",
)


def __getattr__(name: str):
    if name in _FROM_CHECK:
        return getattr(importlib.import_module(f"{__name__}.check"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
