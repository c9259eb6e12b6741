"""Secure aggregation's cost: the bytes SecAgg and SecAgg+ add to a round, and the field a sum needs.

Two protocols, both in their semi-honest form (an honest-but-curious server and clients):
  * SecAgg: Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
    CCS 2017. Every pair of clients masks, so each client deals with the n - 1 others: O(n + m) bytes per
    client and O(n^2 + m n) at the server (the paper's cost analysis).
  * SecAgg+: Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020.
    The same rounds over a sparse graph: each client deals with its k = O(log n) neighbours only,
    O(log n + m) bytes per client and O(n log n + m n) at the server.

Integers, not floats (how an upload enters the protocol). Masks are uniform in Z_R, so an entry must be an
integer mod R. An entry x is clipped to [-c, c] and encoded in fixed point with b bits, unsigned:

    q = round((clip(x, -c, c) + c) (2^b - 1) / (2 c))  in [0, 2^b - 1]    (`fixed_point_encode`)

(the offset encoding Flower's SecAgg+ uses; rounded to nearest, so an entry is off by at most half a step,
c / (2^b - 1); Flower rounds stochastically, which keeps the sum unbiased and changes no byte). The server
decodes the sum of `count` clients as total x 2 c / (2^b - 1) - count x c (`fixed_point_decode_sum`). The
sum of n encodings is at most n (2^b - 1), and it must not wrap mod R = 2^F, so the field takes

    F = bit length of n (2^b - 1),  the least F with n (2^b - 1) < 2^F                   (`field_bits`),

about b + log2 n bits: Bonawitz et al.'s requirement that R exceed any sum the inputs can reach (16-bit
inputs from 2^10 clients: 26-bit elements). n is the round's clients: the field is fixed before anyone
drops. Our default b is 32 (`SecureAggregation.value_bits`): a float32 entry carries 32 bits, and at
b = 32 the step 2 c / (2^32 - 1) is finer than float32's own spacing (2^-23 |x|) for every entry above
2^-8 c, so the float sums the simulation computes stay a faithful stand-in for the decoded sum. Bonawitz
et al. evaluate b = 16 (pass `value_bits=16` to price that). A masked input is m field elements packed at F
bits each (how the authors' implementation, Google's federated-compute `SecAggVector`, sends them):

    masked input = ceil(m F / 8) bytes                                              (`masked_input_bytes`)

Every one of the m entries is sent, zero or not: masking makes each entry uniform, so a sparse upload is
summed as a dense vector of its full size (its index, chosen by the client, cannot be hidden this way).

The rounds, and what a client sends (up) and receives (down) in each. Notation: n clients in the round,
k neighbours per client (n - 1 for SecAgg, `secagg_plus_graph` for SecAgg+), m entries, F field bits,
d clients that drop in round 2 (they shared keys, then sent no masked input: a deadline missed, a failure),
K public-key bytes, S share bytes, I client-id bytes, A authenticated-encryption overhead bytes.

    round 0  AdvertiseKeys          up    2 K              c_u^PK (encryption) and s_u^PK (mask agreement)
                                    down  k (I + 2 K)      each neighbour's id and its two public keys
    round 1  ShareKeys              up    k C              one ciphertext per neighbour v, C = A + 2 I + 2 S:
                                                           AE.enc(u || v || s_{u,v}^SK || b_{u,v}), a Shamir
                                                           share of u's mask key s_u^SK and one of its
                                                           self-mask seed b_u
                                    down  k C              the ciphertexts the neighbours wrote to u
    round 2  MaskedInputCollection  up    ceil(m F / 8)    y_u = x_u + PRG(b_u) + sum_v +-PRG(s_{u,v}) mod 2^F
                                    down  d_u I            the ids of u's neighbours that dropped
    round 3  ConsistencyCheck       (the active-adversary protocol only: not part of the semi-honest one)
    round 4  Unmasking              up    k S              per neighbour v: its s_v^SK share if v dropped,
                                                           its b_v share if v survived
                                    down  0

    survivor:  up = 2 K + k C + ceil(m F / 8) + k S        down = k (I + 2 K) + k C + d_u I
    dropped:   up = 2 K + k C                              down = k (I + 2 K) + k C
    server:    receives the sum of all clients' up, sends the sum of their down (it relays every message)

with d_u = k d / (n - 1) a client's dropped neighbours: exactly d in SecAgg (k = n - 1); in SecAgg+ its
expectation, the graph's labels being a uniform random permutation independent of who drops. A survivor
sends one unmasking share per neighbour however many drop (which secret a share is of changes, not their
count); what dropping adds to its bytes is the d_u ids it is told, and to the server the recomputation of
the dropped clients' pairwise masks (computation, not bytes; not priced here).

The papers give these costs asymptotically and name the messages; the byte sizes are our reading, defaults
those of the authors' implementation (Google's federated-compute, fcp/secagg), elliptic-curve Diffie-Hellman
on P-256 for the key agreement: K = 33 (a compressed P-256 point),
S = 36 (a Shamir share of a 32-byte secret in that implementation's 31-bit pieces mod 2^31 + 11: 9 x 4
bytes; a share over one 256-bit field would be 32), A = 28 (AES-GCM: 12-byte nonce, 16-byte tag), I = 4
(uint32 ids). Also our reading: lists other than round 0's are positional in the neighbour order that round
0 fixed (no ids beside them); round 2's downlink names the dropped neighbours as that implementation does
(the paper sends the survivor list U_3 instead, the same information); the ids inside the ciphertext are the
paper's (u || v); protocol framing, the session id and the signatures of the active-adversary protocol are
not counted; every client that is in round 0 shares keys in round 1 (drops are counted at round 2).

SecAgg+'s graph (`secagg_plus_graph`). Bell et al. prove k = O(log n) neighbours suffice for security against
a corrupted fraction gamma of clients and correctness under a dropped fraction delta. The degree and
threshold here are chosen by the rule of the authors' implementation (federated-compute's
graph_parameter_finder, for its semi-honest `CURIOUS_SERVER` class), reimplemented: a Harary graph (a ring,
each client joined to the k / 2 nearest on either side, k even) with randomly permuted labels; the least
even k < n - 1 such that, with statistical security 2^-40 (split evenly between the two failures below)
and correctness 2^-20,
  * the honest survivors stay connected: removing clients disconnects the graph only if k / 2 consecutive
    ones go at two separate places of the ring, so with B = floor(gamma n) + floor(delta n) bad clients
    P <= n (n - k - 1) / 2 x C(n - k, B - k) / C(n, B) < 2^-41;
  * some threshold t has P[a client has >= t corrupted neighbours] < 2^-41 / n (no coalition holds t shares
    of an honest client's secrets) and P[a client has < t surviving neighbours] < 2^-20 / n (every secret
    can be rebuilt), the counts hypergeometric over the n clients (floor(gamma n) corrupted,
    ceil((1 - delta) n) surviving) with k draws; t is the least such (at least 2: Shamir with threshold 1
    hands out the secret itself).
Where no such k exists below n - 1 (few clients, or gamma + delta near 1), the graph is complete: SecAgg.
Our defaults are gamma = 0.05 and delta = 0.33 (Bonawitz et al. design for up to a third of the clients
failing), a setting the authors' implementation tabulates (n = 10^4 gives k = 86, t = 29).

Why one module past 400 lines: two protocols' costs (SecAgg, SecAgg+), their parameters' derivations from the papers
and the field a sum needs, each figure next to the equation it comes from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import numpy as np

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.messages.pricing import PRICED_LEAVES

PROTOCOLS = ("secagg", "secagg+")
MAX_VALUE_BITS = 32  # a float32 entry has 2^32 values: a finer encoding would invent precision
SECURITY_BITS = 40
CORRECTNESS_BITS = 20


def _check_value_bits(value_bits: int) -> None:
    if isinstance(value_bits, bool) or not isinstance(value_bits, int) or not 1 <= value_bits <= MAX_VALUE_BITS:
        raise ValueError(f"value_bits must be an integer in [1, {MAX_VALUE_BITS}], got {value_bits!r}")


def _check_count(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def field_bits(num_clients: int, value_bits: int) -> int:
    """F, the bits of the modulus R = 2^F in which the sum of `num_clients` b-bit encodings never wraps:
    the least F with num_clients x (2^b - 1) < 2^F (see the module docstring).

        >>> field_bits(1024, 16)  # Bonawitz et al.'s 2^10 clients of 16-bit inputs
        26
    """
    _check_count("num_clients", num_clients, 1)
    _check_value_bits(value_bits)
    return (int(num_clients) * (2 ** value_bits - 1)).bit_length()


def masked_input_bytes(entries: int, bits: int) -> int:
    """The bytes of a masked input: `entries` field elements of `bits` bits each, packed."""
    _check_count("entries", entries, 0)
    _check_count("bits", bits, 1)
    return -(-int(entries) * bits // 8)


def _check_clip(clip: float) -> None:
    if not (isinstance(clip, (int, float, np.floating)) and math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0, got {clip!r}")


def fixed_point_encode(values, value_bits: int, clip: float) -> np.ndarray:
    """`values` as integers in [0, 2^b - 1] (uint64): clipped to [-clip, clip], then
    round((x + clip) (2^b - 1) / (2 clip)); an entry inside the range is off by at most clip / (2^b - 1).

        >>> fixed_point_encode([-1.0, 0.0, 1.0, 5.0], 8, 1.0).tolist()  # 5.0 is clipped to 1.0
        [0, 128, 255, 255]
    """
    _check_value_bits(value_bits)
    _check_clip(clip)
    levels = 2 ** value_bits - 1
    clipped = np.clip(np.asarray(values, np.float64), -clip, clip)
    return np.rint((clipped + clip) * (levels / (2 * clip))).astype(np.uint64)


def fixed_point_decode_sum(total, count: int, value_bits: int, clip: float) -> np.ndarray:
    """The float sum of `count` clients' entries from `total`, the sum of their `fixed_point_encode`s:
    total x 2 clip / (2^b - 1) - count x clip."""
    _check_value_bits(value_bits)
    _check_clip(clip)
    _check_count("count", count, 0)
    return np.asarray(total, np.float64) * (2 * clip / (2 ** value_bits - 1)) - count * clip


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _hypergeometric_pmf(population: int, marked: int, draws: int) -> np.ndarray:
    """[draws + 1] P[x of `draws` taken without replacement from `population` are `marked`]."""
    low, high = max(0, draws - (population - marked)), min(draws, marked)
    x = np.arange(low, high, dtype=np.float64)
    # Successive ratios pmf(x + 1) / pmf(x), so that one lgamma call anchors the whole support.
    log_ratios = np.log((marked - x) * (draws - x)) - np.log((x + 1) * (population - marked - draws + x + 1))
    anchor = _log_choose(marked, low) + _log_choose(population - marked, draws - low) - _log_choose(population, draws)
    pmf = np.zeros(draws + 1)
    pmf[low:high + 1] = np.exp(anchor + np.concatenate([[0.0], np.cumsum(log_ratios)]))
    return pmf


def _harary_threshold(num_clients: int, corrupt: int, bad: int, surviving: int, degree: int) -> int | None:
    """The Shamir threshold that makes a Harary graph of `degree` secure and correct (module docstring),
    or None where that degree cannot be."""
    n = num_clients
    if degree <= bad:
        log_disconnected = (math.log(n * (n - degree - 1) / 2) + math.lgamma(bad + 1) - math.lgamma(bad - degree + 1)
                            + math.lgamma(n - degree + 1) - math.lgamma(n + 1))
        if log_disconnected >= -(SECURITY_BITS + 1) * math.log(2):
            return None
    security_tail = 2.0 ** -(SECURITY_BITS + 1) / n
    correctness_tail = 2.0 ** -CORRECTNESS_BITS / n
    # P[>= t corrupted neighbours], summed from the far tail so that tiny terms are not lost.
    at_least = np.cumsum(_hypergeometric_pmf(n, corrupt, degree)[::-1])[::-1]
    secure = np.flatnonzero(at_least[1:] < security_tail)  # at_least[0] = 1: t >= 1
    surviving_at_most = np.cumsum(_hypergeometric_pmf(n, surviving, degree))
    # The largest t with P[< t surviving neighbours] = P[<= t - 1] below the correctness tail.
    most = int(np.argmax(surviving_at_most >= correctness_tail))
    if not secure.size or secure[0] + 1 > most:
        return None
    return max(int(secure[0]) + 1, 2)


def _check_fractions(corrupt_fraction: float, dropout_fraction: float) -> None:
    for name, value in (("corrupt_fraction", corrupt_fraction), ("dropout_fraction", dropout_fraction)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value < 1):
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if corrupt_fraction + dropout_fraction >= 1:
        raise ValueError(f"corrupt_fraction + dropout_fraction must be < 1 (someone must be honest and stay), "
                         f"got {corrupt_fraction} + {dropout_fraction}")


@functools.lru_cache(maxsize=None)
def secagg_plus_graph(num_clients: int, corrupt_fraction: float, dropout_fraction: float) -> tuple[int, int] | None:
    """(k, t): SecAgg+'s neighbours per client and Shamir threshold for `num_clients` clients of which a
    fraction `corrupt_fraction` may be corrupted and `dropout_fraction` may drop; None where no even
    k < num_clients - 1 meets the bounds (then every other client is a neighbour). The rule is in the module
    docstring.

        >>> secagg_plus_graph(10_000, 0.05, 0.33)  # 86 neighbours of 9,999
        (86, 29)
    """
    _check_count("num_clients", num_clients, 1)
    _check_fractions(corrupt_fraction, dropout_fraction)
    n = int(num_clients)
    # The slack keeps 0.33 x 100 from flooring to 32 through float rounding.
    corrupt = math.floor(corrupt_fraction * n + 1e-9)
    bad = corrupt + math.floor(dropout_fraction * n + 1e-9)
    surviving = math.ceil((1 - dropout_fraction) * n - 1e-9)
    for degree in range(2, n - 1, 2):
        threshold = _harary_threshold(n, corrupt, bad, surviving, degree)
        if threshold is not None:
            return degree, threshold
    return None


class Message(NamedTuple):
    """One message of a round, from one client's side: `direction` 'up' (client to server) or 'down'."""

    round: str
    direction: str
    what: str
    bytes: float


