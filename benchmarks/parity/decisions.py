"""Decisions near a tie: the ReLUs and 2x2 max pools of training, taken the library's way.

A ReLU whose input sits within float32 round-off of 0, or a max-pool window whose two largest values
do, can be decided one way by the library and the other by the official code, and which way depends
on the host (its summation order): the gradient then flows through another unit or another position,
and the two runs part by far more than round-off. These are not rare: a forward pass of these models
makes 1e4-1e5 such decisions per example, so a run of a few thousand example passes holds some within
1e-6 of a tie on any draw of the inputs, and no redraw clears them (a margin large enough to hold on
every host would hold hundreds). So the harness aligns them instead, as it feeds the official code
the library's random draws:

  * the library side (`LibraryDecisions`, JAX) records, for every ReLU and max pool its jitted local
    training runs, the positions within MARGIN of the tie (relative to the tensor's largest magnitude)
    and which way it decided them;
  * the official side (`OfficialDecisions`, torch) wraps their ReLU and max pool: in every training
    pass (gradients on) it takes the library's decision at the recorded positions where its own
    differs and its value is within MARGIN of the tie too, and counts those; a recorded decision it
    takes otherwise from a value beyond the margin, or a position it finds within MARGIN / 2 of a tie
    that the library did not record, means the two values differ by more than round-off and is
    counted `beyond` (the run's `aligned` row is then above round-off, `verdicts.py`).

Calls are matched in order, per round and client (`start`): the k-th ReLU or pool of a client's
training on one side is the k-th on the other. Layouts: the library's NHWC maps are recorded in
torch's NCHW; a batch the library pads (the last partial one) is cut to the official batch; a
sub-model's channels (HeteroFL, FedRolex: the official network is physically smaller) are mapped by
the method's `channel_map`.

The numpy core (`relu_near`, `pool_near`) is shared by both sides.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np

MARGIN = 1e-4
RELU, POOL = 0, 1
ChannelMap = Callable[[int, int], np.ndarray]  # (library channels, official channels) -> global index of each


def relu_near(x: np.ndarray, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """(flat positions, decided on) of a ReLU input's entries within `margin` x max |x| of 0."""
    x = np.asarray(x, np.float32)
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    where = np.flatnonzero(np.abs(x) <= margin * scale)
    return where, x.reshape(-1)[where] > 0


def windows(x: np.ndarray) -> np.ndarray:
    """[N, C, H // 2, W // 2, 4] 2x2 windows of an NCHW map, positions in row-major order."""
    h, w = x.shape[2] // 2 * 2, x.shape[3] // 2 * 2
    return np.stack([x[:, :, i:h:2, j:w:2] for i in (0, 1) for j in (0, 1)], axis=-1)


