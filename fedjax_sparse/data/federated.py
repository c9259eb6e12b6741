"""Client data on the device: one flat array per split, each client an offset and a count.

Nothing is copied per round: a round gathers its batches by index inside the
jitted step (`client_batch`), so the host-to-device transfer happens once.
"""

from __future__ import annotations

from typing import Sequence

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.data.augment import random_crop_flip


@flax.struct.dataclass
class FederatedSplit:
    """All clients' examples of one split, stored client after client.

    x: [total, ...] examples (uint8 images, float32 features or int32 tokens, `data.dataset`);
    y: [total] int32; offsets, counts: [num_clients].
    `max_count` (static) is the largest client, which fixes the scan lengths.
    """

    x: jax.Array
    y: jax.Array
    offsets: jax.Array
    counts: jax.Array
    mean: jax.Array
    std: jax.Array
    max_count: int = flax.struct.field(pytree_node=False)
    augment: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def num_clients(self) -> int:
        return self.offsets.shape[0]

    def client(self, index: jax.Array) -> "ClientData":
        """The view of client `index` that `client_update` receives (traceable)."""
        return ClientData(x=self.x, y=self.y, offset=self.offsets[index], count=self.counts[index],
                          mean=self.mean, std=self.std, max_count=self.max_count,
                          augment=self.augment)


@flax.struct.dataclass
class ClientData:
    """One client's examples: a window [offset, offset + count) of the shared arrays.

    What `client_update` receives as `data` (`FederatedSplit.client`); an algorithm hands it to
    `LocalSGD.train`, or reads it by `example_index` (or `client_batch`, in `Batch`es).
    x, y: the examples and int32 labels of the whole split this is a view of (`FederatedSplit`, shared
      by its clients, never copied per client): the client's own are those `example_index` gives;
    offset, count: int32 scalars, where the client's examples start in `x` and how many it holds;
    mean, std: the data set's per-channel statistics, with which `normalize` standardizes images;
    max_count (static): the largest client's count, which fixes the shapes of the client's loops;
    augment (static): whether training batches are pad-cropped and flipped (`data.augment`);
    positions ([max_count] int32, optional) makes it a view of some of the window's
      examples, in any order: its example i is the window's example positions[i], i < count
      (e.g. the share a client holds out of training, `algorithms.spatl_selection.split_holdout`).
    """

    x: jax.Array
    y: jax.Array
    offset: jax.Array
    count: jax.Array
    mean: jax.Array
    std: jax.Array
    max_count: int = flax.struct.field(pytree_node=False)
    augment: bool = flax.struct.field(pytree_node=False, default=False)
    positions: jax.Array | None = None

    def example_index(self, local: jax.Array) -> jax.Array:
        """Indices into `x` and `y` of the client's examples `local` (clipped to its count)."""
        local = jnp.minimum(local, self.count - 1)
        return self.offset + (local if self.positions is None else self.positions[local])


@flax.struct.dataclass
class Batch:
    """A gathered batch of one client's examples (`client_batch`), what a local step trains on.

    x: [B, ...] the examples as the model sees them (`normalize`: images standardized, features
      and tokens as they are); y: [B] int32 labels; mask: [B] bool, False on the padding positions
      of a short batch (the last of an epoch when B does not divide the client's count), whose
      examples are repeats that the loss and the BatchNorm statistics leave out.
    """

    x: jax.Array
    y: jax.Array
    mask: jax.Array


