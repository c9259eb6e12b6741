"""The run's differential privacy: its ledger (noise, sampling, delta), calibrated before the first round, the
epsilon each round has spent so far (metrics.jsonl, TensorBoard, summary.json), and which of a round's figures
a private run records: those it releases (docs/privacy.md)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from fedjax_sparse.privacy.accounting import (PrivacyLedger, adaptive_update_noise, calibrated_noise,
                                                   count_noise_of, default_delta)
from fedjax_sparse.console import say


def privacy_ledger(config, keeps_state: Callable[[], bool]) -> PrivacyLedger | None:
    """The ledger of a run with `--dp-clip` (`config`: a RunConfig), z calibrated where `--dp-target-epsilon`
    asks; None without differential privacy. Refuses, in one line, what it cannot account. `keeps_state()`:
    whether the algorithm's clients keep state between rounds, which sampling K of N does not amplify (asked
    only under `--sampler uniform` with central noise): such a run is accounted without amplification
    ('unamplified', said in one line)."""
    if config.dp_clip is None:
        return None
    if config.async_buffer is not None:
        raise ValueError("--dp-clip with --async-buffer: an asynchronous step aggregates updates of several "
                         "model versions, which the accountant's rounds do not describe; run synchronously")
    if config.over_selection:
        raise ValueError("--dp-clip with --over-selection: the first K to return are chosen by speed, not by the "
                         "sampling the accountant amplifies by; leave --over-selection out")
    if config.min_reports is not None:
        raise ValueError("--dp-clip with --min-reports: abandoning a round tells how many clients returned, which "
                         "the noise does not cover; leave --min-reports out")
    if config.dp_noise == "local":
        sampling = "local"
    elif config.sampler == "uniform" and keeps_state():
        sampling = "unamplified"
        if config.dp_noise_multiplier > 0 or config.dp_target_epsilon is not None:  # else no epsilon is claimed
            say(f"--dp-clip: the clients keep state between rounds ({config.algorithm}'s, its error feedback's or "
                f"personal layers'), which sampling K of N does not amplify: epsilon is accounted without "
                f"amplification (docs/privacy.md; --sampler poisson amplifies)")
    elif config.sampler in ("uniform", "poisson"):
        sampling = config.sampler
    else:
        raise ValueError(f"--dp-clip accounts --sampler uniform (K of N) and poisson; --sampler {config.sampler} "
                         f"chooses clients in a way the accountant does not amplify by")
    adaptive = config.dp_target_quantile is not None
    if adaptive and config.dp_noise == "local":
        raise ValueError("--dp-target-quantile with --dp-noise local: adaptive clipping's count is noised by the "
                         "server, which local noise does not trust; use --dp-noise central or a fixed --dp-clip")
    count_noise = count_noise_of(config.dp_count_noise, config.clients_per_round) if adaptive else None
    ledger = PrivacyLedger(config.dp_noise_multiplier, config.num_clients, config.clients_per_round, sampling,
                           config.dp_delta if config.dp_delta is not None else default_delta(config.num_clients),
                           config.dp_accountant, count_noise)
    if config.dp_target_epsilon is not None:
        ledger = dataclasses.replace(ledger, noise_multiplier=calibrated_noise(ledger, config.rounds,
                                                                               config.dp_target_epsilon))
    if adaptive:  # refuses, in one line, a count whose noise alone would spend the budget
        source = (f"--dp-count-noise {count_noise:g}" if config.dp_count_noise else
                  f"the default --dp-count-noise (K / 20 = {count_noise:g} at {config.clients_per_round} clients "
                  f"per round)")
        adaptive_update_noise(ledger.noise_multiplier, count_noise, source)
    return ledger


def privacy_record(ledger: PrivacyLedger | None, rounds_done: int) -> dict:
    """A round's privacy figures for metrics.jsonl: the epsilon spent by the rounds so far (none without DP)."""
    if ledger is None:
        return {}
    return {"dp_epsilon": _finite(ledger.epsilon(rounds_done))}


def _finite(epsilon: float) -> float | None:
    # without noise there is no privacy: None, since JSON has no infinity
    return epsilon if math.isfinite(epsilon) else None


def privacy_totals(ledger: PrivacyLedger | None, rounds_done: int) -> dict:
    """The run's privacy for summary.json: epsilon at delta, the noise multiplier accounted and how; with adaptive
    clipping the mechanism's parts, from which a reader recomputes the multiplier (docs/privacy.md): the update's
    own noise multiplier, the count's noise and its sensitivity (half the update sum's)."""
    if ledger is None:
        return {}
    parts = {} if ledger.count_noise is None else {
        "dp_update_noise_multiplier": ledger.update_noise_multiplier, "dp_count_noise": ledger.count_noise,
        "dp_count_sensitivity": ledger.count_sensitivity}
    return {"dp_epsilon": _finite(ledger.epsilon(rounds_done)), "dp_delta": ledger.delta,
            "dp_noise_multiplier": ledger.noise_multiplier, "dp_sampling": ledger.sampling,
            "dp_accountant": ledger.accountant, **parts}


# What a private run's metrics.jsonl holds of a round: the figures of what the server releases, the noised model
# (its evaluation on the test split; the step's own figures, `server_<name>`, computed from the noised sums it was
# handed, adaptive clipping's norm among them) and the privacy spent. Everything else a round measures reads the
# clients' data or who took part, which the noise does not cover: the training loss, the clients' figures, how
# many were dispatched or returned, bytes, FLOPs and seconds (which count them), the clients' own accuracies.
RELEASED_FIGURES = ("round", "dp_epsilon", "test_accuracy", "test_loss")
# summary.json's figures of the same kinds, which it then leaves out
UNRELEASED_TOTALS = ("final_train_loss", "final_personalized_accuracy", "best_personalized_accuracy",
                     "total_uplink_bytes", "total_downlink_bytes", "cumulative_bytes", "dense_train_flops_total",
                     "train_flops_total", "mean_padded_step_fraction", "num_train_examples",
                     "clients_dispatched_total", "updates_lost_total", "updates_lost_share", "simulated_seconds_total",
                     "rounds_abandoned_total")


def _withholds(ledger: PrivacyLedger | None, config) -> bool:
    # without noise (z = 0) nothing is private, and a run asked to record everything records it
    return ledger is not None and ledger.noise_multiplier > 0 and not config.dp_record_unreleased


def released_record(ledger: PrivacyLedger | None, config, record: dict) -> dict:
    """A round's record as metrics.jsonl holds it: under differential privacy with noise, what is released
    (`RELEASED_FIGURES`, `server_<name>`) unless `--dp-record-unreleased`; else all of it."""
    if not _withholds(ledger, config):
        return record
    return {k: v for k, v in record.items() if k in RELEASED_FIGURES or k.startswith("server_")}


def released_summary(ledger: PrivacyLedger | None, config, summary: dict) -> dict:
    """summary.json without the totals of what a private run does not release (`UNRELEASED_TOTALS`)."""
    if not _withholds(ledger, config):
        return summary
    return {k: v for k, v in summary.items() if k not in UNRELEASED_TOTALS}
