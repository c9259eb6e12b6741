"""Sub-model training: HeteroFL, FedRolex and Federated Dropout, and the round FedGSE shares with them.

Clients of different capacity train sub-models of one global model. The four
published rules differ only in which units a client's sub-model keeps; the
round around that choice is built once here (`submodel_algorithm`):

Capacity. Each sampled client gets a capacity beta from `capacities`
(HeteroFL's and FedGSE's five levels 1, 1/2, 1/4, 1/8, 1/16 by default),
drawn with `capacity_proportions` (uniform by default; FedGSE's section 6.3
mixes {1, 1/16} in proportion rho): `dynamic` redraws it every round (FedGSE's
setting), `fixed` draws it once per client. Either way a pure function of
(seed, round, client id) in its own random stream.

Sub-model. beta keeps ceil(beta x N) units of every hidden layer (N its units;
HeteroFL's count: only hidden widths scale) and every unit of the output
layer; layers of one residual unit_group keep the same units
(`core.unit_selection.keep_top_units`, ranked by the rule's scores):
  heterofl     units [0, ceil(beta N)) of each layer (score = -index);
  fedrolex     units {(j - r) mod N : j < ceil(beta N)}, r the round index;
  feddropout   a uniformly random ceil(beta N) units per layer, per client, per round;
  fedgse       the units of largest |dL/dh| on similar data (algorithms/fedgse.py).
The client runs the full-shape model with these unit masks on its unit
outputs (`core.unit_masks`), so clients of every capacity vmap together. Its
update is masked to the sub-model's entries (`variable_masks`: kernel entries
whose output and input units are kept, and the kept units' biases, norm
parameters and statistics): every other entry, momentum and weight decay
included, is exactly unchanged by local training and is never sent.

Messages. The server chose the sub-model, so both sides know its layout: a
message costs the sub-model's values only, both ways (`KnownMaskArray`,
nnz x itemsize); the unit masks and capacity ride along as `Known` (free: a
real client receives a smaller dense model and needs no index).

HeteroFL's two model devices, each an option:
  scaler     during local training a kept unit's output is divided by beta
             (HeteroFL's Scaler), so the next layer's input keeps the full
             model's scale; evaluation runs the full model unscaled. HeteroFL
             puts it right after each convolution, before the norm, where a
             batch-statistics BatchNorm cancels it (BN is scale invariant; only
             its epsilon notices). We apply it exactly where it has an effect:
             at the unit output of layers without normalization (equal to
             scaling before the activation, ReLU being positively homogeneous),
             and not at all behind a BatchNorm. Off by default: on a norm-free
             net it multiplies the gradients of a beta = 1/16 sub-model by up to
             1/beta per layer, which makes the digits MLP diverge at lr 0.05.
  static_bn  ("sBN") clients train with batch statistics and send no running
             statistics; before each evaluation the server recomputes the global
             model's BatchNorm statistics over all training data
             (`core.evaluation.population_batch_stats`). Without it, running
             statistics travel and are aggregated like the weights.
Label split (`label_mask`, HeteroFL's masked cross-entropy): the softmax of a
client's loss ranges over the labels of its own data only; an option for every rule.

Aggregation. `masked_mean` (default, as FedGSE's Algorithm 1 line 11): per
entry, the data-size-weighted mean over the clients that hold it; entries no
client holds keep their value. `heterofl`: HeteroFL's code: a plain mean over
holders, and each output row (class) only over the clients holding that label.

The server keeps only the global model, plus whatever a rule needs to remember
(`memory`, FedGSE-SPL's per-client class accuracies).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.core.aggregation import masked_mean
from fedjax_sparse.core.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm, RoundInfo
from fedjax_sparse.core.compilation import jit
from fedjax_sparse.core.evaluation import population_batch_stats
from fedjax_sparse.core.local_training import LocalObjective
from fedjax_sparse.core.messages import Known, KnownMaskArray
from fedjax_sparse.core.options import option
from fedjax_sparse.core.streams import stream_key
from fedjax_sparse.core.unit_masks import variable_masks
from fedjax_sparse.core.unit_selection import keep_top_units, prefix_scores, random_scores, rolling_scores
from fedjax_sparse.data.federated import client_label_counts
from fedjax_sparse.models.structure import get_path, set_path

tree_map = jax.tree_util.tree_map
FIVE_LEVELS = (1.0, 0.5, 0.25, 0.125, 0.0625)

# scores(server_state, client_id, info, capacity) -> {layer: [units]}: the rule of a sub-model method
ScoreRule = Callable[[Any, jax.Array, RoundInfo, jax.Array], dict]


@dataclasses.dataclass(frozen=True)
class SubmodelOptions:
    capacities: tuple[float, ...] = option(FIVE_LEVELS, "client capacity levels beta (fraction of every hidden "
                                                        "layer's units a sub-model keeps)", low=0.0,
                                           low_open=True, high=1.0)
    capacity_mode: str = option("dynamic", "dynamic: each sampled client draws its level every round; fixed: "
                                           "each client's level is drawn once", choices=("dynamic", "fixed"))
    capacity_proportions: tuple[float, ...] | None = option(None, "weights of the capacity levels (default: "
                                                                  "equal)", low=0.0)
    scaler: bool = option(False, "HeteroFL's Scaler: divide kept units' outputs by beta during local training "
                                 "(layers without normalization; a BatchNorm cancels it)")
    static_bn: bool = option(True, "HeteroFL's static BatchNorm: no running statistics travel; they are "
                                   "recomputed over the training data before each evaluation")
    label_mask: bool = option(False, "HeteroFL's label split: each client's cross-entropy over its own labels only")
    submodel_aggregation: str = option("masked_mean", "masked_mean: data-weighted mean over the clients holding an "
                                                      "entry; heterofl: plain mean, class rows over the clients "
                                                      "holding that label", choices=("masked_mean", "heterofl"))

    def __post_init__(self):
        if self.capacity_proportions is not None:
            if len(self.capacity_proportions) != len(self.capacities):
                raise ValueError(f"--capacity-proportions needs one weight per capacity level "
                                 f"({len(self.capacities)}), got {len(self.capacity_proportions)}")
            if not sum(self.capacity_proportions) > 0:
                raise ValueError(f"--capacity-proportions must not all be zero, got "
                                 f"{','.join(map(str, self.capacity_proportions))}")


def client_capacity(options: SubmodelOptions, seed: int, round_index: jax.Array, client_id: jax.Array) -> jax.Array:
    """The capacity of a client in a round: a pure function of (seed, round, client id)."""
    key = stream_key(seed, "capacities")
    if options.capacity_mode == "dynamic":
        key = jax.random.fold_in(key, round_index)
    key = jax.random.fold_in(key, client_id)
    levels = jnp.asarray(options.capacities, jnp.float32)
    weights = jnp.ones_like(levels) if options.capacity_proportions is None else \
        jnp.asarray(options.capacity_proportions, jnp.float32)
    return levels[jax.random.choice(key, levels.shape[0], p=weights / weights.sum())]


@dataclasses.dataclass(frozen=True)
class ServerMemory:
    """What a rule's server remembers per client: init(num_clients) and update(memory, ups, info)."""

    init: Callable[[int], Any]
    update: Callable[[Any, Any, RoundInfo], Any]


