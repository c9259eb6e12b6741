"""The compressors against the bounds they are published with: QSGD in buckets (Alistarh et al. 2017, Lemma
3.1: unbiased, E||Q(v) - v||^2 <= min(b / s^2, sqrt(b) / s) ||v||^2 a bucket of b entries) and priced per
bucket over the zoo; random-k unbiased (times n / k: E = x, E||C(x) - x||^2 = (n / k - 1) ||x||^2), unscaled
under error feedback (a k / n contraction whose residual keeps the rest), and unbiased through FedAvg's
server."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_structure import zoo_model

from conftest import synthetic_split
from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.uplink_compression import UplinkCompressionOptions, compress_uplink
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.messages.compression import decompressed, random_k, stochastic_quantization, top_k
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import KnownMaskArray, QuantizedArray, message_bytes
from fedjax_sparse.core.contract.options import ignored_options, validate
from fedjax_sparse.core.round.step import build_round, round_info
from fedjax_sparse.models import MODEL_NAMES, get_model

tree_map = jax.tree_util.tree_map
DRAWS = 20000
# Three buckets of 4, 4 and 2 entries whose norms differ by 100x: one norm for the whole vector would round
# every entry of the small buckets to 0 or to a step of the large one, far outside their own bounds.
VECTOR = np.array([3.0, -1.0, 2.0, 0.5, 0.01, -0.02, 0.015, 0.03, 0.005, -0.002], np.float32)
BUCKETS = (slice(0, 4), slice(4, 8), slice(8, 10))


def test_qsgd_in_buckets_is_unbiased_with_lemma_3_1s_variance():
    """2 bits (s = 3), buckets of 4: each entry's mean over 20,000 draws is within 5 standard errors of it
    (its variance (m / s)^2 p (1 - p), p the fractional part of s |x| / m, m its bucket's norm), and each
    bucket's mean squared error is that variance summed, within Lemma 3.1's bound for its size."""
    s = 3
    draws = np.asarray(jax.jit(jax.vmap(lambda k: stochastic_quantization({"v": jnp.asarray(VECTOR)}, 2, k, 4)[
        "v"].dense()))(jax.random.split(jax.random.key(0), DRAWS)))
    assert draws.shape == (DRAWS, 10)
    for part in BUCKETS:
        x, q = VECTOR[part].astype(np.float64), draws[:, part].astype(np.float64)
        norm = np.linalg.norm(x)
        frac = s * np.abs(x) / norm - np.floor(s * np.abs(x) / norm)
        variance = (norm / s) ** 2 * frac * (1 - frac)
        np.testing.assert_array_less(np.abs(q.mean(0) - x), 5 * np.sqrt(variance / DRAWS) + 1e-6 * norm)
        error = ((q - x) ** 2).sum(1)
        np.testing.assert_allclose(error.mean(), variance.sum(), rtol=0.05, atol=1e-6 * norm ** 2)
        b = x.size
        assert error.mean() <= min(b / s ** 2, np.sqrt(b) / s) * norm ** 2
        # Every entry lands on one of the two levels around it: within one step m / s.
        assert np.all(np.abs(q - x) <= norm / s * (1 + 1e-5))


def test_qsgd_buckets_never_span_two_leaves_and_are_priced_per_bucket():
    """Leaves of 700 and 300 entries in buckets of 512: the first has two (512 and 188 entries), the second
    one of its own (buckets over the leaves laid end to end would put the first's last 188 entries and the
    second's 300 in one), each norm that of its own entries; a 1,000-entry leaf at 4 bits costs 2 float32
    norms + 1,000 x 5 bits = 8 + 625 bytes."""
    rng = np.random.default_rng(0)
    quantize = jax.jit(stochastic_quantization, static_argnums=(1, 3))
    tree = {"a": rng.standard_normal((7, 100)).astype(np.float32), "b": rng.standard_normal(300).astype(np.float32)}
    message = quantize(tree, 4, jax.random.key(0), 512)
    a, b = message["a"], message["b"]
    assert isinstance(a, QuantizedArray) and a.levels.shape == (7, 100) and b.levels.shape == (300,)
    flat = tree["a"].reshape(-1)
    np.testing.assert_allclose(a.norms, [np.linalg.norm(flat[:512]), np.linalg.norm(flat[512:])], rtol=1e-6)
    np.testing.assert_allclose(b.norms, [np.linalg.norm(tree["b"])], rtol=1e-6)
    assert int(jnp.abs(a.levels).max()) <= 15
    np.testing.assert_array_less(np.abs(np.asarray(decompressed(message)["a"]).reshape(-1) - flat),
                                 np.repeat(np.asarray(a.norms), [512, 188]) / 15 * (1 + 1e-5))
    leaf = stochastic_quantization({"w": jnp.ones(1000)}, 4, jax.random.key(1), 512)["w"]
    assert leaf.norms.shape == (2,) and int(message_bytes(leaf)) == 2 * 4 + 1000 * 5 // 8
    assert int(message_bytes(message)) == 3 * 4 + (700 * 5 + 7) // 8 + (300 * 5 + 7) // 8
    # Stacked messages (a round's clients) decompress leaf by leaf, each with its own buckets.
    keys = jax.random.split(jax.random.key(2), 3)
    stacked = jax.jit(lambda ks: decompressed(jax.vmap(lambda k: quantize(tree, 4, k, 512))(ks)))(keys)
    np.testing.assert_allclose(stacked["a"][1], decompressed(quantize(tree, 4, keys[1], 512))["a"], rtol=1e-6)


def test_the_bucket_is_an_option_of_qsgd_alone():
    """--quantization-bucket is read by qsgd only (refused with the others, like --quantization-bits) and
    must be a positive count, in one line naming the flag."""
    assert "quantization_bucket" not in ignored_options(UplinkCompressionOptions("qsgd", quantization_bucket=64))
    for name in ("none", "topk", "randk"):
        assert "quantization_bucket" in ignored_options(UplinkCompressionOptions(name, quantization_bucket=64))
    with pytest.raises(ValueError, match="--quantization-bucket must be >= 1, got 0"):
        validate(UplinkCompressionOptions("qsgd", quantization_bucket=0))
    with pytest.raises(ValueError, match="--quantization-bucket must be >= 1, got 0"):
        stochastic_quantization({"w": jnp.ones(3)}, 4, jax.random.key(0), 0)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_qsgd_costs_a_norm_per_bucket_of_each_leaf_over_the_zoo(name):
    """Every leaf of every model: ceil(n / 512) norms of 4 bytes and 5 bits an entry at 4 bits."""
    variables = jax.eval_shape(zoo_model(name).init, jax.random.key(0))
    message = jax.eval_shape(lambda v: stochastic_quantization(v, 4, jax.random.key(0), 512), variables)
    sizes = [int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(variables)]
    norms = [leaf.norms.shape for leaf in jax.tree_util.tree_leaves(
        message, is_leaf=lambda x: isinstance(x, QuantizedArray))]
    assert norms == [(-(-n // 512),) for n in sizes]
    assert int(message_bytes(message)) == sum(4 * -(-n // 512) + (5 * n + 7) // 8 for n in sizes)


def test_random_k_is_unbiased_with_its_published_variance_and_unscaled_is_a_contraction():
    """k = 3 of n = 10 without replacement, 20,000 draws: scaled by n / k each entry's mean is within 5
    standard errors (x_i sqrt((n / k - 1) / draws)) of x_i, and the mean squared error is (n / k - 1) ||x||^2;
    unscaled, the mean is (k / n) x and the error (1 - k / n) ||x||^2. Only the 3 values are paid."""
    x = VECTOR.astype(np.float64)
    keys = jax.random.split(jax.random.key(0), DRAWS)
    for unbiased, mean, error in ((True, x, 10 / 3 - 1), (False, 0.3 * x, 1 - 0.3)):
        draws = np.asarray(jax.jit(jax.vmap(lambda k: random_k({"v": jnp.asarray(VECTOR)}, 0.3, k,
                                                               unbiased=unbiased)["v"].dense()))(keys), np.float64)
        assert np.all((draws != 0).sum(1) == 3)
        scale = 10 / 3 if unbiased else 1.0
        spread = np.abs(x) * scale * np.sqrt(0.3 * 0.7 / DRAWS)  # an entry is kept with probability 0.3
        np.testing.assert_array_less(np.abs(draws.mean(0) - mean), 5 * spread + 1e-7)
        np.testing.assert_allclose(((draws - x) ** 2).sum(1).mean(), error * (x ** 2).sum(), rtol=0.03)
    message = random_k({"v": jnp.asarray(VECTOR)}, 0.3, jax.random.key(1))["v"]
    assert isinstance(message, KnownMaskArray) and int(message_bytes(message)) == 3 * 4


@pytest.fixture(scope="module")
def setting():
    """The MLP on four clients of 8 to 12 examples, two a round, one epoch in batches of 16: one full-batch
    step, so a client's change does not depend on its key."""
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([10, 12, 8, 9])
    context = BuildContext(local=LocalSGD(model, 0.1, 1, 16), num_clients=4, clients_per_round=2, train=split,
                           num_classes=10)
    return model, split, context, model.init(jax.random.key(0))


def _path(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return np.asarray(tree)


def test_random_k_sends_its_entries_times_n_over_k_and_unscaled_under_error_feedback(setting):
    """One client's upload by hand: without error feedback each kept entry of the change is sent times n / k;
    with it, kept entries of (change + residual) are sent as they are and the new residual is exactly what
    was left out, which the next update adds before drawing."""
    model, split, context, variables = setting
    fedavg = make_algorithm("fedavg", context, make_options("fedavg", {}))
    info = round_info(0, 0, jnp.array([0, 1]))
    plain = jax.jit(fedavg.client_update)
    for feedback in (False, True):
        algorithm = compress_uplink(fedavg, context, UplinkCompressionOptions("randk", 0.1, error_feedback=feedback))
        server, clients = algorithm.init(jax.random.key(1), variables, 4)
        down = algorithm.broadcast(server, 0, info)
        state = tree_map(lambda a: a[0], clients)
        update = jax.jit(algorithm.client_update)
        residual = None
        for step in range(2):
            key = jax.random.key(step)
            up, state, _ = update(down, state, split.client(0), key, info)
            trained = plain(down, {}, split.client(0), key, info)[0]
            for path, sent in up["compressed"].items():
                change = _path(trained, path) - _path(down, path)
                mask = np.asarray(sent.mask)
                k = int(np.ceil(0.1 * change.size))
                assert isinstance(sent, KnownMaskArray) and int(mask.sum()) == k
                dense = np.asarray(decompressed(sent))
                if not feedback:
                    np.testing.assert_allclose(dense, np.where(mask, change * change.size / k, 0), rtol=1e-6,
                                               atol=1e-9)
                    continue
                corrected = change + (0 if residual is None else residual[path])
                np.testing.assert_allclose(dense, np.where(mask, corrected, 0), rtol=1e-6, atol=1e-9)
                np.testing.assert_allclose(state["residual"][path], np.where(mask, 0, corrected), rtol=1e-6,
                                           atol=1e-9)
            residual = {p: np.asarray(r) for p, r in state["residual"].items()} if feedback else None


def test_fedavg_with_random_k_is_fedavg_at_ratio_one_and_unbiased_below(setting):
    """r = 1: the same round as FedAvg at its dense bytes. r = 0.25: the server's new model minus FedAvg's
    from the same client keys (the same training), averaged over 32 draws of the entries, has the squared
    norm that an unbiased estimate with scaled random-k's variance has: sum over the draws of
    sum_c p_c^2 sum_leaves (n / k - 1) ||change||^2, over draws^2 (p_c the FedAvg weights). Unscaled, its
    mean would be FedAvg's step times k / n - 1, whose square stands about 5 times higher; scaled twice,
    n / k - 1 times the step."""
    model, split, context, variables = setting
    fedavg = make_algorithm("fedavg", context, make_options("fedavg", {}))
    whole = compress_uplink(fedavg, context, UplinkCompressionOptions("randk", 1.0))
    outs = []
    for algorithm in (fedavg, whole):
        server, clients = algorithm.init(jax.random.key(1), variables, 4)
        server, _, out = build_round(algorithm, split, 2, seed=0)(server, clients, 0)
        outs.append((server, out))
    tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), outs[0][0]["variables"],
             outs[1][0]["variables"])
    np.testing.assert_array_equal(outs[0][1].uplink_bytes, outs[1][1].uplink_bytes)

    randk = compress_uplink(fedavg, context, UplinkCompressionOptions("randk", 0.25))
    ids = jnp.array([0, 1])
    info = round_info(0, 0, ids)
    weights = jnp.array([10.0, 12.0])
    p = np.asarray(weights) / float(weights.sum())

    def round_of(algorithm, key):
        server, clients = algorithm.init(jax.random.key(1), variables, 4)
        down = algorithm.broadcast(server, 0, info)
        ups, _, _ = jax.vmap(lambda c, s, k: algorithm.client_update(down, s, split.client(c), k, info))(
            ids, tree_map(lambda a: a[ids], clients), jax.random.split(key, 2))
        return algorithm.server_update(server, ups, weights, info)["variables"], ups, down

    def draw(key):
        compressed, _, _ = round_of(randk, key)
        plain, ups, down = round_of(fedavg, key)
        diff = tree_map(jnp.subtract, compressed, plain)
        variance = sum(jnp.sum(p ** 2 * (d.size / np.ceil(0.25 * d.size) - 1) * jnp.sum(
            (u - d[None]).reshape(2, -1) ** 2, axis=1)) for u, d in zip(jax.tree_util.tree_leaves(ups),
                                                                       jax.tree_util.tree_leaves(down)))
        step = tree_map(jnp.subtract, plain, down)
        return diff, variance, step

    n = 32
    diffs, variance, steps = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(100), n))
    bias = sum(float(jnp.sum(d.mean(0) ** 2)) for d in jax.tree_util.tree_leaves(diffs))
    expected = float(variance.sum()) / n ** 2
    assert 0.8 * expected < bias < 1.25 * expected, (bias, expected)
    unscaled = sum((1 - np.ceil(0.25 * step[0].size) / step[0].size) ** 2 * float(jnp.sum(step.mean(0) ** 2))
                   for step in jax.tree_util.tree_leaves(steps))
    assert unscaled > 3 * expected  # the unscaled random-k's squared bias: far outside the range above


def test_top_k_keeping_most_entries_ranks_the_dropped_ones_and_keeps_the_same_set():
    """Above half the entries top-k ranks the n - k it drops (a k near n is near a full sort): the kept set,
    ties included (the lower index wins), is the one ranking the kept entries gives, computed here with numpy."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-3, 4, size=(7, 9)).astype(np.float32))  # many ties, zeros among them
    flat = np.abs(np.asarray(x).reshape(-1))
    select = jax.jit(top_k, static_argnums=1)  # one program per k, not each operation compiled per k
    for ratio in (0.3, 0.5, 0.6, 0.9, 0.99, 1.0):
        k = max(1, int(np.ceil(ratio * flat.size - 1e-9)))
        order = np.lexsort((np.arange(flat.size), -flat))  # by magnitude descending, then index ascending
        expected = np.zeros(flat.size, bool)
        expected[order[:k]] = True
        leaf = select({"w": x}, ratio)["w"]
        np.testing.assert_array_equal(np.asarray(leaf.mask).reshape(-1), expected, err_msg=str(ratio))
        np.testing.assert_array_equal(np.asarray(leaf.dense()), np.where(expected.reshape(x.shape), x, 0.0))
