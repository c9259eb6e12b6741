"""FedPM against independent truths: the Beta posterior by hand, the straight-through estimator and the
sampling frequency, the signed-constant weights, the coded mask's price against a real arithmetic coder,
the messages' bytes, both evaluations, and where Adam's state lives."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fedpm import beta_posterior, masked_paths, sampled_mask
from fedjax_sparse.cli import main
from fedjax_sparse.core.algorithm import BuildContext
from fedjax_sparse.core.local_training import LocalSGD
from fedjax_sparse.core.messages import CodedMask, coded_mask_bytes, message_bytes
from fedjax_sparse.core.round import round_info
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map


def test_beta_posterior_by_hand_for_each_reset_schedule():
    """Three clients' bits at two entries. Reset every round: theta = the mean of the bits, clipped to
    [0.01, 0.99]. Never reset: alpha and beta add up over rounds. Reset every 2 rounds: at round 0, not 1."""
    bits = {"w": jnp.array([[1, 0], [1, 0], [0, 0]], bool)}
    ones = {"w": jnp.ones(2)}
    alpha, beta, theta = beta_posterior(ones, ones, bits, jnp.asarray(True))
    np.testing.assert_allclose(alpha["w"], [3, 1])  # 1 + ones
    np.testing.assert_allclose(beta["w"], [2, 4])   # 1 + zeros
    np.testing.assert_allclose(theta["w"], [2 / 3, 0.01])  # (a - 1) / (a + b - 2): 2/3 and 0 -> clipped
    again = {"w": jnp.array([[1, 1], [1, 0], [1, 0]], bool)}
    a2, b2, t2 = beta_posterior(alpha, beta, again, jnp.asarray(False))  # accumulate: 3+3, 1+1; 2+0, 4+2
    np.testing.assert_allclose(a2["w"], [6, 2])
    np.testing.assert_allclose(b2["w"], [2, 6])
    np.testing.assert_allclose(t2["w"], [5 / 6, 1 / 6])
    _, _, t3 = beta_posterior(alpha, beta, again, jnp.asarray(True))
    np.testing.assert_allclose(t3["w"], [0.99, 1 / 3])  # a reset: this round's mean, 1 -> clipped


@pytest.fixture(scope="module")
def setting():
    from conftest import synthetic_split
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([12, 20, 16])
    return model, split, model.init(jax.random.key(0))


def build(setting, **options):
    model, split, _ = setting
    ctx = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=3, clients_per_round=2, train=split,
                       num_classes=10, seed=0)
    return make_algorithm("fedpm", ctx, make_options("fedpm", options))


def test_the_server_aggregates_by_the_posterior_with_the_prior_reset_schedule(setting):
    model, _, variables = setting
    for reset, rounds_reset in ((1, (True, True, True)), (2, (True, False, True)), (0, (False, False, False))):
        algorithm = build(setting, prior_reset=reset)
        server, _ = algorithm.init(jax.random.key(1), variables, 3)
        alpha = {k: np.ones(v.shape) for k, v in server["theta"].items()}
        beta = {k: np.ones(v.shape) for k, v in server["theta"].items()}
        rng = np.random.default_rng(reset)
        for r, is_reset in enumerate(rounds_reset):
            bits = {k: rng.random((2, *v.shape)) < 0.3 for k, v in server["theta"].items()}
            ups = {"mask": {k: CodedMask(jnp.asarray(b)) for k, b in bits.items()}, "batch_stats": {}}
            server = algorithm.server_update(server, ups, jnp.array([1.0, 2.0]), round_info(0, r, jnp.array([0, 1])))
            for k, b in bits.items():
                if is_reset:
                    alpha[k], beta[k] = np.ones_like(alpha[k]), np.ones_like(beta[k])
                alpha[k] = alpha[k] + b.sum(0)
                beta[k] = beta[k] + (2 - b.sum(0))
                expected = np.clip((alpha[k] - 1) / (alpha[k] + beta[k] - 2), 0.01, 0.99)
                np.testing.assert_allclose(server["theta"][k], expected, rtol=1e-6, err_msg=f"reset {reset} {k}")


def test_the_straight_through_gradient_and_the_sampling_frequency():
    """d/dtheta of sum(c m) through a sampled mask is c (dm/dtheta := 1), whatever was sampled; the
    sampled masks' frequency is theta within 4 binomial standard deviations."""
    theta = jnp.array([0.1, 0.5, 0.9, 0.3])
    c = jnp.array([1.0, -2.0, 3.0, 0.5])
    grad = jax.grad(lambda t: jnp.sum(c * sampled_mask(t, jax.random.key(3))))(theta)
    np.testing.assert_allclose(grad, c)
    m = sampled_mask(theta, jax.random.key(3))
    assert set(np.unique(np.asarray(m))) <= {0.0, 1.0}
    draws = jax.vmap(lambda k: sampled_mask(theta, k))(jax.random.split(jax.random.key(0), 4000))
    frequency = np.asarray(draws).mean(0)
    assert np.all(np.abs(frequency - theta) < 4 * np.sqrt(theta * (1 - theta) / 4000))


