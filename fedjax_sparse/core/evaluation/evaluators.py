"""Accuracy of the global model on the test set and of each client's model on its own test split."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.structure.flops import forward_flops
from fedjax_sparse.data.federated import FederatedSplit, normalize
from fedjax_sparse.models.layers import BN_MOMENTUM
from fedjax_sparse.models.structure import Model


AUTO = "auto"


def window_scores(model: Model, variables, x: jax.Array, y: jax.Array, offset: jax.Array, count: jax.Array,
                  mean, std, batch_size: int) -> tuple[jax.Array, jax.Array]:
    """(correct predictions, summed loss) over examples [offset, offset + count) of flat arrays x, y.

    Full batches of `batch_size`, then what is left in quarter batches (`tail_batch`), so an
    evaluation stops at its own size and computes less than a quarter batch of padding: a client of
    100 test examples in batches of 32 runs 3 full batches and one of 8 (4 padded slots) rather than
    4 of 32 (28). Each batch is a contiguous slice of x, moved back from the end of the arrays where
    it would run past them; slots outside the window are left out of both sums. Under `vmap` each
    loop runs as long as the largest window of the batch of windows needs.
    """
    total = x.shape[0]
    batch_size = min(batch_size, total)
    tail = tail_batch(batch_size)
    full = count // batch_size
    correct, loss = _batches(model, variables, x, y, offset, offset + count, full, batch_size, mean, std)
    rest = count - full * batch_size
    tail_correct, tail_loss = _batches(model, variables, x, y, offset + full * batch_size, offset + count,
                                       (rest + tail - 1) // tail, tail, mean, std)
    return correct + tail_correct, loss + tail_loss


def tail_batch(batch_size: int) -> int:
    """The batch a window's remainder (under `batch_size` examples) is scored in: a quarter batch, so at
    most four of them and under a quarter batch of padding."""
    return max(1, batch_size // 4)


def _batches(model: Model, variables, x, y, start, end, num_batches, size: int, mean, std):
    """(correct, summed loss) over examples [start, end), scored `num_batches` slices of `size` at a time."""
    last_start = x.shape[0] - size

    def body(state):
        i, correct, loss = state
        first = start + i * size
        at = jnp.minimum(first, last_start)
        pos = at + jnp.arange(size)
        mask = (pos >= first) & (pos < end)
        labels = jax.lax.dynamic_slice_in_dim(y, at, size)
        images = jax.lax.dynamic_slice_in_dim(x, at, size)
        logits, _ = model.apply(variables, normalize(images, mean, std), train=False)
        correct = correct + jnp.sum((jnp.argmax(logits, -1) == labels) & mask)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return i + 1, correct, loss + jnp.sum(jnp.where(mask, losses, 0.0))

    zero = jnp.zeros((), jnp.int32)
    _, correct, loss = jax.lax.while_loop(lambda s: s[0] < num_batches, body, (zero, zero, jnp.zeros(())))
    return correct, loss


def default_global_batch(model: Model, total: int, max_batch_flops: float = 1e8) -> int:
    """The global evaluator's batch: the largest of 1000, 500, 250 and 125 examples (each divides
    CIFAR's and MNIST's 10,000 test images) whose forward pass stays within `max_batch_flops`
    multiply-adds, at least 125, at most the test set.

    Each batch costs a loop step, a slice and a normalisation besides its forward pass, which a
    small model does not amortise: the digits MLP (84 k multiply-adds an example) evaluated 2.3x
    training's examples per second in batches of 125 and 4.3x in batches of 1,000 (2,500: 3.5x) on 2
    CPU cores. A CIFAR CNN (tens of millions an example) gets 125: spafl_cnn evaluates as fast in
    batches of 32 to 500, and small batches hold less memory (its first layer's activations of 500
    images alone take 100 MB)."""
    per_example = max(float(forward_flops(model.structure)), 1.0)
    fitting = [b for b in (1000, 500, 250) if b * per_example <= max_batch_flops]
    return min(fitting[0] if fitting else 125, total)


def global_evaluator(model: Model, x: np.ndarray, y: np.ndarray, mean, std,
                     batch_size: int | None = None) -> Callable[[Any], dict]:
    """`evaluate(variables) -> {'accuracy', 'loss'}`, jitted, on a whole test set put on the device once.

    Full batches, the rest in quarter batches (`window_scores`); the default
    batch is `default_global_batch`'s.
    """
    total = len(y)
    if total < 1:
        raise ValueError("the test set is empty: global evaluation needs at least one example")
    batch_size = default_global_batch(model, total) if batch_size is None else min(batch_size, total)
    xs, ys = jnp.asarray(x), jnp.asarray(np.asarray(y).astype(np.int32))
    mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)

    def evaluate(xs, ys, variables):
        correct, loss = window_scores(model, variables, xs, ys, jnp.int32(0), jnp.int32(total), mean, std,
                                      batch_size)
        return {"accuracy": correct / total, "loss": loss / total}

    # The test set is an argument of the program: closed over, it would be compiled into it as a constant
    # (CIFAR-10's 30 MB of images: ResNet-20's evaluator compiled in 2.3 s instead of 0.5 s on 2 CPU cores).
    return functools.partial(jit(evaluate), xs, ys)


def default_evaluation_chunk(platform: str | None = None) -> int | None:
    """How many clients personalized evaluation takes at once on `platform` (default: JAX's
    backend): all of them on an accelerator (None: one vmap), one at a time on a CPU.

    Unlike training (`default_client_chunk`), evaluation on a CPU is fastest one client at a time
    for every model: a vmapped group runs its loop as long as its largest client, and XLA:CPU runs
    the group's batched products (grouped convolutions for a CNN) no faster than one client's.
    Measured on 2 cores with digits-MLP clients, examples per second one at a time against groups
    of 4 (what training's rule picks) and one vmap: 555 k, 293 k, 243 k for 100 clients of about
    100 test examples; 151 k, 47 k, 12 k for 1,000 clients of about 10."""
    return 1 if (platform or jax.default_backend()) == "cpu" else None


def personalized_evaluator(model: Model, client_variables: Callable, test: FederatedSplit,
                           batch_size: int = 32, client_chunk: int | None | str = AUTO
                           ) -> Callable[[Any, Any], jax.Array]:
    """Jitted `evaluate(server_state, client_states) -> [num_clients] accuracies`.

    Client i predicts with `client_variables(server_state, client_states[i])` on
    its own test split, in floor(n_i / batch_size) full batches and quarter batches for the rest
    (`window_scores`): small batches, since every client pads its last one (Dirichlet splits hold
    many clients of a few dozen test examples), and a vmap over clients makes
    an accelerator's batch large anyway. Clients go `client_chunk` at a time, as a round trains them: `None` vmaps
    all of them at once (the accelerator layout), c > 0 maps over vmapped
    groups of c, and the default is `default_evaluation_chunk`'s (one client at a
    time on a CPU, one vmap on an accelerator). Groups of several clients are
    formed from clients of similar test sizes, so that each group's loop stops
    near each of its clients' own sizes.
    """
    num_clients = test.num_clients
    if client_chunk is not None and client_chunk != AUTO and not 1 <= client_chunk <= num_clients:
        raise ValueError(f"client chunk must be in [1, {num_clients}] (the clients), got {client_chunk}")
    return functools.partial(split_evaluator(model, client_variables, batch_size, client_chunk), test=test)


def split_evaluator(model: Model, client_variables: Callable, batch_size: int = 32,
                    client_chunk: int | None | str = AUTO) -> Callable[[Any, Any, FederatedSplit], jax.Array]:
    """Jitted `evaluate(server_state, client_states, test) -> [M] accuracies` of M clients whose test
    data `test` holds (client k: `test.client(k)`): `personalized_evaluator` with the split an
    argument, so that one compilation serves the whole population's split and every chunk of
    clients' gathered windows (`data.windows`) of one shape alike; a chunk above M takes all M.

    The split is never a constant of the computation: XLA would fold its counts into reciprocals
    and multiply by them, 1 ulp off a division (3/7 -> 0.42857146), so accuracies would depend on
    how the clients' data reached the evaluator."""

    def one_client(server_state, client_state, test, offset, count):
        variables = client_variables(server_state, client_state)
        correct, _ = window_scores(model, variables, test.x, test.y, offset, count, test.mean, test.std,
                                   min(batch_size, test.max_count))
        return correct / count

    def evaluate(server_state, client_states, test):
        num_clients, chunk = test.num_clients, client_chunk
        if chunk == AUTO:
            chunk = default_evaluation_chunk()
        fn = lambda args: one_client(server_state, args[0], test, *args[1:])  # noqa: E731
        if chunk is None or chunk >= num_clients:
            return jax.vmap(fn)((client_states, test.offsets, test.counts))
        if chunk == 1:
            return jax.lax.map(fn, (client_states, test.offsets, test.counts))
        by_size = jnp.argsort(test.counts, stable=True)
        ordered = jax.tree_util.tree_map(lambda a: a[by_size], (client_states, test.offsets, test.counts))
        accuracies = jax.lax.map(fn, ordered, batch_size=chunk)
        return jnp.zeros_like(accuracies).at[by_size].set(accuracies)

    return jit(evaluate)


