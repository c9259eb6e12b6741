"""FedSpa against independent truths: prune-and-grow and the cosine swap schedule by hand, the
invariants of real rounds (fixed density per kernel, swaps = changed entries / 2 = the schedule's
count, the server's memory = the uploaded masks, zeros outside the mask, the prune rule on the
received weights, the aggregation over the holders), the aggregation of hand-made uploads, the
messages' bytes written out by hand, and one run from the command line."""

import dataclasses
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_split
from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fedspa import prune_and_grow, swap_fraction
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import KnownMaskArray, SparseArray, message_bytes
from fedjax_sparse.core.round.step import build_round, round_info
from fedjax_sparse.models import Layer, Model, ModelStructure
from fedjax_sparse.models.layers import batch_norm

tree_map = jax.tree_util.tree_map


def build(model, split, **options):
    ctx = BuildContext(local=LocalSGD(model, 0.1, 1, 4, momentum=0.9, weight_decay=1e-3),
                       num_clients=split.num_clients, clients_per_round=2, train=split,
                       num_classes=model.num_classes, seed=0)
    return make_algorithm("fedspa", ctx, make_options("fedspa", options))


# ----------------------------------------------------------------- 1. prune and grow by hand

def test_prune_and_grow_by_hand():
    """Six active entries of ten, fraction 1/2: 3 swaps. Dropped: the smallest |w| among the active
    (1 and 4 at 0.1, then 2 before 8 at the 0.3 tie), never an inactive entry (their w = 0 is the
    smallest of all). Grown: the largest |g| among those inactive before (5 at 0.7, then 3 and 7 of
    the three-way tie at 0.2, by lower index), never an active one (their |g| = 9 is the largest)."""
    mask = jnp.array([1, 1, 1, 0, 1, 0, 1, 0, 1, 0], bool)
    w = jnp.array([0.5, -0.1, 0.3, 0.0, 0.1, 0.0, -2.0, 0.0, 0.3, 0.0])
    g = jnp.array([9.0, -9, 9, 0.2, 9, -0.7, 9, -0.2, 9, 0.2])
    swap = jax.jit(prune_and_grow)  # as a client runs it: one program, not op by op
    new, swapped = swap(mask, w, g, jnp.float32(0.5))
    np.testing.assert_array_equal(new, [1, 0, 0, 1, 0, 1, 1, 1, 1, 0])
    assert int(swapped) == 3
    # the same as a 2 x 5 array
    new2, swapped2 = swap(mask.reshape(2, 5), w.reshape(2, 5), g.reshape(2, 5), jnp.float32(0.5))
    np.testing.assert_array_equal(new2, np.asarray(new).reshape(2, 5))
    assert int(swapped2) == 3
    # floor(0.49 x 6) = 2: the two at |w| = 0.1 out, 5 and 3 in
    new, swapped = swap(mask, w, g, jnp.float32(0.49))
    np.testing.assert_array_equal(new, [1, 0, 1, 1, 0, 1, 1, 0, 1, 0])
    assert int(swapped) == 2
    # fraction 0: nothing moves
    new, swapped = swap(mask, w, g, jnp.float32(0.0))
    np.testing.assert_array_equal(new, mask)
    assert int(swapped) == 0


def test_prune_and_grow_is_capped_by_the_inactive_entries():
    """Eight active of ten, fraction 1: floor(8) = 8 swaps asked, only 2 entries inactive: 2 swaps, the
    two smallest |w| (indices 6 and 2) out, both inactive (4, 9) in; the density stays 8 / 10."""
    mask = jnp.array([1, 1, 1, 1, 0, 1, 1, 1, 1, 0], bool)
    w = jnp.array([5.0, 4, 0.5, 3, 0, 6, -0.2, 7, 8, 0])
    g = jnp.array([1.0, 1, 1, 1, 0.01, 1, 1, 1, 1, 0.02])
    new, swapped = prune_and_grow(mask, w, g, jnp.float32(1.0))
    np.testing.assert_array_equal(new, [1, 1, 0, 1, 1, 1, 0, 1, 1, 1])
    assert int(swapped) == 2 and int(np.sum(new)) == 8


