"""Messages: what travels between server and clients, what it costs in bytes, and how uploads are reduced.

Owns `pricing` (priced leaves, SparseArray, KnownMaskArray, CodedMask, QuantizedArray, and `message_bytes`, which
prices any message inside jit), `compression` (top-k, random-k, QSGD, error feedback), `aggregation` (the
reductions over the clients taking part: weighted, masked, present-only means and sums) and `secure_aggregation`
(what SecAgg and SecAgg+ add to every client's bytes, and which algorithms a secure sum serves).

May import: `structure`, and `contract` for secure aggregation's check of an algorithm.
"""

import importlib

# The names of the module this package replaced (core/messages.py before issue 56), from the package as before:
# `from fedjax_sparse.core.messages import ...` keeps working, imported when first asked for.
_FROM_PRICING = (
    "SparseArray", "UnitSparseArray", "unit_sparse", "KnownMaskArray", "Known", "QuantizedArray", "quantized_bytes",
    "CodedMask", "PRICED_LEAVES", "index_itemsize", "coded_mask_bytes", "message_bytes",
)


def __getattr__(name: str):
    if name in _FROM_PRICING:
        return getattr(importlib.import_module(f"{__name__}.pricing"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