def test_frozen_weights_are_signed_constants_and_never_travel_nor_change(setting):
    """Kernels and biases are +-e sqrt(1 / fan_in) of their layer, half of each sign; a round's upload
    holds only coded masks (and no statistics: the MLP has none), and the weights stay as they were."""
    model, split, variables = setting
    algorithm = build(setting)
    server, clients = algorithm.init(jax.random.key(1), variables, 3)
    for layer in model.structure.layers:
        c = math.e * math.sqrt(1 / layer.fan_in)
        for leaf in ("kernel", "bias"):
            w = np.asarray(server["weights"][layer.name][leaf])
            np.testing.assert_allclose(np.abs(w), c, rtol=1e-6)
            assert 0.3 < (w > 0).mean() < 0.7
    info = round_info(0, 0, jnp.array([0, 1]))
    down = algorithm.broadcast(server, 0, info)
    up, _, metrics = jax.jit(algorithm.client_update)(down, tree_map(lambda a: a[0], clients), split.client(0),
                                                      jax.random.key(2), info)
    assert set(up["mask"]) == set(masked_paths(model.structure)) and up["batch_stats"] == {}
    assert all(isinstance(m, CodedMask) and m.bits.dtype == bool for m in up["mask"].values())
    ones = sum(int(np.asarray(m.bits).sum()) for m in up["mask"].values())
    total = sum(m.bits.size for m in up["mask"].values())
    assert float(metrics["mask_density"]) == pytest.approx(ones / total)
    server2 = algorithm.server_update(server, tree_map(lambda a: a[None], up), jnp.ones(1), info)
    tree_map(np.testing.assert_array_equal, server2["weights"], server["weights"])
    # the messages' bytes: 4 per masked entry down (the weights are Known, free), the coded masks up
    masked = sum(int(np.prod(np.shape(v))) for v in server["theta"].values())
    assert int(message_bytes(down)) == 4 * masked
    assert int(message_bytes(up)) == sum(int(coded_mask_bytes(m.bits)) for m in up["mask"].values())
    assert int(message_bytes(up)) < masked / 8 * 1.01 + 40


def arithmetic_code(bits: list[int], ones: int) -> list[int]:
    """A static binary arithmetic coder (Witten, Neal and Cleary 1987; 32-bit integer range) with the
    model P(1) = ones / n: the code bits of `bits`."""
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
        high = low + span * hi // n - 1
        low = low + span * lo // n
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
    pending += 1
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
        high = low + span * hi // n - 1
        low = low + span * lo // n
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


