"""SpaFL (Kim et al., NeurIPS 2024): trainable thresholds, structured sparse personal models,
and only thresholds on the wire.

Thresholds. Every prunable layer of the model's structure gets one threshold
per output unit (filter / neuron), all initialized to 0.

Mask (eq. 1). Unit i of a layer, with incoming weights w_i1..w_in (n = the
layer's `fan_in`; in Flax the unit's kernel slice `kernel[..., i]`), is kept
when the mean magnitude of those weights exceeds its threshold:
    mu_i = (1/n) sum_j |w_ij|,   m_i = S(mu_i - tau_i)   (S(x) = 1 if x > 0 else 0).
The whole unit goes at once (structured sparsity). The mask multiplies the
unit's output after its normalization (`core.structure.unit_masks`, the library's one
masking mechanism), so a pruned unit outputs exactly zero.

Straight-through estimator (eq. 9). S gets the identity gradient
(`straight_through_step`, a `jax.custom_vjp`). With h_i the unit's (normalized)
output and g_i = dL/d(m_i h_i), the chain rule gives
    dL/dm_i     = sum over examples and positions of g_i h_i
    dL/dtau_i   = - dL/dm_i                                                          (eq. 9)
    dL/dw_ij    = (task path through m_i h_i)  +  dL/dm_i * sign(w_ij) / n           (weight path)
For a layer with no bias and no normalization, h_i = sum_j w_ij x_j and
dL/dm_i = sum_j (dL/dw~_ij) w_ij with w~ = w * m: exactly eq. 9 as the paper
writes it for W~ = w * m. Behind a BatchNorm (the paper's CIFAR-10 CNN) we read
eq. 9 the same way, at the unit's output: masking the kernel there would give
the thresholds ~0 task gradient, because BN undoes any scaling of its input,
and a pruned unit (zero kernel) none at all. At the output both kept and
pruned units get the signal eq. 9 intends, so thresholds learn from the loss
and a prematurely pruned unit can come back (section 3.3.2): its output h_i is
computed though multiplied by 0, so dL/dm_i is defined, and the mean-magnitude
path carries it to the unit's weights. Nothing else is hand-written: the
masked forward is differentiated by JAX.

Loss (eq. 5). Task loss + alpha * sum over all thresholds of exp(-tau), so
each step also raises every threshold by lr * alpha * exp(-tau) (eq. 6).
Weights and thresholds are trained jointly by the run's optimizer
(`LocalSGD.optimizer()`: SGD, with momentum 0.9 in the paper), fresh every round.

Bounds. After every step (and after eq. 13) the prunable kernels are clipped
to [-1, 1] and the thresholds to [0, 1] ("we constrain the parameters and
thresholds to be within [-1, 1] and [0, 1]"); `weight_bounds=False` switches
both off. Biases and normalization parameters are not clipped: the bounds are
about the weights the thresholds are compared with.

Reset (appendix A.1). After every step, a layer whose density (kept units /
units, = kept weights / weights) is below 1 % gets all its thresholds reset to
zero; the same check runs on the global thresholds a client starts from.

Weight update from the global thresholds (eq. 13). Before local training, a
sampled client moves its weights by the change of the global thresholds:
    w_ij <- w_ij - (dtau_i / n) * sign(sum_j w_ij),
with dtau = the global thresholds received now minus the global thresholds
this client last received (kept in its state; all start at the server's
initial zeros). This is the paper's "XOR of the sign of dtau and the sign of the
unit's weight sum" written as a product. (The paper's text defines dtau as the
change between two consecutive rounds; a client that was not sampled in the
previous round never received tau(t-1), so the change since its own last
download is the quantity it can compute from what the server sends.)
`threshold_update=False` turns it off (the paper's Table 3 ablation).

Server (eq. 7). tau(t+1) = (1/K) sum_{k in S_t} tau_k(t): the uniform mean of
the sampled clients' thresholds, as eq. 7 writes it (1/K, not data-size
weights).

Messages. Down: the global thresholds, dense float32 {layer: [units]}; up:
the client's trained thresholds, same shape. Weights never leave the client,
so a round moves 2 x K x (number of thresholds) x 4 bytes.

Client state. Personal variables (all clients start from the same initial
weights), the client's own thresholds after its last local training (which
define its personal sparse model), the global thresholds it last received,
and its cumulative training FLOPs.

Evaluation. `client_variables` is the client's weights with the unit masks of
its own thresholds: each client is scored with its personal sparse model.
`global_variables` is None: SpaFL has no global model.

Diagnostics (logged with each evaluation), over all clients' personal models:
  `weight_density`: kept kernel weights / all prunable kernel weights, mean
    over clients; `density_per_layer` {layer: mean over clients};
  `mean_layer_density`: the unweighted mean of the layers' densities, mean over
    clients: the official code's `get_density`, which the paper's Table 2
    densities (0.3057 CIFAR-10, 0.3536 FMNIST) come from;
  `train_flops`: cumulative training FLOPs by appendix A.5 (eq. 50, `core.structure.flops`)
    with the masks of every local step and 1.5 d per eq. 13 update, divided by
    the number of clients: the official code reports this per-client average,
    and it is the figure to set beside the paper's Table 2 (FedAvg's FMNIST
    1.0345e12 = 500 rounds x 6,000 examples x 5 epochs x 3 x LeNet-5-Caffe's
    2,293,000 forward FLOPs / 100 clients, to 0.3 %); `train_flops_total` is the
    sum over clients. The run logs, for every algorithm, `dense_train_flops`:
    the same examples through the dense model (what FedAvg spends), per client;
  `mean_threshold`: mean of the global thresholds.

`spafl_local` is the paper's "Local" row: the same pruning and training, each
client keeping its own thresholds, and no communication at all.

The paper and its code (`spafl_variant`). All of the above is the paper's
reading, the default ("paper"). "code" reproduces the client step of the
official code behind Table 2's CIFAR-10 column (news-vt/SpaFL_NeruIPS_2024 at
d3639ab, `main/cifar10/`; the pieces, with file and line, in `spafl_code`): a
straight-through step whose backward passes g only where |mu_i - tau_i| > 1
(thresholds then move by the regularizer alone), the mask on the kernel before
the normalization, eq. 13 divided by a conv's k^2 instead of its fan-in,
gradients clipped to global norm 3, no bounds (`weight_bounds` is refused),
kernels drawn U(-1/sqrt(n), 1/sqrt(n)), and the reset at "at most 1 %". Not
reproduced: the code applies eq. 13 to every client after each aggregation
(here a client applies the change since its last download when next sampled:
the same total, under one reading of sign(sum w), which the code re-reads at
each application), uploads before the reset its last step triggers, drops each
epoch's last partial batch, and runs its reset check in evaluation passes too:
with two test batches or more, its evaluation already resets a collapsed layer
of the client's own thresholds, so the next round starts from the received ones
unreset (here the round's start resets the received thresholds where the
client's own last mask collapsed a layer). The parity harness (benchmarks/parity)
aligns the timing, the dropped batch and the evaluation's reset with the code
(its causes `eq13_timing`, `drop_last`, `reset_in_evaluation`);
docs/methods/spafl.md tabulates every difference.

Why one module past 400 lines: SpaFL's math is one algorithm (thresholds, the straight-through mask, eq. 13's
update, the regularizer) with its options and the paper's readings written out beside each equation; the official
code's variant is `spafl_code`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sparse.algorithms import spafl_code
from fedjax_sparse.core.messages.aggregation import uniform_mean
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, FederatedAlgorithm, replicate
from fedjax_sparse.core.structure.flops import training_flops
from fedjax_sparse.core.round.local_training import LocalObjective, LocalSGD, clip_grad_norm
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.core.structure.unit_masks import check_params, density, layer_mean_density
from fedjax_sparse.models.structure import Layer, ModelStructure, get_path, set_path

tree_map = jax.tree_util.tree_map
Thresholds = dict  # {layer_name: [num_units] float32}

RESET_DENSITY = 0.01  # appendix A.1: a layer below 1 % density gets its thresholds reset to zero
VARIANTS = ("paper", "code")


@dataclasses.dataclass(frozen=True)
class SpaFLLocalOptions:
    OPTION_GROUP = "spafl"  # the command line's help group (`core.contract.options.option_group`)

    sparsity_coef: float = option(0.002, "SpaFL: alpha, the weight of sum(exp(-threshold)) in the loss", low=0.0)
    weight_bounds: bool = option(True, "SpaFL: clip weights to [-1, 1] and thresholds to [0, 1] after each step")
    spafl_variant: str = option("paper", "SpaFL: the paper's reading (paper) or the official CIFAR-10 code's "
                                         "client step (code: its gated straight-through step, masked kernels, "
                                         "eq. 13 over k^2, gradient clip 3, no bounds, uniform init)",
                                choices=VARIANTS)

    def ignored(self) -> dict[str, str]:
        """Options the chosen variant does not read (`core.contract.options.refuse_ignored`)."""
        if self.spafl_variant == "code":
            return {"weight_bounds": "is not read by --spafl-variant code (the official code clips neither "
                                     "weights nor thresholds)"}
        return {}


@dataclasses.dataclass(frozen=True)
class SpaFLOptions(SpaFLLocalOptions):
    threshold_update: bool = option(True, "SpaFL: move the weights by the change of the global thresholds "
                                          "(eq. 13)")


# ------------------------------------------------------------------ the mask and its gradient

@jax.custom_vjp
def straight_through_step(u: jax.Array) -> jax.Array:
    """S(u) = 1 where u > 0 else 0, with the identity as its gradient (eq. 9)."""
    return (u > 0).astype(u.dtype)


def _step_fwd(u):
    return straight_through_step(u), None


def _step_bwd(_, g):
    return (g,)


straight_through_step.defvjp(_step_fwd, _step_bwd)


def init_thresholds(structure: ModelStructure) -> Thresholds:
    return {l.name: jnp.zeros((l.num_units,), jnp.float32) for l in structure.layers}


def _unit_axes(kernel: jax.Array) -> tuple[int, ...]:
    return tuple(range(kernel.ndim - 1))


def unit_magnitudes(structure: ModelStructure, params) -> dict[str, jax.Array]:
    """mu_i: the mean magnitude of each unit's incoming weights."""
    return {l.name: jnp.mean(jnp.abs(k := get_path(params, l.kernel)), axis=_unit_axes(k))
            for l in structure.layers}