@dataclasses.dataclass(frozen=True)
class SecureAggregation:
    """A secure-aggregation protocol's bytes per round (the module docstring lists every message).

    protocol: 'secagg' (Bonawitz et al. 2017) or 'secagg+' (Bell et al. 2020); value_bits: b, the bits of an
    entry's fixed-point encoding; key_bytes, share_bytes, id_bytes, aead_overhead_bytes: K, S, I, A;
    neighbours: SecAgg+'s k (None: `secagg_plus_graph` of the round's n, corrupt_fraction and
    dropout_fraction); SecAgg ignores the last three, its graph is complete.

        >>> secagg = SecureAggregation("secagg", value_bits=16)
        >>> secagg.client_bytes(num_clients=4, entries=10, dropped=1)  # up, down of a client that stays
        (521.0, 538.0)
    """

    protocol: str
    value_bits: int = 32
    key_bytes: int = 33
    share_bytes: int = 36
    id_bytes: int = 4
    aead_overhead_bytes: int = 28
    neighbours: int | None = None
    corrupt_fraction: float = 0.05
    dropout_fraction: float = 0.33

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        _check_value_bits(self.value_bits)
        for name in ("key_bytes", "share_bytes", "id_bytes"):
            _check_count(name, getattr(self, name), 1)
        _check_count("aead_overhead_bytes", self.aead_overhead_bytes, 0)
        if self.neighbours is not None:
            _check_count("neighbours", self.neighbours, 1)
        _check_fractions(self.corrupt_fraction, self.dropout_fraction)

    def neighbours_in(self, num_clients: int) -> int:
        """k: the clients each client masks with and shares its secrets with, in a round of `num_clients`."""
        _check_count("num_clients", num_clients, 1)
        others = int(num_clients) - 1
        if self.protocol == "secagg":
            return others
        if self.neighbours is not None:
            return min(self.neighbours, others)
        graph = secagg_plus_graph(int(num_clients), self.corrupt_fraction, self.dropout_fraction)
        return others if graph is None else graph[0]

    def field_bits(self, num_clients: int) -> int:
        return field_bits(num_clients, self.value_bits)

    def ciphertext_bytes(self) -> int:
        """C: one encrypted pair of shares, AE.enc(u || v || s_{u,v}^SK || b_{u,v})."""
        return self.aead_overhead_bytes + 2 * self.id_bytes + 2 * self.share_bytes

    def messages(self, num_clients: int, entries: int, dropped: int = 0, *, survived: bool = True
                 ) -> tuple[Message, ...]:
        """Every message one client sends or receives in a round of `num_clients` clients, `entries`
        entries per upload and `dropped` clients dropping at round 2; `survived` False: the messages of one
        of those (it stops after round 1)."""
        _check_count("entries", entries, 0)
        _check_count("num_clients", num_clients, 1)
        # A survivor is not among the dropped; a dropped client is.
        low, high = (0, num_clients - 1) if survived else (1, num_clients)
        if isinstance(dropped, bool) or not isinstance(dropped, (int, np.integer)) or not low <= dropped <= high:
            state = "a survivor" if survived else "a dropped client"
            raise ValueError(f"dropped must be an integer in [{low}, {high}] for {state} of {num_clients} "
                             f"clients, got {dropped!r}")
        k = self.neighbours_in(num_clients)
        keys, ciphertexts = 2 * self.key_bytes, k * self.ciphertext_bytes()
        sent_keys = [Message("0 AdvertiseKeys", "up", "own two public keys", float(keys)),
                     Message("0 AdvertiseKeys", "down", "neighbours' ids and public keys",
                             float(k * (self.id_bytes + keys))),
                     Message("1 ShareKeys", "up", "encrypted shares to each neighbour", float(ciphertexts)),
                     Message("1 ShareKeys", "down", "encrypted shares from each neighbour", float(ciphertexts))]
        if not survived:
            return tuple(sent_keys)
        dropped_neighbours = k * dropped / (num_clients - 1) if num_clients > 1 else 0.0
        return tuple(sent_keys) + (
            Message("2 MaskedInputCollection", "up", "masked input",
                    float(masked_input_bytes(entries, self.field_bits(num_clients)))),
            Message("2 MaskedInputCollection", "down", "ids of dropped neighbours",
                    dropped_neighbours * self.id_bytes),
            Message("4 Unmasking", "up", "a share per neighbour (mask key if dropped, seed if not)",
                    float(k * self.share_bytes)),
        )

    def client_bytes(self, num_clients: int, entries: int, dropped: int = 0, *, survived: bool = True
                     ) -> tuple[float, float]:
        """(uplink, downlink) bytes of one client in the round (`messages`). A survivor's uplink includes the
        masked input, which replaces the plain upload."""
        messages = self.messages(num_clients, entries, dropped, survived=survived)
        return (sum(m.bytes for m in messages if m.direction == "up"),
                sum(m.bytes for m in messages if m.direction == "down"))

    def server_bytes(self, num_clients: int, entries: int, dropped: int = 0) -> tuple[float, float]:
        """(received, sent) bytes at the server: every client's uplink and downlink (it relays them all)."""
        _check_count("num_clients", num_clients, 1)
        _check_count("dropped", dropped, 0)
        if dropped > num_clients:
            raise ValueError(f"dropped must be in [0, {num_clients}] with {num_clients} clients, got {dropped}")
        received = sent = 0.0
        if dropped < num_clients:
            up, down = self.client_bytes(num_clients, entries, dropped)
            received, sent = (num_clients - dropped) * up, (num_clients - dropped) * down
        if dropped:
            up, down = self.client_bytes(num_clients, entries, dropped, survived=False)
            received, sent = received + dropped * up, sent + dropped * down
        return received, sent


