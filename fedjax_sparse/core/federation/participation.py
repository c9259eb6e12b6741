"""Who takes part in a round: samplers, pure functions of (seed, round), over static shapes.

A round has a fixed number of slots S (static: the jitted round's shapes); the sampler fills them with
distinct client ids and says which slots hold a client really dispatched this round. A slot that is not
(Poisson sampling drew fewer than S clients; fewer clients were online than asked for) holds an unused
client id: it is computed with the others (static shapes) but its weight is zero, its state is not written
back and it costs no bytes and no time (`core.round.step.round_step`). What `server_update` sees of it is the
algorithm contract's: `RoundInfo.participating` False and weight 0 (`core.contract.algorithm`).

    uniform:      S = K clients without replacement, all dispatched (the default; today's draw, bit for bit)
    poisson:      each client independently with probability q = K / N (what privacy amplification by
                  sampling assumes); S = the count that Binomial(N, q) exceeds with probability below 1e-9,
                  rounded up to a multiple of 8 (at most N);
                  a round that draws more stops with an error naming it, never silently truncates
    data_size:    S = K clients without replacement, with probability proportional to their examples
    availability: K clients drawn uniformly among those online at the round's hour (fewer where fewer are
                  online): a diurnal pattern (`diurnal_availability`: each client online for a share of
                  the day around its own phase) or a trace file of (client, start hour, end hour) rows

Hours: round r starts at hour r x `hours_per_round` (availability is a schedule over rounds; the simulated
clock, `core.federation.clock`, measures what the rounds cost, and does not feed back into who is sampled, which keeps
sampling a pure function of (seed, round)).

Outside samplers register like algorithms: `register_sampler(SamplerSpec(...))`, or an installed package's
entry point in the group `fedjax_sparse.samplers` naming a `SamplerSpec`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from pathlib import Path
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.round.streams import stream_key
from fedjax_sparse.plugins import EntryPointGroup

ENTRY_POINT_GROUP = "fedjax_sparse.samplers"
OVERFLOW_PROBABILITY = 1e-9


@flax.struct.dataclass
class Participants:
    """A round's slots: `ids` [S] distinct client ids, sorted; `dispatched` [S] bool; `drawn`: how many
    clients the sampler drew (> S only where a Poisson draw overflowed its slots: an error)."""

    ids: jax.Array
    dispatched: jax.Array
    drawn: jax.Array


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A sampler as the round uses it.

    name: for messages; slots: S, static; fixed: every slot is always dispatched (uniform, data_size):
    the round then passes `RoundInfo.participating=None` and computes exactly what it computed before
    samplers; draw(key, round_index) -> Participants, traceable, where key is the run's sampling stream;
    host_ids(seed, round_index) -> ids: optional, the same ids computed otherwise on the host (a fixed
    sampler's; the uniform draw's numpy twin, `core.round.step.sample_clients_host`, is 10x faster at 10^6 clients).
    """

    name: str
    slots: int
    fixed: bool
    draw: Callable[[jax.Array, jax.Array], Participants]
    host_ids: Callable[[int, int], np.ndarray] | None = None

    def __call__(self, seed: int, round_index) -> Participants:
        return self.draw(stream_key(seed, "sampling"), jnp.asarray(round_index, jnp.int32))

    def host(self, seed: int, round_index: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, dispatched) as numpy, computed on the host's CPU (the host and disk stores read the rows
        of the ids before the round)."""
        if self.host_ids is not None:
            ids = self.host_ids(seed, round_index)
            return ids, np.ones(ids.shape, bool)
        cpu = jax.local_devices(backend="cpu")[0]
        with jax.default_device(cpu):
            drawn = _jitted(self)(stream_key(seed, "sampling"), np.int32(round_index))
        check_drawn(self, round_index, int(drawn.drawn))
        return np.asarray(drawn.ids, np.int32), np.asarray(drawn.dispatched, bool)


@functools.lru_cache(maxsize=16)
def _jitted(sampler: Sampler):
    return jax.jit(sampler.draw)


def check_drawn(sampler: Sampler, round_index: int, drawn: int) -> None:
    if drawn > sampler.slots:
        raise ValueError(f"round {round_index + 1}: the {sampler.name} sampler drew {drawn} clients, more than "
                         f"its {sampler.slots} slots (a draw this large has probability below "
                         f"{OVERFLOW_PROBABILITY:g}); raise --clients-per-round's slots or report it")


def sample_clients(seed: int, round_index: jax.Array, num_clients: int, clients_per_round: int) -> jax.Array:
    """The clients of a round: a pure function of the seed and the round index."""
    key = jax.random.fold_in(stream_key(seed, "sampling"), round_index)
    return jnp.sort(jax.random.choice(key, num_clients, (clients_per_round,), replace=False))


@functools.partial(jax.jit, static_argnums=1)
def _sort_keys(key: jax.Array, num_clients: int) -> jax.Array:
    return jax.random.bits(key, (num_clients,), jnp.uint32)


def sample_clients_host(seed: int, round_index: int, num_clients: int, clients_per_round: int) -> np.ndarray:
    """`sample_clients` computed on the host's CPU: the same ids, as int32 numpy.

    The stores that gather on the host need the ids before the round. `jax.random.choice`
    without replacement is the first K of `jax.random.permutation` (`sampling_order`).
    tests/test_client_store.py checks both agree.
    """
    check_slots(clients_per_round, num_clients)
    return np.sort(sampling_order(seed, round_index, num_clients)[:clients_per_round]).astype(np.int32)


def sampling_order(seed: int, round_index: int, num_clients: int, event: int = 0) -> np.ndarray:
    """Round `round_index`'s random order of all clients, on the host: `sample_clients` takes its first K.

    `event` > 0: another order for the round, one per later draw within it (asynchronous rounds draw
    at every arrival). `jax.random.permutation` is rounds of stable sorts of the population by fresh
    32-bit keys; XLA:CPU sorts 10^6 keys in ~0.4 s, numpy in ~0.03 s (a stable sort by key equals an
    unstable sort of key << 32 | position), and nothing of size N touches the accelerator."""
    cpu = jax.local_devices(backend="cpu")[0]
    with jax.default_device(cpu):
        key = jax.random.fold_in(stream_key(seed, "sampling"), round_index)
        if event:
            key = jax.random.fold_in(key, event)
        order = np.arange(num_clients)
        position = np.arange(num_clients, dtype=np.uint64)
        rounds = int(np.ceil(3 * np.log(max(1, num_clients)) / np.log(np.iinfo(np.uint32).max)))
        for _ in range(rounds):
            key, subkey = jax.random.split(key)
            bits = np.asarray(_sort_keys(subkey, num_clients)).astype(np.uint64)
            by_bits = np.sort((bits << np.uint64(32)) | position) & np.uint64(0xFFFFFFFF)
            order = order[by_bits.astype(np.int64)]
    return order


def _round_key(key, round_index):
    return jax.random.fold_in(key, round_index)


def uniform_sampler(num_clients: int, clients_per_round: int) -> Sampler:
    """K of N without replacement, every round: the library's draw before samplers existed."""
    check_slots(clients_per_round, num_clients)

    def draw(key, round_index):
        ids = jnp.sort(jax.random.choice(_round_key(key, round_index), num_clients, (clients_per_round,),
                                         replace=False))
        return Participants(ids, jnp.ones((clients_per_round,), bool), jnp.int32(clients_per_round))

    return Sampler("uniform", clients_per_round, True, draw,
                   host_ids=lambda seed, round_index: sample_clients_host(seed, round_index, num_clients,
                                                                          clients_per_round))


