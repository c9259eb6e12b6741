"""One federated round as one jitted computation.

    seed, round -> sample clients -> gather their states -> vmap(broadcast, client_update)
                -> server_update -> scatter client states -> per-client bytes and metrics

`round_step` is the part every client store shares: the sampled clients' states and a
view of their data in, new server state, their new states and the round's figures out.
The device store wraps it with the gather and scatter in one jit (`build_round`); the
host and disk stores feed it gathered rows and data windows (`core.round.store`).

Clients are sampled by a pure function of (seed, round), so a resumed run
samples the same clients. With a mesh, the sampled-clients axis is sharded over
its `clients` axis; the server's update runs on every device over all the uploads (`round_step`).

Why one module past 400 lines: it is the round itself, which every placement (device, store, CPU devices, several
processes, buffered) runs; its parts (sampling, the vmapped clients, the server step, pricing, the federation's
conditions) meet in one jitted function.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm, RoundInfo, server_step
from fedjax_sparse.core.federation.clock import DeviceProfile, Returns, Stragglers, client_seconds, failed_clients, round_returns
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.round.device_split import BalancedSplit, balanced_order, device_groups
from fedjax_sparse.core.messages.pricing import message_bytes
from fedjax_sparse.core.federation.participation import Sampler, check_slots, uniform_sampler
from fedjax_sparse.core.messages.secure_aggregation import SecureAggregation, secure_bytes
from fedjax_sparse.core.round.streams import stream_key
from fedjax_sparse.data.federated import FederatedSplit

CLIENTS_AXIS = "clients"


@flax.struct.dataclass
class RoundOutput:
    """Per slot: ids, bytes both ways and local-training metrics ([K] each).

    dispatched: [K] bool, the slots holding a client sent the model this round (all, unless the sampler
    varies participation); a slot that was not costs no bytes. Where the round has a clock or stragglers
    (`RoundConditions`): client_seconds [K] (0 for slots not dispatched) and `returns` (`core.federation.clock.Returns`:
    who was aggregated, late, failed or surplus, and the round's simulated seconds); else None."""

    client_ids: jax.Array
    uplink_bytes: jax.Array
    downlink_bytes: jax.Array
    metrics: dict
    dispatched: jax.Array
    client_seconds: jax.Array | None = None
    returns: Returns | None = None
    clients_drawn: jax.Array | None = None  # how many the sampler drew (more than K: an overflow, an error)
    server_metrics: dict | None = None  # what `server_update` reported of its step (`ServerStep`), if anything


@dataclasses.dataclass(frozen=True)
class RoundConditions:
    """The federation a round simulates: who is sampled, how long each client takes, who returns.

    sampler: fills the round's slots (`core.federation.participation`); profile: the devices and links that turn each
    client's counted FLOPs and bytes into seconds (`core.federation.clock`; None: no clock); stragglers: deadline,
    over-selection target, dropout; dense_flops_per_example: a client's training FLOPs per example where
    its algorithm reports none (`train_flops`): 3 x the model's forward FLOPs x the local epochs.

    `varies`: some slot may be absent from the aggregate. Only then does `server_update` see
    `RoundInfo.participating` (else None) and zero weights; with fixed participation the round computes
    exactly what it computed before participation could vary, bit for bit."""

    sampler: Sampler
    profile: DeviceProfile | None = None
    stragglers: Stragglers = Stragglers()
    dense_flops_per_example: float = 0.0
    secure: SecureAggregation | None = None
    upload_entries: int = 0  # with `secure`: the entries a client's upload is summed as (its masked input)
    # a sharded round's placement of the clients on its devices (`core.round.device_split`; None: in slot order);
    # a layout, not the federation: the figures are the same either way
    split: BalancedSplit | None = None

    @property
    def varies(self) -> bool:
        return not self.sampler.fixed or self.stragglers.active

    @property
    def timed(self) -> bool:
        return self.profile is not None or self.stragglers.active

    @property
    def reads_clients(self) -> bool:
        """The server phase reads each client's FLOPs and downlink bytes (to time, mask or price them)."""
        return self.varies or self.timed or self.secure is not None

    def __post_init__(self):
        if (self.stragglers.deadline is not None or self.stragglers.target is not None) and self.profile is None:
            raise ValueError("--round-deadline and --over-selection need a clock: give --device-profile")
        if self.stragglers.target is not None and self.stragglers.target > self.sampler.slots:
            raise ValueError(f"over-selection aggregates {self.stragglers.target} clients of the "
                             f"{self.sampler.slots} dispatched: it needs at least as many dispatched")
        if self.stragglers.min_reports is not None and self.stragglers.min_reports > self.sampler.slots:
            raise ValueError(f"--min-reports {self.stragglers.min_reports} exceeds the {self.sampler.slots} clients "
                             f"a round dispatches: every round would be abandoned")
        if self.secure is not None and self.stragglers.target is not None:
            raise ValueError("--secure-aggregation with --over-selection: the protocol sums every client that "
                             "sends its masked input, so the surplus could not be left out; leave one of them out")


def default_conditions(num_clients: int, clients_per_round: int) -> RoundConditions:
    """Today's federation: K of N uniformly, every client returns, no clock."""
    return RoundConditions(uniform_sampler(num_clients, clients_per_round))


def client_keys(seed: int, round_index: jax.Array, client_ids: jax.Array) -> jax.Array:
    """Each client's randomness for a round, tied to (seed, round, client id)."""
    base = jax.random.fold_in(stream_key(seed, "clients"), round_index)
    return jax.vmap(lambda c: jax.random.fold_in(base, c))(client_ids)


def server_key(seed: int, round_index: jax.Array) -> jax.Array:
    """The server's randomness for a round (e.g. random upload selection, sub-model choice)."""
    return jax.random.fold_in(stream_key(seed, "server"), round_index)


def round_info(seed: int, round_index: jax.Array, client_ids: jax.Array,
               participating: jax.Array | None = None) -> RoundInfo:
    """What the algorithm is told about round `round_index` with these sampled clients."""
    round_index = jnp.asarray(round_index, jnp.int32)
    return RoundInfo(index=round_index, client_ids=jnp.asarray(client_ids, jnp.int32),
                     server_key=server_key(seed, round_index), participating=participating)


def clients_mesh(devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(devices, (CLIENTS_AXIS,))


check_clients_per_round = check_slots


def _check_layout(clients_per_round: int, mesh: Mesh | None, client_chunk: int | None) -> None:
    if mesh is not None and clients_per_round % mesh.size:
        raise ValueError(f"clients per round ({clients_per_round}) must be a multiple of the "
                         f"{mesh.size} devices of the '{CLIENTS_AXIS}' mesh axis")
    if client_chunk is not None:
        if not 1 <= client_chunk <= clients_per_round:
            raise ValueError(f"client chunk must be in [1, {clients_per_round}] (the clients per round), "
                             f"got {client_chunk}")
        if mesh is not None:
            raise ValueError("a client chunk and a mesh do not combine: the mesh shards the vmap of all "
                             "sampled clients; leave the chunk unset when sharding")


def client_phase(algorithm: FederatedAlgorithm, client_chunk: int | None = None) -> Callable:
    """`train(server_state, sampled, ids, positions, keys, data, info) -> (ups, new_states, metrics,
    down_bytes)`, each [K', ...] for the K' clients given (traceable): broadcast, then local training.

    `client_chunk=None` vmaps them all at once; `c` runs them c at a time (`lax.map` over vmapped
    chunks), which must divide K' (see `default_client_chunk`)."""

    def one_client(server_state, client_state, client_id, position, key, data, info):
        down = algorithm.broadcast(server_state, client_id, info)
        up, client_state, metrics = algorithm.client_update(down, client_state, data.client(position), key, info)
        return up, client_state, metrics, message_bytes(down)

    def train(server_state, sampled, ids, positions, keys, data, info):
        if client_chunk is None:
            return jax.vmap(one_client, in_axes=(None, 0, 0, 0, 0, None, None))(
                server_state, sampled, ids, positions, keys, data, info)
        return jax.lax.map(lambda args: one_client(server_state, *args, data, info), (sampled, ids, positions, keys),
                           batch_size=client_chunk)

    return train


def server_phase(algorithm: FederatedAlgorithm, clients_per_round: int, seed: int = 0,
                 conditions: RoundConditions | None = None) -> Callable:
    """`server(server_state, ups, weights, info, dispatched, flops, down_bytes) -> (server_state, server_metrics,
    up_bytes, down_bytes, client_seconds, returns)` over all K uploads in client order (traceable): the algorithm's
    upload selection, the uplink's bytes, who returns (`conditions`: dropout, the clock, a deadline,
    over-selection), the server's update over the returned. `flops`: each client's training FLOPs.

    Where participation varies (`RoundConditions.varies`) the selection sees the clients that did not fail,
    the update those that returned, each as `info.participating` with the others' weights zero; a round in
    which none returned leaves the server's state as it was (but for an algorithm that `steps_when_empty`). Uplink bytes count every client that uploaded
    (returned, or surplus to over-selection), not one that failed or was cut off by the deadline; downlink
    bytes every client dispatched. With secure aggregation (`conditions.secure`) each dispatched client's
    bytes are the protocol's (`secure_bytes`), and the clock reads them. A round abandoned for want of reports
    (`Stragglers.min_reports`) aggregates none: the uploads that arrived count as sent. With none of these, `flops` and
    `down_bytes` are None and so are the down_bytes, seconds and returns given back."""
    varies = conditions is not None and conditions.varies
    timed = conditions is not None and conditions.timed
    secure = conditions.secure if conditions is not None else None
    protocol = secure_bytes(secure, clients_per_round, conditions.upload_entries) if secure is not None else None

    def protocol_bytes(column, count, dtype):
        return jnp.asarray(np.rint(getattr(protocol, column)).astype(np.int64), dtype)[count]

    def select(ups, weights, info):
        if algorithm.select_uploads is not None:
            ups = algorithm.select_uploads(ups, weights, info)
        return ups, jax.vmap(message_bytes, axis_size=clients_per_round)(ups)

    def server(server_state, ups, weights, info, dispatched, flops, down_bytes):
        if conditions is None or not conditions.reads_clients:
            ups, up_bytes = select(ups, weights, info)
            return (*server_step(algorithm.server_update(server_state, ups, weights, info)), up_bytes, None, None,
                    None)
        stragglers = conditions.stragglers
        failed = (failed_clients(seed, info.index, info.client_ids, stragglers.dropout) & dispatched
                  if stragglers.dropout > 0 else jnp.zeros_like(dispatched))
        reporting = dispatched & ~failed
        if varies:
            ups, up_bytes = select(ups, weights * reporting, info.replace(participating=reporting))
        else:
            ups, up_bytes = select(ups, weights, info)
        count = jnp.sum(dispatched)
        if protocol is not None:  # the protocol's messages replace the upload (its masked input) and join the model's
            up_bytes = jnp.broadcast_to(protocol_bytes("up_survivor", count, up_bytes.dtype), up_bytes.shape)
            down_bytes = down_bytes + protocol_bytes("down_survivor", count, down_bytes.dtype)
        if conditions.profile is not None:
            seconds = client_seconds(conditions.profile.profiles(seed, info.client_ids), flops, down_bytes, up_bytes)
            seconds = jnp.where(dispatched, seconds, 0.0)
        else:
            seconds = jnp.zeros(dispatched.shape, jnp.float32)
        returns = round_returns(reporting, failed, seconds, stragglers)
        if protocol is not None:  # a client dropped after sharing its keys sent and received those rounds only
            dropped = returns.late | returns.failed
            told = jnp.round(jnp.asarray(protocol.per_dropped_neighbour, jnp.float32)[count] * jnp.sum(dropped))
            instead = (protocol_bytes("down_dropped", count, down_bytes.dtype)
                       - protocol_bytes("down_survivor", count, down_bytes.dtype))
            down_bytes = down_bytes + jnp.where(dropped, instead, told.astype(down_bytes.dtype))
            up_bytes = jnp.where(dropped, protocol_bytes("up_dropped", count, up_bytes.dtype), up_bytes)
            up_bytes = jnp.where(returns.returned | returns.surplus | sent_in_vain(returns) | dropped, up_bytes, 0)
        else:
            up_bytes = jnp.where(returns.returned | returns.surplus | sent_in_vain(returns), up_bytes, 0)
        down_bytes = jnp.where(dispatched, down_bytes, 0)
        if not varies:
            return (*server_step(algorithm.server_update(server_state, ups, weights, info)), up_bytes, down_bytes,
                    seconds, returns)
        present = returns.returned
        new_state, metrics = server_step(algorithm.server_update(server_state, ups, weights * present,
                                                                 info.replace(participating=present)))
        if not algorithm.steps_when_empty:
            anyone = jnp.any(present)
            new_state = jax.tree_util.tree_map(lambda new, old: jnp.where(anyone, new, old), new_state, server_state)
        return new_state, metrics, up_bytes, down_bytes, seconds, returns

    return server


def sent_in_vain(returns: Returns) -> jax.Array:
    """[K] bool: the uploads that arrived in a round abandoned for want of reports (none without the rule)."""
    return jnp.zeros_like(returns.returned) if returns.abandoned is None else returns.abandoned


def client_flops(metrics: dict, weights: jax.Array, conditions: RoundConditions | None) -> jax.Array:
    """Each client's training FLOPs: its own count where its algorithm reports one, else the dense model's."""
    if "train_flops" in metrics:
        return metrics["train_flops"].astype(jnp.float32)
    per_example = conditions.dense_flops_per_example if conditions is not None else 0.0
    return weights * jnp.float32(per_example)


def keep_absent(new_states: Any, old_states: Any, present: jax.Array) -> Any:
    """The clients' states after the round: the new ones of the present, the old ones of the rest."""
    def keep(new, old):
        return jnp.where(present.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

    return jax.tree_util.tree_map(keep, new_states, old_states)


def round_step(algorithm: FederatedAlgorithm, clients_per_round: int, *, seed: int, mesh: Mesh | None = None,
               client_chunk: int | None = None, ordered_reduction: bool = True,
               conditions: RoundConditions | None = None) -> Callable:
    """The round over gathered inputs, for every client store (traceable, not jitted):

        step(server_state, sampled_states, data, positions, ids, round_index, dispatched)
            -> (server_state, new_sampled_states, RoundOutput)

    `dispatched` ([K] bool): the slots whose client takes part (`core.federation.participation`); `conditions`:
    the clock and stragglers (`server_phase`); a client absent from the aggregate keeps its old state.

    `sampled_states` are the K sampled clients' states ([K, ...], in the order of `ids`);
    client k trains on `data.client(positions[k])`: the whole population's split with
    positions = ids (the device store), or a split of the K gathered windows with
    positions = arange(K) (host and disk stores). Aggregation weights are the view's counts.

    `client_chunk=None` vmaps all K sampled clients at once (the accelerator
    layout). `client_chunk=c` runs them c at a time (`lax.map` over vmapped
    chunks): the same arithmetic in another order, which on a CPU keeps a
    chunk's weights in cache and lets each chunk stop at its own busiest client
    (see `default_client_chunk` and benchmarks/results). A mesh shards the full
    vmap over all its axes (`clients`, or `processes` x `clients` across
    processes), so it takes no chunk. With a mesh, `ordered_reduction` gathers the K uploads onto
    every device and runs the server's update there as each device's own program (`jax.shard_map` of
    replicated inputs: the partitioner may not split its sums again), so its sums run over all of them
    in client order and a run's figures do not depend on the number of devices or processes (but for
    the divisions docs/scale.md names; False: XLA reduces each device's share, then across devices;
    `benchmarks/ordered_reduction.py` measures the cost).
    Several CPU devices of one process take another layout: `core.round.cpu`.
    """
    _check_layout(clients_per_round, mesh, client_chunk)
    train = client_phase(algorithm, client_chunk)
    server = server_phase(algorithm, clients_per_round, seed, conditions)
    varies = conditions is not None and conditions.varies
    timed = conditions is not None and conditions.timed
    reads = conditions is not None and conditions.reads_clients
    split = conditions.split if conditions is not None and mesh is not None else None

    def constrain(tree, spec):
        if mesh is None:
            return tree
        return jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)), tree)

    def shard(tree):
        return tree if mesh is None else constrain(tree, PartitionSpec(tuple(mesh.axis_names)))

    def gathered(tree):
        # every device then reduces all K uploads itself, in client order, as one device does: a
        # cross-device reduction would sum per-device partial sums, in an order set by the sharding
        return constrain(tree, PartitionSpec()) if ordered_reduction else tree

    def server_on_every_device(*args):
        # a program of its own on each device (a manual region): given replicated uploads, the partitioner
        # would still be free to split the server's sums over the devices (partial sums, then an all-reduce;
        # FedSpa's masked mean was split so) unless no partitioning of it is left to choose
        replicate = PartitionSpec()
        return jax.shard_map(server, mesh=mesh, in_specs=replicate, out_specs=replicate, check_vma=False)(*args)

    def step(server_state, sampled_states, data, positions, ids, round_index, dispatched=None):
        round_index = jnp.asarray(round_index, jnp.int32)
        ids = jnp.asarray(ids, jnp.int32)
        dispatched = jnp.ones(ids.shape, bool) if dispatched is None else jnp.asarray(dispatched, bool)
        keys = client_keys(seed, round_index, ids)
        info = round_info(seed, round_index, ids)
        positions = jnp.asarray(positions, jnp.int32)
        clients = (ids, positions, keys, sampled_states)
        if split is not None:  # the devices train the clients in the balanced order, given back in client order
            order = balanced_order(split.steps(data.counts[positions]), ids,
                                   *device_groups(clients_per_round, mesh_size=mesh.size))
            clients = jax.tree_util.tree_map(lambda x: x[order], clients)
        ids_sharded, trained_positions, keys, sampled = shard(clients)
        ups, new_states, metrics, down_bytes = train(server_state, sampled, ids_sharded, trained_positions, keys, data,
                                                     info)
        if split is not None:
            back = jnp.argsort(order)
            ups, new_states, metrics, down_bytes = jax.tree_util.tree_map(lambda x: x[back],
                                                                          (ups, new_states, metrics, down_bytes))
        weights = data.counts[positions].astype(jnp.float32)
        # what the clock reads of the clients (None where the round has none: nothing more is moved)
        clocked = gathered((client_flops(metrics, weights, conditions) if timed else None, down_bytes)) if reads \
            else (None, None)
        ups, weights = gathered((ups, weights))
        # XLA may not simplify the server's arithmetic into the clients' (or back): the server's update then
        # compiles as it does alone, in `core.round.cpu`'s layout, whatever this round's layout is
        ups, weights = jax.lax.optimization_barrier((ups, weights))
        args = (server_state, ups, weights, info, dispatched, *clocked)
        if mesh is not None and ordered_reduction:
            server_state, server_metrics, up_bytes, priced_down, seconds, returns = server_on_every_device(*args)
        else:
            server_state, server_metrics, up_bytes, priced_down, seconds, returns = server(*args)
        if varies:
            old_states = sampled if split is None else sampled_states  # in client order
            new_states = keep_absent(new_states, old_states, shard(returns.returned))
        down_bytes = down_bytes if priced_down is None else priced_down
        return server_state, new_states, RoundOutput(ids, up_bytes, down_bytes, metrics, dispatched, seconds, returns,
                                                     server_metrics=server_metrics)

    return step


