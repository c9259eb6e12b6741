"""Sharded rounds placing the sampled clients on their devices by local steps (core.round.device_split): the
greedy LPT placement worked by hand, its padded fraction by hand, and the same figures as one device."""

import os
import subprocess
import sys
import textwrap

import numpy as np

from fedjax_sparse.core.round.device_split import (BalancedSplit, balanced_order, balanced_padded_step_fraction,
                                             device_groups)
from fedjax_sparse.data.federated import padded_step_fraction


def test_clients_of_one_are_placed_longest_first_on_the_least_loaded_device_ties_by_id():
    """Steps by id 2 5 1 3 2 3, two devices of 3: sorted 1(5) 3(3) 5(3) 0(2) 4(2) 2(1); loads 5|0, 5|3,
    5|6, 7|6, 7|8 (device 1 full), so 2 goes to device 0: [1 0 2 | 3 5 4], sums 8 and 8."""
    order = np.asarray(balanced_order(np.array([2, 5, 1, 3, 2, 3]), np.arange(6), 1, (3, 3)))
    np.testing.assert_array_equal(order, [1, 0, 2, 3, 5, 4])
    # equal steps: the lower id first, whatever slot it was drawn in: 1 -> 0, 3 -> 1, 7 -> 0 (a tie), 9 -> 1
    order = np.asarray(balanced_order(np.array([4, 4, 4, 4]), np.array([7, 3, 9, 1]), 1, (2, 2)))
    np.testing.assert_array_equal(np.array([7, 3, 9, 1])[order], [1, 7, 3, 9])


def test_groups_are_cut_by_size_then_placed_by_their_busiest_client():
    """Steps 2 5 1 3 2 3 7 1, chunks of 2 on two devices of 2 chunks: groups [6 1] (7), [3 5] (3), [0 4] (2),
    [2 7] (1); loads 7|0, 7|3, 7|5 (device 1 full), so [2 7] goes to device 0."""
    order = np.asarray(balanced_order(np.array([2, 5, 1, 3, 2, 3, 7, 1]), np.arange(8), 2, (2, 2)))
    np.testing.assert_array_equal(order, [6, 1, 2, 7, 3, 5, 0, 4])
    # a sharded vmap: one group per device, the largest K/D clients together
    order = np.asarray(balanced_order(np.array([2, 5, 1, 3, 2, 3]), np.arange(6), 3, (1, 1)))
    np.testing.assert_array_equal(order, [1, 3, 5, 0, 4, 2])
    assert device_groups(12, client_chunk=3, num_devices=3) == (3, (2, 1, 1))
    assert device_groups(12, mesh_size=4) == (3, (1, 1, 1, 1))


def test_the_placement_depends_on_the_clients_not_on_the_order_they_were_drawn_in():
    rng = np.random.default_rng(0)
    ids = rng.permutation(40)[:12]
    steps = rng.integers(1, 9, 12)
    placed = ids[np.asarray(balanced_order(steps, ids, 2, (2, 2, 2)))]
    shuffle = rng.permutation(12)
    again = ids[shuffle][np.asarray(balanced_order(steps[shuffle], ids[shuffle], 2, (2, 2, 2)))]
    np.testing.assert_array_equal(placed, again)
    np.testing.assert_array_equal(placed, ids[np.asarray(balanced_order(steps, ids, 2, (2, 2, 2)))])


def test_padded_fraction_of_a_balanced_round_by_hand():
    """Counts 32 8 4 20 4 8 by id, batch 4: steps 8 2 1 5 1 2 (19). Two devices, one vmap each: the id split
    runs 3 x 8 + 3 x 5 = 39 steps (20 padded), the balanced [0 3 1 | 5 2 4] 3 x 8 + 3 x 2 = 30 (11)."""
    counts, ids, dispatched = np.array([32, 8, 4, 20, 4, 8]), np.arange(6), np.ones(6, bool)
    assert padded_step_fraction(counts, 4, 3) == 1 - 19 / 39
    assert balanced_padded_step_fraction(BalancedSplit(4), counts, ids, dispatched, 3, (1, 1)) == 1 - 19 / 30
    # a slot that holds no client counts nothing: 0 3 1 | 2 4 -> 3 x 8 + 2 x 1 = 26 run for 17
    dispatched[5] = False
    assert balanced_padded_step_fraction(BalancedSplit(4), counts, ids, dispatched, 3, (1, 1)) == 1 - 17 / 26


SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    assert jax.device_count() == 4, jax.devices()
    from fedjax_sparse.algorithms import fedavg, fednova, scaffold
    from fedjax_sparse.core.round.cpu import CpuRound
    from fedjax_sparse.core.round.device_split import BalancedSplit, balanced_order
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.federation.participation import uniform_sampler
    from fedjax_sparse.core.round.step import RoundConditions, build_round, clients_mesh
    from fedjax_sparse.data.federated import federated_split
    from fedjax_sparse.models import get_model

    rng = np.random.default_rng(0)
    counts = [9, 47, 12, 30, 5, 22, 4, 8, 61, 6, 14, 3]  # skewed: balancing moves clients
    x = rng.integers(0, 256, size=(sum(counts), 8, 8, 1), dtype=np.uint8)
    y = rng.integers(0, 10, size=sum(counts))
    bounds = np.cumsum([0] + counts)
    split = federated_split(x, y, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])], [0.5], [0.25])
    model = get_model("mlp", (8, 8, 1), 10)
    local = LocalSGD(model, 0.1, 2, 4)
    N, K, ROUNDS = 12, 8, 2
    balanced = RoundConditions(uniform_sampler(N, K), split=BalancedSplit(4))
    ids = np.asarray(uniform_sampler(N, K)(3, 0).ids)
    steps = (split.counts[ids] + 3) // 4
    assert not np.array_equal(np.asarray(balanced_order(steps, ids, 2, (1, 1, 1, 1))), np.arange(K))

    def same(a, b):
        a, b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
        return len(a) == len(b) and all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(a, b))

    def run(round_fn, algorithm):
        server, clients = algorithm.init(jax.random.key(0), model.init(jax.random.key(1)), N)
        outs = []
        for r in range(ROUNDS):
            server, clients, out = round_fn(server, clients, r)
            outs.append(out)
        return server, clients, outs

    result = {}
    for algorithm in (fedavg(local), scaffold(local, N), fednova(local)):
        one = run(build_round(algorithm, split, K, seed=3), algorithm)
        sharded = run(build_round(algorithm, split, K, seed=3, mesh=clients_mesh(), conditions=balanced), algorithm)
        one_chunked = run(build_round(algorithm, split, K, seed=3, client_chunk=2), algorithm)
        cpu = run(CpuRound(algorithm, split, K, seed=3, client_chunk=2, devices=jax.local_devices()[:2],
                           conditions=balanced), algorithm)
        result[algorithm.name] = (same(one, sharded), same(one_chunked, cpu))
    print("RESULT", result)
""")


def test_balanced_sharded_and_cpu_rounds_equal_one_device_bit_for_bit():
    """FedAvg, SCAFFOLD (client states) and FedNova: 2 rounds of 8 of 12 skewed clients placed by steps over
    a 4-device mesh give one device's round, and over 2 CPU devices (chunks of 2) one device's chunked
    round: server state, client states and every output, bit for bit."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "RESULT {'fedavg': (True, True), 'scaffold': (True, True), 'fednova': (True, True)}" in proc.stdout, \
        proc.stdout[-2000:]
