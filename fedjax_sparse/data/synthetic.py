"""FedProx's Synthetic(alpha, beta) (Li et al., MLSys 2020): a population generated client by client.

The generative process of the paper (section 5.1), read as its code (`generate_synthetic.py` of
the FedProx repository) draws it, for client k:
  u_k ~ N(0, alpha^2), B_k ~ N(0, beta^2)          (the code's `np.random.normal(0, alpha)`: alpha
                                                    and beta are standard deviations; the paper's
                                                    "N(0, alpha)" does not say)
  W_k [60 x 10], b_k [10] with entries ~ N(u_k, 1)  (model heterogeneity: alpha)
  v_k [60] with entries ~ N(B_k, 1)                 (feature heterogeneity: beta)
  x ~ N(v_k, Sigma), Sigma diagonal, Sigma_jj = j^-1.2 (j = 1..60)
  y = argmax(softmax(x W_k + b_k))
Taken as written, u_k shifts every class's score alike (by u_k (sum_j x_j + 1)), which leaves
the argmax, the label, unchanged: alpha moves the models but not the labels, in the code as
in this module (tests/test_synthetic.py); the labels' heterogeneity comes from the per-client
draws of W_k and b_k around u_k and from beta. Kept as the process is written.
Client sizes follow the code's power law, lognormal(4, 2) + 50 examples, capped at LEAF's
largest synthetic client (1,000 examples: without a cap a population of 10^6 clients draws
clients of ~10^6 examples, and the largest client fixes every round's scan length and
windows). Each client's examples are split as LEAF splits a user's (`-t sample --tf 0.9`):
max(1, int(0.9 n)) training examples, the rest its own test examples.

Everything about client k is a pure function of (seed, k): its size comes from a block of
4,096 clients' sizes drawn together ([seed, 0, k // 4096]; all N sizes cost milliseconds, and
fix `max_count`), its model from the seed sequence [seed, 1, k], its training and test
examples from [seed, 2, k] and [seed, 3, k] (the examples are i.i.d. given the client's model, so drawing
the two parts from two streams is LEAF's split of one draw, and an evaluation generates the
test part alone). So the population costs nothing until it is read: with the host and disk
stores each process generates the clients it owns, and only when a round samples them or an
evaluation scores them (`GeneratedWindows`, the round's prefetch thread generates them while
the previous round computes); the device store materializes all of them once (`materialize`).

The global test set is the union of the test examples of every client when there are at most
1,000, else of 1,000 clients drawn by the seed ([seed, 4]): a held-out sample of the
population (those clients' test examples are never trained on, wherever the clients train).

Any finite alpha and beta parse, but the draws scale with them: a beta past about 1e38
overflows a client's float32 features, and large enough ones overflow the float64 class
scores that pick its labels (argmaxes of NaN). Each client's examples are checked as they
are generated, and such a client is a one-line ValueError naming alpha and beta, not a
training loss of NaN that would blame the learning rate.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from fedjax_sparse.data.process_layout import ProcessLayout
from fedjax_sparse.data.windows import ClientWindows, Windows, fill_windows

FEATURES, CLASSES = 60, 10
MIN_EXAMPLES, MAX_EXAMPLES = 50, 1000
TRAIN_FRACTION = 0.9
SIZE_BLOCK = 4096
GLOBAL_TEST_CLIENTS = 1000
_SIZES, _MODEL, _TRAIN, _TEST, _GLOBAL = range(5)
SPLITS = {"train": _TRAIN, "test": _TEST}
SPEC = "synthetic:ALPHA,BETA"


def parse_spec(spec: str) -> tuple[float, float]:
    """(alpha, beta) of 'synthetic:ALPHA,BETA'; a one-line ValueError naming the spec otherwise."""
    try:
        alpha, beta = (float(v) for v in spec.split(":", 1)[1].split(","))
    except ValueError:
        raise ValueError(f"data set {spec!r} must be {SPEC} with two numbers, e.g. synthetic:1,1") from None
    if not (alpha >= 0 and beta >= 0 and math.isfinite(alpha) and math.isfinite(beta)):
        raise ValueError(f"data set {spec!r}: alpha and beta must be finite and >= 0, e.g. synthetic:0.5,0.5")
    return alpha, beta


def train_size(n: np.ndarray) -> np.ndarray:
    """LEAF's per-user split: max(1, int(0.9 n)) of a user's n examples train."""
    return np.maximum(1, np.floor(TRAIN_FRACTION * np.asarray(n)).astype(np.int64))


_SIGMA_SQRT = np.arange(1, FEATURES + 1, dtype=np.float64) ** -0.6  # sqrt of j^-1.2


@dataclasses.dataclass(frozen=True)
class Synthetic:
    """The population of `num_clients` clients of Synthetic(alpha, beta) under `seed` (module docstring;
    an int or a sequence of ints, e.g. a run's `stream_seed(seed, 'population')`)."""

    alpha: float
    beta: float
    seed: int | tuple
    num_clients: int

    num_classes = CLASSES
    input_shape = (FEATURES,)
    kind = "features"
    mean = ()
    std = ()
    augment = False
    has_clients = True

    def __post_init__(self):
        if self.num_clients < 1:
            raise ValueError(f"synthetic:{self.alpha:g},{self.beta:g} needs num_clients >= 1, got {self.num_clients}")

    def _rng(self, *words: int) -> np.random.Generator:
        return np.random.default_rng([*np.atleast_1d(self.seed).tolist(), *words])

    @property
    def name(self) -> str:
        return f"synthetic:{self.alpha:g},{self.beta:g}"

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """[N] examples of every client (training and test)."""
        blocks = [self._rng(_SIZES, b).lognormal(4.0, 2.0, SIZE_BLOCK)
                  for b in range(-(-self.num_clients // SIZE_BLOCK))]
        drawn = np.concatenate(blocks)[:self.num_clients]
        return np.minimum(np.floor(drawn).astype(np.int64) + MIN_EXAMPLES, MAX_EXAMPLES)

    @functools.cached_property
    def counts(self) -> dict[str, np.ndarray]:
        """{'train', 'test'}: [N] examples of every client in each split."""
        train = train_size(self.sizes)
        return {"train": train, "test": self.sizes - train}

    def client_model(self, client: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(W [60, 10], b [10], v [60]) of client `client`."""
        rng = self._rng(_MODEL, client)
        u, b_mean = rng.normal(0.0, 1.0, 2) * (self.alpha, self.beta)
        w = rng.normal(u, 1.0, (FEATURES, CLASSES))
        b = rng.normal(u, 1.0, CLASSES)
        v = rng.normal(b_mean, 1.0, FEATURES)
        return w, b, v

    def examples(self, client: int, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(x float32 [n, 60], y int32 [n]): client `client`'s training or test examples."""
        w, b, v = self.client_model(client)
        n = int(self.counts[split][client])
        rng = self._rng(SPLITS[split], client)
        x = v + rng.standard_normal((n, FEATURES)) * _SIGMA_SQRT
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is refused below, in one line
            features, scores = x.astype(np.float32), x @ w + b
        if not (np.isfinite(features).all() and np.isfinite(scores).all()):
            what = (f"features reach |x| = {np.abs(x).max():.3g}, past float32's {np.finfo(np.float32).max:.3g}"
                    if not np.isfinite(features).all() else "class scores x W_k + b_k, which pick its labels, "
                    "overflow float64")
            raise ValueError(f"{self.name}: client {client}'s generated {split} {what} (alpha = {self.alpha:g}, "
                             f"beta = {self.beta:g} draw its model and features); choose smaller ones (the paper's are "
                             f"0 to 1, e.g. synthetic:1,1)")
        return features, np.argmax(scores, axis=1).astype(np.int32)

    def materialize(self, clients, split: str) -> tuple[np.ndarray, np.ndarray]:
        """The examples of `clients`, client after client (x [n, 60], y [n])."""
        parts = [self.examples(int(k), split) for k in clients]
        if not parts:
            return np.zeros((0, FEATURES), np.float32), np.zeros(0, np.int32)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    @functools.cached_property
    def global_test_clients(self) -> np.ndarray:
        if self.num_clients <= GLOBAL_TEST_CLIENTS:
            return np.arange(self.num_clients)
        rng = self._rng(_GLOBAL)
        return np.sort(rng.choice(self.num_clients, GLOBAL_TEST_CLIENTS, replace=False))

    @functools.cached_property
    def global_test(self) -> tuple[np.ndarray, np.ndarray]:
        """(x, y): the global test set (module docstring)."""
        return self.materialize(self.global_test_clients, "test")

    def windows(self, split: str, process: ProcessLayout | None = None) -> "GeneratedWindows":
        """This process's clients of `split`, generated when read."""
        return GeneratedWindows(self, split, process or ProcessLayout())

    def subset(self, max_train: int | None, max_test: int | None, seed: int) -> "Synthetic":
        if max_train is not None or max_test is not None:
            raise ValueError(f"--max-train-examples and --max-test-examples do not apply to {self.name}: its clients' "
                             f"sizes are the generator's; choose --num-clients instead")
        return self


@dataclasses.dataclass(frozen=True)
class GeneratedWindows(ClientWindows):
    """`ClientWindows` of a `Synthetic` population's `split` whose examples are generated when a round
    or an evaluation reads them, for the clients `process` owns only; it holds nothing."""

    population: Synthetic
    split: str
    process: ProcessLayout

    mean = np.zeros(0, np.float32)
    std = np.zeros(0, np.float32)
    augment = False
    nbytes = 0

    @property
    def max_count(self) -> int:
        return int(self.population.counts[self.split].max())

    @property
    def num_clients(self) -> int:
        return self.population.num_clients

    @property
    def process_index(self) -> int:
        return self.process.index

    @property
    def process_count(self) -> int:
        return self.process.count

    def windows(self, ids: np.ndarray) -> Windows:
        return fill_windows(ids, self.max_count, (FEATURES,), np.float32, self.process,
                            lambda client: self.population.examples(client, self.split))
