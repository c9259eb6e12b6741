"""Sub-model training: HeteroFL, FedRolex and Federated Dropout, and the round FedGSE shares with them.

Clients of different capacity train sub-models of one global model. The four
published rules differ only in which units a client's sub-model keeps; the
round around that choice is built once here (`submodel_algorithm`):

Capacity. Each sampled client gets a capacity beta from `capacities`
(HeteroFL's and FedGSE's five levels 1, 1/2, 1/4, 1/8, 1/16 by default),
drawn with `capacity_proportions` (uniform by default; FedGSE's section 6.3
mixes {1, 1/16} in proportion rho): `dynamic` redraws it every round (FedGSE's
setting), `fixed` draws it once per client. Either way a pure function of
(seed, round, client id) in its own random stream. With `capacity_from=device`
(an option of every sub-model method and Fjord) nothing is drawn: each client
gets the largest level whose predicted round time on its device fits the round's
deadline (`core.federation.capacity`: the clock's formula over the sub-model's own messages
and FLOPs, priced below by the functions the round itself uses).

Sub-model. beta keeps ceil(beta x N) units of every hidden layer (N its units;
HeteroFL's count: only hidden widths scale) and every unit of the output
layer; layers of one residual unit_group keep the same units
(`core.structure.unit_selection.keep_top_units`, ranked by the rule's scores):
  heterofl     units [0, ceil(beta N)) of each layer (score = -index);
  fedrolex     units {(j - r) mod N : j < ceil(beta N)}, r the round index;
  feddropout   a uniformly random ceil(beta N) units per layer, per client, per round;
  fedgse       the units of largest |dL/dh| on similar data (algorithms/fedgse.py).
The client runs the full-shape model with these unit masks on its unit
outputs (`core.structure.unit_masks`), so clients of every capacity vmap together. Its
update is masked to the sub-model's entries (`variable_masks`: kernel entries
whose output and input units are kept, and the kept units' biases, norm
parameters and statistics): every other entry, momentum and weight decay
included, is exactly unchanged by local training and is never sent.

Messages. The server chose the sub-model, so both sides know its layout: a
message costs the sub-model's values only, both ways (`KnownMaskArray`,
nnz x itemsize); the unit masks and capacity ride along as `Known` (free: a
real client receives a smaller dense model and needs no index).

HeteroFL's two model devices, each an option:
  scaler     HeteroFL's and FedRolex's Scaler: during local training a tensor
             is divided by beta (evaluation runs the full model unscaled).
             Their code puts it right before every normalization slot (conv ->
             Scaler -> norm -> ReLU; in a pre-activation block on the input of
             bn1, bn2 and the final norm) and nowhere else: never on a shortcut
             (a projection reads the already normalized input and adds its
             output to the stream unscaled) nor on the residual stream itself.
             What that means here, where a unit mask acts after the norm
             (`models.layers.unit_output`), not before it:
             * a layer with a BatchNorm: the Scaler would divide the norm's
               input, and a BatchNorm on batch statistics (how every client
               trains, as in their code, whose client norms track no running
               statistics) cancels it, BN(x / beta) = (x - mu) / sqrt(var +
               eps beta^2): only its epsilon changes, a relative output change
               below eps / (2 var). We leave these layers unscaled, so their
               forward pass is exactly the unscaled one (the official one up to
               that epsilon), and running statistics (`static_bn` off) stay
               those of the unscaled model that evaluation runs. That epsilon is
               not negligible where a norm's input variance is small: in the
               parity run against their code (benchmarks/results/parity.md,
               their gradient clip on both sides) it moved the trained
               weights by up to 3.3 % (cnn4) and 46.5 % (PreResNet-18) of a
               tensor's largest entry after three steps, so in BatchNorm
               models this is their computation without its Scaler, not with
               it;
             * a layer whose output reaches a norm only through a residual sum
               (PreResNet-18's projection shortcuts): not scaled, as in theirs;
             * a norm-free layer of a norm-free model (the MLP, LeNet, VGG-11,
               cnn2; their code's `norm='none'`, where the Scaler still sits in
               the empty slot before the activation): its unit output is
               divided by beta, which equals the official placement because
               ReLU and max pooling are positively homogeneous.
             So in BatchNorm models (cnn4, the ResNets) the Scaler changes
             nothing; in norm-free ones it multiplies the gradients of a
             beta = 1/16 sub-model by up to 1/beta per layer, which makes the
             digits MLP diverge at lr 0.05. Off by default.
  static_bn  ("sBN") clients train with batch statistics and send no running
             statistics; before each evaluation the server recomputes the global
             model's BatchNorm statistics over all training data
             (`core.evaluation.evaluators.population_batch_stats`). Without it, running
             statistics travel and are aggregated like the weights.
Label split (`label_mask`, HeteroFL's and FedRolex's masked cross-entropy): the
logits of classes the client holds no example of are replaced before the
softmax, by 0 (`label_mask_fill=zero`, their `masked_fill(mask == 0, 0)`: those
classes stay in the softmax at logit 0) or by -inf (`exclude`: the softmax
ranges over the client's own labels only); an option for every rule.

Aggregation. `masked_mean` (default, as FedGSE's Algorithm 1 line 11): per
entry, the data-size-weighted mean over the clients that hold it; entries no
client holds keep their value. `heterofl`: HeteroFL's code, and FedRolex's
paper: a plain mean over holders, and each output row (class) only over the
clients holding that label. FedRolex's code (`combine` in resnet_server.py,
its default `--weighting avg`) departs from that plain mean: it multiplies each
upload of a bias, a normalization parameter or an output row by the entry's
count of past updates (`tmp_counts`, starting at 1) and divides by the sum of
those weights. Were the counts read as they stood before the round, they would
cancel; but `self.tmp_counts = tmp_counts_cpy` sits inside its loop over the
state's keys, so from the second key on the counts it reads are the copy its
loop is raising: the k-th client of the round holding an entry weighs
count + (k - 1). Three holders of an entry counted 1 weigh 1, 2 and 3, not
equally. `fedrolex_counts` reproduces that weighting (the counts kept in the
server state, raised by every holder after the round; tests/test_submodels.py
checks it against a replica of their loop); `heterofl` is the paper's mean.
The server steps toward that mean with its optimizer (`building_blocks.server_optimizer`;
sgd at lr 1 by default: the mean replaces the held entries), per entry over the
clients holding it: an entry no client held this round keeps its value and its
optimizer state (no momentum step, no decay of its moments), as with sgd.

The server keeps only the global model, plus whatever a rule needs to remember
(`memory`, FedGSE-SPL's per-client class accuracies).

Why one module past 400 lines: it is the one round the four sub-model rules share (capacities, masks, pricing,
aggregation), each rule a short function beside it; the rules' own files (FedGSE, Fjord) build on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.core.messages.aggregation import masked_mean, present_only
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm, RoundInfo
from fedjax_sparse.core.federation.capacity import Price, device_capacity
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.evaluation.evaluators import population_batch_stats
from fedjax_sparse.core.structure.flops import forward_flops
from fedjax_sparse.core.round.local_training import LocalObjective
from fedjax_sparse.core.messages.pricing import Known, KnownMaskArray, message_bytes
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import ServerOptimizerOptions, from_options
from fedjax_sparse.core.round.streams import stream_key
from fedjax_sparse.core.structure.unit_masks import variable_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores, random_scores, rolling_scores
from fedjax_sparse.data.federated import ClientData, client_label_counts
from fedjax_sparse.models.structure import ModelStructure, get_path, set_path

tree_map = jax.tree_util.tree_map
FIVE_LEVELS = (1.0, 0.5, 0.25, 0.125, 0.0625)

AGGREGATIONS = ("masked_mean", "heterofl", "fedrolex_counts")

# scores(server_state, client_id, info, capacity) -> {layer: [units]}: the rule of a sub-model method
ScoreRule = Callable[[Any, jax.Array, RoundInfo, jax.Array], dict]


@dataclasses.dataclass(frozen=True)
class SubmodelOptions(ServerOptimizerOptions):
    OPTION_GROUP = "sub-models"  # the command line's help group (`core.contract.options.option_group`)

    capacities: tuple[float, ...] = option(FIVE_LEVELS, "client capacity levels beta (fraction of every hidden "
                                                        "layer's units a sub-model keeps)", low=0.0,
                                           low_open=True, high=1.0)
    capacity_mode: str = option("dynamic", "dynamic: each sampled client draws its level every round; fixed: "
                                           "each client's level is drawn once", choices=("dynamic", "fixed"))
    capacity_proportions: tuple[float, ...] | None = option(None, "weights of the capacity levels (default: "
                                                                  "equal)", low=0.0)
    capacity_from: str = option("method", "method: each client's capacity is the method's own (drawn from "
                                          "--capacities; Fjord: its widths); device: the largest level whose "
                                          "predicted round time on the client's device fits --round-deadline "
                                          "(needs --device-profile and --round-deadline)",
                                choices=("method", "device"))
    scaler: bool = option(False, "HeteroFL's Scaler: divide by beta before each normalization during local "
                                 "training (a batch-statistics BatchNorm cancels it; in norm-free models it "
                                 "scales the hidden units' outputs)")
    static_bn: bool = option(True, "HeteroFL's static BatchNorm: no running statistics travel; they are "
                                   "recomputed over the training data before each evaluation")
    label_mask: bool = option(False, "HeteroFL's label split: logits of classes a client holds no example of "
                                     "are masked in its cross-entropy")
    label_mask_fill: str = option("zero", "with --label-mask, what masked logits become: zero (HeteroFL's and "
                                          "FedRolex's code: kept in the softmax at 0) or exclude (-inf: left out "
                                          "of it)", choices=("zero", "exclude"))
    submodel_aggregation: str = option("masked_mean", "masked_mean: data-weighted mean over the clients holding an "
                                                      "entry; heterofl (HeteroFL's code, FedRolex's paper): plain "
                                                      "mean, class rows over the clients holding that label; "
                                                      "fedrolex_counts: that, with FedRolex's code's update-count "
                                                      "weights on biases, norms and class rows",
                                       choices=AGGREGATIONS)

    def __post_init__(self):
        if self.capacity_proportions is not None:
            if len(self.capacity_proportions) != len(self.capacities):
                raise ValueError(f"--capacity-proportions needs one weight per capacity level "
                                 f"({len(self.capacities)}), got {len(self.capacity_proportions)}")
            if not sum(self.capacity_proportions) > 0:
                raise ValueError(f"--capacity-proportions must not all be zero, got "
                                 f"{','.join(map(str, self.capacity_proportions))}")

    def ignored(self) -> dict[str, str]:
        """Options these values make the round ignore (`core.contract.options.refuse_ignored`)."""
        out = super().ignored()
        if not self.label_mask:
            out["label_mask_fill"] = "is read only with --label-mask"
        if self.capacity_from == "device":
            out.update({name: "is not read with --capacity-from device: each client gets the largest level its "
                              "device fits" for name in ("capacity_mode", "capacity_proportions")})
        return out


LABEL_MASK_FILLS = {"zero": 0.0, "exclude": -jnp.inf}


def scaled_layers(structure: ModelStructure) -> frozenset[str]:
    """The hidden layers whose unit outputs the Scaler divides by beta: those without a normalization
    whose unit group has none either (see the module docstring: where HeteroFL's code puts it)."""
    normed_groups = {l.unit_group for l in structure.layers if l.norm is not None and l.unit_group}
    return frozenset(l.name for l in structure.layers[:-1]
                     if l.norm is None and (l.unit_group is None or l.unit_group not in normed_groups))


def training_unit_masks(structure: ModelStructure, masks: dict, capacity: jax.Array, scaler: bool) -> dict:
    """The unit masks a sub-model trains with: its masks, with the Scaler's 1/beta where it acts."""
    scaled = scaled_layers(structure) if scaler else frozenset()
    return {name: m / capacity if name in scaled else m for name, m in masks.items()}


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
    """What a rule's server remembers per client: init(num_clients) and update(memory, ups, info), which
    leaves the memory of a client absent from the round (`RoundInfo.participating`) as it was."""

    init: Callable[[int], Any]
    update: Callable[[Any, Any, RoundInfo], Any]


# capacity(round_index, client_id) -> beta; step_masks(key, capacity) -> (unit masks, width) of one local step
CapacityRule = Callable[[jax.Array, jax.Array], jax.Array]
StepMasks = Callable[[jax.Array, jax.Array], tuple[dict, jax.Array]]
# held_entries(variables, unit masks, capacity) -> bools like variables; client_objective(objective, unit masks,
# capacity) -> objective
HeldEntries = Callable[[dict, dict, jax.Array], dict]
ClientObjective = Callable[[LocalObjective, dict, jax.Array], LocalObjective]


def submodel_algorithm(name: str, context: BuildContext, options: SubmodelOptions, scores: ScoreRule, *,
                       feedback: Callable[[Any], dict] | None = None,
                       memory: ServerMemory | None = None, capacity: CapacityRule | None = None,
                       levels: tuple[float, ...] | None = None,
                       step_masks: StepMasks | None = None, expected_step_flops: Callable | None = None,
                       held_entries: HeldEntries | None = None, client_objective: ClientObjective | None = None
                       ) -> FederatedAlgorithm:
    """The sub-model round around a rule's unit `scores` (see the module docstring).

    feedback(data) -> dict: extra values a client uploads (FedGSE-CSL's labels), priced.
    memory: per-client server memory updated from the uploads (FedGSE-SPL).
    capacity: a client's capacity in a round (default: `client_capacity` from the options).
    levels: the capacities `capacity_from=device` chooses among (default `options.capacities`;
      `capacity` is then not used): the largest a client's device fits (`core.federation.capacity`), each
      priced as the prefix sub-model of that capacity. A rule's sub-model of one capacity costs
      the same whichever units it keeps, as it keeps the same number of each layer's (residual
      groups tied), which tests/test_capacity_rule.py checks over the model zoo.
    step_masks: each local step trains a smaller sub-model of the client's, drawn from the
      step's key (Fjord's per-batch widths); its width is what the Scaler divides by.
      `expected_step_flops(capacity)`: the forward FLOPs of one example in a step (every forward
      pass of the step), in expectation over those draws (the `train_flops` figure).
    held_entries(variables, unit_masks, capacity): the entries a client holds, trains and sends
      (default `variable_masks`; Fjord's per-width BatchNorm statistics: the sets of the widths
      up to the client's).
    client_objective(objective, unit_masks, capacity) -> objective: the client's local objective
      from the round's (Fjord's distillation and per-width statistics: a `step_loss`).

    Every client reports `train_flops`: 3 x the forward multiply-adds of its sub-model over
    the examples it trained on (`core.structure.flops`, with the inputs its dropped units no longer
    feed: the computation of the physically smaller model).
    """
    local = context.local
    model = local.model
    structure = model.structure
    num_classes = context.num_classes
    output = structure.layers[-1]
    variable_shapes = jax.eval_shape(model.init, jax.random.key(0))
    stats_shapes = variable_shapes["batch_stats"]
    server = from_options(options)

    def sent(variables):
        return {"params": variables["params"]} if options.static_bn else variables

    def init(key, variables, num_clients):
        del key
        state = server.init_state(variables)
        if memory is not None:
            state["memory"] = memory.init(num_clients)
        if options.submodel_aggregation == "fedrolex_counts":
            state["update_counts"] = tree_map(lambda x: jnp.ones(x.shape, jnp.float32), sent(variables))
        return state, {}

    def entries(variables, masks, capacity):
        if held_entries is not None:
            return held_entries(variables, masks, capacity)
        return variable_masks(structure, variables, masks)

    def down_message(variables, entry_masks, masks, capacity):
        return {"variables": tree_map(KnownMaskArray, sent(variables), sent(entry_masks)),
                "unit_masks": Known(masks), "capacity": Known(capacity)}

    def up_message(trained, entry_masks, masks, labels_held, feedback_values):
        up = {"variables": tree_map(KnownMaskArray, sent(trained), sent(entry_masks)),
              "unit_masks": Known(masks), "labels_held": Known(labels_held)}
        if feedback_values is not None:
            up["feedback"] = feedback_values
        return up

    def step_flops(masks, capacity):
        return (forward_flops(structure, masks, count_inputs=True) if expected_step_flops is None
                else expected_step_flops(capacity))

    def train_flops(per_example, count):
        return 3.0 * per_example * (count * local.epochs).astype(jnp.float32)

    def price(capacity):
        # the prefix sub-model of this capacity, with values that are not read: a message costs its held
        # entries (Fjord's per-width statistics: one set per width, as its server holds them), and a
        # feedback costs its shapes
        masks = keep_top_units(structure, prefix_scores(structure), capacity)
        variables = tree_map(lambda s: jnp.zeros(s.shape, s.dtype), variable_shapes)
        entry_masks = entries(variables, masks, capacity)
        held = tree_map(lambda v, m: jnp.zeros(m.shape, v.dtype), variables, entry_masks)
        return Price(step_flops=step_flops(masks, capacity),
                     down_bytes=message_bytes(down_message(held, entry_masks, masks, capacity)),
                     up_bytes=message_bytes(up_message(held, entry_masks, masks, jnp.zeros((num_classes,), bool),
                                                       feedback_shapes)))

    feedback_shapes = None if feedback is None else jax.eval_shape(feedback, one_example(model))
    rule = capacity
    if options.capacity_from == "device":
        rule = device_capacity(context, options.capacities if levels is None else levels, price, train_flops)

    def capacity_of(round_index, client_id):
        if rule is not None:
            return rule(round_index, client_id)
        return client_capacity(options, context.seed, round_index, client_id)

    def broadcast(server_state, client_id, info):
        capacity = capacity_of(info.index, client_id)
        masks = keep_top_units(structure, scores(server_state, client_id, info, capacity), capacity)
        variables = server_state["variables"]
        entry_masks = entries(variables, masks, capacity)
        return down_message(variables, entry_masks, masks, capacity)

    def client_update(down, client_state, data, key, info):
        masks, capacity = down["unit_masks"].value, down["capacity"].value
        variables = tree_map(lambda leaf: leaf.values, down["variables"],
                             is_leaf=lambda x: isinstance(x, KnownMaskArray))
        if options.static_bn:  # trains with batch statistics; its running ones are never used nor sent
            variables = {**variables, "batch_stats": tree_map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shapes)}
        entry_masks = entries(variables, masks, capacity)
        labels_held = client_label_counts(data, num_classes) > 0

        def forward(trainable, key):
            if step_masks is None:
                step, width = masks, capacity
            else:
                step, width = step_masks(key, capacity)
            return {"params": trainable["params"],
                    "unit_masks": training_unit_masks(structure, step, width, options.scaler)}

        objective = LocalObjective(
            forward=forward,
            update_mask=entry_masks,
            label_mask=labels_held if options.label_mask else None,
            label_mask_fill=LABEL_MASK_FILLS[options.label_mask_fill])
        if client_objective is not None:
            objective = client_objective(objective, masks, capacity)
        trained, stats = local.train(variables, data, key, round_index=info.index, objective=objective)
        stats = {**stats, "train_flops": train_flops(step_flops(masks, capacity), data.count)}
        up = up_message(trained, entry_masks, masks, labels_held, None if feedback is None else feedback(data))
        return up, client_state, {**stats, "capacity": capacity}

    def server_update(server_state, ups, weights, info):
        is_known = lambda x: isinstance(x, KnownMaskArray)  # noqa: E731
        values = tree_map(lambda leaf: leaf.values, ups["variables"], is_leaf=is_known)
        # an absent client (`RoundInfo.participating`) holds nothing: not in a mean, an update count or `held`
        masks = present_only(tree_map(lambda leaf: leaf.mask, ups["variables"], is_leaf=is_known),
                             info.participating)
        if options.submodel_aggregation != "masked_mean":
            weights = jnp.ones_like(weights)
            held = ups["labels_held"].value  # [K, classes]
            for path in (output.kernel, output.bias):
                if path is not None:
                    leaf = get_path(masks["params"], path)
                    rows = held.reshape((held.shape[0],) + (1,) * (leaf.ndim - 2) + (-1,))
                    masks = {**masks, "params": set_path(masks["params"], path, leaf & rows)}
        entry_weights = masks
        if options.submodel_aggregation == "fedrolex_counts":
            entry_weights = update_count_weights(masks, server_state["update_counts"], counted_paths)
        mean = masked_mean(values, entry_weights, weights, sent(server_state["variables"]))
        state = server.step_toward(server_state, mean, held=tree_map(lambda m: jnp.any(m, axis=0), masks))
        if options.submodel_aggregation == "fedrolex_counts":
            state["update_counts"] = tree_map(lambda c, m: c + jnp.sum(m, axis=0), server_state["update_counts"],
                                              masks)
        if memory is not None:
            state["memory"] = memory.update(server_state["memory"], ups, info)
        return state

    counted_paths = count_weighted_paths(structure, sent(jax.eval_shape(model.init, jax.random.key(0))))
    static_bn = options.static_bn and bool(jax.tree_util.tree_leaves(stats_shapes))  # a model without BN: nothing to do
    train = context.device_train(name, "recomputes the global model's BatchNorm statistics over every client's "
                                       "training data (static BN)", "--no-static-bn") if static_bn else None

    def evaluation_state(server_state):
        variables = server_state["variables"]
        return {**server_state, "variables": {**variables, "batch_stats": recompute(variables, train)}}

    shuffle_key = stream_key(context.seed, "evaluation")  # one shuffled order of the examples, every evaluation
    recompute = jit(lambda variables, split: population_batch_stats(model, variables, split, shuffle_key))
    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: server_state["variables"],
        global_variables=lambda server_state: server_state["variables"],
        evaluation_state=evaluation_state if static_bn else None,
    )


