"""FedGSE (gradient-based sub-model extraction): the server keeps the units whose outputs matter most
to data like the client's.

The round is the sub-model round of `algorithms.submodels` (capacities, masked
training, pricing, aggregation); FedGSE's rule for the units (section 4,
Algorithm 4): the server takes a batch of "similar data" for the client, runs
the full global model on it, and scores unit i of layer l by
    g_li = sum over examples and positions of |dL/dh_li|
(cross-entropy; a backward pass only, no training on the server), then keeps the
top ceil(beta N_l) units of each layer (a residual unit_group by its members'
summed scores). h is the unit's output as every sub-model method sees it
(`models.layers.unit_output`: after normalization and activation, which is
the paper's h_li = sigma(w_li h_{l-1} + b_li)). BatchNorm runs on the similar
batch's own statistics (the global model's running statistics are not
maintained under static BN).

Public and similar data (section 4.2, appendix C). The server holds a public
set: `public_fraction` (default 1 %) of every client's labelled training data,
which the clients upload once ("Clients Upload partial Data"; those examples
stay in the clients' training data too). A client's similar data is a random
batch of `similar_examples` (default 128) public examples whose labels are in
the client's label set L, redrawn every round; with fewer such examples than
that, all of them (the rest of the static batch is masked out of the loss).
L has s labels, s = `significant_labels`. The paper's clients each hold s
labels (a pathological label partition), so by default s is the partition's
labels per client; under any other partition (Dirichlet, IID, a data set's own
clients) it is the labels a typical client's data mostly consists of: the
median over clients of the fewest labels that hold 80 % of a client's examples
(`typical_labels`). L is known one of two ways:
  csl  the client sends its s most frequent labels (ties to the lower label);
       their bytes (one byte each up to 256 classes) count in its upload. The
       server needs them before it picks the sub-model; the simulation reads the
       same answer from the client's data at build time and also puts it, priced,
       in the client's upload of that round.
  spl  the server ranks the classes by the per-class accuracy of the client's
       last sub-model on the public set and takes the top s; a client with no
       earlier sub-model gets s random labels. The server remembers, per
       client, only that accuracy vector (num_clients x classes floats), not
       the sub-models: it scores each uploaded sub-model on the public set when
       it arrives.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.algorithms.submodels import ServerMemory, SubmodelOptions, submodel_algorithm
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm
from fedjax_sparse.core.round.local_training import masked_cross_entropy
from fedjax_sparse.core.messages.pricing import KnownMaskArray
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.core.round.streams import stream_seed
from fedjax_sparse.data.federated import FederatedSplit, client_label_counts, normalize
from fedjax_sparse.models.structure import Model

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class FedGSEOptions(SubmodelOptions):
    similar_labels: str = option("csl", "FedGSE: how the server learns a client's labels: csl (the client sends "
                                        "its top labels) or spl (predicted from its last sub-model)",
                                 choices=("csl", "spl"))
    similar_examples: int = option(128, "FedGSE: similar-data batch size per client and round", low=1)
    public_fraction: float = option(0.01, "FedGSE: share of every client's training data in the server's "
                                          "public set", low=0.0, low_open=True, high=1.0)
    significant_labels: int | None = option(None, "FedGSE: s, the labels that describe a client (default: the "
                                                  "labels partition's labels per client; under another partition "
                                                  "the median over clients of the fewest labels holding 80 % of "
                                                  "a client's examples)", low=1)


@dataclasses.dataclass(frozen=True)
class PublicSet:
    """The server's labelled public examples (uint8 images, int32 labels) with the data's normalization."""

    x: jax.Array
    y: jax.Array
    mean: jax.Array
    std: jax.Array


def public_set(train: FederatedSplit, fraction: float, seed: int) -> PublicSet:
    """ceil(fraction x n_k) random examples of every client k (the clients' one-time upload)."""
    rng = np.random.default_rng(stream_seed(seed, "public_data"))
    offsets, counts = np.asarray(train.offsets), np.asarray(train.counts)
    picked = [offset + rng.choice(count, math.ceil(fraction * count), replace=False)
              for offset, count in zip(offsets, counts)]
    index = np.concatenate(picked)
    return PublicSet(x=train.x[index], y=train.y[index], mean=train.mean, std=train.std)


def top_labels(label_counts: jax.Array, s: int) -> jax.Array:
    """[s] the s most frequent labels (ties to the lower label)."""
    return jax.lax.top_k(label_counts.astype(jnp.float32) - jnp.arange(label_counts.shape[0]) * 1e-6, s)[1]


def label_dtype(num_classes: int):
    return jnp.uint8 if num_classes <= 256 else jnp.int32


def similar_batch(public: PublicSet, labels: jax.Array, size: int, key: jax.Array):
    """(x, y, mask): up to `size` random public examples whose label is in `labels` (mask: real ones)."""
    eligible = jnp.isin(public.y, labels)
    priority = jax.random.uniform(key, public.y.shape) + 2.0 * eligible
    k = min(size, public.y.shape[0])
    _, index = jax.lax.top_k(priority, k)
    return normalize(public.x[index], public.mean, public.std), public.y[index], eligible[index]


def unit_gradient_scores(model: Model, variables: dict, x: jax.Array, y: jax.Array, mask: jax.Array) -> dict:
    """{layer: [units]} g_li = sum over examples and positions of |dL/dh_li| (FedGSE section 4.1)."""
    grads = model.unit_output_gradients({"params": variables["params"], "batch_stats": variables["batch_stats"]},
                                        x, lambda logits: masked_cross_entropy(logits, y, mask),
                                        train=True, mask=mask)
    return {name: jnp.sum(jnp.abs(g), axis=tuple(range(g.ndim - 1))) for name, g in grads.items()}


def class_accuracy(model: Model, variables: dict, public: PublicSet, num_classes: int) -> jax.Array:
    """[classes] accuracy of `variables` (a sub-model: with its unit masks) on each class of the public set."""
    x = normalize(public.x, public.mean, public.std)
    logits, _ = model.apply(variables, x, train=True)
    correct = (jnp.argmax(logits, -1) == public.y).astype(jnp.float32)
    per_class = jnp.zeros((num_classes,)).at[public.y].add(correct)
    counts = jnp.zeros((num_classes,)).at[public.y].add(1.0)
    return per_class / jnp.maximum(counts, 1.0)


def typical_labels(label_counts: np.ndarray, share: float = 0.8) -> int:
    """The median over clients ([N, classes] counts) of the fewest labels holding `share` of a client's examples
    (rounded up; clients without examples left out)."""
    counts = np.asarray(label_counts, np.float64)
    counts = counts[counts.sum(axis=1) > 0]
    covered = np.cumsum(-np.sort(-counts, axis=1), axis=1) / counts.sum(axis=1, keepdims=True)
    fewest = (covered < share - 1e-9).sum(axis=1) + 1
    return int(np.ceil(np.median(fewest)))


def fedgse(context: BuildContext, options: FedGSEOptions) -> FederatedAlgorithm:
    model = context.local.model
    num_classes = context.num_classes
    # (SPL's memory, [num_clients x classes] in the server state, would also be replicated on every process)
    train = context.device_train("fedgse", "draws its public set and its clients' label answers from every "
                                           "client's training data")
    s = options.significant_labels or context.labels_per_client or typical_labels(jax.jit(jax.vmap(
        lambda i: client_label_counts(train.client(i), num_classes)))(jnp.arange(context.num_clients)))
    if not 1 <= s <= num_classes:
        raise ValueError(f"--significant-labels must be in [1, {num_classes}] (the classes), got {s}")
    public = public_set(train, options.public_fraction, context.seed)
    dtype = label_dtype(num_classes)
    stats_shapes = jax.eval_shape(model.init, jax.random.key(0))["batch_stats"]

    def client_labels(data):
        return top_labels(client_label_counts(data, num_classes), s)

    answers = jax.jit(jax.vmap(lambda i: client_labels(train.client(i))))(
        jnp.arange(context.num_clients))  # what each client answers when asked (CSL)

    def spl_labels(memory, client_id, key):
        ranked = top_labels(memory["class_accuracy"][client_id], s)
        guessed = jax.random.permutation(key, num_classes)[:s]
        return jnp.where(memory["seen"][client_id], ranked, guessed)

    def scores(server_state, client_id, info, capacity):
        del capacity
        key = jax.random.fold_in(info.server_key, client_id)
        label_key, batch_key = jax.random.split(key)
        labels = answers[client_id] if options.similar_labels == "csl" else \
            spl_labels(server_state["memory"], client_id, label_key)
        x, y, mask = similar_batch(public, labels, options.similar_examples, batch_key)
        return unit_gradient_scores(model, server_state["variables"], x, y, mask)

    def remember(memory, ups, info):
        params = tree_map(lambda leaf: leaf.values, ups["variables"]["params"],
                          is_leaf=lambda x: isinstance(x, KnownMaskArray))
        stats = tree_map(lambda s_: jnp.zeros(s_.shape, s_.dtype), stats_shapes)
        accuracy = jax.vmap(lambda p, m: class_accuracy(
            model, {"params": p, "batch_stats": stats, "unit_masks": m}, public, num_classes))(
            params, ups["unit_masks"].value)
        ids, present = info.client_ids, info.participating
        if present is None:
            return {"class_accuracy": memory["class_accuracy"].at[ids].set(accuracy),
                    "seen": memory["seen"].at[ids].set(True)}
        # an absent client sent no sub-model: what the server knows of it stays
        return {"class_accuracy": memory["class_accuracy"].at[ids].set(
                    jnp.where(present[:, None], accuracy, memory["class_accuracy"][ids])),
                "seen": memory["seen"].at[ids].set(present | memory["seen"][ids])}

    if options.similar_labels == "csl":
        return submodel_algorithm("fedgse", context, options, scores,
                                  feedback=lambda data: {"labels": client_labels(data).astype(dtype)})
    memory = ServerMemory(init=lambda n: {"class_accuracy": jnp.zeros((n, num_classes), jnp.float32),
                                          "seen": jnp.zeros((n,), bool)},
                          update=remember)
    return submodel_algorithm("fedgse", context, options, scores, memory=memory)


SPEC = AlgorithmSpec("fedgse", FedGSEOptions, fedgse,
                     "FedGSE: sub-models of the units with the largest gradients on similar public data")
