"""How long each client takes: device and link profiles, the simulated clock, stragglers.

A client's round time is what the library already counts exactly, turned into seconds by its profile:

    seconds_k = downlink_bytes_k / downlink_k + 2 train_macs_k / speed_k + uplink_bytes_k / uplink_k + latency_k

(train_macs: the FLOPs a sparse method reports, `train_flops`, else the dense model's 3 x forward x epochs x
examples, both counted as the papers count them, one per multiply-accumulate (`core.structure.flops`); a speed is in
FLOP/s, which counts a multiply-accumulate as 2, `FLOPS_PER_MAC`; the bytes the messages hold, the upload
after the server's selection of what is sent). A synchronous round
lasts until the last client it aggregates has returned, or until `deadline` where a client it waited for
did not return by then.

Profiles are pure functions of (seed, client id): each figure log-normal around a preset's median
(`PRESETS`), so 10^6 clients cost no table; or read from a file, one row per client.

Stragglers (`Stragglers`): a deadline (clients over it are dropped: their update is lost), over-selection
(a round dispatches ceil((1 + f) K) clients and aggregates the first K to return; the rest are discarded),
a dropout probability (a client fails before returning, independently per (seed, round, client)), and a
minimum report count (a round in which fewer return is abandoned, as Bonawitz et al. 2019's server does:
it keeps its model and the updates that did return are lost).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.structure.flops import FLOPS_PER_MAC
from fedjax_sparse.core.round.streams import stream_key

FIGURES = ("flops_per_second", "downlink_bytes_per_second", "uplink_bytes_per_second", "latency_seconds")


@dataclasses.dataclass(frozen=True)
class ProfileDistribution:
    """A population's devices: each figure's median and its log-normal spread (sigma of its log; 0: all equal)."""

    name: str
    flops_per_second: float
    downlink_bytes_per_second: float
    uplink_bytes_per_second: float
    latency_seconds: float
    sigma: float = 0.5
    summary: str = ""


# Medians of the effective rates a training step and a transfer reach (not peak figures). None is measured
# here: each speed is a share of a named device class's float32 peak, the share and every link figure our
# assumption (docs/federation.md gives the arithmetic; a profile file gives measured figures instead):
# phone: a mid-range phone's CPU, an Arm Cortex-A76-class core (two 128-bit NEON pipelines with fused
#   multiply-add: 16 float32 FLOPs a cycle, ~32 GFLOP/s at 2 GHz), ~5 GFLOP/s effective; LTE-like 20 Mbit/s
#   down and 5 Mbit/s up;
# iot: a microcontroller, an Arm Cortex-M4F at 168 MHz (STM32F407): its FPU takes 1 cycle for VADD.F32 or
#   VMUL.F32 and 3 for VFMA.F32 (Cortex-M4 Technical Reference Manual), at most 1 FLOP a cycle, 0.17 GFLOP/s
#   peak; with the loads of a multiply-accumulate's operands, ~0.05 GFLOP/s; 2 Mbit/s down and 0.5 Mbit/s
#   up, 200 ms latency;
# edge: a laptop GPU, an NVIDIA GTX 1650 class (896 cores x 2 FLOPs x ~1.5 GHz = ~2.7 TFLOP/s peak),
#   ~1 TFLOP/s effective, on a 100 Mbit/s link.
PRESETS = {p.name: p for p in (
    ProfileDistribution("phone", 5e9, 2.5e6, 6.25e5, 0.05, 0.7, "mid-range phones on LTE"),
    ProfileDistribution("iot", 5e7, 2.5e5, 6.25e4, 0.2, 0.5, "microcontrollers on a slow link"),
    ProfileDistribution("edge", 1e12, 1.25e7, 1.25e7, 0.01, 0.3, "edge servers and laptops on broadband"),
)}


@flax.struct.dataclass
class ClientProfiles:
    """Per-client figures ([M] float32 each, for the M clients asked about)."""

    flops_per_second: jax.Array
    downlink_bytes_per_second: jax.Array
    uplink_bytes_per_second: jax.Array
    latency_seconds: jax.Array


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """The run's devices: drawn from `distribution`, or a `table` ([N, 4], `FIGURES` order) read from a file."""

    name: str
    distribution: ProfileDistribution | None = None
    table: np.ndarray | None = dataclasses.field(default=None, compare=False, hash=False)

    def profiles(self, seed: int, client_ids: jax.Array) -> ClientProfiles:
        """The clients' figures, a pure function of (seed, id) (traceable)."""
        if self.table is not None:
            rows = jnp.asarray(self.table, jnp.float32)[client_ids]
            return ClientProfiles(*(rows[:, i] for i in range(len(FIGURES))))
        d = self.distribution
        base = stream_key(seed, "devices")

        def one(client_id):
            noise = jax.random.normal(jax.random.fold_in(base, client_id), (len(FIGURES),))
            medians = jnp.asarray([getattr(d, f) for f in FIGURES], jnp.float32)
            return medians * jnp.exp(d.sigma * noise)

        rows = jax.vmap(one)(client_ids)
        return ClientProfiles(*(rows[:, i] for i in range(len(FIGURES))))


