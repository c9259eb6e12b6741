"""Accuracy of the global model on the test set and of each client's model on its own test split."""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sparse.data.federated import FederatedSplit, normalize
from fedjax_sparse.models.layers import BN_MOMENTUM
from fedjax_sparse.models.structure import Model


def _padded_scores(model: Model, variables, x, y, mask, mean, std, batch_size: int):
    """(correct, loss sum) over examples whose mask is True; len(x) is a multiple of batch_size."""
    n = x.shape[0] // batch_size

    def one(batch):
        xb, yb, mb = batch
        logits, _ = model.apply(variables, normalize(xb, mean, std), train=False)
        correct = jnp.sum((jnp.argmax(logits, -1) == yb) & mb)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        return correct, jnp.sum(jnp.where(mb, losses, 0.0))

    batched = jax.tree_util.tree_map(lambda a: a.reshape(n, batch_size, *a.shape[1:]), (x, y, mask))
    correct, loss = jax.lax.map(one, batched)
    return jnp.sum(correct), jnp.sum(loss)


def global_evaluator(model: Model, x: np.ndarray, y: np.ndarray, mean, std,
                     batch_size: int = 500) -> Callable[[Any], dict]:
    """Jitted `evaluate(variables) -> {'accuracy', 'loss'}` on a whole test set put on the device once."""
    total = len(y)
    batch_size = min(batch_size, total)
    padded = math.ceil(total / batch_size) * batch_size
    pad = padded - total
    xs = jnp.asarray(np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]))
    ys = jnp.asarray(np.concatenate([y, np.zeros(pad, y.dtype)]).astype(np.int32))
    mask = jnp.arange(padded) < total
    mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)

    @jax.jit
    def evaluate(variables):
        correct, loss = _padded_scores(model, variables, xs, ys, mask, mean, std, batch_size)
        return {"accuracy": correct / total, "loss": loss / total}

    return evaluate


def personalized_evaluator(model: Model, client_variables: Callable, test: FederatedSplit,
                           batch_size: int = 128, clients_per_chunk: int = 16) -> Callable[[Any, Any], jax.Array]:
    """Jitted `evaluate(server_state, client_states) -> [num_clients] accuracies`.

    Client i predicts with `client_variables(server_state, client_states[i])` on
    its own test split; clients are vmapped in chunks to bound memory.
    """
    batch_size = min(batch_size, test.max_count)
    padded = math.ceil(test.max_count / batch_size) * batch_size

    def one_client(server_state, client_state, offset, count):
        variables = client_variables(server_state, client_state)
        pos = jnp.arange(padded)
        mask = pos < count
        index = offset + jnp.minimum(pos, count - 1)
        correct, _ = _padded_scores(model, variables, test.x[index], test.y[index], mask,
                                    test.mean, test.std, batch_size)
        return correct / count

    @jax.jit
    def evaluate(server_state, client_states):
        return jax.lax.map(lambda args: one_client(server_state, *args),
                           (client_states, test.offsets, test.counts), batch_size=clients_per_chunk)

    return evaluate


def population_batch_stats(model: Model, variables, split: FederatedSplit, batch_size: int = 500):
    """BatchNorm statistics of `variables` recomputed over every example of `split` (static BN).

    HeteroFL's "static batch normalization": sub-models train with batch statistics only,
    so before the global model is evaluated the server recomputes each BN's statistics as
    the average over the training batches of their batch means and variances (PyTorch's
    cumulative average, `momentum=None`). Batches are consecutive slices of the split's
    flat data (all clients' examples); the last, partial batch is weighted by its size.
    Returns new `batch_stats` ({} for models without BatchNorm).
    """
    if not jax.tree_util.tree_leaves(variables["batch_stats"]):
        return variables["batch_stats"]
    total = split.x.shape[0]
    batch_size = min(batch_size, total)
    n = math.ceil(total / batch_size)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, variables["batch_stats"])
    keep = BN_MOMENTUM  # new = keep * old + (1 - keep) * batch, so from zeros: batch = new / (1 - keep)

    def one(i):
        pos = i * batch_size + jnp.arange(batch_size)
        mask = pos < total
        index = jnp.minimum(pos, total - 1)
        x = normalize(split.x[index], split.mean, split.std)
        _, stats = model.apply({**variables, "batch_stats": zeros}, x, train=True, mask=mask)
        count = jnp.sum(mask).astype(jnp.float32)
        return jax.tree_util.tree_map(lambda s: s / (1.0 - keep) * count, stats), count

    sums, counts = jax.lax.map(one, jnp.arange(n))
    return jax.tree_util.tree_map(lambda s: jnp.sum(s, axis=0) / jnp.sum(counts), sums)
