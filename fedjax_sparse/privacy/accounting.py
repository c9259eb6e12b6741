"""What a run's differential privacy costs: epsilon at delta, from Google's `dp-accounting` (not written here).

The unit of privacy is the client: two federations are neighbours when one client's data differ (or one
client is there or not), whatever it holds. Each round releases the noised sum of the sampled clients'
clipped updates, a subsampled Gaussian mechanism with noise multiplier z (noise standard deviation z C
for clip norm C); the rounds compose. The events given to the accountant:

  poisson sampling (each client with probability q = K / N):  PoissonSampledDpEvent(q, Gaussian(z)),
      neighbours by adding or removing a client (the relation Poisson amplification is proven for);
  uniform sampling (K of N without replacement):  SampledWithoutReplacementDpEvent(N, K, Gaussian(z / 2)),
      neighbours by replacing a client's data (the relation sampling a fixed K is analysed under): a
      replaced client's clipped update may move the sum by 2 C, and the accountant's noise multiplier is
      the noise's standard deviation over that sensitivity, z C / 2 C;
  local noise (each client noises its own update; the server sees who took part, so sampling amplifies
      nothing): Gaussian(z / 2) composed over every round (any two updates of one client are 2 C apart),
      a client's worst case of taking part in all;
  unamplified (K of N without replacement, for clients that keep state between rounds: the proof of
      amplification does not hold for them, `privacy.mechanism`): the same event as local
      noise's, Gaussian(z / 2) composed over every round, with the central noise z C on the sum.
These are a plain sum's sensitivities (`ACCOUNTED_SENSITIVITY`). An algorithm whose sums move further (FedLDF's
by 2 C where a client is added: `core.contract.algorithm.PrivateSum`) is noised by the privacy wrapper in proportion,
so that the events above, of multiplier z, stay true of it.

Adaptive clipping (`count_noise`, Andrew et al. 2021) releases a second sum each round: the count of clients
whose update was within the clip norm, each client's indicator centred (1/2 or -1/2, as their estimator and TF
Privacy's quantile query centre it), noised with standard deviation sigma_b. A client added or removed moves it
by 1/2, one replaced by 1: half the update sum's sensitivity in clip norms under either relation. The update's
own noise multiplier z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) then makes the two one Gaussian of multiplier z,
the multiplier accounted (`PrivacyLedger.update_noise_multiplier`, `count_sensitivity`).

`accountant` 'rdp' (Renyi DP, Mironov 2017; Mironov et al. 2019 for the subsampled Gaussian) or 'pld'
(privacy loss distributions, tighter; `dp-accounting` supports it for Poisson sampling and local noise
here). delta defaults to 1 / N^1.1 (`default_delta`): below 1 / N, as a meaningful delta must be for a
population of N.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from fedjax_sparse.console import quieted

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "uniform", "local", "unamplified")
RELATION = {"poisson": "add_or_remove", "uniform": "replace_one", "local": "replace_one",  # each sampling's neighbours
            "unamplified": "replace_one"}
# the neighbouring relation each sampling is accounted under, and the sensitivity (in clip norms) of the sum that a
# noise of standard deviation z C is accounted against in it: a plain sum of clipped updates moves by C where a
# client is added or removed, by 2 C where one is replaced. An algorithm whose sums move otherwise (FedLDF's,
# `core.contract.algorithm.PrivateSum`) scales its noise by its own sensitivity over this one.
ACCOUNTED_SENSITIVITY = {"add_or_remove": 1.0, "replace_one": 2.0}
MAX_NOISE_MULTIPLIER = 1e4


def count_noise_of(given: float | None, clients_per_round: int) -> float:
    """Adaptive clipping's count noise sigma_b: `given` (`--dp-count-noise`), else K / 20, Andrew et al.'s."""
    return given if given else clients_per_round / 20


def default_delta(num_clients: int) -> float:
    """1 / N^1.1: below 1 / N, so that releasing one client's data outright is not within delta."""
    return 1.0 / num_clients ** 1.1