def submodel_algorithm(name: str, context: BuildContext, options: SubmodelOptions, scores: ScoreRule, *,
                       feedback: Callable[[Any], dict] | None = None,
                       memory: ServerMemory | None = None) -> FederatedAlgorithm:
    """The sub-model round around a rule's unit `scores` (see the module docstring).

    feedback(data) -> dict: extra values a client uploads (FedGSE-CSL's labels), priced.
    memory: per-client server memory updated from the uploads (FedGSE-SPL).
    """
    local = context.local
    model = local.model
    structure = model.structure
    num_classes = context.num_classes
    output = structure.layers[-1]
    stats_shapes = jax.eval_shape(model.init, jax.random.key(0))["batch_stats"]
    scaled = {l.name for l in structure.layers[:-1] if l.norm is None} if options.scaler else set()

    def sent(variables):
        return {"params": variables["params"]} if options.static_bn else variables

    def init(key, variables, num_clients):
        del key
        state = {"variables": variables}
        if memory is not None:
            state["memory"] = memory.init(num_clients)
        return state, {}

    def broadcast(server_state, client_id, info):
        capacity = client_capacity(options, context.seed, info.index, client_id)
        masks = keep_top_units(structure, scores(server_state, client_id, info, capacity), capacity)
        variables = server_state["variables"]
        entry_masks = variable_masks(structure, variables, masks)
        return {"variables": tree_map(KnownMaskArray, sent(variables), sent(entry_masks)),
                "unit_masks": Known(masks), "capacity": Known(capacity)}

    def client_update(down, client_state, data, key, info):
        masks, capacity = down["unit_masks"].value, down["capacity"].value
        variables = tree_map(lambda leaf: leaf.values, down["variables"],
                             is_leaf=lambda x: isinstance(x, KnownMaskArray))
        if options.static_bn:  # trains with batch statistics; its running ones are never used nor sent
            variables = {**variables, "batch_stats": tree_map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shapes)}
        entry_masks = variable_masks(structure, variables, masks)
        train_masks = {k: m / capacity if k in scaled else m for k, m in masks.items()}
        labels_held = client_label_counts(data, num_classes) > 0
        objective = LocalObjective(
            forward=lambda t: {"params": t["params"], "unit_masks": train_masks},
            update_mask=entry_masks,
            label_mask=labels_held if options.label_mask else None)
        trained, stats = local.train(variables, data, key, round_index=info.index, objective=objective)
        up = {"variables": tree_map(KnownMaskArray, sent(trained), sent(entry_masks)),
              "unit_masks": Known(masks), "labels_held": Known(labels_held)}
        if feedback is not None:
            up["feedback"] = feedback(data)
        return up, client_state, {**stats, "capacity": capacity}

    def server_update(server_state, ups, weights, info):
        is_known = lambda x: isinstance(x, KnownMaskArray)  # noqa: E731
        values = tree_map(lambda leaf: leaf.values, ups["variables"], is_leaf=is_known)
        masks = tree_map(lambda leaf: leaf.mask, ups["variables"], is_leaf=is_known)
        if options.submodel_aggregation == "heterofl":
            weights = jnp.ones_like(weights)
            held = ups["labels_held"].value  # [K, classes]
            for path in (output.kernel, output.bias):
                if path is not None:
                    leaf = get_path(masks["params"], path)
                    rows = held.reshape((held.shape[0],) + (1,) * (leaf.ndim - 2) + (-1,))
                    masks = {**masks, "params": set_path(masks["params"], path, leaf & rows)}
        variables = server_state["variables"]
        new = masked_mean(values, masks, weights, sent(variables))
        state = {**server_state, "variables": {**variables, **new}}
        if memory is not None:
            state["memory"] = memory.update(server_state["memory"], ups, info)
        return state

    def evaluation_state(server_state):
        variables = server_state["variables"]
        return {**server_state, "variables": {**variables,
                                              "batch_stats": recompute(variables, context.train)}}

    recompute = jit(lambda variables, split: population_batch_stats(model, variables, split))
    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: server_state["variables"],
        global_variables=lambda server_state: server_state["variables"],
        evaluation_state=evaluation_state if options.static_bn else None,
    )


def heterofl(context: BuildContext, options: SubmodelOptions) -> FederatedAlgorithm:
    fixed = prefix_scores(context.local.model.structure)
    return submodel_algorithm("heterofl", context, options, lambda state, client_id, info, capacity: fixed)


def fedrolex(context: BuildContext, options: SubmodelOptions) -> FederatedAlgorithm:
    structure = context.local.model.structure
    return submodel_algorithm("fedrolex", context, options,
                              lambda state, client_id, info, capacity: rolling_scores(structure, info.index))


def feddropout(context: BuildContext, options: SubmodelOptions) -> FederatedAlgorithm:
    structure = context.local.model.structure
    return submodel_algorithm(
        "feddropout", context, options,
        lambda state, client_id, info, capacity: random_scores(structure,
                                                               jax.random.fold_in(info.server_key, client_id)))


SPECS = (
    AlgorithmSpec("heterofl", SubmodelOptions, heterofl, "HeteroFL: each client trains a prefix of every layer"),
    AlgorithmSpec("fedrolex", SubmodelOptions, fedrolex, "FedRolex: a window of units that rolls every round"),
    AlgorithmSpec("feddropout", SubmodelOptions, feddropout, "Federated Dropout: a random subset of units"),
)
