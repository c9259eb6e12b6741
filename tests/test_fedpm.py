"""FedPM against independent truths: the Beta posterior by hand for each prior-reset schedule, the
straight-through estimator by hand and the sampling frequency by the binomial law, the forward pass
of local training seen from inside the model (w x m, m in {0, 1}, w the signed constants), the
coded mask's price by hand and against a real arithmetic coder written here, the messages' bytes,
both evaluations, where Adam's moments live, and one run from the command line."""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_split
from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fedpm import beta_posterior, masked_paths, sampled_mask
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import CodedMask, Known, coded_mask_bytes, message_bytes
from fedjax_sparse.core.round.step import round_info
from fedjax_sparse.models import Layer, Model, ModelStructure, get_model
from fedjax_sparse.models import layers as L
from fedjax_sparse.models.structure import get_path

tree_map = jax.tree_util.tree_map

# ----------------------------------------------------------------- a tiny model with BatchNorm

SEEN = []  # the params of every forward pass of a `Recording` model, as numpy


class _Tiny(nn.Module):
    """2x2x1 -> dense 5 -> BatchNorm -> ReLU -> dense 3."""

    @nn.compact
    def __call__(self, x, train, mask=None, unit_masks=None):
        del unit_masks
        x = nn.Dense(5, name="fc1")(x.reshape(x.shape[0], -1))
        x = nn.relu(L.batch_norm(train, "bn")(x, mask=mask))
        return nn.Dense(3, name="fc2")(x)


class Recording(Model):
    """The model, telling `SEEN` what weights each forward pass really multiplies the inputs by."""

    def apply(self, variables, x, **kwargs):
        jax.debug.callback(lambda p: SEEN.append(tree_map(np.asarray, p)), variables["params"])
        return super().apply(variables, x, **kwargs)


TINY_STRUCTURE = ModelStructure((
    Layer("fc1", "dense", ("fc1", "kernel"), ("fc1", "bias"), ("bn",), 5, 4, ("input",)),
    Layer("fc2", "dense", ("fc2", "kernel"), ("fc2", "bias"), None, 3, 5, ("fc1",))))
TINY_MASKED = 4 * 5 + 5 + 5 * 3 + 3  # kernels and biases: 43 entries
TINY_STATS = 5 + 5  # BatchNorm mean and var


def tiny_model():
    return Recording(name="tiny", module=_Tiny(), input_shape=(2, 2, 1), num_classes=3, structure=TINY_STRUCTURE)


def tiny_split():
    return synthetic_split([12, 20, 16], shape=(2, 2, 1), num_classes=3)


def build(model, split, *, batch_size=2, lr_decay=1.0, **options):
    local = LocalSGD(model, 0.1, 1, batch_size, lr_decay=lr_decay)
    ctx = BuildContext(local=local, num_clients=split.num_clients, clients_per_round=2, train=split,
                       num_classes=model.num_classes, seed=0)
    return make_algorithm("fedpm", ctx, make_options("fedpm", options))


def first(tree):
    return tree_map(lambda a: a[0], tree)


# Round 0 trains at the learning rate 0.1, round 1 at 0.1 x 1e-5 = 1e-6 (theta stays where it was sent):
# one compiled client for the tests that need either.
FAST, SLOW = 0, 1


@pytest.fixture(scope="module")
def tiny():
    """The tiny model's FedPM (batch 2, Adam per client), its initial states and one jitted client_update."""
    model, split = tiny_model(), tiny_split()
    algorithm = build(model, split, lr_decay=1e-5)
    server, clients = init(algorithm, model)
    return model, split, algorithm, server, clients, jax.jit(algorithm.client_update)


def init(algorithm, model, num_clients=3):
    variables = jax.jit(model.init)(jax.random.key(0))
    return jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), variables, num_clients)


# ----------------------------------------------------------------- 1. Bayesian aggregation