def read_profile_file(path: str | Path, num_clients: int) -> DeviceProfile:
    """A profile file: JSON naming a distribution ({"flops_per_second": ..., ..., "sigma": ...}, every figure
    of `FIGURES`), or CSV rows `client,flops_per_second,downlink_bytes_per_second,uplink_bytes_per_second,
    latency_seconds` covering every client once (a header line allowed). Bad content is refused naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"cannot read the device profile {path}: {err.strerror or err}") from None
    if path.suffix == ".json":
        try:
            fields = json.loads(text)
            missing = [f for f in FIGURES if f not in fields]
            unknown = sorted(set(fields) - set(FIGURES) - {"sigma"})
            if missing or unknown or not isinstance(fields, dict):
                raise ValueError(f"needs {', '.join(FIGURES)} (and optionally sigma)"
                                 + (f"; it lacks {', '.join(missing)}" if missing else "")
                                 + (f"; it has unknown {', '.join(unknown)}" if unknown else ""))
            distribution = ProfileDistribution(path.stem, **{k: float(v) for k, v in fields.items()})
        except (ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"the device profile {path}: {' '.join(str(err).split())[:200]}") from None
        check_distribution(distribution, str(path))
        return DeviceProfile(str(path), distribution)
    table = np.full((num_clients, len(FIGURES)), np.nan)
    for number, line in enumerate(text.splitlines(), 1):
        row = line.split("#", 1)[0].strip()
        if not row or (number == 1 and row.split(",")[0].strip().lower() == "client"):
            continue
        try:
            parts = [p.strip() for p in row.split(",")]
            client, values = int(parts[0]), [float(p) for p in parts[1:]]
            if len(values) != len(FIGURES):
                raise ValueError
        except ValueError:
            raise ValueError(f"{path} line {number}: {line.strip()[:80]!r} is not 'client,{','.join(FIGURES)}'") \
                from None
        if not 0 <= client < num_clients or not all(v > 0 and math.isfinite(v) for v in values[:3]) \
                or not (values[3] >= 0 and math.isfinite(values[3])):
            raise ValueError(f"{path} line {number}: the client must be in [0, {num_clients}), the rates positive "
                             f"and the latency >= 0; got {line.strip()[:80]!r}")
        table[client] = values
    missing = np.flatnonzero(np.isnan(table[:, 0]))
    if missing.size:
        raise ValueError(f"the device profile {path} has no row for {missing.size} of the {num_clients} clients "
                         f"(client {missing[0]} first)")
    return DeviceProfile(str(path), table=table)


def check_distribution(d: ProfileDistribution, where: str) -> None:
    for figure in FIGURES[:3]:
        if not getattr(d, figure) > 0 or not math.isfinite(getattr(d, figure)):
            raise ValueError(f"{where}: {figure} must be a positive number, got {getattr(d, figure)}")
    if not d.latency_seconds >= 0 or not d.sigma >= 0:
        raise ValueError(f"{where}: latency_seconds and sigma must be >= 0, got {d.latency_seconds}, {d.sigma}")


def device_profile(name: str, num_clients: int) -> DeviceProfile:
    """`--device-profile name`: a preset (`PRESETS`) or a profile file (`read_profile_file`)."""
    if name in PRESETS:
        return DeviceProfile(name, PRESETS[name])
    if not Path(name).exists():
        raise ValueError(f"--device-profile {name!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    return read_profile_file(name, num_clients)


def client_seconds(profiles: ClientProfiles, train_flops: jax.Array, downlink_bytes: jax.Array,
                   uplink_bytes: jax.Array) -> jax.Array:
    """Each client's round time ([K], float32; see the module's docstring). `train_flops`: multiply-accumulates,
    the library's FLOPs (`core.structure.flops`), each 2 FLOPs of the profiles' FLOP/s."""
    return (downlink_bytes.astype(jnp.float32) / profiles.downlink_bytes_per_second
            + FLOPS_PER_MAC * train_flops.astype(jnp.float32) / profiles.flops_per_second
            + uplink_bytes.astype(jnp.float32) / profiles.uplink_bytes_per_second
            + profiles.latency_seconds)


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """What happens to slow or failing clients (all off by default).

    deadline: seconds after which the server closes the round (None: it waits for every client);
    target: the number of returned clients aggregated, the first to return (over-selection; None: all);
    dropout: the probability that a dispatched client fails before returning;
    min_reports: a round in which fewer clients return is abandoned (None: it aggregates whoever returned)."""

    deadline: float | None = None
    target: int | None = None
    dropout: float = 0.0
    min_reports: int | None = None

    def __post_init__(self):
        if self.deadline is not None and not (self.deadline > 0 and math.isfinite(self.deadline)):
            raise ValueError(f"--round-deadline must be a positive number of seconds, got {self.deadline}")
        if self.target is not None and self.target < 1:
            raise ValueError(f"the clients aggregated per round must be at least 1, got {self.target}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.min_reports is not None and self.min_reports < 1:
            raise ValueError(f"--min-reports must be at least 1, got {self.min_reports}")
        if self.min_reports is not None and self.target is not None and self.min_reports > self.target:
            raise ValueError(f"--min-reports {self.min_reports} exceeds the {self.target} clients over-selection "
                             f"aggregates: every round would be abandoned")

    @property
    def active(self) -> bool:
        return (self.deadline is not None or self.target is not None or self.dropout > 0
                or self.min_reports is not None)


def failed_clients(seed: int, round_index: jax.Array, client_ids: jax.Array, dropout: float) -> jax.Array:
    """[K] bool: the clients that fail this round, each with probability `dropout` (pure in (seed, round, id))."""
    base = jax.random.fold_in(stream_key(seed, "dropout"), round_index)
    return jax.vmap(lambda c: jax.random.uniform(jax.random.fold_in(base, c)) < dropout)(client_ids)


@flax.struct.dataclass
class Returns:
    """Which of the round's slots returned an update the server aggregates, and why the others did not.

    returned, late (over the deadline), failed (dropout), surplus (returned after the first `target`),
    abandoned (returned, in a round abandoned for want of `min_reports`; None: no such rule):
    [K] bool each, over the dispatched slots; seconds: the round's length."""

    returned: jax.Array
    late: jax.Array
    failed: jax.Array
    surplus: jax.Array
    seconds: jax.Array
    abandoned: jax.Array | None = None