def threshold_masks(structure: ModelStructure, params, thresholds: Thresholds) -> dict[str, jax.Array]:
    """Eq. 1 as booleans: unit i is kept where mu_i - tau_i > 0 (no gradient)."""
    mu = unit_magnitudes(structure, params)
    return {name: mu[name] - thresholds[name] > 0 for name in mu}


def ste_masks(structure: ModelStructure, params, thresholds: Thresholds,
              step=straight_through_step) -> dict[str, jax.Array]:
    """Eq. 1 as float {0, 1} masks whose gradient is the straight-through estimator (eq. 9), or
    `step`'s (the official code's gated one, `spafl_code.code_step`)."""
    mu = unit_magnitudes(structure, params)
    return {name: step(mu[name] - thresholds[name]) for name in mu}


def masked_variables(structure: ModelStructure, variables: dict, thresholds: Thresholds,
                     variant: str = "paper") -> dict:
    """The sparse model a client predicts with: its weights run with its threshold masks (at the
    units' outputs; under the code's variant on the kernels, as the official model does)."""
    masks = {k: v.astype(jnp.float32) for k, v in threshold_masks(structure, variables["params"], thresholds).items()}
    if variant == "code":
        return {"params": spafl_code.mask_kernels(structure, variables["params"], masks),
                "batch_stats": variables["batch_stats"]}
    return {"params": variables["params"], "batch_stats": variables["batch_stats"], "unit_masks": masks}