class ProtocolBytes(NamedTuple):
    """A round's protocol bytes per client, each indexed by n, the clients dispatched (0 to the round's slots):
    up_survivor (masked input included), down_survivor (before the dropped ids it is told), up_dropped and
    down_dropped (a client that shared its keys, then dropped at round 2), per_dropped_neighbour (what each
    dropped client adds to a survivor's downlink: k / (n - 1) ids)."""

    up_survivor: np.ndarray
    down_survivor: np.ndarray
    up_dropped: np.ndarray
    down_dropped: np.ndarray
    per_dropped_neighbour: np.ndarray


def secure_bytes(protocol: SecureAggregation, slots: int, entries: int) -> ProtocolBytes:
    """`protocol`'s bytes for every round size n in [0, slots] (a round's n is known only when it runs: the
    clients its sampler dispatched), uploads of `entries` entries: the table the round indexes by n."""
    _check_count("slots", slots, 1)
    rows = np.zeros((5, slots + 1), np.float64)
    for n in range(1, slots + 1):
        up, down = protocol.client_bytes(n, entries, 0)
        gone_up, gone_down = protocol.client_bytes(n, entries, 1, survived=False)
        neighbour = protocol.neighbours_in(n) * protocol.id_bytes / (n - 1) if n > 1 else 0.0
        rows[:, n] = up, down, gone_up, gone_down, neighbour
    return ProtocolBytes(*rows)


