"""The engine against independent truths: loops, plain SGD, exact epochs, equivalences."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sparse.algorithms import fedavg, fednova, fedprox, local_only, scaffold
from fedjax_sparse.core.messages.aggregation import weighted_mean
from fedjax_sparse.core.evaluation.evaluators import personalized_evaluator
from fedjax_sparse.core.round.local_training import LocalSGD, masked_cross_entropy, run_local_steps
from fedjax_sparse.core.federation.participation import sample_clients
from fedjax_sparse.core.round.step import build_round, client_keys, default_client_chunk, round_info
from fedjax_sparse.building_blocks.server_optimizer import server_optimizer
from fedjax_sparse.data.federated import (client_batch, epoch_permutations, federated_split, normalize,
                                          steps_per_epoch)
from conftest import LINEAR_CLASSES as CLASSES, linear_model
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
    """Two clients of 7 and 40 examples vmapped together: the small one idles 16 of the 20 steps.

    With momentum 0.9 any padded step that touched the carry would move the weights
    (the momentum buffer is non-zero), so equality with the client's own run, which
    stops after its 4 real steps, and with a loop that never runs a padded step, shows
    padded steps are exact no-ops; the large client equals its own run too.
    """
    split = make_split([7, 40])
    local = LocalSGD(mlp, learning_rate=0.1, epochs=2, batch_size=4, momentum=0.9)
    variables = mlp.init(jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 2)
    train = lambda cid, key: local.train(variables, split.client(cid), key)
    together, stats = jax.jit(jax.vmap(train))(jnp.arange(2), keys)
    np.testing.assert_array_equal(stats["num_steps"], [4, 20])
    alone_train = jax.jit(train)
    for cid in range(2):
        alone, alone_stats = alone_train(cid, keys[cid])
        assert int(alone_stats["num_steps"]) == [4, 20][cid]
        assert_trees_close(tree_map(lambda a: a[cid], together["params"]), alone["params"], atol=2e-6)
        np.testing.assert_allclose(stats["loss"][cid], alone_stats["loss"], rtol=1e-5)

    # The small client against the same 4 steps written as a loop (no padded step exists), and, as
    # the teeth of the test, the weights those steps would reach had the 16 padded steps applied the
    # momentum left in the optimizer's buffer.
    data, key = split.client(0), keys[0]
    tx = local.optimizer()
    per_epoch = int(steps_per_epoch(7, local.batch_size))

    @jax.jit
    def reference(params):
        order_key, step_key = jax.random.split(key)
        orders = epoch_permutations(order_key, data.count, data.max_count, local.epochs)

        def real_step(t, state):
            params, opt_state = state
            batch_key, _ = jax.random.split(jax.random.fold_in(step_key, t))
            b = client_batch(data, orders[t // per_epoch], t % per_epoch, local.batch_size, batch_key, True)

            def loss(p):
                logits, _ = mlp.apply({"params": p, "batch_stats": {}}, b.x, train=True, mask=b.mask)
                return masked_cross_entropy(logits, b.y, b.mask)

            updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def momentum_only_step(t, state):
            params, opt_state = state
            updates, opt_state = tx.update(tree_map(jnp.zeros_like, params), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        state = jax.lax.fori_loop(0, local.epochs * per_epoch, real_step, (params, tx.init(params)))
        return state[0], jax.lax.fori_loop(0, 16, momentum_only_step, state)[0]

    params, moved = reference(variables["params"])
    assert local.epochs * per_epoch == 4
    small = tree_map(lambda a: a[0], together["params"])
    assert_trees_close(small, params)
    gap = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(jax.tree_util.tree_leaves(moved),
                                                                          jax.tree_util.tree_leaves(small)))
    assert gap > 1e-3


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
    assert_trees_close(server["variables"]["params"], params)


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


def test_library_functions_compose_inside_a_users_jit(make_split, mlp):
    """Rounds scanned inside the user's own `jax.jit`, and the personalized evaluator called in it, give
    what they give called one by one. On a CPU the library compiles with XLA options, which JAX
    forbids on a jitted function traced into another: this raised there (and only there)."""
    split = make_split([9, 17, 12, 30])
    algorithm = fedavg(LocalSGD(mlp, learning_rate=0.1, epochs=1, batch_size=8))
    server, clients = algorithm.init(jax.random.key(1), mlp.init(jax.random.key(0)), 4)
    round_fn = build_round(algorithm, split, 2, seed=3)
    evaluate = personalized_evaluator(mlp, lambda server, client: server["variables"], split)

    @jax.jit
    def two_rounds(server, clients):
        def body(carry, r):
            server, clients, _ = round_fn(*carry, r)
            return (server, clients), None
        (server, clients), _ = jax.lax.scan(body, (server, clients), jnp.arange(2))
        return server, clients, evaluate(server, clients)

    scanned = two_rounds(server, tree_map(jnp.copy, clients))
    for r in range(2):
        server, clients, _ = round_fn(server, clients, r)
    assert_trees_close(scanned[:2], (server, clients))
    np.testing.assert_allclose(scanned[2], evaluate(server, clients), rtol=1e-6)


def test_scaffold_with_zero_control_variates_equals_fedavg_for_one_round(make_split, mlp):
    split = make_split([16, 16, 16, 16])  # equal sizes: SCAFFOLD's uniform mean = FedAvg's weighted mean
    local = LocalSGD(mlp, learning_rate=0.1, epochs=2, batch_size=8)
    variables = mlp.init(jax.random.key(0))
    results = []
    for algorithm in (fedavg(local), scaffold(local, 4)):
        server, clients = algorithm.init(jax.random.key(1), variables, 4)
        server, _, _ = build_round(algorithm, split, 4, seed=0)(server, clients, 0)
        results.append(server["variables"])
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
    assert_trees_close(new_server["variables"]["params"], expected, atol=1e-5)
    fedavg_mean = weighted_mean(tree_map(lambda *a: jnp.stack(a), *ys), jnp.asarray(p))
    gap = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(fedavg_mean),
                                                         jax.tree_util.tree_leaves(new_server["variables"]["params"])))
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
    assert default_client_chunk(variables, 10, "cpu") == 2  # a divisor of K: no remainder outside the loop
    assert default_client_chunk(variables, 7, "cpu") == 1


# ---------------------------------------------------------------------------------------------
# Hand computations on a linear softmax model (logits = x W + b), written out in float64 NumPy.
#
# Clients are built so that the order of their examples cannot matter: a client holds either at
# most one batch of examples (every step is a full-batch step) or copies of a single example
# (every batch's mean loss is that example's loss). Either way each local step is a gradient step
# on the client's mean loss, so a hand loop needs no batch order, and clients can still take
# different numbers of steps.



FEATURES, MEAN, STD = 4, 0.5, 0.25



def order_free_split(clients, seed=0):
    """clients: ('distinct', n) (n <= the batch size) or ('copies', n). Returns (split, [(X, y)])."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for kind, n in clients:
        if kind == "distinct":
            xs.append(rng.integers(0, 256, (n, 2, 2, 1), dtype=np.uint8))
            ys.append(rng.integers(0, CLASSES, n))
        else:
            xs.append(np.repeat(rng.integers(0, 256, (1, 2, 2, 1), dtype=np.uint8), n, axis=0))
            ys.append(np.full(n, rng.integers(0, CLASSES)))
    bounds = np.cumsum([0] + [n for _, n in clients])
    split = federated_split(np.concatenate(xs), np.concatenate(ys), [np.arange(a, b) for a, b in
                                                                     zip(bounds, bounds[1:])], [MEAN], [STD])
    return split, [((x.astype(np.float64) / 255 - MEAN) / STD).reshape(len(x), -1) for x in xs], ys