def test_beta_posterior_by_hand():
    """Three clients' bits at two entries. With a reset the prior is Beta(1, 1) and theta is the mean of
    the bits (clipped to [0.01, 0.99]); without one, alpha and beta keep adding up."""
    ones = {"w": jnp.ones(2)}
    bits = {"w": jnp.array([[1, 0], [1, 0], [0, 0]], bool)}
    alpha, beta, theta = beta_posterior(ones, ones, bits, jnp.asarray(True))
    np.testing.assert_allclose(alpha["w"], [3, 1])  # 1 + ones
    np.testing.assert_allclose(beta["w"], [2, 4])   # 1 + zeros
    np.testing.assert_allclose(theta["w"], [2 / 3, 0.01], rtol=1e-6)  # 2/3 and 0/3 -> clipped
    again = {"w": jnp.array([[1, 1], [1, 0], [1, 0]], bool)}
    a2, b2, t2 = beta_posterior(alpha, beta, again, jnp.asarray(False))  # 3+3, 1+1; 2+0, 4+2
    np.testing.assert_allclose(a2["w"], [6, 2])
    np.testing.assert_allclose(b2["w"], [2, 6])
    np.testing.assert_allclose(t2["w"], [5 / 6, 1 / 6], rtol=1e-6)  # (a - 1) / (a + b - 2)
    a3, b3, t3 = beta_posterior(alpha, beta, again, jnp.asarray(True))  # the old posterior is dropped
    np.testing.assert_allclose(a3["w"], [4, 2])
    np.testing.assert_allclose(b3["w"], [1, 3])
    np.testing.assert_allclose(t3["w"], [0.99, 1 / 3], rtol=1e-6)  # 3/3 -> clipped


# Three rounds of three clients' bits at three entries (rows: clients).
ROUND_BITS = ([[1, 0, 1], [1, 0, 0], [0, 0, 1]],   # ones 2 0 2
              [[1, 1, 0], [1, 0, 0], [1, 1, 0]],   # ones 3 2 0
              [[0, 1, 1], [0, 1, 1], [0, 0, 1]])   # ones 0 2 3
EXPECTED_THETA = {
    1: ([2 / 3, 0.01, 2 / 3], [0.99, 2 / 3, 0.01], [0.01, 2 / 3, 0.99]),   # the mean of each round's bits
    0: ([2 / 3, 0.01, 2 / 3], [5 / 6, 2 / 6, 2 / 6], [5 / 9, 4 / 9, 5 / 9]),  # alpha 3 1 3 -> 6 3 3 -> 6 5 6
    2: ([2 / 3, 0.01, 2 / 3], [5 / 6, 2 / 6, 2 / 6], [0.01, 2 / 3, 0.99]),   # reset at rounds 0 and 2 only
}
EXPECTED_ALPHA = {1: [[3, 1, 3], [4, 3, 1], [1, 3, 4]], 0: [[3, 1, 3], [6, 3, 3], [6, 5, 6]],
                  2: [[3, 1, 3], [6, 3, 3], [1, 3, 4]]}


@pytest.mark.parametrize("prior_reset", [1, 0, 2])
def test_server_update_by_hand_for_each_prior_reset(tiny, prior_reset):
    """server_update over three rounds of hand-written bits: every masked entry of the tiny model with
    flat index j gets column j % 3 of ROUND_BITS; theta, alpha, beta as computed by hand. theta ignores
    the data weights (each bit is one sample); the BatchNorm statistics are the data-weighted mean;
    the frozen weights do not move."""
    model, split, _, server, _, _ = tiny  # the server state's layout does not depend on the options
    algorithm = build(model, split, prior_reset=prior_reset)
    weights = jnp.array([1.0, 2.0, 5.0])
    for r, rows in enumerate(ROUND_BITS):
        rows = np.array(rows, bool)
        mask = {name: jnp.asarray(rows[:, np.arange(t.size) % 3].reshape(3, *t.shape))
                for name, t in server["theta"].items()}
        stats = {"bn": {"mean": jnp.arange(15.0).reshape(3, 5), "var": jnp.full((3, 5), r + 1.0)}}
        ups = {"mask": {name: CodedMask(b) for name, b in mask.items()}, "batch_stats": stats}
        before = server
        server = jax.jit(algorithm.server_update)(server, ups, weights, round_info(0, r, jnp.array([0, 1, 2])))
        for name, theta in server["theta"].items():
            column = np.arange(theta.size).reshape(theta.shape) % 3
            np.testing.assert_allclose(theta, np.asarray(EXPECTED_THETA[prior_reset][r])[column], rtol=1e-6,
                                       err_msg=f"round {r} {name}")
            alpha = np.asarray(EXPECTED_ALPHA[prior_reset][r])[column]
            np.testing.assert_allclose(server["alpha"][name], alpha)
            # alpha + beta = 2 + 3 x (rounds since the last reset)
            since = r + 1 if prior_reset == 0 else (r % prior_reset) + 1
            np.testing.assert_allclose(server["beta"][name], 2 + 3 * since - alpha)
        np.testing.assert_allclose(server["batch_stats"]["bn"]["mean"],
                                   (1 * np.arange(5) + 2 * np.arange(5, 10) + 5 * np.arange(10, 15)) / 8, rtol=1e-6)
        np.testing.assert_allclose(server["batch_stats"]["bn"]["var"], np.full(5, r + 1.0), rtol=1e-6)
        tree_map(np.testing.assert_array_equal, server["weights"], before["weights"])
        assert int(server["round"]) == r + 1