def test_swap_fraction_follows_the_cosine_schedule():
    """r_t = rate (1 + cos(pi min(t, T) / T)) / 2 with rate 0.5, T = 500: 0.5 at t = 0,
    0.25 (1 + cos(pi / 4)) at T / 4, 0.25 at T / 2, 0 at T and after."""
    values = [float(swap_fraction(0.5, 500, t)) for t in (0, 125, 250, 500, 1000)]
    np.testing.assert_allclose(values, [0.5, 0.25 * (1 + math.sqrt(0.5)), 0.25, 0.0, 0.0], atol=1e-7)
    assert float(swap_fraction(0.3, 4, 3)) == pytest.approx(0.15 * (1 - math.sqrt(0.5)), abs=1e-7)


# ----------------------------------------------------------------- 3 and 5. real rounds

class _Net(nn.Module):
    """4x4x1 -> dense 61 -> BatchNorm -> ReLU -> dense 3."""

    @nn.compact
    def __call__(self, x, train, mask=None, unit_masks=None):
        del unit_masks
        x = nn.Dense(61, name="fc1")(x.reshape(x.shape[0], -1))
        x = nn.relu(batch_norm(train, "bn")(x, mask=mask))
        return nn.Dense(3, name="fc2")(x)


NET = Model(name="net", module=_Net(), input_shape=(4, 4, 1), num_classes=3, structure=ModelStructure((
    Layer("fc1", "dense", ("fc1", "kernel"), ("fc1", "bias"), ("bn",), 61, 16, ("input",)),
    Layer("fc2", "dense", ("fc2", "kernel"), ("fc2", "bias"), None, 3, 61, ("fc1",)))))
# At density 0.1: fc1's 976 kernel entries keep round(97.6) = 98, fc2's 183 keep round(18.3) = 18.
ACTIVE = {"fc1": 98, "fc2": 18}
DENSE = 61 + 4 * 61 + 3  # fc1 bias, BN scale, shift, mean, var, fc2 bias
# swap rate 0.5 annealed over 4 rounds: r = 0.5, 0.4268, 0.25, 0.0732; floor(r x 98) + floor(r x 18)
SWAPS = (49 + 9, 41 + 7, 24 + 4, 7 + 1)
DOWN = 4 * (98 + 18 + DENSE)
# values + the cheaper index: fc1 a bitmask of 976 bits (122 bytes; 98 two-byte ids are 196),
# fc2 a list of 18 one-byte ids (its bitmask is 23 bytes); the dense leaves whole
UP = 4 * (98 + 18) + 122 + 18 + 4 * DENSE


def recording(algorithm, k):
    """The algorithm, keeping in its server state what the last round's clients uploaded as kernels."""
    def init(key, variables, n):
        state, clients = algorithm.init(key, variables, n)
        uploaded = {l.name: {"mask": jnp.zeros((k, *jnp.shape(variables["params"][l.name]["kernel"])), bool),
                             "values": jnp.zeros((k, *jnp.shape(variables["params"][l.name]["kernel"])))}
                    for l in NET.structure.layers}
        return {**state, "uploaded": uploaded}, clients

    def server_update(state, ups, weights, info):
        state = algorithm.server_update(state, ups, weights, info)
        kernels = {l.name: ups["params"][l.name]["kernel"] for l in NET.structure.layers}
        assert all(isinstance(s, SparseArray) for s in kernels.values())
        return {**state, "uploaded": {n: {"mask": s.mask, "values": s.values} for n, s in kernels.items()}}

    return dataclasses.replace(algorithm, init=init, server_update=server_update)


