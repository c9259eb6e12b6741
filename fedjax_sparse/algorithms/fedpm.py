"""FedPM (Isik et al., ICLR 2023): frozen random weights, trained Bernoulli masks, one sampled bit per
weight up, Bayesian aggregation.

Weights. Every kernel and bias of the model's prunable layers is frozen at a signed constant
+-c, c = e sqrt(1 / fan_in) with the layer's fan-in and a random sign per entry (the official
code's `ME_init`, `masked_layers.py`); both sides draw it from the run's seed, so it never
travels (`Known`). Other parameters (normalization scales and shifts) stay frozen at the model's
initial values, unmasked: the paper's and the code's networks have no normalization, and a mask
on a shift of 0 or a scale of 1 would only duplicate the kernel's.

Scores and masks. Every masked entry has a score s, theta = sigmoid(s) its probability of being
kept. Each forward pass of local training samples a fresh mask m ~ Bernoulli(theta) from the
step's key and runs the weights w * m. Gradient estimator: straight-through on the probability,
dm/dtheta := 1 (m = theta + stop_gradient(m - theta)), so dL/ds = dL/dm sigmoid'(s). Since
E[m] = theta this is the derivative of the expected forward pass's input, the estimator of
Zhou et al.'s supermasks that FedPM builds on; the official `Bern.backward` returns theta dL/dm
instead, which rescales each entry's gradient by its own probability (Adam undoes most of a
constant scale, not a per-entry one). Scores train with Adam at the run's --lr (the code hard-codes
0.1, SpaFL's appendix A.1.1 says 0.1); the weights never change. Adam's moments live per client
and carry over between its rounds (`fedpm_optimizer_state=client`, as the code builds each
client's optimizer once) or start fresh every round (`reset`). A client starts each round from
the scores of the broadcast, s = logit(theta).

Messages. Down: theta in float32 for every masked entry (as costly as FedAvg's model) and the
BatchNorm statistics, if the model has any. Up: one mask sample m_k ~ Bernoulli(theta_k) of the
client's trained probabilities, each leaf arithmetic-coded (`core.messages.pricing.CodedMask`: its count
of ones plus n H(k/n) + 2 bits; the code estimates n H(f) + log2 n bits with f over the whole
model and codes nothing), and its BatchNorm statistics (dense).

Server (Bayesian aggregation, the code's `sample_mask_aggregation`). A Beta(alpha, beta) posterior
per entry: the prior is reset to Beta(1, 1) every `prior_reset` rounds (1: every round, the
code's choice; 0: never, the posterior accumulates over the whole run), then
alpha += sum_k m_k, beta += sum_k (1 - m_k), and theta = (alpha - 1) / (alpha + beta - 2), the
posterior mode (with the prior reset every round, the mean of the K samples); the sums run over the
clients that take part. theta is clipped to
[0.01, 0.99] so that the next round's scores are finite (the code maps the sampled bits to
0.01/0.99 before counting, which keeps the same range). BatchNorm statistics: the data-weighted
mean of the clients'.

Evaluation. `global_variables`: the weights with one mask sampled from theta (the code evaluates a
sample), drawn from the run's seed and the number of rounds done, so every client and every
process scores the same network; `global_variants` adds `threshold`, the mask theta > 0.5
(logged as `test_accuracy_threshold`). FedPM has no personal model: each client's personalized
accuracy is the sampled global network on its own test split.

Per-round client figures: `mask_density` (the share of ones the client uploads) and
`train_flops` (3 x the forward multiply-adds of every step's expected mask, theta's mean per
layer times the layer's dense count, over the examples seen).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.core.messages.aggregation import present_only, weighted_mean
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm, replicate
from fedjax_sparse.core.structure.flops import layer_forward_flops
from fedjax_sparse.core.round.local_training import LocalObjective
from fedjax_sparse.core.messages.pricing import CodedMask, Known
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.core.round.streams import stream_key
from fedjax_sparse.models.structure import ModelStructure, get_path, set_path

tree_map = jax.tree_util.tree_map
THETA_RANGE = (0.01, 0.99)
PRIOR = 1.0  # lambda_0 of the code: the Beta(1, 1) prior


@dataclasses.dataclass(frozen=True)
class FedPMOptions:
    prior_reset: int = option(1, "FedPM: reset the Beta prior every this many rounds (1: every round, the "
                                 "official code; 0: never)", low=0)
    fedpm_optimizer_state: str = option("client", "FedPM: Adam's moments persist per client across its rounds "
                                                  "(client, the official code) or start fresh each round (reset)",
                                        choices=("client", "reset"))


def masked_paths(structure: ModelStructure) -> dict[str, tuple[str, ...]]:
    """{name: path in params} of the masked entries: every prunable layer's kernel and bias."""
    out = {}
    for layer in structure.layers:
        for path in (layer.kernel, layer.bias):
            if path is not None:
                out["/".join(path)] = path
    return out