# ----------------------------------------------------------------- 2. masks

def test_the_straight_through_gradient_by_hand():
    """L(m) = (a . m - y)^2 through a sampled mask: dL/dtheta is dL/dm at the *sampled* m,
    2 (a . m - y) a (dm/dtheta := 1), not the derivative at theta; through the scores,
    dL/ds = dL/dm theta (1 - theta). The forward value is exactly the Bernoulli sample of the key."""
    a = jnp.array([1.0, -2.0, 3.0, 0.5, 4.0])
    y = 1.5
    theta = jnp.array([0.3, 0.6, 0.5, 0.9, 0.2])
    key = jax.random.key(7)
    m = np.asarray(jax.random.bernoulli(key, theta), np.float32)
    np.testing.assert_array_equal(sampled_mask(theta, key), m)
    assert 0 < m.sum() < m.size  # a mask that is neither theta nor trivial
    loss = lambda mask: (jnp.dot(a, mask) - y) ** 2  # noqa: E731
    by_hand = 2 * (np.dot(np.asarray(a), m) - y) * np.asarray(a)
    np.testing.assert_allclose(jax.grad(lambda t: loss(sampled_mask(t, key)))(theta), by_hand, rtol=1e-6)
    assert not np.allclose(by_hand, 2 * (np.dot(a, theta) - y) * np.asarray(a))  # the estimator reads m, not theta
    scores = jnp.log(theta) - jnp.log1p(-theta)
    through_scores = jax.grad(lambda s: loss(sampled_mask(jax.nn.sigmoid(s), key)))(scores)
    np.testing.assert_allclose(through_scores, by_hand * np.asarray(theta * (1 - theta)), rtol=1e-5)


def test_sampled_masks_are_bits_whose_frequency_is_theta():
    """Every sample is exactly 0 or 1 (the straight-through trick leaves the forward value alone), and
    over 4000 draws each entry's frequency is within 4 binomial standard deviations of its theta."""
    theta = jnp.array([0.01, 0.1, 0.3, 0.5, 0.7, 0.93, 0.99])
    draws = np.asarray(jax.jit(jax.vmap(lambda k: sampled_mask(theta, k)))(jax.random.split(jax.random.key(0), 4000)))
    assert set(np.unique(draws)) == {0.0, 1.0}
    p = np.asarray(theta, np.float64)
    assert np.all(np.abs(draws.mean(0) - p) <= 4 * np.sqrt(p * (1 - p) / 4000))
    wide = jax.random.uniform(jax.random.key(1), (100_000,), minval=0.01, maxval=0.99)
    assert set(np.unique(np.asarray(jax.jit(sampled_mask)(wide, jax.random.key(2))))) == {0.0, 1.0}


