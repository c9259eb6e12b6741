"""Buffered asynchronous aggregation (FedBuff; Nguyen et al., AISTATS 2022) on the simulated clock.

`concurrency` clients train at once, each from the model current when it was dispatched. A client
returns after its `core.federation.clock` seconds (its counted FLOPs and bytes over its device and link); its
update joins a buffer and a new client is dispatched with the current model. Each time `buffer`
updates have arrived, the server steps:

    x <- server_update(x, {rebase(s(tau_i) * increment_i, broadcast_i(x))}, weights)

tau_i: the server steps taken since client i was dispatched (its staleness); s(tau) = (1 + tau)^-a,
a = 0.5 by default (FedBuff's 1 / sqrt(1 + tau)); increment_i: what its training added to the
model it received (`core.contract.algorithm.StaleUpload`), but for the parts the client keeps whole as its own
state (`StaleUpload.unweighted`: SCAFFOLD's control delta, so that c stays the mean of the c_i), which
count whole. With FedAvg at server lr 1 and uniform weights
this is FedBuff's x + (1/B) sum_i s(tau_i) Delta_i; with data weights (FedAvg's default) the mean
is weighted by the clients' examples; the server optimizer (FedAdam, FedAvgM) steps as in a
synchronous round. A run's round is one server step.

Time and order, read where FedBuff's Algorithm 1 is silent: events at the same simulated instant are
taken together; the arrivals of an instant join the buffer in dispatch order, a step closes the buffer
at the instant its B-th update arrives (updates beyond B wait for the next step), and the clients
that replace them are dispatched after that step, with the new model. So when every client takes the
same time and concurrency = buffer = K, each step aggregates K updates of staleness 0 trained from
the model of the step before: synchronous FedAvg (tests/test_buffered_round.py). Who is dispatched:
the round's sampling order (`core.federation.participation.sampling_order`, the synchronous round's draw at the
first dispatch after each step; another order for each later dispatch before the next step), skipping
clients in flight or waiting in the buffer (each dispatch sorts the population once on the host: about
0.1 s at 10^6 clients). A client dispatched twice from one model trains with its key folded with how
often it was.

Where it computes: clients dispatched at the same instant train together in one vmapped call, in
groups padded to a power of two (few compilations); each one's increment, new state, metrics, bytes
and seconds wait in a table of `concurrency + buffer` rows on the device until the step that takes
it. Nothing else is kept: a client's update is computed when it is dispatched, from the model then
current, so no past model versions are needed. A client's new state is written to the store at the
step that aggregates its update. Bytes and FLOPs are counted with the step that aggregates them.

A checkpoint keeps the table beside the server state (`saved_state`) and the events in flight, the
buffer and the clock in its meta (`saved_meta`), so a resumed run goes on exactly.

Where client states and data live is the store's business, as in a synchronous round: the device store
(the population's split on the device) or a host or disk store (each group's rows read and its data
windows gathered on the host; a step writes its clients' new rows). Limits: one process, without a mesh
or several CPU devices; the uniform order (no other sampler), no deadline, over-selection or dropout.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm, server_step
from fedjax_sparse.core.client_state.store import ClientStore, DeviceStore
from fedjax_sparse.core.federation.clock import Returns, client_seconds
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.messages.pricing import message_bytes
from fedjax_sparse.core.federation.participation import sampling_order
from fedjax_sparse.core.round.step import (RoundConditions, RoundOutput, client_flops, client_keys, client_phase,
                                      largest_divisor, round_info)
from fedjax_sparse.data.federated import FederatedSplit
from fedjax_sparse.data.windows import ClientWindows, window_split

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class Buffering:
    """buffer: B, the updates a server step aggregates; concurrency: the clients training at once;
    staleness_exponent: a in s(tau) = (1 + tau)^-a (0: every update counts fully)."""

    buffer: int
    concurrency: int
    staleness_exponent: float = 0.5

    def __post_init__(self):
        if self.buffer < 1:
            raise ValueError(f"--async-buffer must be at least 1, got {self.buffer}")
        if self.concurrency < 1:
            raise ValueError(f"--async-concurrency must be at least 1, got {self.concurrency}")
        if not (self.staleness_exponent >= 0 and math.isfinite(self.staleness_exponent)):
            raise ValueError(f"--staleness-exponent must be a number >= 0, got {self.staleness_exponent}")

    def weight(self, staleness: jax.Array) -> jax.Array:
        return (1.0 + staleness.astype(jnp.float32)) ** jnp.float32(-self.staleness_exponent)


def check_buffered(algorithm: FederatedAlgorithm, buffering: Buffering, conditions: RoundConditions,
                   num_clients: int) -> None:
    """Refuses, in one line, what asynchronous rounds cannot run."""
    if algorithm.stale_upload is None or algorithm.select_uploads is not None:
        raise ValueError(f"--algorithm {algorithm.name} cannot aggregate asynchronously: its server does not take "
                         f"an update trained from an older model (no stale_upload in its contract); asynchronous "
                         f"rounds run fedavg, fedprox, feddyn and scaffold (with any --server-optimizer)")
    if conditions.profile is None:
        raise ValueError("asynchronous rounds (--async-buffer) need a clock to order the clients' returns: give "
                         "--device-profile")
    if conditions.secure is not None:
        raise ValueError("asynchronous rounds take no --secure-aggregation: the protocol sums a round's clients "
                         "together, and a buffer's updates come from different rounds")
    if conditions.stragglers.active:
        raise ValueError("asynchronous rounds take no --round-deadline, --over-selection, --dropout or "
                         "--min-reports: every dispatched client returns, late or not, and its staleness weighs it")
    if conditions.sampler.name != "uniform":
        raise ValueError(f"asynchronous rounds dispatch clients in a uniform random order; --sampler "
                         f"{conditions.sampler.name} is for synchronous rounds")
    if buffering.concurrency + buffering.buffer > num_clients:
        raise ValueError(f"--async-concurrency {buffering.concurrency} plus --async-buffer {buffering.buffer} "
                         f"exceed the {num_clients} clients: a client in flight or waiting in the buffer is not "
                         f"dispatched again")


@dataclasses.dataclass(order=True)
class _InFlight:
    finish: float
    sequence: int
    row: int = dataclasses.field(compare=False)
    client: int = dataclasses.field(compare=False)
    version: int = dataclasses.field(compare=False)


def _group_size(count: int) -> int:
    """The next power of two: groups of any size compile a few programs only."""
    return 1 << max(0, count - 1).bit_length()


class BufferedRound:
    """`round(server_state, round_index) -> (server_state, RoundOutput)`: one FedBuff server step (see the
    module's docstring), with the loop's interface of `core.round.store.StoreRound`.

    store and data: a `DeviceStore` with the population's `FederatedSplit` on the device, or a host or
    disk store with this process's `ClientWindows`; counts: every client's training examples (the
    aggregation weights). RoundOutput's slots are the B aggregated clients; its `returns` carry the
    step's simulated seconds, and metrics gain each client's `staleness`."""

    mesh = None
    cpu_devices: list = []

    def __init__(self, algorithm: FederatedAlgorithm, store: ClientStore, data: FederatedSplit | ClientWindows,
                 buffering: Buffering, *, seed: int, conditions: RoundConditions, counts: np.ndarray,
                 client_chunk: int | None = None):
        check_buffered(algorithm, buffering, conditions, store.num_clients)
        if jax.process_count() > 1:
            raise ValueError("asynchronous rounds (--async-buffer) run in one process")
        on_device = isinstance(store, DeviceStore)
        if on_device != isinstance(data, FederatedSplit) or (not on_device and not isinstance(data, ClientWindows)):
            raise ValueError("the device store trains on the population's FederatedSplit, the host and disk stores "
                             "on this process's ClientWindows")
        self.store, self.data, self.conditions, self.buffering, self.seed = store, data, conditions, buffering, seed
        self.algorithm, self._on_device = algorithm, on_device
        self._counts = np.asarray(counts, np.float32)
        self.num_clients = store.num_clients
        self._rows = buffering.concurrency + buffering.buffer
        self._chunk = client_chunk
        self._groups: dict[int, Any] = {}
        self._step = jit(self._step_fn)
        self._write = jit(self._write_fn, donate_argnums=(0,)) if on_device else jit(
            lambda states: store.layout.pack(states, buffering.buffer))
        self._table = None
        self._free = list(range(self._rows))
        self._flight: list[_InFlight] = []
        self._buffer: list[_InFlight] = []
        self._sequence = 0
        self._version = 0
        self._time = 0.0
        self._step_time = 0.0
        self._draws = 0  # dispatch events since the last step (the next one's sampling order)
        self._repeats: dict[int, int] = {}  # how often each client was dispatched from the current model

    def close(self) -> None:
        pass

    # -- what a checkpoint keeps (the interface of `core.round.store.StoreRound`) -------------------
    def saved_state(self, server_state):
        """The arrays a checkpoint saves: the server state and the table of updates not yet aggregated."""
        if self._table is None:
            self._table = self._empty_table(server_state)
        return {"server_state": server_state, "in_flight": self._table}

    def saved_meta(self) -> dict:
        """The simulation's host state, for the checkpoint's meta (JSON)."""
        def events(entries):
            return [[e.finish, e.sequence, e.row, e.client, e.version] for e in entries]

        return {"buffered": {"flight": events(self._flight), "buffer": events(self._buffer), "free": self._free,
                             "sequence": self._sequence, "version": self._version, "time": self._time,
                             "step_time": self._step_time, "draws": self._draws,
                             "repeats": {str(c): n for c, n in self._repeats.items()}}}

    def resumed(self, state, meta: dict):
        """The server state of a restored checkpoint (`saved_state`'s arrays), the simulation restored with it."""
        if "buffered" not in meta:
            raise ValueError("the checkpoint was written by synchronous rounds; resume it without --async-buffer")
        host = meta["buffered"]
        self._table = state["in_flight"]
        self._flight = [_InFlight(float(f), int(q), int(r), int(c), int(v)) for f, q, r, c, v in host["flight"]]
        heapq.heapify(self._flight)
        self._buffer = [_InFlight(float(f), int(q), int(r), int(c), int(v)) for f, q, r, c, v in host["buffer"]]
        self._free = [int(r) for r in host["free"]]
        self._sequence, self._version, self._draws = int(host["sequence"]), int(host["version"]), int(host["draws"])
        self._time, self._step_time = float(host["time"]), float(host["step_time"])
        self._repeats = {int(c): int(n) for c, n in host["repeats"].items()}
        return state["server_state"]

    # -- device computations ------------------------------------------------------------------------
    def _train_fn(self, size: int):
        algorithm, conditions, stale, seed = self.algorithm, self.conditions, self.algorithm.stale_upload, self.seed
        chunk = None if self._chunk is None else largest_divisor(size, self._chunk)
        train = client_phase(algorithm, chunk)

        def group(server_state, sampled, windows, table, ids, rows, repeats, weights, round_index):
            # a client sent the same model again trains with other randomness (its first time: the round's key)
            keys = jax.vmap(lambda k, n: jax.lax.cond(n > 0, lambda: jax.random.fold_in(k, n), lambda: k))(
                client_keys(seed, round_index, ids), repeats)
            info = round_info(seed, round_index, ids)
            if windows is None:  # the population's split: client k's examples at its id
                data, positions = self.data, ids
            else:  # the group's gathered windows: client k's at k
                data = window_split(*windows, self.data.mean, self.data.std, self.data.max_count, self.data.augment)
                positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
            ups, new_states, metrics, down_bytes = train(server_state, sampled, ids, positions, keys, data, info)
            downs = jax.vmap(lambda c: algorithm.broadcast(server_state, c, info))(ids)
            increments = jax.vmap(stale.increment)(ups, downs)
            up_bytes = jax.vmap(message_bytes)(ups)
            seconds = client_seconds(conditions.profile.profiles(seed, ids), client_flops(metrics, weights, conditions),
                                     down_bytes, up_bytes)
            entry = {"increment": increments, "state": new_states, "metrics": metrics, "down_bytes": down_bytes,
                     "up_bytes": up_bytes, "seconds": seconds}
            if table is None:
                return entry
            # padding rows point past the table and are dropped
            table = tree_map(lambda t, e: t.at[rows].set(e, mode="drop"), table, entry)
            return table, seconds

        return group

    def _clients(self, ids: np.ndarray):
        """The group's states and, from a host or disk store, its data windows (None: the split on the device)."""
        states = self.store.client_states(ids)
        if self._on_device:
            return states, None
        windows = self.data.windows(ids)
        return states, (windows.x, windows.y, windows.counts)

    def _empty_table(self, server_state):
        """The table's rows, shaped as one client's outputs."""
        one = np.zeros((1,), np.int32)
        states, windows = self._clients(one)
        shapes = jax.eval_shape(self._train_fn(1), server_state, states, windows, None, one, one, one,
                                np.ones((1,), np.float32), np.int32(0))
        return tree_map(lambda s: jnp.zeros((self._rows,) + s.shape[1:], s.dtype), shapes)

    def _group(self, size: int):
        if size not in self._groups:
            self._groups[size] = jit(self._train_fn(size), donate_argnums=(3,))
        return self._groups[size]

    def _write_fn(self, client_states, ids, new_states):
        return tree_map(lambda a, new: a.at[ids].set(new), client_states, new_states)

    def _step_fn(self, server_state, table, rows, ids, staleness, weights, round_index, seconds):
        algorithm = self.algorithm
        entry = tree_map(lambda t: t[rows], table)
        info = round_info(self.seed, round_index, ids)
        downs = jax.vmap(lambda c: algorithm.broadcast(server_state, c, info))(ids)
        scale = self.buffering.weight(staleness)
        stale = algorithm.stale_upload

        def weighted(increment, s):
            if not stale.unweighted:
                return tree_map(lambda x: x * s, increment)
            return {k: v if k in stale.unweighted else tree_map(lambda x: x * s, v) for k, v in increment.items()}

        ups = jax.vmap(lambda inc, down, s: stale.rebase(weighted(inc, s), down))(entry["increment"], downs, scale)
        server_state, server_metrics = server_step(algorithm.server_update(server_state, ups, weights, info))
        everyone = jnp.ones(ids.shape, bool)
        nobody = jnp.zeros(ids.shape, bool)
        metrics = {**entry["metrics"], "staleness": staleness.astype(jnp.float32)}
        out = RoundOutput(ids, entry["up_bytes"], entry["down_bytes"], metrics, everyone, entry["seconds"],
                          Returns(everyone, nobody, nobody, nobody, seconds), jnp.int32(ids.shape[0]), server_metrics)
        return server_state, entry["state"], out

    # -- the simulation -----------------------------------------------------------------------------
    def _dispatch(self, server_state, count: int) -> None:
        """Sends the current model to up to `count` clients now (fewer where rows run out) and trains them."""
        count = min(count, len(self._free))
        if count <= 0:
            return
        busy = {e.client for e in self._flight} | {e.client for e in self._buffer}
        order = sampling_order(self.seed, self._version, self.num_clients, self._draws)
        self._draws += 1
        chosen = sorted(int(c) for c in order[np.isin(order, list(busy), invert=True)][:count])
        rows = [self._free.pop(0) for _ in chosen]
        repeats = [self._repeats.get(c, 0) for c in chosen]
        for c in chosen:
            self._repeats[c] = self._repeats.get(c, 0) + 1
        size = _group_size(len(chosen))
        pad = size - len(chosen)
        ids = np.asarray(chosen + [chosen[-1]] * pad, np.int32)
        row_index = np.asarray(rows + [self._rows] * pad, np.int32)
        repeat = np.asarray(repeats + [0] * pad, np.int32)
        group = self._group(size)
        if self._table is None:
            self._table = self._empty_table(server_state)
        states, windows = self._clients(ids)
        self._table, seconds = group(server_state, states, windows, self._table, ids, row_index, repeat,
                                     self._counts[ids], np.int32(self._version))
        seconds = np.asarray(seconds, np.float64)[:len(chosen)]
        for client, row, s in zip(chosen, rows, seconds):
            heapq.heappush(self._flight, _InFlight(self._time + float(s), self._sequence, row, client, self._version))
            self._sequence += 1

    def __call__(self, server_state, round_index: int, *, prefetch_next: bool = True):
        del prefetch_next
        if round_index != self._version:
            raise ValueError(f"asynchronous rounds run in order from the first: asked for round {round_index + 1} "
                             f"after {self._version}")
        b = self.buffering.buffer
        if self._version == 0 and not self._flight and not self._buffer:
            self._dispatch(server_state, self.buffering.concurrency)
        while len(self._buffer) < b:
            if not self._flight:
                raise RuntimeError("no client in flight and the buffer not full: report this")
            self._time = self._flight[0].finish
            while self._flight and self._flight[0].finish == self._time:
                self._buffer.append(heapq.heappop(self._flight))
            if len(self._buffer) < b:
                self._dispatch(server_state, self.buffering.concurrency - len(self._flight))
        taken, self._buffer = self._buffer[:b], self._buffer[b:]
        taken.sort(key=lambda e: e.client)
        rows = np.asarray([e.row for e in taken], np.int32)
        ids = np.asarray([e.client for e in taken], np.int32)
        staleness = np.asarray([self._version - e.version for e in taken], np.int32)
        seconds = np.float32(self._time - self._step_time)
        server_state, new_states, out = self._step(server_state, self._table, rows, ids, staleness, self._counts[ids],
                                                   np.int32(self._version), seconds)
        if self._on_device:
            self.store.states = self._write(self.store.states, ids, new_states)
        else:
            self.store.write(ids, np.asarray(self._write(new_states)))
        self._free.extend(int(r) for r in rows)
        self._version += 1
        self._step_time = self._time
        self._draws = 0
        self._repeats = {}
        # the clients that replace this instant's arrivals start from the new model
        self._dispatch(server_state, self.buffering.concurrency - len(self._flight))
        return server_state, out