def signed_constants(structure: ModelStructure, params: dict, key: jax.Array) -> dict:
    """`params` with every masked leaf replaced by +-e sqrt(1 / fan_in) (random signs from `key`)."""
    for i, layer in enumerate(structure.layers):
        c = math.e * math.sqrt(1.0 / layer.fan_in)
        for j, path in enumerate(p for p in (layer.kernel, layer.bias) if p is not None):
            shape = jnp.shape(get_path(params, path))
            signs = jax.random.rademacher(jax.random.fold_in(key, 2 * i + j), shape, jnp.float32)
            params = set_path(params, path, c * signs)
    return params


def logit(theta: jax.Array) -> jax.Array:
    return jnp.log(theta) - jnp.log1p(-theta)


def sampled_mask(theta: jax.Array, key: jax.Array) -> jax.Array:
    """m ~ Bernoulli(theta) whose gradient is the straight-through estimator dm/dtheta = 1."""
    sample = jax.random.bernoulli(key, theta).astype(theta.dtype)
    return theta + jax.lax.stop_gradient(sample - theta)


def sampled_masks(thetas: dict, key: jax.Array) -> dict:
    """`sampled_mask` of every leaf, from one draw of uniforms for them all (one random-number kernel
    per forward pass instead of one per leaf: XLA compiles each draw separately)."""
    names = sorted(thetas)
    flat = jnp.concatenate([thetas[n].reshape(-1) for n in names])
    sample = (jax.random.uniform(key, flat.shape) < flat).astype(flat.dtype)
    masks = flat + jax.lax.stop_gradient(sample - flat)
    out, start = {}, 0
    for n in names:
        size = thetas[n].size
        out[n] = masks[start:start + size].reshape(thetas[n].shape)
        start += size
    return out


def masked_params(weights: dict, paths: dict, masks: dict) -> dict:
    """The frozen weights with each masked leaf multiplied by its mask."""
    for name, path in paths.items():
        weights = set_path(weights, path, get_path(weights, path) * masks[name])
    return weights


def beta_posterior(alpha: dict, beta: dict, bits: dict, reset: jax.Array,
                   participating: jax.Array | None = None) -> tuple[dict, dict, dict]:
    """(alpha, beta, theta) after the K samples `bits` ({name: [K, ...]}); the prior is Beta(1, 1)
    first where `reset`. theta: the posterior mode (alpha - 1) / (alpha + beta - 2), clipped.
    `participating` (`RoundInfo`): the samples of the clients taking part alone are counted."""
    def update(a, b, m):
        samples = m.shape[0] if participating is None else jnp.sum(participating.astype(jnp.float32))
        ones = jnp.sum(present_only(m, participating).astype(jnp.float32), axis=0)
        a = jnp.where(reset, PRIOR, a) + ones
        b = jnp.where(reset, PRIOR, b) + (samples - ones)
        theta = jnp.clip((a - 1.0) / jnp.maximum(a + b - 2.0, 1e-12), *THETA_RANGE)
        return a, b, theta

    out = {name: update(alpha[name], beta[name], bits[name]) for name in bits}
    return ({n: o[0] for n, o in out.items()}, {n: o[1] for n, o in out.items()},
            {n: o[2] for n, o in out.items()})