def federated_split(x: np.ndarray, y: np.ndarray, client_indices: Sequence[np.ndarray],
                    mean: Sequence[float], std: Sequence[float], augment: bool = False) -> FederatedSplit:
    """Lays the clients' examples out contiguously and puts them on the device once."""
    if not client_indices:
        raise ValueError("client_indices is empty: at least one client is needed")
    counts = np.array([len(ix) for ix in client_indices], np.int32)
    if counts.min() < 1:
        empty = [i for i, c in enumerate(counts) if c == 0]
        raise ValueError(f"clients {empty[:10]} hold no examples; every client needs at least one")
    order = np.concatenate([np.asarray(ix, np.int64) for ix in client_indices])
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    return FederatedSplit(
        x=jnp.asarray(x[order]), y=jnp.asarray(y[order].astype(np.int32)),
        offsets=jnp.asarray(offsets), counts=jnp.asarray(counts),
        mean=jnp.asarray(mean, jnp.float32), std=jnp.asarray(std, jnp.float32),
        max_count=int(counts.max()), augment=augment)


def client_label_counts(data: ClientData, num_classes: int) -> jax.Array:
    """[num_classes] int32: how many of the client's training examples carry each label."""
    pos = jnp.arange(data.max_count)
    labels = data.y[data.example_index(pos)]
    return jnp.zeros((num_classes,), jnp.int32).at[labels].add((pos < data.count).astype(jnp.int32))


def steps_per_epoch(count: jax.Array, batch_size: int) -> jax.Array:
    return (count + batch_size - 1) // batch_size


def padded_step_fraction(counts: np.ndarray, batch_size: int, chunk: int | None = None) -> float:
    """Share of the vmapped steps that are no-ops when clients holding `counts` train together.

    Clients vmapped together run as many steps as the busiest of them; the
    others idle. `chunk=None` vmaps all of them at once; `chunk=c` groups them
    as the round's `lax.map` does: consecutive groups of c, the remainder last.
    """
    steps = np.ceil(np.asarray(counts) / batch_size)
    if not steps.size:  # no client trained (an empty Poisson draw)
        return 0.0
    chunk = len(steps) if chunk is None else chunk
    run = sum(len(group) * group.max() for group in np.split(steps, range(chunk, len(steps), chunk)))
    return float(1.0 - steps.sum() / run)


def normalize(x: jax.Array, mean: jax.Array, std: jax.Array,
              augment_key: jax.Array | None = None) -> jax.Array:
    """What a model sees of a batch of examples: uint8 images standardized to float32 (pad-crop and
    flip first when a key is given); float32 features and int32 tokens as they are (decided by the
    dtype, at trace time)."""
    if x.dtype != jnp.uint8:
        return x
    x = x.astype(jnp.float32) / 255.0
    if augment_key is not None:
        x = random_crop_flip(augment_key, x)
    return (x - mean) / std


def epoch_permutations(key: jax.Array, count: jax.Array, max_count: int, epochs: int) -> jax.Array:
    """[epochs, max_count] orderings whose first `count` entries permute range(count).

    Random sort keys for the padding slots are pushed past every real slot, so
    a client of any size shuffles inside a static shape.
    """
    slots = jnp.arange(max_count)

    def one(k):
        scores = jnp.where(slots < count, jax.random.uniform(k, (max_count,)), 2.0)
        return jnp.argsort(scores).astype(jnp.int32)

    return jax.vmap(one)(jax.random.split(key, epochs))


def client_batch(data: ClientData, order: jax.Array, step_in_epoch: jax.Array, batch_size: int,
                 key: jax.Array, train: bool) -> Batch:
    """Gathers batch `step_in_epoch` of an epoch with the given example order."""
    pos = step_in_epoch * batch_size + jnp.arange(batch_size)
    mask = pos < data.count
    index = data.example_index(order[jnp.minimum(pos, data.max_count - 1)])
    x = normalize(data.x[index], data.mean, data.std, key if train and data.augment else None)
    return Batch(x=x, y=data.y[index], mask=mask)


def assert_split(split: FederatedSplit) -> None:
    chex.assert_rank(split.x, 4 if split.x.dtype == jnp.uint8 else 2)
    chex.assert_rank([split.y, split.offsets, split.counts], 1)
    chex.assert_equal_shape([split.offsets, split.counts])
    assert split.x.dtype in (jnp.uint8, jnp.float32, jnp.int32), split.x.dtype