@pytest.mark.parametrize("n,density", [(1000, 0.5), (3000, 0.1), (4096, 0.93), (2500, 0.01)])
def test_the_coded_mask_price_is_what_a_real_arithmetic_coder_spends(n, density):
    """The price, the count of ones (2 bytes for n < 65536) plus ceil((n H(k/n) + 2) / 8), by hand; a real
    arithmetic coder with the same static model decodes back exactly and never needs more bytes than the
    price's code part, within one byte of it."""
    rng = np.random.default_rng(n)
    bits = (rng.random(n) < density).astype(np.int32)
    k = int(bits.sum())
    p = k / n
    entropy = -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    body = math.ceil((n * entropy + 2) / 8)
    assert int(coded_mask_bytes(jnp.asarray(bits, bool))) == 2 + body
    code = arithmetic_code(bits.tolist(), k)
    assert arithmetic_decode(code, n, k) == bits.tolist()
    real = math.ceil(len(code) / 8)
    assert body - 1 <= real <= body
    assert int(coded_mask_bytes(jnp.zeros(n, bool))) == int(coded_mask_bytes(jnp.ones(n, bool))) == 2


def test_both_evaluations_by_hand(setting):
    """global_variables: the weights times a mask sampled from theta; the threshold variant: theta > 0.5."""
    model, _, variables = setting
    algorithm = build(setting)
    server, _ = algorithm.init(jax.random.key(1), variables, 3)
    theta = {k: jnp.where(jnp.arange(v.size).reshape(v.shape) % 2 == 0, 0.9, 0.2) for k, v in server["theta"].items()}
    server = {**server, "theta": theta}
    thresholded = algorithm.global_variants(server)["threshold"]["params"]
    sampled = algorithm.global_variables(server)["params"]
    for name, path in masked_paths(model.structure).items():
        w = np.asarray(server["weights"][path[0]][path[1]])
        keep = np.asarray(theta[name]) > 0.5
        np.testing.assert_array_equal(np.asarray(thresholded[path[0]][path[1]]), np.where(keep, w, 0.0))
        s = np.asarray(sampled[path[0]][path[1]])
        assert set(np.unique(s / w).round(6)) <= {0.0, 1.0}
        if s.size > 1000:
            assert abs((s[keep] != 0).mean() - 0.9) < 0.05 and abs((s[~keep] != 0).mean() - 0.2) < 0.05


def test_adams_state_lives_per_client_or_starts_fresh(setting):
    """`client`: the client's Adam moments after its round are kept and start its next one (its second
    round differs from a fresh optimizer's); `reset`: no client state at all."""
    model, split, variables = setting
    info = round_info(0, 0, jnp.array([0, 1]))
    kept = build(setting, fedpm_optimizer_state="client")
    server, clients = kept.init(jax.random.key(1), variables, 3)
    assert int(clients["adam"][0].count[0]) == 0
    update = jax.jit(kept.client_update)
    state = tree_map(lambda a: a[0], clients)
    down = kept.broadcast(server, 0, info)
    _, after, _ = update(down, state, split.client(0), jax.random.key(2), info)
    steps = int(np.ceil(12 / 8))
    assert int(after["adam"][0].count) == steps and float(jnp.abs(after["adam"][0].mu["params"]["fc1/kernel"]).max()) > 0
    up_carried, carried, _ = update(down, after, split.client(0), jax.random.key(3), info)
    up_fresh, fresh, _ = update(down, state, split.client(0), jax.random.key(3), info)
    assert int(carried["adam"][0].count) == 2 * steps and int(fresh["adam"][0].count) == steps
    assert not np.allclose(carried["adam"][0].mu["params"]["fc1/kernel"], fresh["adam"][0].mu["params"]["fc1/kernel"])
    assert not np.array_equal(up_carried["mask"]["fc1/kernel"].bits, up_fresh["mask"]["fc1/kernel"].bits)
    reset = build(setting, fedpm_optimizer_state="reset")
    _, none = reset.init(jax.random.key(1), variables, 3)
    assert none == {} and reset.init_clients is None


def test_cli_run_logs_both_accuracies_the_mask_density_and_flops(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--algorithm", "fedpm", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "2",
                 "--local-epochs", "1", "--max-train-examples", "200", "--max-test-examples", "100", "--no-progress",
                 "--no-tensorboard", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert 0 <= last["test_accuracy_threshold"] <= 1 and 0 <= last["test_accuracy"] <= 1
    assert 0.3 < last["client_mask_density"] < 0.7  # scores start N(0, 1): theta around 0.5
    assert 0 < last["train_flops"] < last["dense_train_flops"]