def fedpm(context: BuildContext, options: FedPMOptions) -> FederatedAlgorithm:
    local = context.local
    model = local.model
    structure = model.structure
    paths = masked_paths(structure)
    if not paths:
        raise ValueError(f"fedpm masks the kernels and biases of a model's prunable layers; {model.name} has none")
    kernels = {"/".join(l.kernel): l.name for l in structure.layers}
    dense_layer_flops = layer_forward_flops(structure)
    evaluation_key = stream_key(context.seed, "evaluation")
    persistent = options.fedpm_optimizer_state == "client"

    def optimizer(learning_rate):
        return optax.adam(learning_rate)

    def expected_flops(scores: dict) -> jax.Array:
        return sum(jnp.mean(jax.nn.sigmoid(scores[name])) * dense_layer_flops[layer]
                   for name, layer in kernels.items())

    def objective(weights):
        def forward(trainable, key):
            masks = sampled_masks(tree_map(jax.nn.sigmoid, trainable["params"]), key)
            return {"params": masked_params(weights, paths, masks)}

        def after_step(before, after, batch):
            examples = batch.mask.sum().astype(jnp.float32)
            return after, {"train_flops": 3.0 * examples * expected_flops(before["params"])}

        return LocalObjective(forward=forward, after_step=after_step, optimizer=optimizer)

    def initial_scores(variables, key):
        return {name: jax.random.normal(jax.random.fold_in(key, i), jnp.shape(get_path(variables["params"], path)))
                for i, (name, path) in enumerate(paths.items())}

    def init_clients(key, variables, ids):
        if not persistent:
            return {}
        trainable = {"params": initial_scores(variables, key)}
        return replicate({"adam": optimizer(1.0).init(trainable)}, len(ids))

    def init(key, variables, num_clients):
        weights_key, scores_key = jax.random.split(key)
        theta = tree_map(jax.nn.sigmoid, initial_scores(variables, scores_key))
        ones = tree_map(lambda t: jnp.full_like(t, PRIOR), theta)
        server_state = {"weights": signed_constants(structure, variables["params"], weights_key),
                        "theta": theta, "alpha": ones, "beta": ones, "batch_stats": variables["batch_stats"],
                        "round": jnp.zeros((), jnp.int32)}
        return server_state, init_clients(key, variables, jnp.arange(num_clients))

    def broadcast(server_state, client_id, info):
        return {"theta": server_state["theta"], "batch_stats": server_state["batch_stats"],
                "weights": Known(server_state["weights"])}

    def client_update(down, client_state, data, key, info):
        train_key, upload_key = jax.random.split(key)
        scores = tree_map(logit, down["theta"])
        trained, adam, stats = local.train_with_optimizer_state(
            {"params": scores, "batch_stats": down["batch_stats"]}, data, train_key, round_index=info.index,
            objective=objective(down["weights"].value), optimizer_state=client_state.get("adam"))
        bits = tree_map(lambda m: m > 0.5, sampled_masks(tree_map(jax.nn.sigmoid, trained["params"]), upload_key))
        ones = sum(jnp.sum(b) for b in bits.values())
        total = sum(b.size for b in bits.values())
        up = {"mask": {name: CodedMask(b) for name, b in bits.items()}, "batch_stats": trained["batch_stats"]}
        metrics = {**stats, "mask_density": ones / total}
        return up, ({"adam": adam} if persistent else {}), metrics

    def server_update(server_state, ups, weights, info):
        bits = {name: coded.bits for name, coded in ups["mask"].items()}
        reset = (options.prior_reset > 0) & (info.index % max(options.prior_reset, 1) == 0)
        alpha, beta, theta = beta_posterior(server_state["alpha"], server_state["beta"], bits, reset,
                                            info.participating)
        return {**server_state, "theta": theta, "alpha": alpha, "beta": beta,
                "batch_stats": weighted_mean(ups["batch_stats"], weights), "round": server_state["round"] + 1}

    def network(server_state, masks):
        return {"params": masked_params(server_state["weights"], paths, masks),
                "batch_stats": server_state["batch_stats"]}

    def sampled_network(server_state):
        key = jax.random.fold_in(evaluation_key, server_state["round"])
        return network(server_state, sampled_masks(server_state["theta"], key))

    def thresholded_network(server_state):
        return network(server_state, tree_map(lambda t: (t > 0.5).astype(jnp.float32), server_state["theta"]))

    return FederatedAlgorithm(
        name="fedpm",
        init=init,
        init_clients=init_clients if persistent else None,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: sampled_network(server_state),
        global_variables=sampled_network,
        global_variants=lambda server_state: {"threshold": thresholded_network(server_state)},
    )


SPEC = AlgorithmSpec("fedpm", FedPMOptions, fedpm,
                     "FedPM: frozen random weights, Bernoulli masks trained with Adam, one coded mask sample up, "
                     "Bayesian aggregation")
