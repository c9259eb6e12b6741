"""SpaFL (Kim et al., NeurIPS 2024): trainable thresholds, structured sparse personal models,
and only thresholds on the wire.

Thresholds. Every prunable layer of the model's structure gets one threshold
per output unit (filter / neuron), all initialized to 0.

Mask (eq. 1). Unit i of a layer, with incoming weights w_i1..w_in (n = the
layer's `fan_in`; in Flax the unit's kernel slice `kernel[..., i]`), is kept
when the mean magnitude of those weights exceeds its threshold:
    mu_i = (1/n) sum_j |w_ij|,   m_i = S(mu_i - tau_i)   (S(x) = 1 if x > 0 else 0),
and the forward pass uses W~ = w * m: the whole unit goes at once (structured
sparsity). `core.unit_masks.apply_unit_masks` applies it, which also zeroes
the unit's bias and normalization scale/bias, so a pruned unit outputs exactly
zero, as if removed (the SpaFL models have no biases; for models with biases
or BatchNorm this is what makes "pruned" mean absent from the network; those
entries take the mask under a stop_gradient, so the mask's gradient is the
kernel's alone, as eq. 9 states).

Straight-through estimator (eq. 9). S gets the identity gradient
(`straight_through_step`, a `jax.custom_vjp`). With g_ij = dL/dW~_ij and
W~_ij = w_ij m_i the chain rule then gives
    dL/dm_i     = sum_j g_ij w_ij
    dL/dtau_i   = dL/dm_i * S'(.) * d(mu_i - tau_i)/dtau_i = - sum_j g_ij w_ij          (eq. 9)
    dL/dw_ij    = g_ij m_i  +  dL/dm_i * S'(.) * dmu_i/dw_ij
                = g_ij m_i  +  (sum_k g_ik w_ik) sign(w_ij) / n                        (weight path)
so the loss reaches the threshold, and through the mean magnitude the weights
(including those of a pruned unit: g_ij is still defined there, which is how a
prematurely pruned unit can come back). Nothing else is hand-written: the
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
and its cumulative training FLOPs (masked and dense-equivalent).

Evaluation. `client_variables` is the client's weights masked by its own
thresholds: each client is scored with its personal sparse model.
`global_variables` is None: SpaFL has no global model.

Diagnostics (logged with each evaluation): `density` (overall kept kernel
weights / all prunable kernel weights, mean over all clients' personal
models), `density_per_layer` {layer: mean over clients}, `train_flops`
(cumulative training FLOPs of all clients so far, by `core.flops` eq. 50,
with the masks of every local step and including 1.5 d per eq. 13 update;
the last evaluation's value is the paper's Table 2 figure) and
`train_flops_dense` (the same examples through the dense model with no eq. 13,
i.e. what FedAvg spends on the same clients), and `mean_threshold` (mean of the
global thresholds).

`spafl_local` is the paper's "Local" row: the same pruning and training, each
client keeping its own thresholds, and no communication at all.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sparse.core.aggregation import uniform_mean
from fedjax_sparse.core.algorithm import FederatedAlgorithm, replicate
from fedjax_sparse.core.flops import training_flops, forward_flops
from fedjax_sparse.core.local_training import LocalSGD, masked_cross_entropy, run_local_steps
from fedjax_sparse.core.unit_masks import apply_unit_masks, check_params, density
from fedjax_sparse.models.structure import ModelStructure, get_path, set_path

tree_map = jax.tree_util.tree_map
Thresholds = dict  # {layer_name: [num_units] float32}

RESET_DENSITY = 0.01  # appendix A.1: a layer below 1 % density gets its thresholds reset to zero


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


def ste_masks(structure: ModelStructure, params, thresholds: Thresholds) -> dict[str, jax.Array]:
    """Eq. 1 as float {0, 1} masks whose gradient is the straight-through estimator (eq. 9)."""
    mu = unit_magnitudes(structure, params)
    return {name: straight_through_step(mu[name] - thresholds[name]) for name in mu}


def masked_variables(structure: ModelStructure, variables: dict, thresholds: Thresholds) -> dict:
    """The sparse model a client predicts with: its weights times its threshold masks."""
    masks = threshold_masks(structure, variables["params"], thresholds)
    return {"params": apply_unit_masks(structure, variables["params"],
                                       {k: v.astype(jnp.float32) for k, v in masks.items()}),
            "batch_stats": variables["batch_stats"]}


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


def global_threshold_update(structure: ModelStructure, params, delta: Thresholds):
    """Eq. 13: w_ij <- w_ij - (dtau_i / n_i) sign(sum_j w_ij), n_i = the unit's fan-in."""
    for layer in structure.layers:
        kernel = get_path(params, layer.kernel)
        direction = jnp.sign(jnp.sum(kernel, axis=_unit_axes(kernel)))
        kernel = kernel - (delta[layer.name] / layer.fan_in) * direction
        params = set_path(params, layer.kernel, kernel)
    return params


