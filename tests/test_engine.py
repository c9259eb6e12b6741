"""The engine against independent truths: loops, plain SGD, exact epochs, equivalences."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sparse.algorithms import fedavg, fednova, fedprox, local_only, scaffold
from fedjax_sparse.core.aggregation import weighted_mean
from fedjax_sparse.core.local_training import LocalSGD, masked_cross_entropy, run_local_steps
from fedjax_sparse.core.round import build_round, client_keys, default_client_chunk, round_info, sample_clients
from fedjax_sparse.data.federated import (client_batch, epoch_permutations, federated_split, normalize,
                                          steps_per_epoch)
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map


def assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                                   atol=atol, rtol=rtol), a, b)


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


def test_sampling_is_a_pure_function_of_seed_and_round():
    a = sample_clients(3, 7, 50, 10)
    b = sample_clients(3, 7, 50, 10)
    c = sample_clients(3, 8, 50, 10)
    np.testing.assert_array_equal(a, b)
    assert len(set(np.asarray(a).tolist())) == 10
    assert not np.array_equal(a, c)


def test_every_example_is_seen_exactly_once_per_epoch():
    """The real scan, with labels set to example ids, counts every use of every example."""
    counts = [5, 13, 21]
    total = sum(counts)
    x = np.zeros((total, 2, 2, 1), np.uint8)
    bounds = np.cumsum([0] + counts)
    split = federated_split(x, np.arange(total), [np.arange(a, b) for a, b in zip(bounds, bounds[1:])],
                            mean=[0.0], std=[1.0])

    def step(seen, batch, key):
        return seen.at[batch.y].add(batch.mask.astype(seen.dtype)), jnp.zeros(())

    for cid in range(3):
        seen, stats = run_local_steps(step, jnp.zeros(total, jnp.int32), split.client(cid),
                                      jax.random.key(cid), epochs=3, batch_size=4)
        expected = np.zeros(total, int)
        expected[bounds[cid]:bounds[cid + 1]] = 3
        np.testing.assert_array_equal(seen, expected)
        assert int(stats["num_steps"]) == 3 * -(-counts[cid] // 4)


def test_padded_steps_change_nothing(make_split, mlp):
    """The scan over the largest client's steps equals a loop over only the real steps."""
    split = make_split([7, 40])  # client 0 gets many padded steps
    data = split.client(0)
    local = LocalSGD(mlp, learning_rate=0.1, epochs=2, batch_size=4, momentum=0.9)
    variables = mlp.init(jax.random.key(0))
    key = jax.random.key(1)
    trained, stats = jax.jit(local.train)(variables, data, key)

    # Reference: the same steps, written as a Python loop that never runs a padded step.
    tx = local.optimizer()
    order_key, step_key = jax.random.split(key)
    orders = epoch_permutations(order_key, data.count, data.max_count, local.epochs)
    per_epoch = int(steps_per_epoch(data.count, local.batch_size))
    params, opt_state = variables["params"], tx.init(variables["params"])
    for t in range(local.epochs * per_epoch):
        batch_key, _ = jax.random.split(jax.random.fold_in(step_key, t))
        b = client_batch(data, orders[t // per_epoch], t % per_epoch, local.batch_size, batch_key, True)

        def loss(p):
            logits, _ = mlp.apply({"params": p, "batch_stats": {}}, b.x, train=True, mask=b.mask)
            return masked_cross_entropy(logits, b.y, b.mask)

        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        params = optax.apply_updates(params, updates)
    assert int(stats["num_steps"]) == local.epochs * per_epoch == 4
    assert_trees_close(trained["params"], params)


def test_fedavg_with_one_client_equals_plain_gradient_descent(make_split, mlp):
    split = make_split([24])
    local = LocalSGD(mlp, learning_rate=0.05, epochs=3, batch_size=24)  # full batch: order-free
    algorithm = fedavg(local)
    variables = mlp.init(jax.random.key(0))
    server, clients = algorithm.init(jax.random.key(1), variables, 1)
    round_fn = build_round(algorithm, split, 1, seed=0)
    server, clients, _ = round_fn(server, clients, 0)

    x = normalize(split.x, split.mean, split.std)
    params = variables["params"]
    for _ in range(3):
        def loss(p):
            logits, _ = mlp.apply({"params": p, "batch_stats": {}}, x, train=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, split.y).mean()
        params = tree_map(lambda w, g: w - 0.05 * g, params, jax.grad(loss)(params))
    assert_trees_close(server["params"], params)


def _loop_round(algorithm, split, server, clients, round_index, seed, k):
    """One round written as a Python loop over the sampled clients."""
    ids = sample_clients(seed, round_index, split.num_clients, k)
    keys = client_keys(seed, round_index, ids)
    info = round_info(seed, round_index, ids)
    ups, new_states = [], []
    for cid, key in zip(np.asarray(ids), keys):
        state = tree_map(lambda a: a[cid], clients)
        down = algorithm.broadcast(server, cid, info)
        up, state, _ = jax.jit(algorithm.client_update)(down, state, split.client(cid), key, info)
        ups.append(up)
        new_states.append(state)
    stacked = tree_map(lambda *xs: jnp.stack(xs), *ups)
    server = algorithm.server_update(server, stacked, split.counts[ids].astype(jnp.float32), info)
    if new_states and jax.tree_util.tree_leaves(new_states[0]):
        stacked_states = tree_map(lambda *xs: jnp.stack(xs), *new_states)
        clients = tree_map(lambda a, n: a.at[ids].set(n), clients, stacked_states)
    return server, clients


@pytest.mark.parametrize("name,chunk", [("fedavg", None), ("scaffold", None), ("local", None),
                                        ("fedavg", 1), ("scaffold", 2)])
def test_vmapped_round_equals_per_client_loop(make_split, mlp, name, chunk):
    """chunk None: one vmap over the 3 sampled clients; 1 and 2: lax.map over chunks (2 leaves a remainder)."""
    split = make_split([9, 17, 12, 30, 5, 22])
    local = LocalSGD(mlp, learning_rate=0.1, epochs=2, batch_size=8)
    algorithm = {"fedavg": fedavg(local), "scaffold": scaffold(local, 6), "local": local_only(local)}[name]
    variables = mlp.init(jax.random.key(0))
    server, clients = algorithm.init(jax.random.key(1), variables, 6)
    ref_server, ref_clients = server, clients
    round_fn = build_round(algorithm, split, 3, seed=5, client_chunk=chunk)
    for r in range(2):
        ref_server, ref_clients = _loop_round(algorithm, split, ref_server, ref_clients, r, 5, 3)
        server, clients, _ = round_fn(server, tree_map(jnp.copy, clients), r)
    assert_trees_close(server, ref_server)
    assert_trees_close(clients, ref_clients)


def test_scaffold_with_zero_control_variates_equals_fedavg_for_one_round(make_split, mlp):
    split = make_split([16, 16, 16, 16])  # equal sizes: SCAFFOLD's uniform mean = FedAvg's weighted mean
    local = LocalSGD(mlp, learning_rate=0.1, epochs=2, batch_size=8)
    variables = mlp.init(jax.random.key(0))
    results = []
    for algorithm in (fedavg(local), scaffold(local, 4)):
        server, clients = algorithm.init(jax.random.key(1), variables, 4)
        server, _, _ = build_round(algorithm, split, 4, seed=0)(server, clients, 0)
        results.append(server if algorithm.name == "fedavg" else server["variables"])
    assert_trees_close(results[0], results[1])


def test_fednova_with_equal_steps_and_fedprox_with_zero_mu_equal_fedavg(make_split, mlp):
    split = make_split([12, 16, 10, 14])  # batch 16: one step per epoch for everybody
    local = LocalSGD(mlp, learning_rate=0.1, epochs=3, batch_size=16, momentum=0.5)
    variables = mlp.init(jax.random.key(0))
    finals = {}
    for algorithm in (fedavg(local), fednova(local), fedprox(local, 0.0)):
        server, clients = algorithm.init(jax.random.key(1), variables, 4)
        round_fn = build_round(algorithm, split, 3, seed=2)
        for r in range(2):
            server, clients, _ = round_fn(server, clients, r)
        finals[algorithm.name] = server
    assert_trees_close(finals["fedavg"], finals["fednova"], atol=1e-5)
    assert_trees_close(finals["fedavg"], finals["fedprox"], atol=1e-6)


def test_fednova_weights_clients_by_their_step_counts(make_split, mlp):
    """With unequal tau_i, FedNova's update differs from FedAvg's and matches the formula."""
    split = make_split([8, 32])
    local = LocalSGD(mlp, learning_rate=0.1, epochs=1, batch_size=8)
    variables = mlp.init(jax.random.key(0))
    nova = fednova(local)
    server, clients = nova.init(jax.random.key(1), variables, 2)
    new_server, _, out = build_round(nova, split, 2, seed=0)(server, clients, 0)
    ids = np.asarray(out.client_ids)
    keys = client_keys(0, 0, out.client_ids)
    ys = [local.train(variables, split.client(c), k)[0]["params"] for c, k in zip(ids, keys)]
    p = np.asarray(split.counts)[ids] / np.asarray(split.counts)[ids].sum()
    tau = np.array([1.0, 4.0])[ids]
    tau_eff = (p * tau).sum()
    expected = tree_map(lambda w, y0, y1: w - tau_eff * (p[0] * (w - y0) / tau[0] + p[1] * (w - y1) / tau[1]),
                        variables["params"], ys[0], ys[1])
    assert_trees_close(new_server["params"], expected, atol=1e-5)
    fedavg_mean = weighted_mean(tree_map(lambda *a: jnp.stack(a), *ys), jnp.asarray(p))
    gap = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(fedavg_mean),
                                                         jax.tree_util.tree_leaves(new_server["params"])))
    assert gap > 1e-4