def round_returns(reporting: jax.Array, failed: jax.Array, seconds: jax.Array, stragglers: Stragglers) -> Returns:
    """The synchronous round's outcome. `reporting`: dispatched and not failed; `seconds`: each client's time.

    The round lasts until the last aggregated client returned; until the deadline where some client the
    server waited for (failed or late: it cannot tell them apart) never returned in time. Where fewer than
    `min_reports` returned, none is aggregated: their updates are `abandoned` (the round lasted as long)."""
    on_time = reporting if stragglers.deadline is None else reporting & (seconds <= stragglers.deadline)
    late = reporting & ~on_time
    returned = on_time
    if stragglers.target is not None:
        order = jnp.argsort(jnp.where(on_time, seconds, jnp.inf), stable=True)
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
        returned = on_time & (rank < stragglers.target)
    surplus = on_time & ~returned
    last = jnp.max(jnp.where(returned, seconds, 0.0))
    if stragglers.deadline is not None:  # a client it waited for never came: the server waited to the deadline
        waited = jnp.any(late | failed)
        if stragglers.target is not None:
            waited &= jnp.sum(returned) < stragglers.target
        last = jnp.where(waited, jnp.float32(stragglers.deadline), last)
    if stragglers.min_reports is None:
        return Returns(returned, late, failed, surplus, last)
    abandoned = returned & (jnp.sum(returned) < stragglers.min_reports)
    return Returns(returned & ~abandoned, late, failed, surplus, last, abandoned)