# ------------------------------------------------------------------ local training

def local_trainer(local: LocalSGD, alpha: float, weight_bounds: bool):
    """`train(variables, thresholds, data, key) -> (variables, thresholds, stats)`.

    One `run_local_steps` scan; each step differentiates the masked forward
    pass with respect to the weights and the thresholds together, takes one
    optimizer step, clips (when bounded) and applies the 1 % reset. Its stats
    add `train_flops` (eq. 50 with each step's masks) and `threshold_resets`.
    """
    model = local.model
    structure = model.structure
    tx = local.optimizer()

    def project(params, thresholds):
        if weight_bounds:
            params, thresholds = clip_kernels(structure, params), clip_thresholds(thresholds)
        thresholds, resets = reset_collapsed_layers(structure, params, thresholds)
        return params, thresholds, resets

    def step(carry, batch, key):
        del key
        trainable, batch_stats, opt_state, flops, resets = carry

        def loss_fn(trainable):
            masks = ste_masks(structure, trainable["params"], trainable["thresholds"])
            params = apply_unit_masks(structure, trainable["params"], masks)
            logits, new_stats = model.apply({"params": params, "batch_stats": batch_stats}, batch.x,
                                            train=True, mask=batch.mask)
            task = masked_cross_entropy(logits, batch.y, batch.mask)
            return task + sparsity_penalty(trainable["thresholds"], alpha), (task, new_stats)

        grads, (task, new_stats) = jax.grad(loss_fn, has_aux=True)(trainable)
        used = threshold_masks(structure, trainable["params"], trainable["thresholds"])
        flops = flops + training_flops(structure, batch.mask.sum(), used)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        params, thresholds, reset = project(trainable["params"], trainable["thresholds"])
        carry = ({"params": params, "thresholds": thresholds}, new_stats, opt_state, flops, resets + reset)
        return carry, task

    def train(variables, thresholds, data, key):
        trainable = {"params": variables["params"], "thresholds": thresholds}
        carry = (trainable, variables["batch_stats"], tx.init(trainable), jnp.zeros((), jnp.float32),
                 jnp.zeros((), jnp.int32))
        (trainable, batch_stats, _, flops, resets), stats = run_local_steps(
            step, carry, data, key, epochs=local.epochs, batch_size=local.batch_size)
        variables = {"params": trainable["params"], "batch_stats": batch_stats}
        return variables, trainable["thresholds"], {**stats, "train_flops": flops, "threshold_resets": resets}

    return train


def _check_alpha(sparsity_coef: float) -> None:
    if not (math.isfinite(sparsity_coef) and sparsity_coef >= 0):
        raise ValueError(f"SpaFL --sparsity-coef must be a finite number >= 0, got {sparsity_coef}")


