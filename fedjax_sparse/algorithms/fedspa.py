"""FedSpa (Huang et al., 2022, arXiv 2201.11380): personalized sparse models at a fixed density,
with masks that evolve by prune-and-grow. What travels and how the server aggregates is our reading.

What is known (the paper's abstract and SpaFL's appendix A.1.1): each client trains a personalized
sparse model under its own mask; the number of active parameters is fixed throughout training
("sparse-to-sparse"); SpaFL ran it at density 0.5 with an initial pruning rate of 0.5 decayed by
cosine annealing. No code by the authors was found. The rest is our reading, in the style of the
RigL-type prune-and-grow the paper's setting implies:

  * Masks. Every kernel of the model's prunable layers is sparse, each at `sparse_density` of its
    entries (the same density per layer); biases and normalization stay dense. Client i's first
    mask is a uniformly random one of that density, a pure function of the run's seed and i, so the
    server knows it without being told.
  * Down: the global model's values at the client's mask (the server remembers every client's
    mask: `memory`, N masks, the per-client memory the design allows a server), a message the
    client can place without an index (`KnownMaskArray`), and the dense leaves whole.
  * Prune and grow, once per round, before local training (so the round trains the mask it
    uploads): with the swap rate of the round, r_t = `swap_rate` x (1 + cos(pi min(t, T) / T)) / 2
    (T = `swap_anneal_rounds`, 500 = SpaFL's rounds), each kernel drops the s = floor(r_t x active)
    active entries of smallest magnitude and activates s of the entries inactive before it, those
    of largest |gradient| of the loss on one batch of the client's data (at the received model);
    grown entries start at zero. Ties: the lower flat index. The density is unchanged and exactly s
    entries per kernel swap (s is capped by the inactive entries).
  * Local training: the run's (momentum) SGD on the active entries only; an inactive entry stays
    exactly zero, momentum and weight decay included.
  * Up: the trained kernels at the new mask (`SparseArray`: values plus the cheaper index, so the
    server learns the mask), and the dense leaves.
  * Server: per entry, the data-weighted mean over the clients whose mask holds it (an entry no
    client holds keeps its value), the server optimizer's step toward it (sgd at lr 1 by
    default), and each sampled client's new mask into its memory (of the clients taking part:
    an absent one's memory stays).
  * Personal model: each client's last trained sparse model (a client never sampled: the initial
    model at its initial mask); FedSpa has no global model to evaluate.

Per-round client figures: `swapped` (entries swapped), `weight_density` (active kernel entries /
all) and `train_flops` (3 x the multiply-adds of the active kernel entries over the examples seen:
each conv entry runs once per output position, each dense entry once).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from fedjax_sparse.core.messages.aggregation import mean_of_sent
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm
from fedjax_sparse.core.round.local_training import LocalObjective, masked_cross_entropy
from fedjax_sparse.core.messages.pricing import KnownMaskArray, SparseArray
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import ServerOptimizerOptions, from_options
from fedjax_sparse.data.federated import client_batch, epoch_permutations
from fedjax_sparse.models.structure import ModelStructure, get_path, set_path

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class FedSpaOptions(ServerOptimizerOptions):
    sparse_density: float = option(0.5, "FedSpa: the share of each kernel's entries a client's mask keeps", low=0.0,
                                   low_open=True, high=1.0)
    swap_rate: float = option(0.5, "FedSpa: the share of active entries swapped by prune-and-grow at round 0 "
                                   "(cosine-annealed to 0)", low=0.0, high=1.0)
    swap_anneal_rounds: int = option(500, "FedSpa: the round at which the annealed swap rate reaches 0", low=1)


def swap_fraction(rate: float, anneal_rounds: int, round_index: jax.Array) -> jax.Array:
    """r_t = rate x (1 + cos(pi min(t, T) / T)) / 2."""
    t = jnp.minimum(jnp.asarray(round_index, jnp.float32), anneal_rounds)
    return rate * 0.5 * (1.0 + jnp.cos(jnp.pi * t / anneal_rounds))


def random_kernel_masks(structure: ModelStructure, params: dict, density: float, key: jax.Array) -> dict:
    """{layer: kernel-shaped bool}: exactly round(density x entries) random entries of each kernel."""
    out = {}
    for i, layer in enumerate(structure.layers):
        shape = jnp.shape(get_path(params, layer.kernel))
        size = math.prod(shape)
        scores = jax.random.uniform(jax.random.fold_in(key, i), (size,))
        out[layer.name] = _top(scores, round(density * size)).reshape(shape)
    return out


def _top(scores: jax.Array, count: jax.Array) -> jax.Array:
    """[n] bool: the `count` largest scores (ties: the lower index)."""
    order = jnp.argsort(-scores, stable=True)
    return jnp.zeros(scores.shape, bool).at[order].set(jnp.arange(scores.shape[0]) < count)


def prune_and_grow(mask: jax.Array, weights: jax.Array, grads: jax.Array, fraction: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """(new mask, entries swapped): floor(fraction x active) active entries of smallest |w| dropped,
    as many of the entries inactive before of largest |g| grown (capped by those inactive)."""
    flat_mask, shape = mask.reshape(-1), mask.shape
    active = jnp.sum(flat_mask)
    swap = jnp.minimum(jnp.floor(fraction * active).astype(jnp.int32), flat_mask.size - active)
    drop = _top(jnp.where(flat_mask, -jnp.abs(weights.reshape(-1)), -jnp.inf), swap)
    grow = _top(jnp.where(flat_mask, -jnp.inf, jnp.abs(grads.reshape(-1))), swap)
    return ((flat_mask & ~drop) | grow).reshape(shape), swap


def fedspa(context: BuildContext, options: FedSpaOptions) -> FederatedAlgorithm:
    local = context.local
    model = local.model
    structure = model.structure
    if not structure.layers:
        raise ValueError(f"fedspa sparsifies the kernels of a model's prunable layers; {model.name} has none")
    server = from_options(options)

    def with_kernels(variables, kernel_values: dict, default):
        """A variables-shaped tree: `default` everywhere, `kernel_values[layer]` at each kernel."""
        out = tree_map(lambda leaf: default(leaf), variables)
        for layer in structure.layers:
            out = {**out, "params": set_path(out["params"], layer.kernel, kernel_values[layer.name])}
        return out

    def masked(variables, masks):
        return {**variables, "params": tree_map(lambda w, m: jnp.where(m, w, 0.0), variables["params"],
                                                with_kernels(variables, masks, lambda l: jnp.ones(l.shape, bool))
                                                ["params"])}

    def initial_masks(key, variables, client_id):
        return random_kernel_masks(structure, variables["params"], options.sparse_density,
                                   jax.random.fold_in(key, client_id))

    def init_clients(key, variables, ids):
        return jax.vmap(lambda i: masked(variables, initial_masks(key, variables, i)))(jnp.asarray(ids))

    def init(key, variables, n):
        state = server.init_state(variables)
        state["memory"] = jax.vmap(lambda i: initial_masks(key, variables, i))(jnp.arange(n))
        return state, init_clients(key, variables, jnp.arange(n))

    def broadcast(server_state, client_id, info):
        masks = tree_map(lambda m: m[client_id], server_state["memory"])
        variables = server_state["variables"]
        return tree_map(KnownMaskArray, variables, with_kernels(variables, masks, lambda l: jnp.ones(l.shape, bool)))

    def loss_gradient(variables, data, key):
        order_key, batch_key = jax.random.split(key)
        order = epoch_permutations(order_key, data.count, data.max_count, 1)[0]
        batch = client_batch(data, order, 0, local.batch_size, batch_key, train=True)

        def loss(params):
            logits, _ = model.apply({**variables, "params": params}, batch.x, train=True, mask=batch.mask)
            return masked_cross_entropy(logits, batch.y, batch.mask)

        return jax.grad(loss)(variables["params"])

    def client_update(down, client_state, data, key, info):
        del client_state  # the personal model is what it trains next, from the received values
        is_known = lambda x: isinstance(x, KnownMaskArray)  # noqa: E731
        variables = tree_map(lambda leaf: leaf.dense(), down, is_leaf=is_known)
        old = {l.name: get_path(down["params"], l.kernel).mask for l in structure.layers}
        grad_key, train_key = jax.random.split(key)
        grads = loss_gradient(variables, data, grad_key)
        fraction = swap_fraction(options.swap_rate, options.swap_anneal_rounds, info.index)
        new, swapped = {}, jnp.zeros((), jnp.int32)
        for layer in structure.layers:
            new[layer.name], s = prune_and_grow(old[layer.name], get_path(variables["params"], layer.kernel),
                                                get_path(grads, layer.kernel), fraction)
            swapped = swapped + s
        entries = with_kernels(variables, new, lambda l: jnp.ones(jnp.shape(l), bool))
        objective = LocalObjective(update_mask=entries)
        trained, stats = local.train(masked(variables, new), data, train_key, round_index=info.index,
                                     objective=objective)
        up = tree_map(KnownMaskArray, trained, entries)
        for layer in structure.layers:  # the new mask travels as the kernels' index
            kernel = get_path(trained["params"], layer.kernel)
            up = {**up, "params": set_path(up["params"], layer.kernel, SparseArray(kernel, new[layer.name]))}
        kept = {l.name: jnp.sum(new[l.name]) for l in structure.layers}
        examples = (data.count * local.epochs).astype(jnp.float32)
        metrics = {**stats, "swapped": swapped,
                   "weight_density": sum(kept.values()) / structure.num_prunable_weights,
                   "train_flops": 3.0 * examples * sum(kept[l.name] * float(l.output_hw) for l in structure.layers)}
        return up, trained, metrics

    def server_update(server_state, ups, weights, info):
        mean, held = mean_of_sent(ups, weights, server_state["variables"], info.participating)
        state = server.step_toward(server_state, mean, held)
        ids = info.client_ids
        new = {l.name: get_path(ups["params"], l.kernel).mask for l in structure.layers}
        if info.participating is not None:  # an absent client's mask did not change: the server keeps its own
            new = tree_map(lambda memory, m: jnp.where(info.participating.reshape((-1,) + (1,) * (m.ndim - 1)),
                                                       m, memory[ids]), server_state["memory"], new)
        state["memory"] = tree_map(lambda memory, m: memory.at[ids].set(m), server_state["memory"], new)
        return state

    return FederatedAlgorithm(
        name="fedspa",
        init=init,
        init_clients=init_clients,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: client_state,
        global_variables=None,
    )


SPEC = AlgorithmSpec("fedspa", FedSpaOptions, fedspa,
                     "FedSpa: personalized sparse models at a fixed density, masks by prune-and-grow")