def summed_entries(algorithm: FederatedAlgorithm, up_shape) -> int:
    """The entries a client's upload is summed as under secure aggregation (its leaves' sizes, and one for
    the weight a weighted mean divides by), refusing in one line an algorithm whose server would need more
    than the sum: a per-client choice (`select_uploads`), a server that reads uploads otherwise than through
    their mean (`aggregates_mean` False), or client-chosen index sets (sparse leaves, whose indexes cannot
    be masked into a sum)."""
    flag, algorithm_name = "--secure-aggregation", algorithm.name
    if algorithm.select_uploads is not None:
        raise ValueError(f"{flag}: {algorithm_name}'s server chooses each client's upload after reading them all "
                         f"(FedLDF's per-client layer choice); secure aggregation reveals only their sum")
    if not algorithm.aggregates_mean:
        raise ValueError(f"{flag}: {algorithm_name}'s server reads each client's upload, not only their mean "
                         f"(a masked mean, a per-client rule); secure aggregation reveals only their sum")
    leaves = jax.tree_util.tree_leaves(up_shape, is_leaf=lambda x: isinstance(x, PRICED_LEAVES))
    if any(isinstance(x, PRICED_LEAVES) for x in leaves):
        raise ValueError(f"{flag}: {algorithm_name}'s upload holds client-chosen indexes (sparse leaves), which "
                         f"masks cannot hide; sum them dense or leave secure aggregation out")
    return int(sum(int(np.prod(x.shape)) for x in leaves)) + 1
