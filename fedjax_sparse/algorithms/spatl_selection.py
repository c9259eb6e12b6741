"""SPATL's salient selection: which encoder units a client uploads (section 4.3).

A unit's salience is the L2 norm of its incoming weights; a layer keeps its top share of units, that share (its
keep ratio) chosen by a policy: one ratio for every layer (`fixed_policy`, the largest that meets the FLOPs
reduction), or each client's GNN-PPO agent (`agent_policy`, `fedjax_sparse.agent`) searching the ratios against
the accuracy of the salient sub-model on examples the client held out of local training. FLOPs of the encoder
at given masks or ratios come from the model's structure (`core.structure.flops`)."""


from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.agent import (AgentConfig, AgentState, GraphTemplate, PruningEnv, init_agent, search,
                                 unit_norm_statistics)
from fedjax_sparse.core.structure.flops import layer_forward_flops
from fedjax_sparse.core.structure.unit_masks import full_unit_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores
from fedjax_sparse.core.round.streams import stream_seed
from fedjax_sparse.data.federated import ClientData, FederatedSplit, epoch_permutations, normalize
from fedjax_sparse.data.partition import stratified_holdout
from fedjax_sparse.models.structure import ModelStructure, get_path


tree_map = jax.tree_util.tree_map


class AgentOptions(Protocol):
    """What the agent's policy reads of SPATL's options (`algorithms.spatl.SPATLOptions`)."""

    agent_updates: int
    agent_reset: bool
    agent_validation_fraction: float
    agent_validation_examples: int
    flops_reduction: float


# ------------------------------------------------------------------ salient units

def encoder_layers(structure: ModelStructure) -> tuple[str, ...]:
    names = tuple(l.name for l in structure.part("encoder"))
    if not names:
        raise ValueError("spatl needs a model whose structure names an encoder (Layer.part == 'encoder'); "
                         "this model has none")
    return names


def unit_l2_norms(structure: ModelStructure, params, layers: tuple[str, ...]) -> dict[str, jax.Array]:
    """{layer: [units]} the L2 norm of each unit's incoming weights (its kernel slice)."""
    out = {}
    for name in layers:
        kernel = get_path(params, structure[name].kernel)
        out[name] = jnp.sqrt(jnp.sum(kernel.reshape(-1, kernel.shape[-1]) ** 2, axis=0))
    return out


def salient_masks(structure: ModelStructure, params, keep_ratios: dict[str, jax.Array],
                  layers: tuple[str, ...]) -> dict[str, jax.Array]:
    """Unit masks keeping, per encoder layer, its keep ratio of units with the largest L2 norms."""
    return keep_top_units(structure, unit_l2_norms(structure, params, layers), keep_ratios, layers=layers)


def encoder_flops(structure: ModelStructure, masks: dict, layers: tuple[str, ...]) -> jax.Array:
    """Forward FLOPs of the encoder layers, counting the inputs pruned producers no longer feed."""
    per_layer = layer_forward_flops(structure, masks, count_inputs=True)
    return sum(per_layer[name] for name in layers)


def encoder_flops_at(structure: ModelStructure, layers: tuple[str, ...],
                     keep_ratios: dict[str, jax.Array] | jax.Array | float) -> jax.Array:
    """The encoder's forward FLOPs when its layers keep these ratios of their units (one ratio for
    all or {layer: ratio}). FLOPs depend on how many units each layer keeps, not which, so
    HeteroFL's prefix masks stand for any selection."""
    masks = keep_top_units(structure, prefix_scores(structure), keep_ratios, layers=layers)
    return encoder_flops(structure, masks, layers)


def dense_encoder_flops(structure: ModelStructure, layers: tuple[str, ...]) -> float:
    """The whole encoder's forward FLOPs, as one program (op by op, each layer's operations compile on their own:
    seconds on a ResNet, at every build)."""
    return float(jax.jit(lambda: encoder_flops(structure, full_unit_masks(structure), layers))())


def uniform_keep_ratio(structure: ModelStructure, layers: tuple[str, ...], reduction: float) -> float:
    """The largest keep ratio r whose masks (r of every encoder layer) cut its FLOPs by >= `reduction`;
    bisection over r on the host."""
    dense = dense_encoder_flops(structure, layers)
    # one program for the ~40 ratios tried: op by op, every layer's operations compiled on their own (seconds at
    # every build on a ResNet)
    flops_at = jax.jit(lambda r: encoder_flops_at(structure, layers, r))

    def kept(r):
        return float(flops_at(jnp.float32(r))) / dense

    low, high = 0.0, 1.0
    if kept(high) <= 1.0 - reduction:
        return high
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if kept(mid) <= 1.0 - reduction else (low, mid)
    return low if low > 0 else high


@dataclasses.dataclass(frozen=True)
class SalientPolicy:
    """How a client picks its encoder layers' keep ratios.

    init(key) -> the policy's per-client state (e.g. a learned agent);
    select(state, trained_variables, validation, key) -> (state, {layer: ratio}, metrics dict of scalars),
      `validation` the client's held-out examples (a `ClientData` window);
    holdout: the share of each client's data held out of local training for `validation` (0: none).
    """

    init: Callable[[jax.Array], Any]
    select: Callable[[Any, dict, ClientData, jax.Array], tuple[Any, dict, dict]]
    holdout: float = 0.0


def fixed_policy(layers: tuple[str, ...], ratio: float) -> SalientPolicy:
    ratios = {name: jnp.asarray(ratio, jnp.float32) for name in layers}
    return SalientPolicy(init=lambda key: {}, select=lambda state, variables, data, key: (state, ratios, {}))


