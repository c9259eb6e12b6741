"""Evaluation: the global model on the test set and every client's own model on its own test split.

Owns `evaluators` (the global and personalized evaluators, the clients' accuracy distribution, finiteness), `cpu`
(the personalized evaluation shared among CPU devices) and `store` (clients evaluated a round's worth at a time
through a client store).

May import: `contract`, `structure`, `round` (compilation, the CPU placement) and `client_state`.
"""

import importlib

# The names of the module this package replaced (core/evaluation.py before issue 56), from the package as before:
# `from fedjax_sparse.core.evaluation import ...` keeps working, imported when first asked for.
_FROM_EVALUATORS = (
    "AUTO", "window_scores", "tail_batch", "default_global_batch", "global_evaluator", "default_evaluation_chunk",
    "personalized_evaluator", "split_evaluator", "PERCENTILES", "client_accuracy_figures", "all_finite",
    "population_diagnostics", "population_batch_stats",
)


def __getattr__(name: str):
    if name in _FROM_EVALUATORS:
        return getattr(importlib.import_module(f"{__name__}.evaluators"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
