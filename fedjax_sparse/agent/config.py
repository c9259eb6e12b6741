"""The agent's settings (`AgentConfig`): search layout, PPO and network sizes, each checked on creation.

Its own module so that the PPO update (`ppo`) and the search (`search`) both read it
without importing each other.
"""

from __future__ import annotations

import dataclasses
import math


def _check_int(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = False) -> None:
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (isinstance(value, (int, float)) and above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Search and PPO settings; defaults are the paper's (sec. 4.1) or the official code's.

    updates: PPO updates per search (one search per client per round; ours).
    steps_per_update: environment steps collected per update (paper: 20).
    epochs: full-batch gradient steps per update (paper: 20).
    gamma (paper .99), gae_lambda (1: plain discounted returns), clip (paper .2).
    learning_rate, adam_b1, adam_b2: Adam (paper: 3e-4, (.9, .999)).
    action_std: the Gaussian's fixed standard deviation (paper: .5).
    entropy_coef, value_coef: loss weights (official code: .01, .5).
    min_keep_ratio: p_min, the lowest keep ratio an episode can reach (official: .1).
    max_episode_steps: T, steps before an episode that missed the budget ends (official: 10).
    flops_target: the required FLOPs reduction, a fraction of the dense encoder's (official: .2).
    penalty: the reward of an episode that missed the budget (see the module docstring).
    hidden_size, message_passing_steps: the networks' width and depth (ours).
    """

    updates: int = 5
    steps_per_update: int = 20
    epochs: int = 20
    gamma: float = 0.99
    gae_lambda: float = 1.0
    clip: float = 0.2
    learning_rate: float = 3e-4
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    action_std: float = 0.5
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    min_keep_ratio: float = 0.1
    max_episode_steps: int = 10
    flops_target: float = 0.2
    penalty: float = 0.0
    hidden_size: int = 64
    message_passing_steps: int = 2

    def __post_init__(self):
        for name in ("updates", "steps_per_update", "epochs", "max_episode_steps", "hidden_size"):
            _check_int(name, getattr(self, name), 1)
        _check_int("message_passing_steps", self.message_passing_steps, 0)
        _check_range("gamma", self.gamma, 0.0, 1.0, low_open=True)
        _check_range("gae_lambda", self.gae_lambda, 0.0, 1.0)
        _check_range("clip", self.clip, 0.0, 1.0, low_open=True, high_open=True)
        _check_range("learning_rate", self.learning_rate, 0.0, math.inf, low_open=True, high_open=True)
        _check_range("adam_b1", self.adam_b1, 0.0, 1.0, high_open=True)
        _check_range("adam_b2", self.adam_b2, 0.0, 1.0, high_open=True)
        _check_range("action_std", self.action_std, 0.0, math.inf, low_open=True, high_open=True)
        _check_range("entropy_coef", self.entropy_coef, 0.0, math.inf, high_open=True)
        _check_range("value_coef", self.value_coef, 0.0, math.inf, high_open=True)
        _check_range("min_keep_ratio", self.min_keep_ratio, 0.0, 1.0, low_open=True)
        _check_range("flops_target", self.flops_target, 0.0, 1.0, low_open=True, high_open=True)
        _check_range("penalty", self.penalty, -math.inf, math.inf, low_open=True, high_open=True)

    @property
    def flops_budget(self) -> float:
        """The fraction of the dense encoder FLOPs a pruned encoder may keep."""
        return 1.0 - self.flops_target