def test_rounds_keep_the_density_swap_by_schedule_and_remember_the_uploaded_masks():
    """Four rounds of 2 of 4 clients (density 0.1, swap rate 0.5 annealed over 4 rounds, momentum and
    weight decay). Each sampled client: exactly 98 and 18 active kernel entries before and after; its
    `swapped` = the entries where the old and new masks differ / 2 = the schedule's count by hand;
    the server's memory of it = the mask it uploaded; its trained kernels zero outside that mask and
    equal to the upload inside; the entries it dropped all smaller in |w| (as received) than those
    it kept. The new global kernel is, per entry, the data-weighted mean of the uploads holding it,
    or the old value. Clients not sampled: memory and model unchanged. Bytes and FLOPs by hand."""
    counts = [10, 14, 7, 12]
    split = synthetic_split(counts, shape=(4, 4, 1), num_classes=3)
    algorithm = recording(build(NET, split, sparse_density=0.1, swap_rate=0.5, swap_anneal_rounds=4), 2)
    variables = jax.jit(NET.init)(jax.random.key(0))
    (server, clients), again = jax.jit(lambda key: (algorithm.init(key, variables, 4),
                                                    algorithm.init_clients(key, variables, jnp.array([2]))))(
        jax.random.key(1))
    memory = tree_map(np.asarray, server["memory"])
    for name, active in ACTIVE.items():  # the first masks: random, exact counts, a pure function of (key, id)
        assert (memory[name].reshape(4, -1).sum(1) == active).all()
        assert len({m.tobytes() for m in memory[name]}) == 4
        np.testing.assert_array_equal(clients["params"][name]["kernel"],
                                      np.where(memory[name], variables["params"][name]["kernel"], 0.0))
    tree_map(lambda a, b: np.testing.assert_array_equal(a[0], b[2]), again, clients)
    round_fn = build_round(algorithm, split, 2, seed=3)
    seen = set()
    for r in range(4):
        before = tree_map(np.array, (server, clients))
        server, clients, out = round_fn(server, clients, r)
        old_server, old_clients = before
        new_server, new_clients = tree_map(np.asarray, (server, clients))
        ids = np.asarray(out.client_ids)
        seen.update(ids.tolist())
        np.testing.assert_array_equal(out.downlink_bytes, [DOWN, DOWN])
        np.testing.assert_array_equal(out.uplink_bytes, [UP, UP])
        np.testing.assert_allclose(out.metrics["weight_density"], [116 / 1159] * 2, rtol=1e-6)
        np.testing.assert_allclose(out.metrics["train_flops"], [3 * counts[i] * 116 for i in ids], rtol=1e-6)
        for k, i in enumerate(ids):
            changed = 0
            for name, active in ACTIVE.items():
                old, new = old_server["memory"][name][i], new_server["memory"][name][i]
                assert old.sum() == new.sum() == active
                np.testing.assert_array_equal(new, new_server["uploaded"][name]["mask"][k])
                changed += int((old != new).sum())
                trained = new_clients["params"][name]["kernel"][i]
                assert np.all(trained[~new] == 0)
                np.testing.assert_array_equal(trained[new], new_server["uploaded"][name]["values"][k][new])
                received = np.abs(old_server["variables"]["params"][name]["kernel"])
                assert received[old & ~new].max() <= received[old & new].min()
            assert changed / 2 == int(out.metrics["swapped"][k]) == SWAPS[r], (r, k)
        for i in set(range(4)) - set(ids.tolist()):
            for name in ACTIVE:
                np.testing.assert_array_equal(new_server["memory"][name][i], old_server["memory"][name][i])
            tree_map(lambda a, b: np.testing.assert_array_equal(a[i], b[i]), new_clients, old_clients)
        weights = np.array([counts[i] for i in ids], np.float64)
        for name in ACTIVE:
            masks = new_server["uploaded"][name]["mask"]
            values = new_server["uploaded"][name]["values"]
            held = np.einsum("k,k...->...", weights, masks)
            mean = np.einsum("k,k...->...", weights, masks * values) / np.where(held > 0, held, 1)
            expected = np.where(held > 0, mean, old_server["variables"]["params"][name]["kernel"])
            np.testing.assert_allclose(new_server["variables"]["params"][name]["kernel"], expected, rtol=1e-5,
                                       atol=1e-6)
    assert len(seen) > 2  # more than one pair of clients took part


# ----------------------------------------------------------------- 4. aggregation by hand

class _Fc(nn.Module):
    @nn.compact
    def __call__(self, x, train, mask=None, unit_masks=None):
        del train, mask, unit_masks
        return nn.Dense(3, name="fc")(x.reshape(x.shape[0], -1))