def pool_near(x: np.ndarray, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """(flat window positions, position chosen: the first maximum) of a max pool's windows whose two
    largest values lie within `margin` x max |x| of each other (windows of zeros, whose gradient meets
    a ReLU's zero derivative, left out)."""
    x = np.asarray(x, np.float32)
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    win = windows(x)
    top2 = np.sort(win, axis=-1)[..., -2:]
    near = (top2[..., 1] > 0) & (top2[..., 1] - top2[..., 0] <= margin * scale)
    where = np.flatnonzero(near)
    return where, np.argmax(win.reshape(-1, 4)[where], axis=-1).astype(np.int8)


def pack(calls: list[tuple[int, tuple[int, ...], np.ndarray, np.ndarray]], prefix: str) -> dict[str, np.ndarray]:
    """A client round's recorded calls as flat arrays under `prefix/`."""
    shapes = np.ones((len(calls), 4), np.int64)
    for i, (_, shape, _, _) in enumerate(calls):
        shapes[i, :len(shape)] = shape
    return {f"{prefix}/kind": np.array([c[0] for c in calls], np.int8),
            f"{prefix}/ndim": np.array([len(c[1]) for c in calls], np.int8), f"{prefix}/shape": shapes,
            f"{prefix}/count": np.array([len(c[2]) for c in calls], np.int64),
            f"{prefix}/where": np.concatenate([c[2] for c in calls]).astype(np.int64) if calls else np.zeros(0, np.int64),
            f"{prefix}/decision": np.concatenate([np.asarray(c[3], np.int8) for c in calls]) if calls
            else np.zeros(0, np.int8)}


def unpack(arrays: dict[str, np.ndarray], prefix: str) -> list[tuple[int, tuple[int, ...], np.ndarray, np.ndarray]]:
    bounds = np.concatenate([[0], np.cumsum(arrays[f"{prefix}/count"])])
    return [(int(kind), tuple(int(s) for s in arrays[f"{prefix}/shape"][i, :arrays[f"{prefix}/ndim"][i]]),
             arrays[f"{prefix}/where"][bounds[i]:bounds[i + 1]], arrays[f"{prefix}/decision"][bounds[i]:bounds[i + 1]])
            for i, kind in enumerate(arrays[f"{prefix}/kind"])]


def to_official(where: np.ndarray, library_shape: tuple[int, ...], official_shape: tuple[int, ...],
                channel_map: ChannelMap | None) -> tuple[np.ndarray, np.ndarray]:
    """The library's flat positions in the official tensor's: (positions, which of `where` they come
    from). Rows past the official batch (the library's padding) and channels the official sub-model
    lacks are dropped; `channel_map` gives the global channel of each official one."""
    index = np.unravel_index(where, library_shape)
    keep = index[0] < official_shape[0]
    channel = index[1]
    if channel_map is None and library_shape[1] != official_shape[1]:
        raise ValueError(f"library {library_shape} vs official {official_shape}: channels differ and the method "
                         f"gives no channel map")
    if channel_map is not None:  # FedRolex's full-width sub-model is the model with its channels rolled
        inverse = np.full(library_shape[1], -1, np.int64)
        inverse[channel_map(library_shape[1], official_shape[1])] = np.arange(official_shape[1])
        channel = inverse[channel]
        keep &= channel >= 0
    if library_shape[2:] != official_shape[2:]:
        raise ValueError(f"library {library_shape} vs official {official_shape}: spatial shapes differ")
    mapped = (index[0][keep], channel[keep]) + tuple(i[keep] for i in index[2:])
    return np.ravel_multi_index(mapped, official_shape), np.flatnonzero(keep)


# ------------------------------------------------------------------ the library side (JAX)

def nchw(x: np.ndarray) -> np.ndarray:
    return np.transpose(x, (0, 3, 1, 2)) if x.ndim == 4 else x


class LibraryDecisions:
    """While `installed()`, every ReLU (flax.linen.relu, jax.nn.relu) and `models.layers.max_pool2`
    the library runs records its near-tie decisions (a debug callback: the values are unchanged).
    Install before the jitted functions are first traced; `take(prefix)` after each client update
    (and `jax.effects_barrier()`)."""

    def __init__(self, margin: float = MARGIN):
        self.margin = margin
        self.calls: list = []

    def _record(self, kind: int):
        def record(x):
            x = nchw(np.asarray(x))
            where, decision = (relu_near if kind == RELU else pool_near)(x, self.margin)
            self.calls.append((kind, x.shape, where, decision))
        return record

    @contextlib.contextmanager
    def installed(self):
        import flax.linen
        import jax

        from fedjax_sparse.models import layers

        relu, pool = jax.nn.relu, layers.max_pool2

        def recorded_relu(x):
            jax.debug.callback(self._record(RELU), x, ordered=True)
            return relu(x)

        def recorded_pool(x):
            jax.debug.callback(self._record(POOL), x, ordered=True)
            return pool(x)

        flax.linen.relu = jax.nn.relu = recorded_relu
        layers.max_pool2 = recorded_pool
        try:
            yield self
        finally:
            flax.linen.relu = jax.nn.relu = relu
            layers.max_pool2 = pool

    def take(self, prefix: str) -> dict[str, np.ndarray]:
        out = pack(self.calls, prefix)
        self.calls = []
        return out


# ------------------------------------------------------------------ the official side (torch)

class OfficialDecisions:
    """Wraps torch.nn.functional's relu and max_pool2d (and `relu_owners`: (dict, key) pairs holding a
    reference to F.relu taken at import, as FedPM's activation_dict does) so that each training pass
    takes the library's recorded decisions (see the module docstring). `start(prefix, channel_map)`
    before a client's training in a round, `finish()` after it."""

    def __init__(self, library: dict[str, np.ndarray], relu_owners: tuple = (), margin: float = MARGIN):
        import torch.nn.functional as F

        self.library, self.margin = library, margin
        self.calls: list = []
        self.prefix = None
        self.channel_map: ChannelMap | None = None
        self.aligned = {RELU: 0, POOL: 0}
        self.beyond = 0
        self.passes = 0
        self.relu_original, self.pool_original = F.relu, F.max_pool2d
        F.relu = self.relu
        F.max_pool2d = self.max_pool2d
        for owner, key in relu_owners:
            owner[key] = self.relu

    def start(self, prefix: str, channel_map: ChannelMap | None = None, passes: int | None = None,
              skipped: tuple[int, ...] = ()) -> None:
        """Take the library's decisions of `prefix` in order. Where the official run skips some of the
        library's forward passes (SpaFL's code drops the short batch the library trains on), `passes` is
        the library's number of passes (its calls split evenly among them) and `skipped` those skipped."""
        if self.prefix is not None:
            raise RuntimeError(f"decisions of {self.prefix} not finished")
        calls = unpack(self.library, prefix)
        if skipped:
            if passes is None or len(calls) % passes:
                raise ValueError(f"{prefix}: {len(calls)} library calls do not split into {passes} passes")
            per = len(calls) // passes
            calls = [call for i, call in enumerate(calls) if i // per not in skipped]
        self.calls, self.prefix, self.channel_map = calls, prefix, channel_map

    def finish(self) -> None:
        if self.calls:
            raise RuntimeError(f"{self.prefix}: {len(self.calls)} library ReLU/pool calls left unmatched by the "
                               f"official run (its passes differ from the library's)")
        self.prefix = None

    def _next(self, kind: int, shape: tuple[int, ...]):
        if self.prefix is None:
            raise RuntimeError("a training pass of the official code ran outside start()/finish()")
        if not self.calls:
            raise RuntimeError(f"{self.prefix}: the official run makes more ReLU/pool calls than the library's")
        call = self.calls.pop(0)
        if call[0] != kind or len(call[1]) != len(shape):
            raise RuntimeError(f"{self.prefix}: official {('relu', 'pool')[kind]} {shape} met library "
                               f"{('relu', 'pool')[call[0]]} {call[1]}")
        return call

    def relu(self, x, inplace: bool = False):
        import torch
        if not (torch.is_grad_enabled() and x.requires_grad):
            return self.relu_original(x, inplace=inplace)
        _, shape, where, decision = self._next(RELU, tuple(x.shape))
        values = x.detach().cpu().numpy()
        at, source = to_official(where, shape, tuple(x.shape), self.channel_map)
        flat = values.reshape(-1)
        near = np.abs(flat[at]) <= self.margin * float(np.max(np.abs(values)))
        force = self._sort(flat[at] > 0, decision[source].astype(bool), near, relu_near(values, self.margin / 2)[0], at)
        if not force.any():
            return self.relu_original(x, inplace=inplace)
        self.aligned[RELU] += int(force.sum())
        keep = flat > 0
        keep[at[force]] = decision[source][force].astype(bool)
        return x * torch.from_numpy(keep.reshape(values.shape).astype(values.dtype))

    def max_pool2d(self, x, *args, **kwargs):
        import torch
        out = self.pool_original(x, *args, **kwargs)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return out
        size = args[0] if args else kwargs.get("kernel_size")
        if size not in (2, (2, 2)) or kwargs.get("return_indices") or (len(args) > 1 and args[1] not in (None, 2, (2, 2))):
            raise RuntimeError(f"the harness aligns 2x2 stride-2 max pools only, got {args} {kwargs}")
        _, shape, where, decision = self._next(POOL, tuple(x.shape))
        values = x.detach().cpu().numpy()
        pooled = tuple(out.shape)
        at, source = to_official(where, shape[:2] + (shape[2] // 2, shape[3] // 2), pooled, self.channel_map)
        win = windows(values).reshape(-1, 4)
        top2 = np.sort(win[at], axis=-1)[..., -2:]
        near = top2[:, 1] - top2[:, 0] <= self.margin * float(np.max(np.abs(values)))
        ours = decision[source].astype(np.int64)
        force = self._sort(np.argmax(win[at], axis=-1), ours, near, pool_near(values, self.margin / 2)[0], at)
        self.passes += 1
        if not force.any():
            return out
        self.aligned[POOL] += int(force.sum())
        h, w = pooled[2] * 2, pooled[3] * 2
        stacked = torch.stack([x[:, :, i:h:2, j:w:2] for i in (0, 1) for j in (0, 1)], dim=-1)
        choice = np.argmax(win, axis=-1)
        choice[at[force]] = ours[force]
        forced = np.zeros(win.shape[0], bool)
        forced[at[force]] = True
        taken = torch.take_along_dim(stacked, torch.from_numpy(choice.reshape(pooled + (1,))), dim=-1)[..., 0]
        return torch.where(torch.from_numpy(forced.reshape(pooled)), taken, out)

    def _sort(self, theirs: np.ndarray, ours: np.ndarray, near: np.ndarray, near_here: np.ndarray,
              recorded: np.ndarray) -> np.ndarray:
        """Which recorded decisions to take the library's way: those decided otherwise here where this
        side's value is within the margin of the tie too. Counted `beyond`: a recorded decision decided
        otherwise with this side's value beyond the margin, and a near tie here (within half the margin)
        the library did not record (beyond the margin there): values that differ by more than round-off."""
        differ = theirs != ours
        self.beyond += int(np.sum(differ & ~near)) + int(np.sum(~np.isin(near_here, recorded)))
        return differ & near

    def arrays(self) -> dict[str, np.ndarray]:
        """What the official run hands back about its decisions (`aligned_row` reads it)."""
        return {"decisions/aligned_relu": np.array(self.aligned[RELU]), "decisions/aligned_pool":
                np.array(self.aligned[POOL]), "decisions/beyond": np.array(self.beyond),
                "decisions/pools": np.array(self.passes)}


def aligned_row(official: dict[str, np.ndarray]) -> dict:
    """The `aligned` row of a run (verdicts.py): how many ReLU and max-pool decisions within MARGIN of a
    tie the official run took the library's way; it fails if one differed beyond the margin."""
    relu, pool = int(official["decisions/aligned_relu"]), int(official["decisions/aligned_pool"])
    return {"compared": f"ReLU and max-pool decisions within {MARGIN:g} of a tie, taken the library's way",
            "kind": "aligned", "tensors": 0, "aligned": relu + pool, "aligned_relu": relu, "aligned_pool": pool,
            "beyond": int(official["decisions/beyond"]), "max_rel": 0.0, "max_abs": 0.0,
            "note": f"{relu} ReLU and {pool} max-pool decisions the official run took otherwise on its own (the "
                    f"count depends on the host's round-off); decisions differing beyond the margin fail"}