def device_round(algorithm: FederatedAlgorithm, clients_per_round: int, *, seed: int, mesh: Mesh | None = None,
                 client_chunk: int | None = None, ordered_reduction: bool = True,
                 conditions: RoundConditions | None = None) -> Callable:
    """`round(server_state, client_states, train, round_index)` of the device store (traceable):
    samples train's clients (`conditions.sampler`; default K uniformly), gathers their states ([N, ...]),
    runs `round_step` and scatters their new states."""
    slots = conditions.sampler.slots if conditions is not None else clients_per_round
    step = round_step(algorithm, slots, seed=seed, mesh=mesh, client_chunk=client_chunk,
                      ordered_reduction=ordered_reduction, conditions=conditions)

    def round_fn(server_state, client_states, train, round_index):
        sampler = conditions.sampler if conditions is not None else uniform_sampler(train.num_clients,
                                                                                    clients_per_round)
        drawn = sampler(seed, round_index)
        ids = drawn.ids
        sampled = jax.tree_util.tree_map(lambda a: a[ids], client_states)
        server_state, new_states, out = step(server_state, sampled, train, ids, ids, round_index, drawn.dispatched)
        out = out.replace(clients_drawn=drawn.drawn)
        client_states = jax.tree_util.tree_map(lambda a, new: a.at[ids].set(new), client_states, new_states)
        return server_state, client_states, out

    return round_fn


