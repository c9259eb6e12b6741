"""FedDyn against a hand computation: two rounds of partial participation on the linear model, with the
clients' gradient states and the server's h carried from the first round into the second."""

import jax
import numpy as np

from conftest import linear_model
from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.round.step import build_round
from test_engine import SCAFFOLD_CLIENTS, SCAFFOLD_STEPS, hand_local_sgd, order_free_split, random_theta, \
    to_params, to_vector


def test_two_rounds_of_feddyn_match_a_hand_computation():
    split, xs, ys = order_free_split(SCAFFOLD_CLIENTS)
    lr, alpha = 0.1, 0.3
    local = LocalSGD(linear_model(), learning_rate=lr, epochs=2, batch_size=4)
    context = BuildContext(local=local, num_clients=4, clients_per_round=3, train=split, num_classes=3)
    algorithm = make_algorithm("feddyn", context, make_options("feddyn", {"feddyn_alpha": alpha}))
    theta = random_theta(2)
    server, clients = algorithm.init(jax.random.key(0), {"params": to_params(theta), "batch_stats": {}}, 4)
    round_fn = build_round(algorithm, split, 3, seed=5)
    x, h, g = theta, np.zeros_like(theta), [np.zeros_like(theta)] * 4
    for r in range(2):
        server, clients, out = round_fn(server, clients, r)
        ids = [int(i) for i in out.client_ids]
        trained = []
        for i in ids:  # L_i(w) - <g_i, w> + alpha/2 |w - x|^2: gradient + (-g_i) + alpha (w - x)
            w = hand_local_sgd(x, xs[i], ys[i], SCAFFOLD_STEPS[i], lr, correction=-g[i], mu=alpha)
            g = [gi - alpha * (w - x) if j == i else gi for j, gi in enumerate(g)]
            trained.append(w)
        h = h - alpha / 4 * sum(w - x for w in trained)
        x = np.mean(trained, axis=0) - h / alpha
        np.testing.assert_allclose(to_vector(server["variables"]["params"]), x, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(to_vector(server["h"]), h, rtol=2e-5, atol=2e-6)
        for i in range(4):
            np.testing.assert_allclose(to_vector(jax.tree_util.tree_map(lambda a: a[i], clients["gradient"])),
                                       g[i], rtol=2e-5, atol=2e-6)
    assert any(np.any(gi != 0) for gi in g) and len(set(ids)) == 3