def sparsity_penalty(thresholds: Thresholds, alpha: float) -> jax.Array:
    """Eq. 5's regularizer: alpha * sum over all thresholds of exp(-tau)."""
    return alpha * sum(jnp.sum(jnp.exp(-t)) for t in jax.tree_util.tree_leaves(thresholds))


# ------------------------------------------------------------------ projections and updates

def clip_kernels(structure: ModelStructure, params):
    for layer in structure.layers:
        params = set_path(params, layer.kernel, jnp.clip(get_path(params, layer.kernel), -1.0, 1.0))
    return params


def clip_thresholds(thresholds: Thresholds) -> Thresholds:
    return tree_map(lambda t: jnp.clip(t, 0.0, 1.0), thresholds)


def reset_collapsed_layers(structure: ModelStructure, params, thresholds: Thresholds,
                           min_density: float = RESET_DENSITY) -> tuple[Thresholds, jax.Array]:
    """Thresholds of every layer whose density is below `min_density` set to zero; and how many layers."""
    masks = threshold_masks(structure, params, thresholds)
    out, resets = {}, jnp.zeros((), jnp.int32)
    for layer in structure.layers:
        collapsed = jnp.mean(masks[layer.name].astype(jnp.float32)) < min_density
        out[layer.name] = jnp.where(collapsed, jnp.zeros_like(thresholds[layer.name]), thresholds[layer.name])
        resets = resets + collapsed.astype(jnp.int32)
    return out, resets


