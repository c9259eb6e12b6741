"""The run's federation options: who is sampled, the clients' devices and links, stragglers.

Everything here off (the defaults) is the federation the library always simulated: K of N clients
uniformly each round, all returning, no clock; the round then computes what it always computed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from fedjax_sparse.core.round.buffered import Buffering
from fedjax_sparse.core.federation.clock import Stragglers, device_profile
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.core.federation.participation import SamplerContext, build_sampler
from fedjax_sparse.core.round.step import RoundConditions
from fedjax_sparse.core.messages.secure_aggregation import PROTOCOLS, SecureAggregation


@dataclasses.dataclass(frozen=True)
class FederationOptions:
    """The run's federation (docs/federation.md)."""

    OPTION_GROUP = "federation"  # the command line's help group (`core.contract.options.option_group`)

    sampler: str = option("uniform", "who takes part each round: uniform (K of N, the default), poisson (each client "
                                     "with probability K/N), data_size (K of N in proportion to their examples), "
                                     "availability (K of those online: a diurnal pattern or --availability-trace), "
                                     "or an installed sampler (entry point group fedjax_sparse.samplers)")
    hours_per_round: float = option(1.0, "availability: the simulated hours between rounds' starts (round r is at "
                                         "hour r x this)", low=0.0, low_open=True)
    online_fraction: float = option(0.5, "availability, diurnal pattern: the share of each day a client is online, "
                                         "around its own phase", low=0.0, low_open=True, high=1.0)
    availability_trace: str | None = option(None, "availability: a CSV file of client,start,end rows (hours; online "
                                                  "in [start, end)) instead of the diurnal pattern")
    device_profile: str | None = option(None, "the clients' devices and links, which give every round a simulated "
                                              "duration: phone, iot, edge (log-normal populations) or a profile "
                                              "file (JSON distribution or per-client CSV); default: no clock")
    round_deadline: float | None = option(None, "simulated seconds after which the server closes a round; clients "
                                                "over it are dropped and their update lost (needs "
                                                "--device-profile)", low=0.0, low_open=True)
    over_selection: float = option(0.0, "dispatch ceil((1 + f) K) clients and aggregate the first K to return "
                                        "(needs --device-profile)", low=0.0)
    dropout: float = option(0.0, "the probability that a dispatched client fails before returning (under "
                                 "--dp-clip the mean's fixed denominator K counts the failed too, so the update "
                                 "shrinks by (1 - p) on average; without it the mean is over those that returned)",
                            low=0.0, high=1.0, high_open=True)
    min_reports: int | None = option(None, "abandon a round in which fewer clients return (Bonawitz et al. 2019): "
                                           "the server keeps its model and the round's updates are lost (default: "
                                           "a round aggregates whoever returned)", low=1)
    async_buffer: int | None = option(None, "asynchronous rounds (FedBuff): --clients-per-round clients train at "
                                            "once, each from the model current when it was sent, and the server "
                                            "steps each time this many updates have arrived by the simulated clock "
                                            "(needs --device-profile; a round is one step); default: synchronous",
                                      low=1)
    secure_aggregation: str = option("none", "the server sees only the sum of the round's uploads: secagg "
                                             "(Bonawitz et al. 2017) or secagg+ (Bell et al. 2020), their bytes "
                                             "counted in every client's (none: it sees each upload)",
                                     choices=("none", *PROTOCOLS), group="privacy")
    secagg_bits: int = option(32, "secure aggregation: the bits of an entry's fixed-point encoding", low=1, high=32,
                              group="privacy")
    staleness_exponent: float = option(0.5, "asynchronous rounds: an update s server steps old is weighted by "
                                            "(1 + s)^-a (0.5: FedBuff's 1/sqrt(1 + s); 0: not down-weighted)",
                                       low=0.0)

    def ignored(self) -> dict[str, str]:
        out = {}
        if self.sampler != "availability":
            out.update({name: "is read only with --sampler availability"
                        for name in ("hours_per_round", "online_fraction", "availability_trace")})
        elif self.availability_trace is not None:
            out["online_fraction"] = "is read by the diurnal pattern, not with --availability-trace"
        if self.async_buffer is None:
            out["staleness_exponent"] = "is read only with --async-buffer"
        if self.secure_aggregation == "none":
            out["secagg_bits"] = "is read only with --secure-aggregation"
        return out


def buffering(config) -> Buffering | None:
    """The asynchronous rounds' buffer, concurrency (the clients per round) and staleness weighting; None:
    synchronous rounds."""
    if config.async_buffer is None:
        return None
    return Buffering(config.async_buffer, config.clients_per_round, config.staleness_exponent)