def agent_holdout(train: FederatedSplit, fraction: float, seed: int) -> jax.Array | None:
    """[total] bool over the training split: the examples each client holds out of local training
    (`data.stratified_holdout`: a random, label-stratified ceil(fraction x n) of its n, drawn from the
    client's own stream of the run's seed, so the same every round); None when fraction is 0."""
    if fraction == 0.0:
        return None
    y, offsets, counts = np.asarray(train.y), np.asarray(train.offsets), np.asarray(train.counts)
    held = np.zeros(len(y), bool)
    stream = stream_seed(seed, "agent_validation")
    for client, (offset, count) in enumerate(zip(offsets, counts)):
        held[offset:offset + count] = stratified_holdout(y[offset:offset + count], fraction,
                                                         np.random.default_rng([*stream, client]))
    return jnp.asarray(held)


def split_holdout(data: ClientData, held: jax.Array | None) -> tuple[ClientData, ClientData]:
    """(training, held-out) views of a client's data: the examples `held` (`agent_holdout`) marks and
    the others, each a `positions` view of its window. A client with no held-out example (one of one
    example) is validated on its training data; `held` None: both are the whole data."""
    if held is None:
        return data, data
    if data.positions is not None:
        raise ValueError("split_holdout takes a client's whole data window, not a view of it")
    pos = jnp.arange(data.max_count)
    real = pos < data.count
    flags = held[data.example_index(pos)] & real
    num_held = jnp.sum(flags).astype(data.count.dtype)

    def view(first, count):  # the positions flagged `first`, in window order, then the others
        order = jnp.argsort(jnp.where(real, (flags != first).astype(jnp.int32), 2), stable=True)
        return dataclasses.replace(data, count=count, positions=order.astype(jnp.int32))

    some = num_held > 0
    validation = view(True, jnp.where(some, num_held, data.count))
    validation = dataclasses.replace(validation, positions=jnp.where(some, validation.positions, pos))
    return view(False, data.count - num_held), validation


def validation_batch(data: ClientData, size: int, key: jax.Array):
    """(x, y, mask): `size` random examples of a client's data window (fewer: masked)."""
    k = min(size, data.max_count)
    order = epoch_permutations(key, data.count, data.max_count, 1)[0][:k]
    mask = jnp.arange(k) < data.count
    index = data.example_index(order)
    return normalize(data.x[index], data.mean, data.std), data.y[index], mask


def agent_config(options: AgentOptions) -> AgentConfig:
    """The agent's settings: the paper's PPO defaults, SPATL's updates per round and FLOPs target."""
    return AgentConfig(updates=options.agent_updates, flops_target=options.flops_reduction)


def agent_policy(model, layers: tuple[str, ...], options: AgentOptions, config: AgentConfig | None = None,
                 initial: AgentState | None = None) -> SalientPolicy:
    """Each client's GNN-PPO agent (`fedjax_sparse.agent`) searches its keep ratios every round.

    The environment is the client's trained model: FLOPs from the masks the ratios imply,
    the unit-norm statistics of its weights, and as reward the accuracy of its salient
    sub-model (encoder masked, its own predictor) on up to `agent_validation_examples` of its
    validation examples: the `agent_validation_fraction` of its own data held out of local
    training (never the test data; examples it trained on would score ~100 % for any
    sub-model and leave the agent nothing to learn from). The agent's state is
    the client's and carries over between rounds (sec. 4.6.2's continual learning) unless
    `agent_reset`; `initial` (or `agent_init`) is a trained agent every client starts from.
    """
    structure = model.structure
    config = config or agent_config(options)
    template = GraphTemplate.from_structure(structure, layers)
    dense = float(encoder_flops(structure, full_unit_masks(structure), layers))

    def as_dict(ratios):
        return {name: ratios[i] for i, name in enumerate(layers)}

    def flops_kept(env_state, ratios):
        return encoder_flops_at(structure, layers, as_dict(ratios)) / dense

    def norm_stats(env_state, ratios):
        return unit_norm_statistics(unit_l2_norms(structure, env_state["variables"]["params"], layers), layers,
                                    ratios)

    def reward(env_state, ratios):
        variables = env_state["variables"]
        masks = salient_masks(structure, variables["params"], as_dict(ratios), layers)
        x, y, mask = env_state["validation"]
        logits, _ = model.apply({**variables, "unit_masks": masks}, x, train=False)
        return jnp.sum((jnp.argmax(logits, -1) == y) & mask) / jnp.maximum(mask.sum(), 1)

    env = PruningEnv(flops_kept=flops_kept, unit_norm_stats=norm_stats, reward=reward)

    def init(key):
        return initial if initial is not None else init_agent(key, template, config)

    def select(state, variables, data, key):
        init_key, batch_key, search_key = jax.random.split(key, 3)
        if options.agent_reset:
            state = init(init_key)
        env_state = {"variables": variables,
                     "validation": validation_batch(data, options.agent_validation_examples, batch_key)}
        state, result = search(state, env_state, search_key, env=env, template=template, config=config)
        metrics = {"agent_reward": result.reward, "agent_flops_kept": result.flops_kept,
                   "agent_met_target": result.agent_met_target.astype(jnp.float32),
                   "agent_last_update_reward": result.mean_episode_reward[-1]}
        return state, as_dict(result.keep_ratios), metrics

    return SalientPolicy(init=init, select=select, holdout=options.agent_validation_fraction)