def test_local_training_runs_frozen_signed_constants_times_fresh_bits(tiny):
    """Seen from inside the model: every forward pass of local training multiplies the inputs by
    w x m, m a fresh {0, 1} sample per step (kept at the broadcast's theta: 0.1 in fc1, 0.8 in fc2),
    w the frozen signed constants +-e sqrt(1 / fan_in) (fc1: e / 2, fc2: e / sqrt(5)), unchanged
    through training; BatchNorm's scale and shift stay frozen at 1 and 0. The upload holds only the
    coded masks and the BatchNorm statistics; train_flops is 3 x examples x the expected mask's
    multiply-adds (a learning rate of 1e-6 keeps theta where it was sent)."""
    _, split, algorithm, server, clients, client_update = tiny
    constants = {"fc1": math.e / 2, "fc2": math.e / math.sqrt(5)}
    w = server["weights"]
    for layer, c in constants.items():
        for leaf in ("kernel", "bias"):
            values = np.asarray(w[layer][leaf])
            np.testing.assert_allclose(np.abs(values), c, rtol=1e-7)
            assert (values > 0).any() and (values < 0).any()
    np.testing.assert_array_equal(w["bn"]["scale"], np.ones(5))
    np.testing.assert_array_equal(w["bn"]["bias"], np.zeros(5))
    theta = {name: jnp.full(t.shape, 0.1 if name.startswith("fc1") else 0.8, jnp.float32)  # not weak: one compile
             for name, t in server["theta"].items()}
    server = {**server, "theta": theta}
    info = round_info(0, SLOW, jnp.array([0, 1]))
    down = algorithm.broadcast(server, 0, info)
    SEEN.clear()
    up, _, metrics = client_update(down, first(clients), split.client(0), jax.random.key(2), info)
    jax.effects_barrier()
    assert len(SEEN) == int(metrics["num_steps"]) == 6  # one forward pass per step, 12 examples, batch 2
    kept = {"fc1": [], "fc2": []}
    for params in SEEN:
        for layer in constants:
            for leaf in ("kernel", "bias"):
                seen, frozen = params[layer][leaf], np.asarray(w[layer][leaf])
                assert np.all((seen == 0) | (seen == frozen)), (layer, leaf)  # w x m, m in {0, 1}
                kept[layer].append(seen != 0)
        np.testing.assert_array_equal(params["bn"]["scale"], np.ones(5))
        np.testing.assert_array_equal(params["bn"]["bias"], np.zeros(5))
    masks = [np.concatenate([m.ravel() for m in kept["fc1"][2 * s:2 * s + 2]]) for s in range(6)]
    assert len({m.tobytes() for m in masks}) > 1  # a fresh sample every step
    for layer, p in (("fc1", 0.1), ("fc2", 0.8)):
        frequency = np.concatenate([m.ravel() for m in kept[layer]]).mean()
        samples = 6 * (25 if layer == "fc1" else 18)
        assert abs(frequency - p) <= 4 * math.sqrt(p * (1 - p) / samples), (layer, frequency)
    assert set(up) == {"mask", "batch_stats"} and set(up["mask"]) == set(masked_paths(TINY_STRUCTURE))
    for name, coded in up["mask"].items():
        assert isinstance(coded, CodedMask) and coded.bits.dtype == bool
        assert coded.bits.shape == server["theta"][name].shape
    assert not np.allclose(up["batch_stats"]["bn"]["mean"], 0.0)  # trained statistics travel
    ones = sum(int(np.sum(c.bits)) for c in up["mask"].values())
    assert float(metrics["mask_density"]) == pytest.approx(ones / TINY_MASKED)
    # fc1: 4 x 5 multiply-adds at theta 0.1, fc2: 5 x 3 at 0.8, 12 examples, forward + backward = 3x
    np.testing.assert_allclose(float(metrics["train_flops"]), 3 * 12 * (0.1 * 20 + 0.8 * 15), rtol=1e-5)


# ----------------------------------------------------------------- 3. bytes