def dispatched_per_round(config) -> int:
    """The clients a round asks the sampler for: K, or ceil((1 + f) K) with over-selection."""
    if not config.over_selection:
        return config.clients_per_round
    return min(config.num_clients, math.ceil((1 + config.over_selection) * config.clients_per_round))


def slot_multiple(config) -> int:
    """What a sampler's own slot count is rounded to: 8 (CPU chunks), and the devices where the round is sharded
    over them (--shard-clients, several processes), so that each device gets as many."""
    if config.shard_clients or jax.process_count() > 1:
        return math.lcm(8, jax.device_count())
    return 8


def round_conditions(config, counts: np.ndarray, dense_flops_per_example: float) -> RoundConditions:
    """The `RoundConditions` of the run's federation options (`config`: a RunConfig)."""
    slots = dispatched_per_round(config)
    if config.over_selection and slots == config.clients_per_round:
        raise ValueError(f"--over-selection {config.over_selection} dispatches no more than K = "
                         f"{config.clients_per_round} clients of {config.num_clients}: lower --clients-per-round")
    sampler = build_sampler(config.sampler, SamplerContext(
        num_clients=config.num_clients, clients_per_round=slots, seed=config.seed, counts=counts,
        hours_per_round=config.hours_per_round, online_fraction=config.online_fraction,
        availability_trace=config.availability_trace, slot_multiple=slot_multiple(config)))
    profile = device_profile(config.device_profile, config.num_clients) if config.device_profile else None
    stragglers = Stragglers(deadline=config.round_deadline,
                            target=config.clients_per_round if config.over_selection else None,
                            dropout=config.dropout, min_reports=config.min_reports)
    secure = (SecureAggregation(config.secure_aggregation, config.secagg_bits)
              if config.secure_aggregation != "none" else None)
    return RoundConditions(sampler, profile, stragglers, dense_flops_per_example, secure)


def federation_record(out, conditions: RoundConditions, counters) -> dict:
    """A round's federation figures for metrics.jsonl (none where the federation is today's: uniform, all
    returning, no clock), and `counters` (a run's `Counters`) advanced.

    clients_dispatched: slots whose client was sent the model; clients_returned: those aggregated;
    updates_late / updates_failed / updates_surplus: lost to the deadline, to dropout, and discarded by
    over-selection; with --min-reports, round_abandoned and updates_abandoned (returned, lost with the round);
    simulated_seconds: the round's length (`core.federation.clock`), cumulative beside it."""
    if not conditions.varies and not conditions.timed:
        return {}
    dispatched = np.asarray(out.dispatched, bool)
    record = {"clients_dispatched": int(dispatched.sum())}
    counters.clients_dispatched_total += record["clients_dispatched"]
    if out.returns is not None:
        returns = {name: np.asarray(getattr(out.returns, name), bool) for name in ("returned", "late", "failed",
                                                                                  "surplus")}
        record.update({"clients_returned": int(returns["returned"].sum()), "updates_late": int(returns["late"].sum()),
                       "updates_failed": int(returns["failed"].sum()),
                       "updates_surplus": int(returns["surplus"].sum())})
        counters.updates_lost_total += record["updates_late"] + record["updates_failed"]
        if out.returns.abandoned is not None:
            abandoned = int(np.asarray(out.returns.abandoned, bool).sum())
            record.update({"round_abandoned": bool(record["clients_returned"] + abandoned
                                                   < conditions.stragglers.min_reports),
                           "updates_abandoned": abandoned})
            counters.updates_lost_total += abandoned
            counters.rounds_abandoned_total += int(record["round_abandoned"])
    if conditions.profile is not None:
        seconds = float(np.asarray(out.returns.seconds))
        counters.simulated_seconds_total += seconds
        record.update({"simulated_seconds": seconds,
                       "cumulative_simulated_seconds": counters.simulated_seconds_total})
    return record


def federation_totals(conditions: RoundConditions, counters) -> dict:
    """The run's federation figures for summary.json (none where the federation is today's)."""
    if not conditions.varies and not conditions.timed:
        return {}
    dispatched = counters.clients_dispatched_total
    return {"clients_dispatched_total": dispatched, "updates_lost_total": counters.updates_lost_total,
            "updates_lost_share": counters.updates_lost_total / dispatched if dispatched else None,
            **({"rounds_abandoned_total": counters.rounds_abandoned_total}
               if conditions.stragglers.min_reports is not None else {}),
            **({"simulated_seconds_total": counters.simulated_seconds_total}
               if conditions.profile is not None else {})}