FC = Model(name="fc", module=_Fc(), input_shape=(2, 1, 1), num_classes=3, structure=ModelStructure((
    Layer("fc", "dense", ("fc", "kernel"), ("fc", "bias"), None, 3, 2, ("input",)),)))


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_aggregation_of_two_hand_made_uploads(server_lr):
    """Clients 0 (weight 1) and 2 (weight 3) of three upload different masks; values outside a mask
    (999) must not count. Per kernel entry, the data-weighted mean over the clients whose new mask
    holds it: (1 x 10 + 3 x 30) / 4 = 25, 20 (client 0 alone), 40 and 50 (client 2 alone); entries no
    one holds keep the old 4 and 6. The dense bias: (1 x 1 + 3 x 5) / 4 = 4. At a server learning rate
    of 1/2, half of each step from the old values, and an unheld entry still does not move. The server
    remembers both new masks, and client 1's old one."""
    split = synthetic_split([4, 4, 4], shape=(2, 1, 1), num_classes=3)
    algorithm = build(FC, split, sparse_density=0.5, server_lr=server_lr)
    server, _ = jax.jit(lambda key: algorithm.init(key, FC.init(jax.random.key(0)), 3))(jax.random.key(1))
    old = np.array([[1.0, 2, 3], [4, 5, 6]])
    server["variables"] = {"params": {"fc": {"kernel": jnp.asarray(old, jnp.float32), "bias": jnp.full(3, 2.0)}},
                           "batch_stats": {}}
    masks = np.array([[[1, 1, 0], [0, 0, 0]],
                      [[1, 0, 1], [0, 1, 0]]], bool)
    values = np.where(masks, [[[10.0, 20, 999], [999, 999, 999]], [[30.0, 999, 40], [999, 50, 999]]], 999.0)
    ups = {"params": {"fc": {"kernel": SparseArray(jnp.asarray(values, jnp.float32), jnp.asarray(masks)),
                             "bias": KnownMaskArray(jnp.array([[1.0] * 3, [5.0] * 3]), jnp.ones((2, 3), bool))}},
           "batch_stats": {}}
    new = jax.jit(algorithm.server_update)(server, ups, jnp.array([1.0, 3.0]), round_info(0, 0, jnp.array([0, 2])))
    mean = np.array([[25.0, 20, 40], [4, 50, 6]])
    step = np.where([[1, 1, 1], [0, 1, 0]], old + server_lr * (mean - old), old)
    np.testing.assert_allclose(new["variables"]["params"]["fc"]["kernel"], step, rtol=1e-6)
    np.testing.assert_allclose(new["variables"]["params"]["fc"]["bias"], 2 + server_lr * (4.0 - 2), rtol=1e-6)
    memory = np.asarray(new["memory"]["fc"])
    np.testing.assert_array_equal(memory[0], masks[0])
    np.testing.assert_array_equal(memory[2], masks[1])
    np.testing.assert_array_equal(memory[1], np.asarray(server["memory"]["fc"])[1])
    # the broadcast to client 2: its new mask's values and the bias, 4 x (3 + 3) bytes, no index
    down = algorithm.broadcast(new, 2, round_info(0, 1, jnp.array([1, 2])))
    assert isinstance(down["params"]["fc"]["kernel"], KnownMaskArray)
    np.testing.assert_array_equal(down["params"]["fc"]["kernel"].mask, masks[1])
    assert int(message_bytes(down)) == 4 * (3 + 3)


# ----------------------------------------------------------------- 6. the command line

def test_cli_run_logs_swaps_density_and_personalized_accuracy(tmp_path):
    """Two rounds on the digits MLP at density 0.5 (fc1 8192 of 16384, fc2 32768 of 65536, fc3 1280 of
    2560 kernel entries; 522 bias entries). Swaps: floor(0.5 x active) at round 0 = 21120, and at
    round 1 (r = 0.25 (1 + cos(pi / 500)) = 0.4999951) 4095 + 16383 + 639 = 21117. Down: 4 x (42240 +
    522) per client; up: 4 x 42240 values + bitmasks of 2048, 8192 and 320 bytes + 4 x 522. Half the
    dense FLOPs. No global model: no test accuracy, a personalized one."""
    out = tmp_path / "r"
    assert main(["run", "--algorithm", "fedspa", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "2",
                 "--local-epochs", "1", "--max-train-examples", "200", "--max-test-examples", "100", "--no-progress",
                 "--no-tensorboard", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert [r["client_swapped"] for r in records] == [21120, 21117]
    for record in records:
        # 42240 / 84480: XLA turns a division by a constant into a product by its float32 reciprocal (1 ulp)
        assert record["client_weight_density"] == pytest.approx(0.5, rel=1e-7)
        assert record["downlink_bytes"] == 2 * 4 * (42240 + 522)
        assert record["uplink_bytes"] == 2 * (4 * 42240 + 2048 + 8192 + 320 + 4 * 522)
        assert record["train_flops"] == pytest.approx(record["dense_train_flops"] / 2, rel=1e-6)
        assert record["test_accuracy"] is None and 0 <= record["personalized_accuracy"] <= 1