def fan_in(layer: Layer, kernel: jax.Array) -> int:
    """Eq. 13's n_i in the paper's reading: the unit's fan-in."""
    return layer.fan_in


def global_threshold_update(structure: ModelStructure, params, delta: Thresholds, divisor=fan_in):
    """Eq. 13: w_ij <- w_ij - (dtau_i / n_i) sign(sum_j w_ij), n_i = `divisor(layer, kernel)`: the
    unit's fan-in (`fan_in`) or the official code's (`spafl_code.eq13_divisor`)."""
    for layer in structure.layers:
        kernel = get_path(params, layer.kernel)
        direction = jnp.sign(jnp.sum(kernel, axis=_unit_axes(kernel)))
        kernel = kernel - (delta[layer.name] / divisor(layer, kernel)) * direction
        params = set_path(params, layer.kernel, kernel)
    return params


# ------------------------------------------------------------------ local training

def local_objective(structure: ModelStructure, alpha: float, weight_bounds: bool) -> LocalObjective:
    """SpaFL's local step on LocalSGD's: weights and thresholds trained together through the
    straight-through masks, the eq. 5 regularizer, then (after each step) the bounds and the
    1 % reset. Per-step metrics: `train_flops` (eq. 50 with the step's masks) and
    `threshold_resets`."""

    def after_step(before, after, batch):
        used = threshold_masks(structure, before["params"], before["thresholds"])
        flops = training_flops(structure, batch.mask.sum(), used)
        params, thresholds = after["params"], after["thresholds"]
        if weight_bounds:
            params, thresholds = clip_kernels(structure, params), clip_thresholds(thresholds)
        thresholds, resets = reset_collapsed_layers(structure, params, thresholds)
        return ({"params": params, "thresholds": thresholds},
                {"train_flops": jnp.asarray(flops, jnp.float32), "threshold_resets": resets})

    return LocalObjective(
        forward=lambda t, key: {"params": t["params"],
                           "unit_masks": ste_masks(structure, t["params"], t["thresholds"])},
        extra_loss=lambda t: sparsity_penalty(t["thresholds"], alpha),
        after_step=after_step)


