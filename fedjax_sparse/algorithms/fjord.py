"""Fjord (Horvath et al., NeurIPS 2021): ordered dropout, each client training the first units of
every hidden layer, on the sub-model round of `algorithms.submodels`.

Ordered dropout. A width p keeps units [0, ceil(p N)) of every hidden layer (HeteroFL's prefix,
`core.unit_selection.prefix_scores`; residual groups tied) and every unit of the output layer (the
classifier is not ordered-dropped in FjORD's code: it takes the sliced input and keeps its
outputs). Inputs follow the previous layer's kept units, never the image's channels.

Widths, two ways (`fjord_sampling`):
  client (default)  SpaFL's variant (section 5.2, appendix A.1.1): each sampled client draws
                    p ~ U(width_low, width_high) (0.4, 0.6) for the round, a pure function of
                    (seed, round, client id), and all its local steps train that sub-model. SpaFL
                    does not say whether p is drawn per round or per batch; per round is the
                    reading that makes its Comm column (~E[p] of FedAvg's each way) what a client
                    sends, since the sub-model a client holds is what travels.
  batch             FjORD's own (the Flower baseline by FjORD's authors): the discrete widths
                    `fjord_widths` (0.2, ..., 1.0); client i's tier, its largest width p_max, is
                    the floor(i S / N)-th of the S widths (the code's floor(cid / 20) for 100
                    clients and five widths); every local step (batch) draws p uniformly from the
                    widths <= p_max and trains that prefix, so the client holds, sends and receives
                    its p_max sub-model. FjORD's self-distillation (a second forward pass at p_max
                    as the teacher) is not part of this reading: one forward pass per step.
Aggregation: per entry, over the clients that held it (the round's `masked_mean`, data-size
weighted; FjORD's `fjord_average` is the same per-entry mean over holders, sample-weighted).
BatchNorm: clients train with batch statistics and the server recomputes the global model's
before each evaluation (`static_bn`, on by default); FjORD keeps running statistics per width,
which a continuous p cannot have. Messages: the sub-model's values both ways (the server and the
client both know the width), as every sub-model method.

At width_low = width_high = p, Fjord is HeteroFL with the single capacity p (tests/test_fjord.py).
`train_flops`: the sub-model's count; in `batch` sampling its expectation over the widths a
client may draw.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_sparse.algorithms.submodels import SubmodelOptions, submodel_algorithm
from fedjax_sparse.core.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm
from fedjax_sparse.core.flops import forward_flops
from fedjax_sparse.core.options import option
from fedjax_sparse.core.streams import stream_key
from fedjax_sparse.core.unit_selection import keep_top_units, prefix_scores

FJORD_WIDTHS = (0.2, 0.4, 0.6, 0.8, 1.0)


@dataclasses.dataclass(frozen=True)
class FjordOptions(SubmodelOptions):
    fjord_sampling: str = option("client", "Fjord: client (p ~ U(width_low, width_high) per client per round, "
                                           "SpaFL's variant) or batch (FjORD's: a width <= the client's tier "
                                           "drawn from --fjord-widths every batch)", choices=("client", "batch"))
    width_low: float = option(0.4, "Fjord client sampling: the smallest width p", low=0.0, low_open=True, high=1.0)
    width_high: float = option(0.6, "Fjord client sampling: the largest width p", low=0.0, low_open=True, high=1.0)
    fjord_widths: tuple[float, ...] = option(FJORD_WIDTHS, "Fjord batch sampling: the widths p_s, one tier per "
                                                           "width", low=0.0, low_open=True, high=1.0)

    def __post_init__(self):
        super().__post_init__()
        if self.width_low > self.width_high:
            raise ValueError(f"--width-low {self.width_low} exceeds --width-high {self.width_high}")

    def ignored(self) -> dict[str, str]:
        out = super().ignored()
        out.update({name: "is not read by fjord: its widths come from --fjord-sampling"
                    for name in ("capacities", "capacity_mode", "capacity_proportions")})
        if self.fjord_sampling == "client":
            out["fjord_widths"] = "is read only with --fjord-sampling batch"
        else:
            out.update({name: "is read only with --fjord-sampling client" for name in ("width_low", "width_high")})
        return out


def client_width(seed: int, low: float, high: float, round_index: jax.Array, client_id: jax.Array) -> jax.Array:
    """SpaFL's variant: p ~ U(low, high), a pure function of (seed, round, client id)."""
    key = jax.random.fold_in(jax.random.fold_in(stream_key(seed, "capacities"), round_index), client_id)
    return jax.random.uniform(key, (), jnp.float32, low, high)


def tier_width(widths: jax.Array, client_id: jax.Array, num_clients: int) -> jax.Array:
    """FjORD's tiers: client i's largest width is the floor(i S / N)-th of the S sorted `widths`."""
    return widths[jnp.minimum(client_id * widths.shape[0] // num_clients, widths.shape[0] - 1)]


def batch_width(key: jax.Array, widths: jax.Array, p_max: jax.Array) -> jax.Array:
    """A width drawn uniformly from `widths` <= p_max (FjORD's per-batch sampling)."""
    allowed = widths <= p_max + 1e-6
    return jax.random.choice(key, widths, p=allowed / jnp.sum(allowed))


def fjord(context: BuildContext, options: FjordOptions) -> FederatedAlgorithm:
    structure = context.local.model.structure
    prefix = prefix_scores(structure)

    def rule(state, client_id, info, capacity):
        return prefix

    if options.fjord_sampling == "client":
        return submodel_algorithm("fjord", context, options, rule, capacity=lambda round_index, client_id: client_width(
            context.seed, options.width_low, options.width_high, round_index, client_id))

    widths = jnp.asarray(sorted(options.fjord_widths), jnp.float32)
    width_flops = jnp.stack([forward_flops(structure, keep_top_units(structure, prefix, w), count_inputs=True)
                             for w in widths])

    def step_masks(step_key, p_max):
        width = batch_width(step_key, widths, p_max)
        return keep_top_units(structure, prefix, width), width

    def expected_step_flops(p_max):
        allowed = widths <= p_max + 1e-6
        return jnp.sum(jnp.where(allowed, width_flops, 0.0)) / jnp.sum(allowed)

    return submodel_algorithm("fjord", context, options, rule,
                              capacity=lambda round_index, client_id: tier_width(widths, client_id,
                                                                                 context.num_clients),
                              step_masks=step_masks, expected_step_flops=expected_step_flops)


SPEC = AlgorithmSpec("fjord", FjordOptions, fjord,
                     "Fjord: ordered dropout, each client trains the first p of every hidden layer")