def to_vector(params):
    """The linear model's params (or a params-shaped tree) as one float64 vector: kernel, then bias."""
    return np.concatenate([np.ravel(np.asarray(params["fc"]["kernel"], np.float64)),
                           np.asarray(params["fc"]["bias"], np.float64)])


def to_params(theta):
    k = FEATURES * CLASSES
    return {"fc": {"kernel": jnp.asarray(theta[:k].reshape(FEATURES, CLASSES), jnp.float32),
                   "bias": jnp.asarray(theta[k:], jnp.float32)}}


def mean_ce_gradient(theta, x, y):
    """Gradient of the mean softmax cross-entropy of logits x W + b, by the formula X^T (P - Y) / n."""
    w, b = theta[:FEATURES * CLASSES].reshape(FEATURES, CLASSES), theta[FEATURES * CLASSES:]
    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return np.concatenate([(x.T @ p).ravel(), p.sum(0)])


def hand_local_sgd(theta, x, y, steps, lr, momentum=0.0, correction=0.0, mu=0.0):
    """`steps` steps of (heavy-ball) SGD on the mean loss: v = rho v + g; w -= lr v, where
    g = gradient + correction + mu (w - w_start)."""
    start, w, v = theta, theta.copy(), np.zeros_like(theta)
    for _ in range(steps):
        v = momentum * v + mean_ce_gradient(w, x, y) + correction + mu * (w - start)
        w = w - lr * v
    return w