PERCENTILES = (10, 25, 50, 75, 90)


def client_accuracy_figures(accuracies: np.ndarray) -> dict:
    """The distribution of the clients' accuracies (each client's model on its own test split, one value
    per client, unweighted: fairness asks how the clients fare, not the examples): mean, standard
    deviation, min, max, the mean of the worst and of the best 10 % of clients (at least one each), and
    percentiles (numpy's linear interpolation), as `client_accuracy_<figure>`."""
    a = np.sort(np.asarray(accuracies, np.float64))
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"client accuracies must be a non-empty vector, got shape {a.shape}")
    tenth = max(1, int(np.ceil(0.1 * a.size)))
    out = {"mean": a.mean(), "std": a.std(), "min": a[0], "max": a[-1], "worst10": a[:tenth].mean(),
           "best10": a[-tenth:].mean(), **{f"p{q}": np.percentile(a, q) for q in PERCENTILES}}
    return {f"client_accuracy_{name}": float(value) for name, value in out.items()}


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every float in `tree` is finite (a diverged run's are not)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def population_diagnostics(algorithm: FederatedAlgorithm, server_state, client_states) -> dict:
    """`algorithm.diagnostics` of clients whose states are all at hand ([N, ...], id order)."""
    figures = jax.tree_util.tree_map(np.asarray, algorithm.client_diagnostics(server_state, client_states))
    return algorithm.diagnostics(server_state, figures)


def population_batch_stats(model: Model, variables, split: FederatedSplit, key: jax.Array, batch_size: int = 500):
    """BatchNorm statistics of `variables` recomputed over every example of `split` (static BN).

    HeteroFL's "static batch normalization": sub-models train with batch statistics only,
    so before the global model is evaluated the server recomputes each BN's statistics as
    the average over the training batches of their batch means and variances (PyTorch's
    cumulative average, `momentum=None`). Batches are consecutive slices of one random
    permutation of the split's examples drawn from `key`, as HeteroFL's code draws its
    batches shuffled: the split's own order is client by client, often class by class
    within a client, and batches of one class would average within-class variances, far
    below the data's. The last, partial batch is weighted by its size. Returns new
    `batch_stats` ({} for models without BatchNorm).
    """
    if not jax.tree_util.tree_leaves(variables["batch_stats"]):
        return variables["batch_stats"]
    total = split.x.shape[0]
    batch_size = min(batch_size, total)
    n = math.ceil(total / batch_size)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, variables["batch_stats"])
    keep = BN_MOMENTUM  # new = keep * old + (1 - keep) * batch, so from zeros: batch = new / (1 - keep)
    order = jax.random.permutation(key, total)

    def one(i):
        pos = i * batch_size + jnp.arange(batch_size)
        mask = pos < total
        index = order[jnp.minimum(pos, total - 1)]
        x = normalize(split.x[index], split.mean, split.std)
        _, stats = model.apply({**variables, "batch_stats": zeros}, x, train=True, mask=mask)
        count = jnp.sum(mask).astype(jnp.float32)
        return jax.tree_util.tree_map(lambda s: s / (1.0 - keep) * count, stats), count

    sums, counts = jax.lax.map(one, jnp.arange(n))
    return jax.tree_util.tree_map(lambda s: jnp.sum(s, axis=0) / jnp.sum(counts), sums)
