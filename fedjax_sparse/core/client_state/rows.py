"""One client's state as a row of bytes (`RowLayout`), and which row slot holds each client (`SlotMap`).

The host and disk client stores (`core.client_state.store`) keep a client's state as one row: its
leaves' bytes one after the other, packed and unpacked inside the jitted round, so a round moves
one [K, row_bytes] block each way and the blocks of several processes combine exactly
(`core.round.distributed`). A row that a kept checkpoint refers to is never overwritten: `SlotMap`
moves a client written after a checkpoint to a free (or new) slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]       # of one client's leaf
    dtype: Any                   # the leaf's dtype (a PRNG key dtype for keys)
    stored: Any                  # the numpy dtype its bytes are read as
    stored_shape: tuple[int, ...]
    offset: int
    nbytes: int


class RowLayout:
    """How one client's state (a pytree) is laid out as a row of bytes, and back (traceable)."""

    def __init__(self, one_client: Any):
        leaves, self.treedef = jax.tree_util.tree_flatten(one_client)
        specs, offset = [], 0
        for leaf in leaves:
            shape, dtype = tuple(leaf.shape), leaf.dtype
            if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
                data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
                stored, stored_shape = np.dtype(data.dtype), tuple(data.shape)
            else:
                stored = np.dtype(np.uint8) if dtype == np.bool_ else np.dtype(dtype)
                stored_shape = shape
            nbytes = int(np.prod(stored_shape, dtype=np.int64)) * stored.itemsize
            specs.append(_Leaf(shape, dtype, stored, stored_shape, offset, nbytes))
            offset += nbytes
        self.leaves = tuple(specs)
        self.row_bytes = offset

    def __eq__(self, other):
        return isinstance(other, RowLayout) and (self.treedef, self.leaves) == (other.treedef, other.leaves)

    def __hash__(self):
        return hash((self.treedef, self.leaves))

    @classmethod
    def of_states(cls, states: Any) -> "RowLayout":
        """The layout of states with a leading clients axis (arrays or shape structs)."""
        return cls(tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), states))

    def signature(self) -> list:
        """What a snapshot records to refuse rows written with another layout."""
        return [[list(l.shape), str(l.dtype), l.offset, l.nbytes] for l in self.leaves]

    def pack(self, states: Any, num_rows: int) -> jax.Array:
        """[M, ...] states -> uint8 [M, row_bytes]."""
        parts = []
        for spec, x in zip(self.leaves, self.treedef.flatten_up_to(states)):
            if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            x = x.astype(spec.stored).reshape(num_rows, -1)
            if spec.stored.itemsize > 1:
                x = jax.lax.bitcast_convert_type(x, jnp.uint8)
            parts.append(x.reshape(num_rows, spec.nbytes))
        return jnp.concatenate(parts, axis=1) if parts else jnp.zeros((num_rows, 0), jnp.uint8)

    def unpack(self, rows: jax.Array) -> Any:
        """uint8 [M, row_bytes] -> [M, ...] states."""
        m = rows.shape[0]
        leaves = []
        for spec in self.leaves:
            x = rows[:, spec.offset:spec.offset + spec.nbytes]
            if spec.stored.itemsize > 1:
                x = jax.lax.bitcast_convert_type(x.reshape(m, -1, spec.stored.itemsize), spec.stored)
            x = x.reshape(m, *spec.stored_shape)
            if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
                x = jax.random.wrap_key_data(x, impl=spec.dtype._impl)
            elif spec.dtype == np.bool_:
                x = x != 0
            leaves.append(x)
        return self.treedef.unflatten(leaves)


class SlotMap:
    """Which row slot holds each (local) client, and which slots kept checkpoints still need.

    live[i]: client i's slot (-1: never written). Writing a client whose slot a kept
    checkpoint refers to moves it to a free (or new) slot; any other slot is overwritten in
    place. `commit` records a checkpoint's map: the last `keep` of them stay readable.
    """

    def __init__(self, num_local: int, keep: int):
        self.live = np.full(num_local, -1, np.int64)
        self.keep = keep
        self.num_slots = 0
        self._kept: list[np.ndarray] = []  # the slots each kept checkpoint refers to, oldest first
        self._pinned = np.zeros(0, bool)
        self._free: list[int] = []

    def assign(self, local: np.ndarray) -> np.ndarray:
        """Slots to write these (distinct) clients to; updates `live`."""
        slots = self.live[local].copy()
        for j, slot in enumerate(slots):
            if slot < 0 or (slot < len(self._pinned) and self._pinned[slot]):
                if self._free:
                    slots[j] = self._free.pop()
                else:
                    slots[j] = self.num_slots
                    self.num_slots += 1
        self.live[local] = slots
        return slots

    def commit(self) -> np.ndarray:
        """Pins the current map (a checkpoint's) and frees slots no kept map refers to."""
        saved = self.live.copy()
        self._kept = (self._kept + [saved[saved >= 0]])[-self.keep:] if self.keep else []
        self._refresh()
        return saved

    def older_pins(self) -> np.ndarray:
        """The slots the kept checkpoints before the latest refer to."""
        return np.unique(np.concatenate([np.zeros(0, np.int64), *self._kept[:-1]]))

    def load(self, live: np.ndarray, num_slots: int, older: np.ndarray | None = None) -> None:
        """Restores a checkpoint's map, its slots and `older` (those of the checkpoints kept before it,
        `older_pins`) pinned; other slots up to `num_slots` are free."""
        self.live = np.asarray(live, np.int64).copy()
        self.num_slots = max(int(num_slots), int(self.live.max(initial=-1)) + 1)
        kept = ([] if older is None else [np.asarray(older, np.int64)]) + [self.live[self.live >= 0]]
        self._kept = kept[-self.keep:] if self.keep else []
        self._refresh()

    def _refresh(self) -> None:
        self._pinned = np.zeros(self.num_slots, bool)
        for kept in self._kept:
            self._pinned[kept] = True
        used = self._pinned.copy()
        used[self.live[self.live >= 0]] = True
        self._free = np.flatnonzero(~used)[::-1].tolist()  # pop() takes the lowest