def one_example(model) -> ClientData:
    """The shapes of a client holding one example of the model's input (what a feedback's price reads:
    its shape, which no example's value sets)."""
    channels = model.input_shape[-1:] if model.input_kind != "tokens" else ()
    spec = jax.ShapeDtypeStruct
    return ClientData(x=spec((1, *model.input_shape), jnp.float32), y=spec((1,), jnp.int32),
                      offset=spec((), jnp.int32), count=spec((), jnp.int32), mean=spec(channels, jnp.float32),
                      std=spec(channels, jnp.float32), max_count=1)


def count_weighted_paths(structure: ModelStructure, variables: dict) -> dict:
    """{path: (counted, reads the round's earlier holders)} of every leaf: FedRolex's code weighs an
    upload by the entry's update count on the leaves torch shapes 1-D (biases, norm parameters,
    statistics) and on the output layer's kernel; the first key of its loop (the first layer's kernel)
    reads the counts before the round, every later key the counts its earlier clients already raised."""
    first, output = ("params", *structure.layers[0].kernel), ("params", *structure.layers[-1].kernel)

    def rule(path, leaf):
        keys = tuple(getattr(e, "key", e) for e in path)
        return (leaf.ndim <= 1 or keys == output, keys != first)

    return jax.tree_util.tree_map_with_path(rule, variables)


def update_count_weights(masks: dict, counts: dict, counted_paths: dict) -> dict:
    """[K, ...] per-entry weights of FedRolex's code (`combine` in resnet_server.py, --weighting avg): on a
    counted leaf, the k-th client holding an entry weighs count + the number of clients before it in the
    round holding it (its `self.tmp_counts = tmp_counts_cpy` sits inside the loop over keys, so from the
    second key on the counts read are the ones being raised); other leaves weigh 1 where held."""
    def weights(mask, count, rule):
        counted, sequential = rule
        held = mask.astype(jnp.float32)
        if not counted:
            return held
        earlier = jnp.cumsum(held, axis=0) - held if sequential else jnp.zeros_like(held)
        return held * (count + earlier)

    return tree_map(weights, masks, counts, counted_paths, is_leaf=lambda x: isinstance(x, tuple))


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