def momentum_norm(tau, rho):
    """||a||_1 of FedNova: [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)."""
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)


def random_theta(seed, scale=0.5):
    return np.random.default_rng(seed).normal(0.0, scale, FEATURES * CLASSES + CLASSES)


def test_hand_model_gradient_matches_autodiff():
    """The hand formula of the linear model's gradient, checked once against jax.grad."""
    split, xs, ys = order_free_split([("distinct", 5)])
    model, theta = linear_model(), random_theta(0)
    batch = client_batch(split.client(0), jnp.arange(5), 0, 5, jax.random.key(0), train=False)

    def loss(p):
        return masked_cross_entropy(model.apply({"params": p, "batch_stats": {}}, batch.x, train=True)[0],
                                    batch.y, batch.mask)

    np.testing.assert_allclose(to_vector(jax.grad(loss)(to_params(theta))), mean_ce_gradient(theta, xs[0], ys[0]),
                               rtol=1e-5, atol=1e-6)


SCAFFOLD_CLIENTS = [("distinct", 3), ("copies", 10), ("distinct", 4), ("copies", 7)]  # batch 4, 2 epochs:
SCAFFOLD_STEPS = [2, 6, 2, 4]                                                           # K_i = 2 ceil(n_i / 4)


def hand_scaffold_round(x, c, cs, ids, xs, ys, *, lr, rho, server_lr, divisor):
    """One SCAFFOLD round, option II: returns (x, c, client controls)."""
    cs = [ci.copy() for ci in cs]
    deltas, control_deltas = [], []
    for i in ids:
        k = SCAFFOLD_STEPS[i]
        y = hand_local_sgd(x, xs[i], ys[i], k, lr, rho, correction=c - cs[i])
        a = momentum_norm(k, rho) if divisor == "effective" else k
        new = cs[i] - c + (x - y) / (a * lr)
        deltas.append(y - x)
        control_deltas.append(new - cs[i])
        cs[i] = new
    x = x + server_lr * np.mean(deltas, axis=0)
    c = c + len(ids) / len(cs) * np.mean(control_deltas, axis=0)
    return x, c, cs


