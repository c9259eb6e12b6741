"""SCAFFOLD's control variates, the piece SCAFFOLD and SPATL share.

A client corrects each local gradient by c - c_i (the server's estimate of the
global update direction minus its own), and after training re-estimates
c_i+ = c_i - c + (x - y) / (a lr)   (SCAFFOLD's option II),
with x the model it started from, y the one it ended with and a the
optimizer's effective number of steps (`LocalSGD.effective_steps`: K plain SGD
steps, or FedNova's ||a||_1 under momentum, which moves the weights about
1 / (1 - momentum) times further per gradient). Both work on any pytree (the
whole model for SCAFFOLD, the encoder for SPATL). The server then moves c by
the sum of the round's control deltas over N, the number of all clients.
"""

from __future__ import annotations

from typing import Any

import chex
import jax

from fedjax_sparse.core.messages.aggregation import present_sum
from fedjax_sparse.core.round.local_training import LocalSGD

tree_map = jax.tree_util.tree_map


def corrected_gradients(grads: Any, server_control: Any, client_control: Any) -> Any:
    """g + c - c_i, leaf by leaf."""
    chex.assert_trees_all_equal_shapes(grads, server_control, client_control)
    return tree_map(lambda g, c, ci: g + c - ci, grads, server_control, client_control)


def control_update(local: LocalSGD, client_control: Any, server_control: Any, start: Any, end: Any,
                   num_steps: jax.Array, round_index: jax.Array) -> Any:
    """c_i+ = c_i - c + (start - end) / (effective steps x the round's learning rate)."""
    chex.assert_trees_all_equal_shapes(client_control, server_control, start, end)
    scale = 1.0 / (local.effective_steps(num_steps) * local.learning_rate_at(round_index))
    return tree_map(lambda ci, c, w0, w1: ci - c + (w0 - w1) * scale, client_control, server_control, start, end)


def server_control_update(server_control: Any, control_deltas: Any, num_clients: int,
                          participating: jax.Array | None = None) -> Any:
    """c <- c + (1/N) sum over the round's clients of their control deltas (leading client axis); given
    `participating` (`RoundInfo`), over the clients taking part alone (an absent one's c_i did not change)."""
    chex.assert_trees_all_equal_shapes(server_control, tree_map(lambda d: d[0], control_deltas))
    return tree_map(lambda c, d: c + d / num_clients, server_control, present_sum(control_deltas, participating))