def code_local_objective(structure: ModelStructure, alpha: float, optimizer) -> LocalObjective:
    """The official code's local step: kernels masked through its gated step, the eq. 5
    regularizer, the gradients clipped to global norm 3 before `optimizer` (the run's momentum
    SGD), no bounds, and the code's 1 % reset: where this step's mask kept at most 1 % of a layer,
    the code zeroes that layer's thresholds before its next forward pass; here right after the
    step, which is the same point. Per-step metrics as `local_objective`'s."""

    def after_step(before, after, batch):
        used = threshold_masks(structure, before["params"], before["thresholds"])
        flops = training_flops(structure, batch.mask.sum(), used)
        thresholds, resets = spafl_code.reset_after_collapse(used, after["thresholds"])
        return ({"params": after["params"], "thresholds": thresholds},
                {"train_flops": jnp.asarray(flops, jnp.float32), "threshold_resets": resets})

    def forward(t, key):
        masks = ste_masks(structure, t["params"], t["thresholds"], step=spafl_code.code_step)
        return {"params": spafl_code.mask_kernels(structure, t["params"], masks)}

    return LocalObjective(
        forward=forward,
        extra_loss=lambda t: sparsity_penalty(t["thresholds"], alpha),
        after_step=after_step,
        optimizer=lambda lr: optax.chain(clip_grad_norm(spafl_code.CODE_GRAD_CLIP), optimizer(lr)))


def _check_alpha(sparsity_coef: float) -> None:
    if not (np.isfinite(sparsity_coef) and sparsity_coef >= 0):
        raise ValueError(f"--sparsity-coef must be a finite number >= 0, got {sparsity_coef}")


def _diagnostics(structure: ModelStructure):
    @jax.jit
    def client_diagnostics(server_state, client_states):
        def one(state):
            masks = threshold_masks(structure, state["variables"]["params"], state["thresholds"])
            overall, per_layer = density(structure, masks)
            return {"weight_density": overall, "density_per_layer": per_layer,
                    "mean_layer_density": layer_mean_density(structure, masks)}

        return {**jax.vmap(one)(client_states), "train_flops": client_states["train_flops"]}

    def diagnostics(server_state, figures):
        flops = np.asarray(figures["train_flops"], np.float64)  # float64 sums: totals reach ~1e14
        out = {"weight_density": float(np.mean(figures["weight_density"])),
               "mean_layer_density": float(np.mean(figures["mean_layer_density"])),
               "density_per_layer": {k: float(np.mean(v)) for k, v in figures["density_per_layer"].items()},
               "train_flops": float(flops.mean()), "train_flops_total": float(flops.sum())}
        if "thresholds" in server_state:
            leaves = jax.tree_util.tree_leaves(server_state["thresholds"])
            out["mean_threshold"] = float(sum(np.sum(np.asarray(t)) for t in leaves) / sum(t.size for t in leaves))
        return out

    return client_diagnostics, diagnostics