def build_round(algorithm: FederatedAlgorithm, train: FederatedSplit, clients_per_round: int, *,
                seed: int, mesh: Mesh | None = None, client_chunk: int | None = None,
                ordered_reduction: bool = True,
                conditions: RoundConditions | None = None) -> Callable[[Any, Any, jax.Array],
                                                                       tuple[Any, Any, RoundOutput]]:
    """Returns jitted `round(server_state, client_states, round_index)`: the device store's round.

    Every client's state ([N, ...]) and data (`train`) lie on the device; one jit samples,
    gathers, trains, aggregates and scatters (`device_round`; the client states are donated).
    See `round_step` for `client_chunk` and `mesh`; `core.round.store` for the other stores.
    """
    check_clients_per_round(clients_per_round, train.num_clients)
    round_fn = device_round(algorithm, clients_per_round, seed=seed, mesh=mesh, client_chunk=client_chunk,
                            ordered_reduction=ordered_reduction, conditions=conditions)
    return jit(lambda server_state, client_states, round_index: round_fn(server_state, client_states, train,
                                                                             round_index), donate_argnums=(1,))


def default_client_chunk(variables: Any, clients_per_round: int, platform: str | None = None,
                         cache_bytes: int = 3 << 19) -> int | None:
    """How many clients a round should train at once on `platform` (default: JAX's backend).

    On accelerators, all of them (None: one vmap). On a CPU, as many as fit
    their weights in about `cache_bytes` (1.5 MiB, at least one client): a
    full vmap streams every sampled client's weights through memory at each
    step, and XLA:CPU runs large batched weight-gradient dots slowly. Measured
    on 2 cores (benchmarks/results/cpu_full.md), chunks of 4 digits-MLP
    clients (340 kB each) are 1.6 to 2.8 times faster than one vmap at 100 and
    1000 clients per round, and a CIFAR CNN is fastest one client at a time.

    The chunk divides the clients per round (the largest divisor within the cache's bound): `lax.map`
    runs a remainder outside its loop, a program XLA compiles apart, whose float results differ in
    the last bits from the loop's; without one, every client computes as in one vmap of all, and as
    a process's share of them does with several processes (`tests/test_distributed.py`).
    """
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return None
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(variables))
    bound = max(1, min(clients_per_round, cache_bytes // max(nbytes, 1)))
    return largest_divisor(clients_per_round, bound)


def largest_divisor(n: int, bound: int) -> int:
    """The largest chunk of at most `bound` that divides `n` clients (see `default_client_chunk`)."""
    return next(c for c in range(min(bound, n), 0, -1) if n % c == 0)