def arithmetic_code(bits: list[int], ones: int) -> list[int]:
    """A static binary arithmetic coder (Witten, Neal and Cleary 1987) on 32-bit integers, with
    carry-free underflow handling (pending bits), of the model P(1) = ones / n: the code bits."""
    n, zeros = len(bits), len(bits) - ones
    full, half, quarter = (1 << 32) - 1, 1 << 31, 1 << 30
    low, high, pending, out = 0, full, 0, []

    def emit(bit):
        nonlocal pending
        out.append(bit)
        out.extend([1 - bit] * pending)
        pending = 0

    for b in bits:
        span = high - low + 1
        lo, hi = (0, zeros) if b == 0 else (zeros, n)
        low, high = low + span * lo // n, low + span * hi // n - 1
        while True:
            if high < half:
                emit(0)
            elif low >= half:
                emit(1)
                low, high = low - half, high - half
            elif low >= quarter and high < 3 * quarter:
                pending += 1
                low, high = low - quarter, high - quarter
            else:
                break
            low, high = 2 * low, 2 * high + 1
    pending += 1  # two more bits single out a point inside [low, high]
    emit(0 if low < quarter else 1)
    return out


def arithmetic_decode(code: list[int], n: int, ones: int) -> list[int]:
    zeros = n - ones
    full, half, quarter = (1 << 32) - 1, 1 << 31, 1 << 30
    stream = iter(code + [0] * 64)
    value = 0
    for _ in range(32):
        value = 2 * value + next(stream)
    low, high, out = 0, full, []
    for _ in range(n):
        span = high - low + 1
        b = 0 if ((value - low + 1) * n - 1) // span < zeros else 1
        lo, hi = (0, zeros) if b == 0 else (zeros, n)
        low, high = low + span * lo // n, low + span * hi // n - 1
        out.append(b)
        while True:
            if high < half:
                pass
            elif low >= half:
                low, high, value = low - half, high - half, value - half
            elif low >= quarter and high < 3 * quarter:
                low, high, value = low - quarter, high - quarter, value - quarter
            else:
                break
            low, high, value = 2 * low, 2 * high + 1, 2 * value + next(stream)
    return out


def entropy_bits(n: int, k: int) -> float:
    p = k / n
    return -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p))  # = -log2 P(bits) under P(1) = k / n


@pytest.mark.parametrize("n,density", [(1000, 0.5), (3000, 0.1), (4096, 0.93), (2500, 0.01), (5000, 0.3)])
def test_the_coded_price_against_a_real_arithmetic_coder(n, density):
    """The price by hand: the count of ones (2 bytes for 256 <= n < 65536) plus ceil((n H(k/n) + 2) / 8).
    A real 32-bit arithmetic coder with the same static model decodes back exactly, and its code takes
    between n H and n H + 2 + delta bits: after the last renormalization its interval is wider than
    2^-2 of its range (hence the 2), and each step's integer rounding of a width of at least 2^30 with
    a probability of at least 1/n costs at most log2(1 + n / 2^30) bits, delta = 1.5 n^2 / 2^30 in all
    (0.035 bits at n = 5000). In whole bytes it fits in the priced body, at most one byte under it."""
    rng = np.random.default_rng(n)
    bits = (rng.random(n) < density).astype(np.int32)
    k = int(bits.sum())
    nh = entropy_bits(n, k)
    body = math.ceil((nh + 2) / 8)
    assert int(coded_mask_bytes(jnp.asarray(bits, bool))) == 2 + body
    code = arithmetic_code(bits.tolist(), k)
    assert arithmetic_decode(code, n, k) == bits.tolist()
    delta = 1.5 * n * n / 2 ** 30
    assert nh < len(code) <= nh + 2 + delta
    assert body - 1 <= math.ceil(len(code) / 8) <= body