def test_scaffold_two_rounds_with_momentum_match_a_hand_computation():
    """Round 2 starts from non-zero control variates; momentum 0.9, unequal K_i, lr decay, eta_g."""
    split, xs, ys = order_free_split(SCAFFOLD_CLIENTS)
    lr, rho, server_lr, decay = 0.1, 0.9, 0.7, 0.8
    local = LocalSGD(linear_model(), learning_rate=lr, epochs=2, batch_size=4, momentum=rho, lr_decay=decay)
    algorithm = scaffold(local, 4, server_optimizer("sgd", lr=server_lr))
    theta = random_theta(1)
    server, clients = algorithm.init(jax.random.key(0), {"params": to_params(theta), "batch_stats": {}}, 4)
    round_fn = build_round(algorithm, split, 3, seed=4)
    x, c, cs = theta, np.zeros_like(theta), [np.zeros_like(theta)] * 4
    plain = (x, c, cs)  # the same rounds with option II's plain divisor K_i lr
    sampled = []
    for r in range(2):
        server, clients, out = round_fn(server, clients, r)
        ids = np.asarray(out.client_ids).tolist()
        sampled.append(ids)
        np.testing.assert_array_equal(out.metrics["num_steps"], np.asarray(SCAFFOLD_STEPS)[ids])
        x, c, cs = hand_scaffold_round(x, c, cs, ids, xs, ys, lr=lr * decay ** r, rho=rho,
                                       server_lr=server_lr, divisor="effective")
        plain = hand_scaffold_round(*plain, ids, xs, ys, lr=lr * decay ** r, rho=rho, server_lr=server_lr,
                                    divisor="plain")
        np.testing.assert_allclose(to_vector(server["variables"]["params"]), x, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(to_vector(server["control"]), c, rtol=1e-4, atol=1e-5)
        for i in range(4):
            np.testing.assert_allclose(to_vector(tree_map(lambda a: a[i], clients)), cs[i], rtol=1e-4, atol=1e-5)
    # round 2 ([0, 1, 2]) has clients with and without a control from round 1 ([0, 2, 3]), and client
    # 3 keeps the control it made in round 1
    assert sampled == [[0, 2, 3], [0, 1, 2]], sampled
    # Teeth: option II's plain divisor gives controls (and so a round-2 model) far from the result.
    assert np.abs(to_vector(server["control"]) - plain[1]).max() > 100 * 1e-5
    assert np.abs(to_vector(server["variables"]["params"]) - plain[0]).max() > 100 * 1e-5


def test_scaffold_control_variate_estimates_the_gradient_under_momentum():
    """A problem whose gradient is constant to ~1% over the local trajectory (tiny lr x many steps):
    with momentum 0.9, c_i+ = c_i - c + (x - y) / (||a||_1 lr) is the true gradient at x within a few
    percent, whatever c and c_i were; option II's (x - y) / (K lr) would be ~9x too large."""
    split, xs, ys = order_free_split([("distinct", 6)], seed=3)
    steps, lr, rho = 100, 1e-5, 0.9
    local = LocalSGD(linear_model(), learning_rate=lr, epochs=steps, batch_size=8, momentum=rho)
    algorithm = scaffold(local, 1)
    theta = random_theta(2, scale=0.05)
    true_grad = mean_ce_gradient(theta, xs[0], ys[0])
    info = round_info(0, 0, jnp.zeros(1, jnp.int32))
    update = jax.jit(algorithm.client_update)
    rng = np.random.default_rng(5)
    for controls in ("zero", "random"):
        c, ci = ((np.zeros_like(theta), np.zeros_like(theta)) if controls == "zero" else
                 (rng.normal(0, 0.2, theta.shape), rng.normal(0, 0.2, theta.shape)))
        down = {"variables": {"params": to_params(theta), "batch_stats": {}}, "control": to_params(c)}
        up, new_control, stats = update(down, to_params(ci), split.client(0), jax.random.key(0), info)
        assert int(stats["num_steps"]) == steps
        end = theta + to_vector(up["delta"])
        # the premise: the gradient barely changes between the start and the end of the trajectory
        assert np.linalg.norm(mean_ce_gradient(end, xs[0], ys[0]) - true_grad) < 0.02 * np.linalg.norm(true_grad)
        error = np.linalg.norm(to_vector(new_control) - true_grad) / np.linalg.norm(true_grad)
        assert error < 0.03, (controls, error)
        plain = ci - c + (theta - end) / (steps * lr)
        if controls == "zero":
            ratio = np.linalg.norm(plain) / np.linalg.norm(true_grad)
            assert 8.5 < ratio < 9.5, ratio  # ||a||_1 / K = 9.1 for K = 100, rho = 0.9
        assert np.linalg.norm(plain - true_grad) > 2 * np.linalg.norm(true_grad)


def test_fednova_with_momentum_and_unequal_steps_matches_its_formula():
    """x+ = x - tau_eff sum_i p_i (x - y_i) / ||a_i||_1, tau_eff = sum_i p_i ||a_i||_1, p_i data weights."""
    clients = [("distinct", 3), ("copies", 14), ("copies", 9), ("distinct", 2)]
    steps = [1, 4, 3, 1]  # batch 4, one epoch
    split, xs, ys = order_free_split(clients, seed=6)
    lr, rho = 0.1, 0.9
    local = LocalSGD(linear_model(), learning_rate=lr, epochs=1, batch_size=4, momentum=rho)
    algorithm = fednova(local)
    theta = random_theta(3)
    server, clients_state = algorithm.init(jax.random.key(0), {"params": to_params(theta), "batch_stats": {}}, 4)
    server, _, out = build_round(algorithm, split, 3, seed=1)(server, clients_state, 0)
    ids = np.asarray(out.client_ids).tolist()
    assert len({steps[i] for i in ids}) > 1  # the sampled clients take unequal numbers of steps

    n = np.array([clients[i][1] for i in ids], np.float64)
    p = n / n.sum()
    ys_hand = [hand_local_sgd(theta, xs[i], ys[i], steps[i], lr, rho) for i in ids]
    a = np.array([momentum_norm(steps[i], rho) for i in ids])
    tau_eff = (p * a).sum()
    expected = theta - tau_eff * sum(pi * (theta - yi) / ai for pi, yi, ai in zip(p, ys_hand, a))
    np.testing.assert_allclose(to_vector(server["variables"]["params"]), expected, rtol=1e-5, atol=1e-5)
    # Teeth: FedAvg's data-weighted mean, and FedNova with ||a||_1 = tau (momentum ignored), differ.
    fedavg_mean = sum(pi * yi for pi, yi in zip(p, ys_hand))
    tau = np.array([steps[i] for i in ids], np.float64)
    no_momentum = theta - (p * tau).sum() * sum(pi * (theta - yi) / ti for pi, yi, ti in zip(p, ys_hand, tau))
    for other in (fedavg_mean, no_momentum):
        assert np.abs(other - expected).max() > 1e-3


def test_fedprox_step_includes_the_proximal_gradient():
    """One client, full batch, plain SGD: w <- w - lr (grad + mu (w - w_global)) for 5 steps."""
    split, xs, ys = order_free_split([("distinct", 6)], seed=7)
    lr, mu, steps = 0.3, 2.0, 5
    local = LocalSGD(linear_model(), learning_rate=lr, epochs=steps, batch_size=8)
    theta = random_theta(4)
    results = {}
    for m in (mu, 0.0):
        algorithm = fedprox(local, m)
        server, clients = algorithm.init(jax.random.key(0), {"params": to_params(theta), "batch_stats": {}}, 1)
        server, _, _ = build_round(algorithm, split, 1, seed=0)(server, clients, 0)
        results[m] = to_vector(server["variables"]["params"])
    expected = hand_local_sgd(theta, xs[0], ys[0], steps, lr, mu=mu)
    np.testing.assert_allclose(results[mu], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[0.0], hand_local_sgd(theta, xs[0], ys[0], steps, lr), rtol=1e-5, atol=1e-6)
    assert np.abs(results[mu] - results[0.0]).max() > 1e-2  # the proximal term really pulls


def test_grad_clip_norm_scales_the_raw_gradient_before_weight_decay_and_the_step():
    """One plain-SGD step with weight decay: unclipped, the step is -lr (g + wd w), which gives g; clipped
    at c it is -lr (g min(1, c / (||g|| + 1e-6)) + wd w), PyTorch's clip_grad_norm_ then SGD's decay.
    A norm above ||g|| leaves the step exactly as it was; none and a bad value: one line."""
    from conftest import synthetic_split
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([12])
    data = split.client(0)
    variables = model.init(jax.random.key(0))
    lr, wd = 0.1, 0.01

    def step(clip):
        local = LocalSGD(model, lr, 1, 16, weight_decay=wd, grad_clip_norm=clip)
        new, stats = local.train(variables, data, jax.random.key(1))
        assert int(stats["num_steps"]) == 1
        return new["params"]

    w = variables["params"]
    g = jax.tree_util.tree_map(lambda n, o: -(n - o) / lr - wd * o, step(None), w)
    norm = float(optax.tree.norm(g))
    for clip in (norm / 4, norm * 2):
        scale = min(1.0, clip / (norm + 1e-6))
        expected = jax.tree_util.tree_map(lambda o, gi: o - lr * (gi * scale + wd * o), w, g)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), step(clip),
                               expected)
    with pytest.raises(ValueError, match=r"^--grad-clip-norm must be a finite number > 0 \(or none\), got 0.0$"):
        LocalSGD(model, lr, 1, 16, grad_clip_norm=0.0)