def _diagnostics(structure: ModelStructure):
    @jax.jit
    def densities(client_states):
        def one(state):
            masks = threshold_masks(structure, state["variables"]["params"], state["thresholds"])
            return density(structure, masks)

        return jax.vmap(one)(client_states)

    def diagnostics(server_state, client_states):
        overall, per_layer = densities(client_states)
        out = {"density": jnp.mean(overall),
               "density_per_layer": {k: jnp.mean(v) for k, v in per_layer.items()},
               # float64 sums on the host: totals reach ~1e14
               "train_flops": float(np.asarray(client_states["train_flops"], np.float64).sum()),
               "train_flops_dense": float(np.asarray(client_states["train_flops_dense"], np.float64).sum())}
        if "thresholds" in server_state:
            leaves = jax.tree_util.tree_leaves(server_state["thresholds"])
            out["mean_threshold"] = sum(jnp.sum(t) for t in leaves) / sum(t.size for t in leaves)
        return out

    return diagnostics


def _builder(local: LocalSGD, sparsity_coef: float, weight_bounds: bool, threshold_update: bool,
             communicate: bool) -> FederatedAlgorithm:
    _check_alpha(sparsity_coef)
    structure = local.model.structure
    train = local_trainer(local, sparsity_coef, weight_bounds)
    dense_forward = forward_flops(structure)

    def init(key, variables, num_clients):
        del key
        check_params(structure, variables["params"])
        zeros = init_thresholds(structure)
        state = {"variables": variables, "thresholds": zeros,
                 "train_flops": jnp.zeros((), jnp.float32), "train_flops_dense": jnp.zeros((), jnp.float32)}
        if communicate:
            state["global_thresholds"] = zeros
        return ({"thresholds": zeros} if communicate else {}), replicate(state, num_clients)

    def client_update(down, state, data, key):
        variables = state["variables"]
        extra_flops = 0.0
        if communicate:
            thresholds = down
            if threshold_update:
                delta = tree_map(jnp.subtract, down, state["global_thresholds"])
                params = global_threshold_update(structure, variables["params"], delta)
                if weight_bounds:
                    params = clip_kernels(structure, params)
                variables = {**variables, "params": params}
                num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
                extra_flops = training_flops(structure, 0, update_params=num_params)
        else:
            thresholds = state["thresholds"]
        thresholds, start_resets = reset_collapsed_layers(structure, variables["params"], thresholds)
        variables, thresholds, stats = train(variables, thresholds, data, key)
        flops = stats["train_flops"] + extra_flops
        dense = 3.0 * (local.epochs * data.count).astype(jnp.float32) * dense_forward
        new_state = {"variables": variables, "thresholds": thresholds,
                     "train_flops": state["train_flops"] + flops,
                     "train_flops_dense": state["train_flops_dense"] + dense}
        if communicate:
            new_state["global_thresholds"] = down
        masks = threshold_masks(structure, variables["params"], thresholds)
        metrics = {"loss": stats["loss"], "num_steps": stats["num_steps"], "train_flops": flops,
                   "threshold_resets": stats["threshold_resets"] + start_resets,
                   "density": density(structure, masks)[0]}
        return (thresholds if communicate else {}), new_state, metrics

    def server_update(server_state, ups, weights):
        if not communicate:
            return server_state
        del weights  # eq. 7: uniform mean over the K sampled clients
        return {"thresholds": uniform_mean(ups)}

    return FederatedAlgorithm(
        name="spafl" if communicate else "spafl_local",
        init=init,
        broadcast=(lambda server_state, client_id: server_state["thresholds"]) if communicate
        else (lambda server_state, client_id: {}),
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, state: masked_variables(structure, state["variables"],
                                                                      state["thresholds"]),
        global_variables=None,
        diagnostics=_diagnostics(structure),
    )


def spafl(local: LocalSGD, sparsity_coef: float, *, weight_bounds: bool = True,
          threshold_update: bool = True) -> FederatedAlgorithm:
    """SpaFL: `sparsity_coef` is alpha of eq. 5; see the module docstring."""
    return _builder(local, sparsity_coef, weight_bounds, threshold_update, communicate=True)


def spafl_local(local: LocalSGD, sparsity_coef: float, *, weight_bounds: bool = True) -> FederatedAlgorithm:
    """The paper's "Local" row: SpaFL's pruning and training with no communication."""
    return _builder(local, sparsity_coef, weight_bounds, threshold_update=False, communicate=False)