def test_the_coded_price_of_edge_masks_by_hand():
    """All zeros or all ones: the count alone. The count takes the smallest of 1, 2, 4 bytes holding
    0..n (n + 1 values): 1 byte up to n = 255, 2 from n = 256. One 1 among 8: 8 H(1/8) = 4.35 bits,
    + 2 -> 1 byte."""
    for n, count in ((255, 1), (256, 2), (65536, 4)):
        assert int(coded_mask_bytes(jnp.zeros(n, bool))) == count, n
        assert int(coded_mask_bytes(jnp.ones((n, 1), bool))) == count, n
    assert int(coded_mask_bytes(jnp.arange(8) == 3)) == 1 + 1
    assert int(coded_mask_bytes(jnp.arange(256) < 128)) == 2 + math.ceil((256 + 2) / 8)  # H(1/2) = 1
    assert int(message_bytes({"a": CodedMask(jnp.zeros(300, bool)), "b": CodedMask(jnp.arange(8) == 3),
                              "w": Known(jnp.ones(1000))})) == 2 + 2


def test_message_bytes_down_and_up(tiny):
    """Down: theta, 4 bytes per masked entry, plus the BatchNorm statistics; the frozen weights are
    `Known` (free). Up: each leaf's coded mask, priced by hand from its count of ones, plus the
    statistics."""
    _, split, algorithm, server, clients, client_update = tiny
    info = round_info(0, FAST, jnp.array([0, 1]))
    down = algorithm.broadcast(server, 0, info)
    assert isinstance(down["weights"], Known)
    assert int(message_bytes(down)) == 4 * TINY_MASKED + 4 * TINY_STATS == 212
    up, _, _ = client_update(down, first(clients), split.client(0), jax.random.key(2), info)

    def by_hand(bits):
        n, k = bits.size, int(bits.sum())
        code = 0 if k in (0, n) else math.ceil((entropy_bits(n, k) + 2) / 8)
        return 1 + code  # n <= 255: a 1-byte count

    up_bytes = sum(by_hand(np.asarray(c.bits)) for c in up["mask"].values()) + 4 * TINY_STATS
    assert int(message_bytes(up)) == up_bytes
    # each leaf costs at most its 1-byte count + ceil((n + 2) / 8): 1 + 3, 1 + 1, 1 + 3, 1 + 1
    assert 4 + 4 * TINY_STATS <= up_bytes <= 12 + 4 * TINY_STATS


# ----------------------------------------------------------------- 4. evaluation

def test_both_evaluations_by_hand():
    """On the digits MLP with theta set by hand: the threshold variant keeps exactly theta > 0.5 (0.5
    itself is dropped); the sampled network keeps every theta = 1 entry, no theta = 0 entry, and the
    others at their frequency; it is the same sample at each call and for every client, and a new one
    after another round. The server state is written by hand: random +-1 weights, theta by level."""
    model = get_model("mlp", (8, 8, 1), 10)
    algorithm = build(model, synthetic_split([12, 20, 16]))
    shapes = jax.eval_shape(model.init, jax.random.key(0))["params"]
    rng = np.random.default_rng(0)
    levels = np.array([0.0, 1.0, 0.5, 0.8, 0.3, 0.51])
    server = {"weights": tree_map(lambda s: jnp.asarray(rng.choice([-1.0, 1.0], s.shape), jnp.float32), shapes),
              "theta": {name: jnp.asarray(levels[np.arange(math.prod(get_path(shapes, path).shape)) % 6].reshape(
                  get_path(shapes, path).shape), jnp.float32) for name, path in masked_paths(model.structure).items()},
              "batch_stats": {}, "round": jnp.asarray(3, jnp.int32)}
    thresholded = jax.jit(algorithm.global_variants)(server)["threshold"]
    global_variables = jax.jit(algorithm.global_variables)
    sampled = global_variables(server)
    tree_map(np.testing.assert_array_equal, global_variables(server), sampled)
    tree_map(np.testing.assert_array_equal, jax.jit(algorithm.client_variables)(server, {}), sampled)
    later = global_variables({**server, "round": server["round"] + 1})
    assert not np.array_equal(later["params"]["fc2"]["kernel"], sampled["params"]["fc2"]["kernel"])
    for name, (layer, leaf) in masked_paths(model.structure).items():
        w = np.asarray(server["weights"][layer][leaf])
        level = levels[np.arange(w.size) % 6].reshape(w.shape)
        np.testing.assert_array_equal(thresholded["params"][layer][leaf], np.where(level > 0.5, w, 0.0))
        s = np.asarray(sampled["params"][layer][leaf])
        assert np.all((s == 0) | (s == w))
        assert np.all(s[level == 1.0] == w[level == 1.0]) and np.all(s[level == 0.0] == 0)
        if w.size > 10_000:
            for p in (0.5, 0.8, 0.3):
                kept = (s[level == p] != 0)
                assert abs(kept.mean() - p) <= 4 * math.sqrt(p * (1 - p) / kept.size), (name, p)


