"""The pieces an algorithm author needs, in one place: the core's (each documented in its own module) and the reusable
algorithm pieces this package holds itself, the server optimizer and SCAFFOLD's control variates.

Model parts (`core.structure.model_parts`)
    part_labels, take_part, overlay, merge: a model's encoder/predictor/... parts as nested dicts,
    taken out, put back and joined (SPATL's encoder, FedPer's predictor, FedBN's norms).
Messages and their price (`core.messages.pricing`, `core.messages.compression`)
    SparseArray (values at a mask; `SparseArray.from_indices`), KnownMaskArray (positions the
    receiver knows), Known (free), CodedMask (an arithmetic-coded bit mask), QuantizedArray, and
    message_bytes, which prices any of them inside jit; top_k, random_k, stochastic_quantization,
    error_feedback, decompressed: the standard uplink compressors.
Local objectives (`core.round.local_training`)
    LocalSGD.train with a LocalObjective (a forward pass of its own, an extra loss, a gradient
    correction, an update mask, a projection after each step, another optimizer); proximal_term.
Aggregation and the server's step (`core.messages.aggregation`, `building_blocks.server_optimizer`)
    weighted_mean, masked_mean, mean_of_sent, uniform_mean, present_sum, present_only (the reductions over
    the clients taking part, `RoundInfo.participating`); ServerOptimizer (init_state, step_toward, apply: the
    FedOpt step on the mean delta, over held entries only), STATE_KEY, without_optimizer_state;
    ServerStep: a server update's new state with metrics of its step, logged every round.
Unit masks and sub-models (`core.structure.unit_masks`, `core.structure.unit_selection`)
    full_unit_masks, variable_masks, keep_top_units, prefix_scores: structured sparsity on any model
    of the zoo.

A top-k upload with error feedback, priced, in a few lines:

    >>> import jax.numpy as jnp
    >>> delta = {"w": jnp.array([0.5, -2.0, 0.1, 1.0])}
    >>> message, residual = error_feedback(delta, {"w": jnp.zeros(4)}, lambda t: top_k(t, 0.5))
    >>> decompressed(message)["w"].tolist(), int(message_bytes(message))  # 2 floats + a 1-byte bitmask
    ([0.0, -2.0, 0.0, 1.0], 9)
    >>> residual["w"].tolist()
    [0.5, 0.0, 0.10000000149011612, 0.0]

The tutorial "Write your own algorithm" (docs/) builds top-k FedAvg with error feedback, FedDyn and
FedPer from these pieces.
"""

from fedjax_sparse.core.messages.aggregation import (masked_mean, mean_of_sent, present_only, present_sum, uniform_mean,
                                           weighted_mean)
from fedjax_sparse.core.contract.algorithm import (AlgorithmSpec, BuildContext, FederatedAlgorithm, NoOptions, RoundInfo,
                                          ServerStep, replicate)
from fedjax_sparse.core.messages.compression import decompressed, error_feedback, random_k, stochastic_quantization, top_k
from fedjax_sparse.core.round.local_training import LocalObjective, LocalSGD, proximal_term
from fedjax_sparse.core.messages.pricing import (CodedMask, Known, KnownMaskArray, QuantizedArray, SparseArray,
                                         message_bytes)
from fedjax_sparse.core.structure.model_parts import merge, overlay, part_labels, take_part
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import (STATE_KEY, ServerOptimizer, ServerOptimizerOptions, from_options,
                                                 server_optimizer, without_optimizer_state)
from fedjax_sparse.core.structure.unit_masks import full_unit_masks, variable_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores

__all__ = [
    "AlgorithmSpec", "BuildContext", "CodedMask", "FederatedAlgorithm", "Known", "KnownMaskArray", "LocalObjective",
    "LocalSGD", "NoOptions", "QuantizedArray", "RoundInfo", "STATE_KEY", "ServerOptimizer", "ServerOptimizerOptions",
    "ServerStep",
    "SparseArray", "decompressed", "error_feedback", "from_options", "full_unit_masks", "keep_top_units",
    "masked_mean", "mean_of_sent", "merge", "message_bytes", "option", "overlay", "part_labels", "prefix_scores",
    "present_only", "present_sum", "proximal_term", "random_k", "replicate", "server_optimizer",
    "stochastic_quantization", "take_part", "top_k", "uniform_mean", "variable_masks", "weighted_mean",
    "without_optimizer_state",
]
