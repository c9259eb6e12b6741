"""PPO for a Gaussian policy with fixed standard deviation (SPATL sec. 3.2.2, eq. 8).

Rollout storage is a `Transition` with a leading time axis; observations are
any pytree that the policy function `apply_fn(params, observation) ->
(means [L], value)` reads, so this module knows nothing of graphs.

One update (`ppo_update`): advantages by GAE over the stored steps, then
`epochs` full-batch Adam steps on

  loss = -E[min(r A, clip(r, 1 - eps, 1 + eps) A)]          (eq. 8, negated)
         + value_coef E[(V - R)^2] - entropy_coef H

Choices where the paper is silent:
  * GAE with lambda (`gae_lambda = 1`, our default, gives the discounted
    returns minus the value that the paper's gamma alone implies; the
    official code uses Monte-Carlo returns). A rollout cut in the middle of
    an episode is bootstrapped by the value of the state it stopped in.
  * Advantages are standardized over the batch before the loss (standard
    PPO practice; the official code standardizes the returns instead):
    rewards are accuracy x 100, and a critic still learning that scale would
    otherwise give every early action the same large positive advantage.
  * The action's log-probability is that of the raw Gaussian sample; the
    environment clips it to [0, 1] (as the official code does).
  * With the paper's fixed standard deviation the entropy is a constant, so
    the entropy bonus (coefficient 0.01, official code) changes the loss
    value but no gradient; it is kept so the loss matches the official one.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from fedjax_sparse.agent.config import AgentConfig

PolicyFn = Callable[[Any, Any], tuple[jax.Array, jax.Array]]


@flax.struct.dataclass
class Transition:
    """One environment step (or, stacked, a rollout [T, ...]) as PPO stores it.

    `action` is the raw Gaussian sample, `log_prob` and `value` what the
    acting policy gave for it, `reward` the step's reward (0 until an
    episode ends) and `done` whether the episode ended with this step.
    """

    observation: Any
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array


def _optimizer(config: AgentConfig) -> optax.GradientTransformation:
    return optax.adam(config.learning_rate, b1=config.adam_b1, b2=config.adam_b2)


def init_optimizer_state(params: Any, config: AgentConfig) -> optax.OptState:
    """Adam's state over the parameters raveled into one vector, as `ppo_update` steps them.

    Adam is elementwise, so this is the same arithmetic as on the tree; one
    vector instead of one set of moment updates per leaf makes the search's
    program much quicker to compile.
    """
    return _optimizer(config).init(ravel_pytree(params)[0])


def gaussian_log_prob(action: jax.Array, mean: jax.Array, std: float) -> jax.Array:
    """log N(action; mean, std^2 I), summed over the action's dimensions."""
    z = (action - mean) / std
    return jnp.sum(-0.5 * z * z - math.log(std) - 0.5 * math.log(2 * math.pi), axis=-1)


def gaussian_entropy(dim: int, std: float) -> float:
    return dim * (0.5 + 0.5 * math.log(2 * math.pi) + math.log(std))


def generalized_advantages(rewards: jax.Array, values: jax.Array, dones: jax.Array,
                           last_value: jax.Array, gamma: float,
                           gae_lambda: float) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns) [T] of one rollout; `last_value` = V(state after the last step).

    A done step does not look past its episode's end.
    """
    chex.assert_rank([rewards, values, dones], 1)
    chex.assert_equal_shape([rewards, values, dones])
    continues = 1.0 - dones.astype(jnp.float32)
    next_values = jnp.concatenate([values[1:], last_value[None]])
    deltas = rewards + gamma * continues * next_values - values

    def backward(advantage, step):
        delta, cont = step
        advantage = delta + gamma * gae_lambda * cont * advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(backward, jnp.zeros((), jnp.float32), (deltas, continues),
                                 reverse=True)
    return advantages, advantages + values


def ppo_loss(params: Any, apply_fn: PolicyFn, batch: Transition, advantages: jax.Array,
             returns: jax.Array, config: AgentConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped PPO loss of eq. 8 plus value loss and entropy bonus, over a batch [T]."""
    means, values = jax.vmap(apply_fn, in_axes=(None, 0))(params, batch.observation)
    log_prob = gaussian_log_prob(batch.action, means, config.action_std)
    ratio = jnp.exp(log_prob - batch.log_prob)
    clipped = jnp.clip(ratio, 1.0 - config.clip, 1.0 + config.clip)
    policy_loss = -jnp.mean(jnp.minimum(ratio * advantages, clipped * advantages))
    value_loss = jnp.mean((values - returns) ** 2)
    entropy = gaussian_entropy(batch.action.shape[-1], config.action_std)
    loss = policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy
    return loss, {"policy_loss": policy_loss, "value_loss": value_loss,
                  "clip_fraction": jnp.mean(jnp.abs(ratio - 1.0) > config.clip)}


def ppo_update(params: Any, opt_state: optax.OptState, apply_fn: PolicyFn, rollout: Transition,
               last_value: jax.Array, config: AgentConfig) -> tuple[Any, optax.OptState, dict[str, jax.Array]]:
    """`config.epochs` full-batch Adam steps on one rollout; metrics are per epoch."""
    advantages, returns = generalized_advantages(rollout.reward, rollout.value, rollout.done,
                                                 last_value, config.gamma, config.gae_lambda)
    advantages = (advantages - jnp.mean(advantages)) / (jnp.std(advantages) + 1e-8)
    optimizer = _optimizer(config)
    grad_fn = jax.grad(ppo_loss, has_aux=True)
    flat_params, unravel = ravel_pytree(params)

    def epoch(carry, _):
        flat_params, opt_state = carry
        grads, metrics = grad_fn(unravel(flat_params), apply_fn, rollout, advantages, returns, config)
        updates, opt_state = optimizer.update(ravel_pytree(grads)[0], opt_state, flat_params)
        return (flat_params + updates, opt_state), metrics

    (flat_params, opt_state), metrics = jax.lax.scan(epoch, (flat_params, opt_state), None,
                                                     length=config.epochs)
    return unravel(flat_params), opt_state, metrics