# ----------------------------------------------------------------- 5. Adam's state

def test_adam_moments_persist_per_client_or_reset(tiny):
    """`client`: a client's Adam moments after its round start its next one: the count goes on, and the
    moments and the upload differ from a fresh optimizer's on the same key (12 examples at batch 2: 6 steps
    a round). `reset`: no client state at all."""
    model, split, kept, server, clients, client_update = tiny
    info = round_info(0, FAST, jnp.array([0, 1]))
    np.testing.assert_array_equal(clients["adam"][0].count, [0, 0, 0])
    down = kept.broadcast(server, 0, info)
    _, after, _ = client_update(down, first(clients), split.client(0), jax.random.key(2), info)
    assert int(after["adam"][0].count) == 6 and float(jnp.abs(after["adam"][0].mu["params"]["fc1/kernel"]).max()) > 0
    up_carried, carried, _ = client_update(down, after, split.client(0), jax.random.key(3), info)
    up_fresh, fresh, _ = client_update(down, first(clients), split.client(0), jax.random.key(3), info)
    assert int(carried["adam"][0].count) == 12 and int(fresh["adam"][0].count) == 6
    assert not np.allclose(carried["adam"][0].mu["params"]["fc1/kernel"], fresh["adam"][0].mu["params"]["fc1/kernel"])
    assert not np.allclose(carried["adam"][0].nu["params"]["fc2/kernel"], fresh["adam"][0].nu["params"]["fc2/kernel"])
    assert any(not np.array_equal(up_carried["mask"][n].bits, up_fresh["mask"][n].bits) for n in up_fresh["mask"])

    reset = build(model, split, fedpm_optimizer_state="reset")
    _, none = jax.eval_shape(lambda k: reset.init(k, model.init(jax.random.key(0)), 3), jax.random.key(1))
    assert none == {} and reset.init_clients is None
    up, state, _ = jax.eval_shape(reset.client_update, reset.broadcast(server, 0, info), {}, split.client(0),
                                  jax.random.key(3), info)
    assert state == {} and set(up) == {"mask", "batch_stats"}


# ----------------------------------------------------------------- 6. the command line

def test_cli_run_logs_the_threshold_accuracy_the_mask_density_and_flops(tmp_path):
    """Two rounds on the digits MLP (85,002 masked entries). Down: 4 bytes each, to 2 clients. Up: at
    most each leaf's count plus ceil((n + 2) / 8) (H <= 1), near it as theta starts around 1/2. The
    clients' FLOPs are about half the dense ones (theta = sigmoid(N(0, 1)), mean 1/2)."""
    out = tmp_path / "r"
    assert main(["run", "--algorithm", "fedpm", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "2",
                 "--local-epochs", "1", "--max-train-examples", "200", "--max-test-examples", "100", "--no-progress",
                 "--no-tensorboard", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    # (n, count bytes): fc1 kernel, bias, fc2 kernel, bias, fc3 kernel, bias
    leaves = ((16384, 2), (256, 2), (65536, 4), (256, 2), (2560, 2), (10, 1))
    most = sum(count + math.ceil((n + 2) / 8) for n, count in leaves)
    assert most == 10644
    for record in records:
        assert 0 <= record["test_accuracy_threshold"] <= 1 and 0 <= record["test_accuracy"] <= 1
        assert 0 <= record["personalized_accuracy"] <= 1
        assert 0.3 < record["client_mask_density"] < 0.7
        assert record["downlink_bytes"] == 2 * 4 * 85002
        assert 0.9 * 2 * most < record["uplink_bytes"] <= 2 * most
        assert 0.4 < record["train_flops"] / record["dense_train_flops"] < 0.6
