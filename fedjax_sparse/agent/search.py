"""SPATL's salient-parameter search (Algorithm 1) as one jittable, vmappable function.

Each client runs a GNN + PPO agent (`networks`, `ppo`) that decides, per
encoder layer, the fraction of units to keep. The client's model enters only
through a `PruningEnv` of pure functions over a per-client `env_state`, so
`search` can be vmapped over clients (`search_clients`) with the
environment, the graph template and the config static.

An episode (Algorithm 1's inner while loop): keep ratios p start at 1; each
step the agent observes the graph of the pruned encoder, samples a ~ N(mean,
std) per layer and sets p <- clip(p (1 - clip(a, 0, 1)), p_min, 1) (the
official code's update) until the FLOPs kept fall to the budget
1 - `flops_target` or `max_episode_steps` steps have passed. The last step
is rewarded with 100 x the pruned model's validation accuracy (eq. 7) if the
budget was met, else with `penalty` (default 0, i.e. as bad as accuracy 0;
the official code's top1 - 100 and -100 on failure are the same rewards
shifted by -100). Other steps get reward 0.

Landing on the budget (ours). Eq. 7 has no FLOPs term and Algorithm 1 stops
at the first step past the budget, so a step of the usual size (a mean
pruning fraction near 1/2 per layer) overshoots it by far: an untrained agent
on the digits MLP cut 0.45-0.95 of the FLOPs at a 0.2 target, and the
rewards, being accuracies, favour keeping more. We keep eq. 7 and the
termination, but the step that crosses the budget (from ratios above it)
is cut back: of the sampled action a it applies t a, with t in (0, 1] the smallest fraction
whose keep ratios meet the budget (bisection; FLOPs do not increase with t).
Layers whose actions saturate (clipped to 1) move in lockstep and may each
lose a unit at the same t, so a last pass gives back, layer by layer, the
unit the bisection's final halving took from it while that still fits: the
episode ends within one unit's FLOPs (of one layer) of the budget. The transition
stores the sampled action (the cut is part of the environment). Episodes
ending with equal rewards (accuracy on a few validation examples is coarse)
rank by the FLOPs they keep, more first (`better_episode`).

Layout of a search (our choices where the paper is vague):
  * "updates the policy every 20 search steps": an update collects exactly
    `steps_per_update` environment steps, resetting an episode whenever it
    ends, then runs `epochs` PPO epochs. An episode still running when the
    rollout stops is bootstrapped by the critic there and continues in the
    next update (as a step-counting PPO loop does); a new search starts a new
    episode, since the client's weights (the environment) have changed.
    (Algorithm 1 calls an episode a "search step"; counting environment
    steps instead gives every update 20 transitions, however short the
    episodes are.)
  * The accuracy is evaluated at every step and kept where the episode ends
    (static shapes under vmap), so an update costs `steps_per_update`
    evaluations of `env.reward`.
  * The best keep ratios are those of the highest-rewarded episode that met
    the budget, over all updates of the search (Algorithm 1's "if is best
    Reward"; ties to the one keeping more FLOPs). If none did, the result falls back to the largest uniform keep
    ratio meeting the budget (bisection on `env.flops_kept`; it may go below
    p_min if the target demands it), with its accuracy evaluated once.
  * Continual learning (sec. 4.6.2): `AgentState` (network parameters and
    Adam state) is returned and is what the next round's search starts from.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import chex
import flax.serialization
import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.agent.config import AgentConfig
from fedjax_sparse.agent.graph import NUM_NORM_STATS, GraphTemplate, graph_state
from fedjax_sparse.agent.networks import ActorCritic
from fedjax_sparse.agent.ppo import Transition, gaussian_log_prob, init_optimizer_state, ppo_update

BISECTION_STEPS = 30


@dataclasses.dataclass(frozen=True)
class PruningEnv:
    """A client's pruning problem as pure functions of (env_state, keep_ratios [L]).

    flops_kept -> scalar in [0, 1]: the fraction of the dense encoder FLOPs the
      masks implied by the keep ratios keep (must not increase as ratios drop);
    unit_norm_stats -> [L, NUM_NORM_STATS] (e.g. `graph.unit_norm_statistics`);
    reward -> scalar in [0, 1]: the pruned model's accuracy on the client's
      validation examples.
    `env_state` is any pytree (the client's weights, data, ...); the functions
    must be hashable (module-level functions or `functools.partial`s of them).
    """

    flops_kept: Callable[[Any, jax.Array], jax.Array]
    unit_norm_stats: Callable[[Any, jax.Array], jax.Array]
    reward: Callable[[Any, jax.Array], jax.Array]


@flax.struct.dataclass
class AgentState:
    """What a client's agent carries from round to round: network parameters and Adam's state
    (over the raveled parameters, see `ppo.init_optimizer_state`)."""

    params: Any
    opt_state: optax.OptState


@flax.struct.dataclass
class Observation:
    """The inputs of `graph.graph_state` that change during an episode."""

    keep_ratios: jax.Array
    unit_norm_stats: jax.Array
    flops_kept: jax.Array


@flax.struct.dataclass
class SearchResult:
    """keep_ratios [L]: the best ratios found (or the fallback); reward: their 100 x accuracy;
    flops_kept: their FLOPs fraction; agent_met_target: whether any episode met the budget
    (False means the uniform fallback was returned); met_target: whether `keep_ratios` meet it
    (False only if no ratios can); mean_episode_reward [updates]: the mean final reward of the
    episodes that ended during each update (NaN if none did)."""

    keep_ratios: jax.Array
    reward: jax.Array
    flops_kept: jax.Array
    agent_met_target: jax.Array
    met_target: jax.Array
    mean_episode_reward: jax.Array


def _network(config: AgentConfig) -> ActorCritic:
    return ActorCritic(hidden_size=config.hidden_size, message_passing_steps=config.message_passing_steps)


def policy_fn(template: GraphTemplate,
              config: AgentConfig) -> Callable[[Any, Observation], tuple[jax.Array, jax.Array]]:
    """`(params, observation) -> (means [L], value)` for the agent of `template`."""
    network = _network(config)

    def apply(params, observation: Observation):
        graph = graph_state(template, observation.keep_ratios, observation.unit_norm_stats,
                            observation.flops_kept, config.flops_budget)
        return network.apply({"params": params}, graph)

    return apply


@functools.partial(jax.jit, static_argnames=("template", "config"))
def init_agent(key: jax.Array, template: GraphTemplate, config: AgentConfig) -> AgentState:
    """A fresh agent (jitted: Flax's initializers run op by op, and slowly, outside jit)."""
    num_nodes = template.num_nodes
    graph = graph_state(template, jnp.ones(num_nodes), jnp.zeros((num_nodes, NUM_NORM_STATS)),
                        jnp.ones(()), config.flops_budget)
    params = _network(config).init(key, graph)["params"]
    return AgentState(params=params, opt_state=init_optimizer_state(params, config))


def _observe(env: PruningEnv, env_state: Any, keep_ratios: jax.Array) -> Observation:
    flops = env.flops_kept(env_state, keep_ratios)
    stats = env.unit_norm_stats(env_state, keep_ratios)
    chex.assert_rank(flops, 0)
    chex.assert_shape(stats, (keep_ratios.shape[0], NUM_NORM_STATS))
    return Observation(keep_ratios, stats.astype(jnp.float32), flops.astype(jnp.float32))


def _bisect(fits: Callable[[jax.Array], jax.Array], feasible: float,
            infeasible: float) -> tuple[jax.Array, jax.Array]:
    """(feasible end, infeasible end) of [feasible, infeasible] (either order) after `BISECTION_STEPS`
    halvings; `fits` must hold on one side of a single boundary and hold at `feasible`."""
    def bisect(bounds, _):
        good, bad = bounds
        middle = 0.5 * (good + bad)
        ok = fits(middle)
        return (jnp.where(ok, middle, good), jnp.where(ok, bad, middle)), None

    bounds, _ = jax.lax.scan(bisect, (jnp.asarray(feasible, jnp.float32), jnp.asarray(infeasible, jnp.float32)),
                             None, length=BISECTION_STEPS)
    return bounds


def largest_uniform_keep_ratio(env: PruningEnv, env_state: Any, num_layers: int,
                               flops_budget: float) -> jax.Array:
    """The largest r in [0, 1] (to 2^-30) whose uniform ratios keep at most `flops_budget`.

    Bisection assumes `flops_kept` does not increase as the ratio drops; if
    even r = 0 misses the budget, returns 0.
    """
    def fits(ratio):
        return env.flops_kept(env_state, jnp.full((num_layers,), ratio)) <= flops_budget

    return jnp.where(fits(jnp.ones(())), 1.0, _bisect(fits, 0.0, 1.0)[0])


def better_episode(reward: jax.Array, flops_kept: jax.Array, best_reward: jax.Array,
                   best_flops_kept: jax.Array) -> jax.Array:
    """Whether an episode beats the best so far: a higher reward, or an equal one keeping more FLOPs."""
    return (reward > best_reward) | ((reward == best_reward) & (flops_kept > best_flops_kept))


def best_episode(rewards: jax.Array, flops_kept: jax.Array, met: jax.Array) -> jax.Array:
    """Index of the best of a rollout's steps (`better_episode`'s order) among those that met the budget
    (any index when none did)."""
    return jnp.lexsort((jnp.where(met, flops_kept, -jnp.inf), jnp.where(met, rewards, -jnp.inf)))[-1]


def search(agent_state: AgentState, env_state: Any, key: jax.Array, *, env: PruningEnv,
           template: GraphTemplate, config: AgentConfig) -> tuple[AgentState, SearchResult]:
    """Runs `config.updates` PPO updates of one client's agent; returns its new state and the best ratios.

    Jit it with `env`, `template` and `config` static. Randomness: update u
    splits (key_u+1, rollout_u) = split(key_u) from key_0 = `key`, and step t
    of its rollout draws its action noise from split(rollout_u, steps)[t].
    """
    apply = policy_fn(template, config)
    num_layers, budget = template.num_nodes, config.flops_budget
    start = _observe(env, env_state, jnp.ones(num_layers, jnp.float32))

    def env_step(params, carry, step_key):
        observation, steps_taken = carry
        mean, value = apply(params, observation)
        action = mean + config.action_std * jax.random.normal(step_key, mean.shape)

        def keep_at(fraction):  # the keep ratios after `fraction` of the action
            return jnp.clip(observation.keep_ratios * (1.0 - fraction * jnp.clip(action, 0.0, 1.0)),
                            config.min_keep_ratio, 1.0)

        def fits(ratios):
            return env.flops_kept(env_state, ratios) <= budget

        met = fits(keep_at(1.0))
        crossing = met & (observation.flops_kept > budget)
        inside, outside = _bisect(lambda t: fits(keep_at(t)), 1.0, 0.0)
        keep = keep_at(jnp.where(crossing, inside, 1.0))

        def give_back(ratios, layer):  # the unit the last halving took from this layer, if it still fits
            trial = ratios.at[layer].set(jnp.where(crossing, keep_at(outside)[layer], ratios[layer]))
            return jnp.where(fits(trial), trial, ratios), None

        keep, _ = jax.lax.scan(give_back, keep, jnp.arange(num_layers))
        following = _observe(env, env_state, keep)
        done = met | (steps_taken + 1 >= config.max_episode_steps)
        accuracy = env.reward(env_state, keep)
        chex.assert_rank(accuracy, 0)
        reward = jnp.where(done, jnp.where(met, 100.0 * accuracy, config.penalty), 0.0)
        transition = Transition(observation, action, gaussian_log_prob(action, mean, config.action_std),
                                value, reward, done)
        flops = following.flops_kept
        following = jax.tree_util.tree_map(lambda s, f: jnp.where(done, s, f), start, following)
        return (following, jnp.where(done, 0, steps_taken + 1)), (transition, keep, met, flops)

    def update(carry, _):
        agent_state, episode, (best_ratios, best_reward, best_flops), key = carry
        key, rollout_key = jax.random.split(key)
        episode, (rollout, keeps, met, flops) = jax.lax.scan(
            functools.partial(env_step, agent_state.params), episode,
            jax.random.split(rollout_key, config.steps_per_update))
        observation, _ = episode
        _, last_value = apply(agent_state.params, observation)
        params, opt_state, _ = ppo_update(agent_state.params, agent_state.opt_state, apply, rollout,
                                          last_value, config)
        i = best_episode(rollout.reward, flops, met)
        better = met[i] & better_episode(rollout.reward[i], flops[i], best_reward, best_flops)
        best = (jnp.where(better, keeps[i], best_ratios), jnp.where(better, rollout.reward[i], best_reward),
                jnp.where(better, flops[i], best_flops))
        ended = rollout.done.astype(jnp.float32)
        mean_reward = jnp.sum(rollout.reward * ended) / jnp.sum(ended)
        return (AgentState(params, opt_state), episode, best, key), mean_reward

    def fallback():
        ratio = largest_uniform_keep_ratio(env, env_state, num_layers, budget)
        ratios = jnp.full((num_layers,), ratio, jnp.float32)
        return ratios, 100.0 * env.reward(env_state, ratios).astype(jnp.float32)

    best = (jnp.ones(num_layers, jnp.float32), jnp.full((), -jnp.inf), jnp.full((), -jnp.inf))
    (agent_state, _, (best_ratios, best_reward, _), _), mean_rewards = jax.lax.scan(
        update, (agent_state, (start, jnp.zeros((), jnp.int32)), best, key), None, length=config.updates)
    agent_met_target = jnp.isfinite(best_reward)
    keep_ratios, reward = jax.lax.cond(agent_met_target, lambda: (best_ratios, best_reward), fallback)
    flops = env.flops_kept(env_state, keep_ratios)
    return agent_state, SearchResult(keep_ratios=keep_ratios, reward=reward, flops_kept=flops,
                                     agent_met_target=agent_met_target, met_target=flops <= budget,
                                     mean_episode_reward=mean_rewards)


def search_clients(agent_states: AgentState, env_states: Any, keys: jax.Array, *, env: PruningEnv,
                   template: GraphTemplate, config: AgentConfig) -> tuple[AgentState, SearchResult]:
    """`search` vmapped over clients: every argument but the static ones has a leading client axis."""
    return jax.vmap(functools.partial(search, env=env, template=template, config=config))(
        agent_states, env_states, keys)


def save_agent(path, agent_state: AgentState) -> None:
    """Writes an agent (network parameters and Adam state) to `path`, e.g. to start other clients from it."""
    from pathlib import Path

    Path(path).write_bytes(flax.serialization.to_bytes(agent_state))


def load_agent(path, template: GraphTemplate, config: AgentConfig) -> AgentState:
    """The agent saved at `path`, for an encoder of `template` and networks of `config`."""
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--agent-init {path}: is a folder; give the file agent.save_agent wrote")
    if not path.is_file():
        raise ValueError(f"--agent-init {path}: no such file (give the file agent.save_agent wrote)")
    like = init_agent(jax.random.key(0), template, config)
    try:
        loaded = flax.serialization.from_bytes(like, path.read_bytes())
    except OSError as err:
        raise ValueError(f"--agent-init {path}: cannot be read ({err.strerror})") from None
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--agent-init {path}: not an agent of this encoder and network size ({err})") from None
    shapes = [(jnp.shape(a), jnp.shape(b)) for a, b in zip(jax.tree_util.tree_leaves(loaded),
                                                          jax.tree_util.tree_leaves(like))]
    if any(a != b for a, b in shapes):
        raise ValueError(f"--agent-init {path}: not an agent of this encoder and network size (its arrays have "
                         f"other shapes than a {config.hidden_size}-wide agent's)")
    return loaded
