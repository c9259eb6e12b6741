"""Fjord (Horvath et al., NeurIPS 2021): ordered dropout, each client training the first units of
every hidden layer, on the sub-model round of `algorithms.submodels`.

Ordered dropout. A width p keeps units [0, ceil(p N)) of every hidden layer (HeteroFL's prefix,
`core.structure.unit_selection.prefix_scores`; residual groups tied) and every unit of the output layer (the
classifier is not ordered-dropped in FjORD's code: it takes the sliced input and keeps its
outputs). Inputs follow the previous layer's kept units, never the image's channels.

Widths, two ways (`fjord_sampling`):
  client (default)  SpaFL's variant (section 5.2, appendix A.1.1), the setting of SpaFL's Table 2:
                    each sampled client draws p ~ U(width_low, width_high) (0.4, 0.6) for the
                    round, a pure function of (seed, round, client id), and all its local steps
                    train that sub-model. SpaFL does not say whether p is drawn per round or per
                    batch; per round is the reading that makes its Comm column (~E[p] of FedAvg's
                    each way) what a client sends, since the sub-model a client holds is what
                    travels. Neither distillation nor per-width statistics apply (a continuous p
                    has no set of widths, and the client trains one width).
  batch             FjORD's own (the Flower baseline by FjORD's authors, adap/flower
                    baselines/fjord): the discrete widths `fjord_widths` (0.2, ..., 1.0); client
                    i's tier, its largest width p_max, is the floor(i S / N)-th of the S widths (the
                    code's floor(cid / 20) for 100 clients and five widths); every local step
                    (batch) draws p uniformly from the widths <= p_max and trains that prefix, so
                    the client holds, sends and receives its p_max sub-model.
FjORD's own setting is `--fjord-sampling batch --fjord-bn per_width --no-static-bn`, with
`--fjord-distillation` for the paper's self-distillation (the baseline's code runs both variants:
without it by default, `train_mode=fjord`, and with it, `train_mode=fjord_kd`). Our defaults stay
SpaFL's variant, shared statistics and no distillation, what SpaFL's Table 2 compares against.

Self-distillation (`fjord_distillation`, batch sampling only), as the baseline's `models.train`
does it: each step runs the teacher, the client's p_max sub-model, with the cross-entropy on the
labels, and the student, the step's width p, with the cross-entropy against the teacher's
softmax, detached; one SGD step on the sum (`distillation_loss`: no temperature, both weights 1).
The student pass runs even when p = p_max, as in the code; its term's gradient is then
softmax(z) - softmax(z) = 0, so such a step is the teacher's plain step. The reported loss is the
sum of both terms (the code logs the student's alone). With `--label-mask`, both passes' logits are
masked before their softmax. `train_flops` counts both passes, each forward and backward:
3 x (F(p_max) + E[F(p)]) per example.

BatchNorm (`fjord_bn`). `shared`: one set of statistics; clients train with batch statistics and,
with `static_bn` (on by default), the server recomputes the global model's before each
evaluation and none travel (with `--no-static-bn` they travel, and a pass at a width p below the
tier also moves the statistics of the channels between p and p_max: units it drops, normalized
before their mask zeroes them). `per_width` (batch sampling only, FjORD's `ODBatchNorm2d`): one set
of running statistics per width of `fjord_widths`, all sharing the one sliced affine scale and
bias (the model's); a pass at width p updates the first ceil(p N) channels of p's set only (the
distillation's teacher pass updates p_max's). The server holds every set and sends a client the
sets of the widths up to its tier (each priced as its known positions, like every sub-model
entry); each set is averaged over the round's clients whose tier reaches its width, as the
code's `fjord_average` does (a client that drew no batch at that width this round still counts,
with the set it received). The global model is evaluated at full width with the largest width's
set (channels beyond the largest width keep their initial statistics, as their weights keep theirs;
FjORD's server also scores every width with its own set; we score the full model only).
Static BN keeps no running statistics, so `per_width` needs `--no-static-bn` (refused otherwise,
in one line). A model without BatchNorm has no statistics: `per_width` is then a no-op.

Aggregation: per entry, over the clients that held it (the round's `masked_mean`, data-size
weighted; FjORD's `fjord_average` is the same per-entry mean over holders, sample-weighted).
Messages: the sub-model's values both ways (the server and the client both know the width), as
every sub-model method.

Widths from the device (`--capacity-from device`, `algorithms.submodels`): each client's width is
the largest its device fits in the round's deadline (`core.federation.capacity`), and nothing is drawn.
  client  the largest width in [width_low, width_high]: in a continuous range, the largest
          sub-model (a width p keeps ceil(p N) units of a layer of N, so the sub-model changes
          only where p crosses some j / N); the candidates are those widths j / N of every
          hidden layer's (group's) N inside the range, width_low and width_high (`range_widths`),
          and a client gets the largest that fits, width_low where none does.
  batch   the client's tier: the largest of `fjord_widths` that fits (the smallest where none
          does), in place of FjORD's tiers by client id; each batch still draws a width up to
          it, and its time is priced at its expected FLOPs over those draws (`train_flops`).

At width_low = width_high = p, Fjord is HeteroFL with the single capacity p (tests/test_fjord.py).
`train_flops`: the sub-model's count; in `batch` sampling its expectation over the widths a
client may draw (plus the teacher's pass with distillation).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.algorithms.submodels import StepMasks, SubmodelOptions, submodel_algorithm, training_unit_masks
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm
from fedjax_sparse.core.structure.flops import forward_flops
from fedjax_sparse.core.round.local_training import LocalObjective, label_masked_cross_entropy
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.core.round.streams import stream_key
from fedjax_sparse.core.structure.unit_masks import variable_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores, selectable_groups
from fedjax_sparse.data.federated import Batch
from fedjax_sparse.models.structure import Model, ModelStructure

tree_map = jax.tree_util.tree_map
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
    fjord_distillation: bool = option(False, "Fjord batch sampling: FjORD's self-distillation, every step a "
                                             "teacher pass at the client's tier (cross-entropy on the labels) "
                                             "and the student at the batch's width (cross-entropy against the "
                                             "teacher's detached softmax), one step on the sum")
    fjord_bn: str = option("shared", "Fjord batch sampling: shared (one set of BatchNorm statistics) or "
                                     "per_width (FjORD's: one set of running statistics per width of "
                                     "--fjord-widths; needs --no-static-bn)", choices=("shared", "per_width"))

    def __post_init__(self):
        super().__post_init__()
        if self.width_low > self.width_high:
            raise ValueError(f"--width-low {self.width_low} exceeds --width-high {self.width_high}")
        if self.fjord_sampling == "batch" and self.fjord_bn == "per_width" and self.static_bn:
            raise ValueError("--fjord-bn per_width keeps running BatchNorm statistics per width, which static BN "
                             "(on by default) never keeps: add --no-static-bn")

    def ignored(self) -> dict[str, str]:
        out = super().ignored()
        out.update({name: "is not read by fjord: its widths come from --fjord-sampling"
                    for name in ("capacities", "capacity_mode", "capacity_proportions")})
        if self.fjord_sampling == "client":
            out.update({name: "is read only with --fjord-sampling batch"
                        for name in ("fjord_widths", "fjord_distillation", "fjord_bn")})
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


def range_widths(structure: ModelStructure, low: float, high: float) -> tuple[float, ...]:
    """The widths of [low, high] at which the sub-model changes, ascending: low, every j / N inside
    (low, high) for each selectable group of N units (a width p keeps ceil(p N) of them, so the
    sub-model of any p in (j / N, next] is that of the next one), and high."""
    steps = {j / members[0].num_units for members in selectable_groups(structure)
             for j in range(1, members[0].num_units) if low < j / members[0].num_units < high}
    return tuple(sorted(steps | {low, high}))


def batch_width(key: jax.Array, widths: jax.Array, p_max: jax.Array) -> jax.Array:
    """A width drawn uniformly from `widths` <= p_max (FjORD's per-batch sampling)."""
    allowed = widths <= p_max + 1e-6
    return jax.random.choice(key, widths, p=allowed / jnp.sum(allowed))


def width_index(widths: jax.Array, width: jax.Array) -> jax.Array:
    """The position of `width` (one of them) in `widths`."""
    return jnp.argmin(jnp.abs(widths - width))


def distillation_loss(teacher_logits: jax.Array, student_logits: jax.Array, labels: jax.Array, mask: jax.Array,
                      label_mask: jax.Array | None = None, fill: float = -math.inf) -> jax.Array:
    """FjORD's self-distillation objective of one batch: CE(teacher, labels) + CE(student,
    stop_gradient(softmax(teacher))), each a mean over the valid examples (`mask`), no temperature.

    With `label_mask`, both logits take `fill` outside it before their softmax; a class the teacher
    gives probability 0 (a -inf logit) adds nothing to the student's term (rather than 0 x -inf).
    """
    teacher = label_masked_cross_entropy(teacher_logits, labels, mask, label_mask, fill)
    if label_mask is not None:
        teacher_logits = jnp.where(label_mask, teacher_logits, fill)
        student_logits = jnp.where(label_mask, student_logits, fill)
    target = jax.lax.stop_gradient(jax.nn.softmax(teacher_logits))
    log_student = jax.nn.log_softmax(student_logits)
    per_example = -jnp.sum(jnp.where(target > 0, target * log_student, 0.0), axis=-1)
    student = jnp.sum(jnp.where(mask, per_example, 0.0)) / jnp.maximum(mask.sum(), 1)
    return teacher + student


def width_step_loss(model: Model, step_masks: StepMasks, tier_masks: dict, p_max: jax.Array, *, scaler: bool,
                    distillation: bool, widths: jax.Array | None, label_mask: jax.Array | None,
                    label_mask_fill: float) -> Callable[[dict, Any, Batch, jax.Array], tuple[jax.Array, Any]]:
    """`LocalObjective.step_loss` of a client of tier p_max under batch sampling.

    Each step trains the width `step_masks` draws from the step's key, as the plain step does;
    `distillation`: with the teacher pass at (`tier_masks`, p_max) before it and
    `distillation_loss` as the loss. `widths`: the statistics are per width (`batch_stats` holds
    one set per sorted width on a leading axis, and a pass at width p reads and writes p's set);
    None: one shared set.
    """
    structure = model.structure

    def apply(trainable, masks, width, stats, batch):
        held = stats
        if widths is not None:
            index = width_index(widths, width)
            stats = tree_map(lambda s: s[index], held)
        logits, new = model.apply({"params": trainable["params"], "batch_stats": stats,
                                   "unit_masks": training_unit_masks(structure, masks, width, scaler)},
                                  batch.x, train=True, mask=batch.mask)
        if widths is not None:
            new = tree_map(lambda h, s: h.at[index].set(s), held, new)
        return logits, new

    def step_loss(trainable, stats, batch, key):
        masks, width = step_masks(key, p_max)
        if not distillation:
            logits, stats = apply(trainable, masks, width, stats, batch)
            return label_masked_cross_entropy(logits, batch.y, batch.mask, label_mask, label_mask_fill), stats
        teacher, stats = apply(trainable, tier_masks, p_max, stats, batch)
        student, stats = apply(trainable, masks, width, stats, batch)
        return distillation_loss(teacher, student, batch.y, batch.mask, label_mask, label_mask_fill), stats

    return step_loss


def per_width_stats(batch_stats: Any, num_widths: int) -> Any:
    """One copy of the model's statistics per width, on a leading axis (every width's set starts alike)."""
    return tree_map(lambda s: jnp.broadcast_to(s, (num_widths, *s.shape)), batch_stats)


def width_stats_masks(structure: ModelStructure, shapes: dict, widths: jax.Array) -> Any:
    """Bools shaped like `per_width_stats` of the model variables' `shapes`: set s's channels are those
    of width s's sub-model."""
    prefix = prefix_scores(structure)
    return tree_map(lambda *sets: jnp.stack(sets), *[
        variable_masks(structure, shapes, keep_top_units(structure, prefix, w))["batch_stats"] for w in widths])


def held_width_stats(masks: Any, widths: jax.Array, p_max: jax.Array) -> Any:
    """The sets (`width_stats_masks`) a client of tier p_max holds: those of the widths up to p_max (the
    others it neither trains nor receives)."""
    reach = widths <= p_max + 1e-6
    return tree_map(lambda m: m & reach.reshape((-1,) + (1,) * (m.ndim - 1)), masks)


def fjord(context: BuildContext, options: FjordOptions) -> FederatedAlgorithm:
    model = context.local.model
    structure = model.structure
    prefix = prefix_scores(structure)

    def rule(state, client_id, info, capacity):
        return prefix

    if options.fjord_sampling == "client":
        return submodel_algorithm("fjord", context, options, rule, capacity=lambda round_index, client_id: client_width(
            context.seed, options.width_low, options.width_high, round_index, client_id),
            levels=range_widths(structure, options.width_low, options.width_high))

    widths = jnp.asarray(sorted(options.fjord_widths), jnp.float32)
    width_flops = jnp.stack([forward_flops(structure, keep_top_units(structure, prefix, w), count_inputs=True)
                             for w in widths])
    distillation = options.fjord_distillation
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    per_width = options.fjord_bn == "per_width" and bool(jax.tree_util.tree_leaves(shapes["batch_stats"]))
    stats_masks = width_stats_masks(structure, shapes, widths) if per_width else None

    def step_masks(step_key, p_max):
        width = batch_width(step_key, widths, p_max)
        return keep_top_units(structure, prefix, width), width

    def expected_step_flops(p_max):
        allowed = widths <= p_max + 1e-6
        student = jnp.sum(jnp.where(allowed, width_flops, 0.0)) / jnp.sum(allowed)
        return width_flops[width_index(widths, p_max)] + student if distillation else student

    def held_entries(variables, masks, p_max):
        entries = variable_masks(structure, variables, masks)
        return {**entries, "batch_stats": held_width_stats(stats_masks, widths, p_max)}

    def client_objective(objective: LocalObjective, masks, p_max):
        return dataclasses.replace(objective, step_loss=width_step_loss(
            model, step_masks, masks, p_max, scaler=options.scaler, distillation=distillation,
            widths=widths if per_width else None, label_mask=objective.label_mask,
            label_mask_fill=objective.label_mask_fill))

    algorithm = submodel_algorithm("fjord", context, options, rule,
                                   capacity=lambda round_index, client_id: tier_width(widths, client_id,
                                                                                      context.num_clients),
                                   levels=options.fjord_widths, step_masks=step_masks,
                                   expected_step_flops=expected_step_flops,
                                   held_entries=held_entries if per_width else None,
                                   client_objective=client_objective if distillation or per_width else None)
    if not per_width:
        return algorithm

    def full_width(variables):  # the model's variables, with the largest width's statistics
        return {**variables, "batch_stats": tree_map(lambda s: s[-1], variables["batch_stats"])}

    def init(key, variables, num_clients):
        held = {**variables, "batch_stats": per_width_stats(variables["batch_stats"], widths.shape[0])}
        return algorithm.init(key, held, num_clients)

    return dataclasses.replace(
        algorithm, init=init,
        client_variables=lambda server_state, client_state: full_width(algorithm.client_variables(server_state,
                                                                                                   client_state)),
        global_variables=lambda server_state: full_width(algorithm.global_variables(server_state)))


SPEC = AlgorithmSpec("fjord", FjordOptions, fjord,
                     "Fjord: ordered dropout, each client trains the first p of every hidden layer")