@dataclasses.dataclass(frozen=True)
class PrivacyLedger:
    """A run's privacy: noise multiplier z, N clients, K a round, how they are sampled (`SAMPLINGS`), delta;
    `count_noise`: sigma_b, where adaptive clipping also releases a noised count (None: a fixed clip norm), which
    takes its share of z (the module docstring)."""

    noise_multiplier: float
    num_clients: int
    clients_per_round: int
    sampling: str
    delta: float
    accountant: str = "rdp"
    count_noise: float | None = None

    def __post_init__(self):
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"privacy accounting knows the samplings {', '.join(SAMPLINGS)}, got {self.sampling!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"--dp-accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        if self.accountant == "pld" and self.sampling == "uniform":
            raise ValueError("--dp-accountant pld accounts Poisson sampling (--sampler poisson) and local noise; "
                             "sampling K of N without replacement takes --dp-accountant rdp")
        if not 0 < self.delta < 1:
            raise ValueError(f"--dp-delta must be in (0, 1), got {self.delta}")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"--dp-noise-multiplier must be >= 0, got {self.noise_multiplier}")

    @property
    def relation(self) -> str:
        """The neighbouring relation the run is accounted under (`ACCOUNTED_SENSITIVITY`)."""
        return RELATION[self.sampling]

    @property
    def count_sensitivity(self) -> float:
        """How far one neighbour moves adaptive clipping's centred count: 1/2 added or removed, 1 replaced."""
        return ACCOUNTED_SENSITIVITY[self.relation] / 2

    @property
    def update_noise_multiplier(self) -> float:
        """The update's own noise over the clip norm: z, or z_delta where the count takes its share."""
        if self.count_noise is None:
            return self.noise_multiplier
        return adaptive_update_noise(self.noise_multiplier, self.count_noise)

    def event(self, rounds: int) -> "dp_accounting.DpEvent":
        from dp_accounting import dp_event  # imported where used: its SciPy costs every run 0.6 s to start

        # the noise over the sum's sensitivity: C where a client is added or removed, 2 C where it is replaced
        gaussian = dp_event.GaussianDpEvent(self.noise_multiplier / ACCOUNTED_SENSITIVITY[self.relation])
        if self.sampling == "poisson":
            one = dp_event.PoissonSampledDpEvent(self.clients_per_round / self.num_clients, gaussian)
        elif self.sampling == "uniform":
            one = dp_event.SampledWithoutReplacementDpEvent(self.num_clients, self.clients_per_round, gaussian)
        else:
            one = gaussian
        return dp_event.SelfComposedDpEvent(one, rounds)

    def epsilon(self, rounds: int) -> float:
        """epsilon at `delta` after `rounds` rounds (inf without noise, 0 before the first round)."""
        if rounds == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        if self.accountant == "pld":
            from dp_accounting.pld import pld_privacy_accountant

            accountant = pld_privacy_accountant.PLDAccountant()
        else:
            import dp_accounting
            from dp_accounting.rdp import rdp_privacy_accountant

            relation = (dp_accounting.NeighboringRelation.REPLACE_ONE if self.relation == "replace_one"
                        else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
            accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
        # dp-accounting logs each Renyi order whose series does not converge (it leaves the order out, and the
        # others bound epsilon): dozens of lines a calibration, none of them the user's concern
        with quieted("absl", logging.ERROR):
            accountant.compose(self.event(rounds))
            return float(accountant.get_epsilon(self.delta))


def calibrated_noise(ledger: PrivacyLedger, rounds: int, target_epsilon: float) -> float:
    """The smallest noise multiplier whose `rounds` rounds spend at most `target_epsilon` (bisection on z,
    to a relative 1e-3); a ValueError in one line where none up to `MAX_NOISE_MULTIPLIER` does."""
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"--dp-target-epsilon must be a positive number, got {target_epsilon}")

    def spent(z):
        return dataclasses.replace(ledger, noise_multiplier=z).epsilon(rounds)

    high = 1.0
    while spent(high) > target_epsilon:
        high *= 2
        if high > MAX_NOISE_MULTIPLIER:
            raise ValueError(f"--dp-target-epsilon {target_epsilon} cannot be met in {rounds} rounds of "
                             f"{ledger.sampling} sampling ({ledger.clients_per_round} of {ledger.num_clients}) at "
                             f"delta {ledger.delta:g} "
                             f"by any noise multiplier up to {MAX_NOISE_MULTIPLIER:g}; allow a larger epsilon, fewer "
                             f"rounds or fewer clients per round")
    low = 0.0
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        if middle > 0 and spent(middle) <= target_epsilon:
            high = middle
        else:
            low = middle
    return high


def adaptive_update_noise(noise_multiplier: float, count_noise: float, source: str | None = None) -> float:
    """Adaptive clipping's share of the budget (Andrew et al. 2021, section 3.1): the centred count of clients
    under the clip norm (its sensitivity half the update sum's), noised with standard deviation `count_noise`,
    and the update, noised with the returned multiplier z_delta, together cost one Gaussian of multiplier z:
    z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2). A ValueError in one line where the count alone would spend it,
    naming `source` (where sigma_b came from; default `--dp-count-noise sigma_b`)."""
    if noise_multiplier == 0:
        return 0.0
    rest = noise_multiplier ** -2 - (2 * count_noise) ** -2
    if not rest > 0:
        raise ValueError(f"{source or f'--dp-count-noise {count_noise:g}'} is too small for the noise multiplier "
                         f"{noise_multiplier:g}: the count alone would spend the budget (it needs more than "
                         f"{noise_multiplier / 2:g}); give a larger --dp-count-noise")
    return rest ** -0.5