def test_run_local_steps_reports_mean_loss_over_examples(make_split):
    split = make_split([10])
    data = split.client(0)

    def step(carry, batch, key):  # "loss" = mean label of the batch's real examples
        y = batch.y.astype(jnp.float32)
        return carry, jnp.sum(jnp.where(batch.mask, y, 0)) / jnp.maximum(batch.mask.sum(), 1)

    _, stats = run_local_steps(step, jnp.zeros(()), data, jax.random.key(0), epochs=2, batch_size=4)
    np.testing.assert_allclose(float(stats["loss"]), float(np.asarray(split.y).mean()), rtol=1e-6)
    assert int(stats["num_steps"]) == 6


def test_padded_step_fraction_is_set_by_the_busiest_sampled_client():
    from fedjax_sparse.data.federated import padded_step_fraction
    # steps per epoch 1 and 3: the small client idles 2 of the 6 vmapped steps.
    assert padded_step_fraction([16, 48], 16) == 1 - 4 / 6
    assert padded_step_fraction([20, 20, 20], 8) == 0.0
    # chunks of 2 train [16, 48] and then [32]: 1 + 3 + 2 real steps of 3 + 3 + 2
    assert padded_step_fraction([16, 48, 32], 16, chunk=2) == 1 - 6 / 8
    assert padded_step_fraction([16, 48, 32], 16, chunk=1) == 0.0
    assert padded_step_fraction([16, 48, 32], 16) == 1 - 6 / 9


def test_client_chunk_and_its_default_are_checked(make_split, mlp):
    split = make_split([8, 8, 8, 8])
    algorithm = fedavg(LocalSGD(mlp, learning_rate=0.1, epochs=1, batch_size=8))
    for bad in (0, 5):
        with pytest.raises(ValueError, match=rf"client chunk must be in \[1, 4\].*got {bad}"):
            build_round(algorithm, split, 4, seed=0, client_chunk=bad)
    variables = mlp.init(jax.random.key(0))  # 85,002 float32 parameters, 340,008 bytes
    assert default_client_chunk(variables, 100, "gpu") is None
    assert default_client_chunk(variables, 100, "cpu") == (3 << 19) // 340008 == 4
    assert default_client_chunk(variables, 3, "cpu") == 3
    assert default_client_chunk(variables, 100, "cpu", cache_bytes=1000) == 1