def _builder(local: LocalSGD, sparsity_coef: float, weight_bounds: bool, threshold_update: bool,
             communicate: bool, variant: str) -> FederatedAlgorithm:
    _check_alpha(sparsity_coef)
    if variant not in VARIANTS:
        raise ValueError(f"--spafl-variant must be one of {', '.join(VARIANTS)}, got {variant}")
    code = variant == "code"
    if code and local.grad_clip_norm is not None:
        raise ValueError(f"--grad-clip-norm {local.grad_clip_norm} and --spafl-variant code do not combine: the "
                         f"code variant clips at its code's {spafl_code.CODE_GRAD_CLIP:g} already")
    weight_bounds = weight_bounds and not code
    structure = local.model.structure
    objective = (code_local_objective(structure, sparsity_coef, local.optimizer) if code
                 else local_objective(structure, sparsity_coef, weight_bounds))
    eq13_divisor = spafl_code.eq13_divisor if code else fan_in
    client_diagnostics, diagnostics = _diagnostics(structure)

    def init_clients(key, variables, ids):
        check_params(structure, variables["params"])
        if code:  # every client starts from the same draw of the code's initial kernels
            variables = {**variables, "params": spafl_code.uniform_kernels(structure, variables["params"], key)}
        zeros = init_thresholds(structure)
        state = {"variables": variables, "thresholds": zeros, "train_flops": jnp.zeros((), jnp.float32)}
        if communicate:
            state["global_thresholds"] = zeros
        return replicate(state, len(ids))

    def init(key, variables, num_clients):
        server_state = {"thresholds": init_thresholds(structure)} if communicate else {}
        return server_state, init_clients(key, variables, jnp.arange(num_clients))

    def client_update(down, state, data, key, info):
        variables = state["variables"]
        extra_flops = 0.0
        if communicate:
            thresholds = down
            if threshold_update:
                delta = tree_map(jnp.subtract, down, state["global_thresholds"])
                params = global_threshold_update(structure, variables["params"], delta, eq13_divisor)
                if weight_bounds:
                    params = clip_kernels(structure, params)
                variables = {**variables, "params": params}
                num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
                extra_flops = training_flops(structure, 0, update_params=num_params)
        else:
            thresholds = state["thresholds"]
        if code:  # a round's first forward pass checks the mask of the client's last one: its own thresholds
            last = threshold_masks(structure, variables["params"], state["thresholds"])
            thresholds, start_resets = spafl_code.reset_after_collapse(last, thresholds)
        else:
            thresholds, start_resets = reset_collapsed_layers(structure, variables["params"], thresholds)
        trained, stats = local.train(variables, data, key, round_index=info.index,
                                     extra={"thresholds": thresholds}, objective=objective)
        thresholds = trained.pop("thresholds")
        variables = trained
        flops = stats["train_flops"] + extra_flops
        new_state = {"variables": variables, "thresholds": thresholds, "train_flops": state["train_flops"] + flops}
        if communicate:
            new_state["global_thresholds"] = down
        masks = threshold_masks(structure, variables["params"], thresholds)
        metrics = {"loss": stats["loss"], "num_steps": stats["num_steps"], "train_flops": flops,
                   "threshold_resets": stats["threshold_resets"] + start_resets,
                   "weight_density": density(structure, masks)[0]}
        return (thresholds if communicate else {}), new_state, metrics

    def server_update(server_state, ups, weights, info):
        if not communicate:
            return server_state
        del weights  # eq. 7: uniform mean over the K sampled clients (those taking part)
        return {"thresholds": uniform_mean(ups, info.participating)}

    return FederatedAlgorithm(
        name="spafl" if communicate else "spafl_local",
        init=init,
        init_clients=init_clients,
        broadcast=(lambda server_state, client_id, info: server_state["thresholds"]) if communicate
        else (lambda server_state, client_id, info: {}),
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, state: masked_variables(structure, state["variables"],
                                                                      state["thresholds"], variant),
        global_variables=None,
        client_diagnostics=client_diagnostics,
        diagnostics=diagnostics,
        aggregates_mean=communicate,  # eq. 7: the thresholds' mean
    )


def spafl(local: LocalSGD, sparsity_coef: float, *, weight_bounds: bool = True,
          threshold_update: bool = True, variant: str = "paper") -> FederatedAlgorithm:
    """SpaFL: `sparsity_coef` is alpha of eq. 5; `variant` 'paper' or 'code'; see the module docstring."""
    return _builder(local, sparsity_coef, weight_bounds, threshold_update, communicate=True, variant=variant)


def spafl_local(local: LocalSGD, sparsity_coef: float, *, weight_bounds: bool = True,
                variant: str = "paper") -> FederatedAlgorithm:
    """The paper's "Local" row: SpaFL's pruning and training with no communication."""
    return _builder(local, sparsity_coef, weight_bounds, threshold_update=False, communicate=False,
                    variant=variant)


SPECS = (
    AlgorithmSpec("spafl", SpaFLOptions,
                  lambda ctx, o: spafl(ctx.local, o.sparsity_coef, weight_bounds=o.weight_bounds,
                                       threshold_update=o.threshold_update, variant=o.spafl_variant),
                  "SpaFL: trainable unit thresholds, only thresholds travel"),
    AlgorithmSpec("spafl_local", SpaFLLocalOptions,
                  lambda ctx, o: spafl_local(ctx.local, o.sparsity_coef, weight_bounds=o.weight_bounds,
                                             variant=o.spafl_variant),
                  "SpaFL's pruning and training with no communication"),
)
