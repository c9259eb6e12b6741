"""Messages: what travels between server and clients, what it costs in bytes, and how uploads are reduced.

Owns `pricing` (priced leaves, SparseArray, KnownMaskArray, CodedMask, QuantizedArray, and `message_bytes`, which
prices any message inside jit), `compression` (top-k, random-k, QSGD, error feedback), `aggregation` (the
reductions over the clients taking part: weighted, masked, present-only means and sums) and `secure_aggregation`
(what SecAgg and SecAgg+ add to every client's bytes, and which algorithms a secure sum serves).

May import: `structure`, and `contract` for secure aggregation's check of an algorithm.
"""