def poisson_slots(num_clients: int, rate: float) -> int:
    """The smallest S with P(Binomial(N, q) > S) < `OVERFLOW_PROBABILITY` (at least 1)."""
    from scipy.stats import binom  # scikit-learn's dependency, so always there

    return int(min(num_clients, max(1, binom.isf(OVERFLOW_PROBABILITY, num_clients, rate) + 1)))


def _first_slots(chosen: jax.Array, scores: jax.Array, slots: int) -> Participants:
    """The chosen clients (by score, best first) in the first slots, padded with unchosen ones; sorted by id."""
    order = jnp.argsort(jnp.where(chosen, -scores, jnp.inf), stable=True)[:slots]
    ids, dispatched = order.astype(jnp.int32), chosen[order]
    by_id = jnp.argsort(ids)
    return Participants(ids[by_id], dispatched[by_id], jnp.sum(chosen).astype(jnp.int32))


def poisson_sampler(num_clients: int, clients_per_round: int, multiple: int = 8) -> Sampler:
    """Each client independently with probability q = K / N.

    The slots are rounded up to a `multiple` (at most N): a CPU round trains clients in chunks that divide
    the slots, and a bound such as 155 (prime factors 5 and 31) leaves chunks of 1 on one device, 2x slower
    (benchmarks/results/participation_cost_*); a sharded round splits them evenly over its devices (the run
    asks for a multiple of 8 and of the devices). The extra slots only lower the chance of an overflow."""
    check_slots(clients_per_round, num_clients)
    if multiple < 1:
        raise ValueError(f"the slots' multiple must be at least 1, got {multiple}")
    rate = clients_per_round / num_clients
    slots = min(num_clients, -(-poisson_slots(num_clients, rate) // multiple) * multiple)

    def draw(key, round_index):
        chosen = jax.random.uniform(_round_key(key, round_index), (num_clients,)) < rate
        return _first_slots(chosen, jnp.zeros((num_clients,)), slots)

    return Sampler("poisson", slots, False, draw)


def data_size_sampler(num_clients: int, clients_per_round: int, counts: np.ndarray) -> Sampler:
    """K of N without replacement, each draw with probability proportional to the clients' examples."""
    check_slots(clients_per_round, num_clients)
    counts = np.asarray(counts, np.float64)
    if counts.shape != (num_clients,) or (counts < 0).any() or np.count_nonzero(counts) < clients_per_round:
        raise ValueError(f"--sampler data_size needs at least --clients-per-round {clients_per_round} clients "
                         f"with examples; {np.count_nonzero(counts)} of {num_clients} have any")
    p = jnp.asarray(counts / counts.sum(), jnp.float32)

    def draw(key, round_index):
        ids = jnp.sort(jax.random.choice(_round_key(key, round_index), num_clients, (clients_per_round,),
                                         replace=False, p=p))
        return Participants(ids, jnp.ones((clients_per_round,), bool), jnp.int32(clients_per_round))

    return Sampler("data_size", clients_per_round, True, draw)


def diurnal_online(seed: int, num_clients: int, online_fraction: float, hours: jax.Array) -> jax.Array:
    """[N] bool: which clients are online at `hours` in a diurnal pattern. Client i has its own phase
    phi_i ~ U[0, 24) (a time zone, the hour its device idles on a charger) and is online while
    cos(2 pi (h - phi_i) / 24) > cos(pi f): for the share f = `online_fraction` of each day, centred on phi_i."""
    phase = jax.random.uniform(stream_key(seed, "availability"), (num_clients,), maxval=24.0)
    return jnp.cos(2 * jnp.pi * (hours - phase) / 24.0) > jnp.cos(jnp.pi * online_fraction)


def read_availability_trace(path: str | Path, num_clients: int) -> np.ndarray:
    """A trace file's rows `client,start,end` (hours; a client online in [start, end); '#' comments and a
    header line allowed) as an [R, 3] float64 array. A bad row is refused naming its line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read the availability trace {path}: {err.strerror or err}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text or (number == 1 and text.replace(" ", "").lower() == "client,start,end"):
            continue
        parts = [p.strip() for p in text.split(",")]
        try:
            client, start, end = int(parts[0]), float(parts[1]), float(parts[2])
            if len(parts) != 3:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"{path} line {number}: {line.strip()[:80]!r} is not 'client,start,end' (an id and "
                             f"two hours)") from None
        if not 0 <= client < num_clients or not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"{path} line {number}: client {client} must be in [0, {num_clients}) and "
                             f"start <= end, finite hours; got {line.strip()[:80]!r}")
        rows.append((client, start, end))
    if not rows:
        raise ValueError(f"the availability trace {path} has no 'client,start,end' rows")
    return np.asarray(rows, np.float64)


def trace_online(trace: np.ndarray, num_clients: int, hours: jax.Array) -> jax.Array:
    """[N] bool: the clients with an interval of `trace` holding `hours`."""
    client = jnp.asarray(trace[:, 0], jnp.int32)
    inside = (jnp.asarray(trace[:, 1], jnp.float32) <= hours) & (hours < jnp.asarray(trace[:, 2], jnp.float32))
    return jnp.zeros((num_clients,), bool).at[client].max(inside)


def availability_sampler(num_clients: int, clients_per_round: int, seed: int, *, hours_per_round: float,
                         online_fraction: float = 0.5, trace: np.ndarray | None = None) -> Sampler:
    """K clients drawn uniformly among those online at round r's hour r x `hours_per_round`: a diurnal
    pattern (`diurnal_online`) or, given, a trace (`read_availability_trace`)."""
    check_slots(clients_per_round, num_clients)
    if not hours_per_round > 0 or not math.isfinite(hours_per_round):
        raise ValueError(f"--hours-per-round must be a positive number of hours, got {hours_per_round}")
    if trace is None and not 0 < online_fraction <= 1:
        raise ValueError(f"--online-fraction must be in (0, 1], got {online_fraction}")

    def draw(key, round_index):
        hours = round_index.astype(jnp.float32) * hours_per_round
        online = (trace_online(trace, num_clients, hours) if trace is not None
                  else diurnal_online(seed, num_clients, online_fraction, hours))
        scores = jax.random.uniform(_round_key(key, round_index), (num_clients,))
        chosen_rank = jnp.argsort(jnp.where(online, -scores, jnp.inf), stable=True)
        chosen = jnp.zeros((num_clients,), bool).at[chosen_rank[:clients_per_round]].set(True) & online
        out = _first_slots(chosen, scores, clients_per_round)
        return out.replace(drawn=jnp.minimum(out.drawn, clients_per_round))

    return Sampler("availability", clients_per_round, False, draw)


def check_slots(clients_per_round: int, num_clients: int) -> None:
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(f"clients per round must be in [1, {num_clients}], got {clients_per_round}")


@dataclasses.dataclass(frozen=True)
class SamplerContext:
    """What a sampler's builder is given: the population, the run's K and seed, the clients' example
    counts, the run's participation options (`hours_per_round`, `online_fraction`, `availability_trace`),
    and what a slot count it chooses must be a multiple of (8, and the devices of a sharded round)."""

    num_clients: int
    clients_per_round: int
    seed: int
    counts: np.ndarray
    hours_per_round: float = 1.0
    online_fraction: float = 0.5
    availability_trace: str | None = None
    slot_multiple: int = 8  # a sampler that chooses its slot count rounds it up to a multiple of this


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """A named sampler and its builder."""

    name: str
    build: Callable[[SamplerContext], Sampler]
    summary: str = ""


def _availability(ctx: SamplerContext) -> Sampler:
    trace = (read_availability_trace(ctx.availability_trace, ctx.num_clients)
             if ctx.availability_trace is not None else None)
    return availability_sampler(ctx.num_clients, ctx.clients_per_round, ctx.seed, hours_per_round=ctx.hours_per_round,
                                online_fraction=ctx.online_fraction, trace=trace)


SAMPLERS: dict[str, SamplerSpec] = {spec.name: spec for spec in (
    SamplerSpec("uniform", lambda c: uniform_sampler(c.num_clients, c.clients_per_round),
                "K of N without replacement (the default)"),
    SamplerSpec("poisson", lambda c: poisson_sampler(c.num_clients, c.clients_per_round, c.slot_multiple),
                "each client with probability K/N"),
    SamplerSpec("data_size", lambda c: data_size_sampler(c.num_clients, c.clients_per_round, c.counts),
                "K of N, probability proportional to examples"),
    SamplerSpec("availability", _availability,
                "K of the clients online (diurnal pattern or --availability-trace)"),
)}
_BUILT_IN = frozenset(SAMPLERS)
INSTALLED = EntryPointGroup(ENTRY_POINT_GROUP)


def register_sampler(spec: SamplerSpec) -> None:
    """Adds `spec` to the samplers `--sampler` can name; a name taken by another sampler is refused."""
    if not isinstance(spec, SamplerSpec):
        raise TypeError(f"register_sampler takes a SamplerSpec, got {type(spec).__name__}")
    if spec.name in SAMPLERS and SAMPLERS[spec.name] is not spec:
        raise ValueError(f"a sampler named {spec.name!r} is registered already")
    SAMPLERS[spec.name] = spec


def _load_entry_points() -> None:
    skipped = []

    def take(entry, spec):
        if entry.name in _BUILT_IN or not isinstance(spec, SamplerSpec) or spec.name != entry.name:
            skipped.append((entry, "it must name a SamplerSpec of its own name, not a built-in's"))
            return
        try:
            register_sampler(spec)
        except ValueError as err:
            skipped.append((entry, str(err)))

    INSTALLED.load(take, lambda entry, why: skipped.append((entry, why)))
    for entry, why in skipped:  # warned here, so that each warning points at the caller that asked for samplers
        warnings.warn(f"skipped the installed sampler {entry.name!r} ({entry.value}): {why}", UserWarning,
                      stacklevel=2)


def sampler_names() -> list[str]:
    _load_entry_points()
    return sorted(SAMPLERS)


def build_sampler(name: str, context: SamplerContext) -> Sampler:
    """The sampler `--sampler name` builds for this run."""
    _load_entry_points()
    if name not in SAMPLERS:
        raise ValueError(f"unknown --sampler {name!r}; the samplers are {', '.join(sorted(SAMPLERS))}")
    sampler = SAMPLERS[name].build(context)
    if not 1 <= sampler.slots <= context.num_clients:
        raise ValueError(f"the sampler {name!r} asks for {sampler.slots} slots; a round has 1 to "
                         f"{context.num_clients} (the clients)")
    return sampler
