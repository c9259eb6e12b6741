"""FedSpa (our reading) against independent truths: prune-and-grow and the cosine schedule by hand, a constant
density and exact swap counts over real rounds, the server's memory of each mask, the per-entry mean over the
clients holding an entry, and the messages' bytes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fedspa import prune_and_grow, swap_fraction
from fedjax_sparse.cli import main
from fedjax_sparse.core.algorithm import BuildContext
from fedjax_sparse.core.local_training import LocalSGD
from fedjax_sparse.core.messages import KnownMaskArray, SparseArray, message_bytes
from fedjax_sparse.core.round import build_round, round_info
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map
is_entries = lambda x: isinstance(x, (SparseArray, KnownMaskArray))  # noqa: E731


def test_prune_and_grow_by_hand():
    """Active {0, 1, 3, 4, 6} (5), fraction 0.5: floor(2.5) = 2 swaps. Dropped: the two smallest |w| among
    the active, entries 3 (0.1) and 0 (-0.2); grown: the two largest |g| among the entries inactive before,
    5 (-0.9) and 2 (0.7; 7's 0.7 ties it, the lower index wins)."""
    mask = jnp.array([1, 1, 0, 1, 1, 0, 1, 0], bool)
    w = jnp.array([-0.2, 0.5, 9.0, 0.1, -0.8, 9.0, 0.6, 9.0])
    g = jnp.array([5.0, 5.0, 0.7, 5.0, 5.0, -0.9, 5.0, 0.7])
    new, swapped = prune_and_grow(mask, w, g, jnp.float32(0.5))
    np.testing.assert_array_equal(new, [0, 1, 1, 0, 1, 1, 1, 0])
    assert int(swapped) == 2 and int(new.sum()) == int(mask.sum())
    capped, swapped = prune_and_grow(jnp.array([1, 1, 1, 0], bool), jnp.array([0.1, 0.2, 0.3, 0.0]),
                                     jnp.array([0.0, 0.0, 0.0, 1.0]), jnp.float32(1.0))
    assert int(swapped) == 1 and np.asarray(capped).tolist() == [False, True, True, True]  # one inactive entry


def test_swap_rate_is_cosine_annealed_to_zero():
    values = [float(swap_fraction(0.5, 100, t)) for t in (0, 50, 100, 200)]
    np.testing.assert_allclose(values, [0.5, 0.25, 0.0, 0.0], atol=1e-7)


@pytest.fixture(scope="module")
def setting():
    from conftest import synthetic_split
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([12, 20, 16, 10])
    ctx = BuildContext(local=LocalSGD(model, 0.1, 1, 8, 0.9, 1e-3), num_clients=4, clients_per_round=2,
                       train=split, num_classes=10, seed=0)
    algorithm = make_algorithm("fedspa", ctx, make_options("fedspa", {"swap_anneal_rounds": 4}))
    return model, split, algorithm, model.init(jax.random.key(0))


def test_rounds_keep_the_density_swap_what_they_say_and_remember_the_masks(setting):
    """Three rounds: each client's mask keeps exactly round(0.5 x n) entries of every kernel, its
    `swapped` figure is half the entries in which its old and new masks differ, the server's memory holds
    the mask of its upload, and its personal model is exactly zero outside the mask."""
    model, split, algorithm, variables = setting
    server, clients = algorithm.init(jax.random.key(1), variables, 4)
    for layer in model.structure.layers:
        masks = np.asarray(server["memory"][layer.name])
        assert (masks.reshape(4, -1).sum(1) == round(0.5 * layer.num_weights)).all()
        assert len({m.tobytes() for m in masks}) == 4  # every client its own random mask
    round_fn = build_round(algorithm, split, 2, seed=0)
    total_swaps = 0
    for r in range(3):
        before = tree_map(np.asarray, server["memory"])
        server, clients, out = round_fn(server, clients, r)
        for k, client in enumerate(np.asarray(out.client_ids)):
            changed = 0
            for layer in model.structure.layers:
                new = np.asarray(server["memory"][layer.name][client])
                assert new.sum() == round(0.5 * layer.num_weights)
                changed += int((new != before[layer.name][client]).sum())
                kernel = np.asarray(clients["params"][layer.name]["kernel"][client])
                assert not kernel[~new].any()  # inside, a grown entry starts at 0 and a dead input keeps it there
            assert changed == 2 * int(out.metrics["swapped"][k])
            total_swaps += changed
        np.testing.assert_allclose(np.asarray(out.metrics["weight_density"]), 0.5, rtol=1e-6)
    assert total_swaps > 0


def test_each_entry_is_the_mean_over_the_clients_holding_it_and_the_bytes_by_count(setting):
    model, split, algorithm, variables = setting
    server, clients = algorithm.init(jax.random.key(1), variables, 4)
    info = round_info(0, 0, jnp.array([1, 3]))
    update = jax.jit(algorithm.client_update)
    downs = [algorithm.broadcast(server, c, info) for c in (1, 3)]
    ups = [update(d, tree_map(lambda a: a[c], clients), split.client(c), jax.random.key(c), info)[0]
           for d, c in zip(downs, (1, 3))]
    for c, down, up in zip((1, 3), downs, ups):
        memory = {layer.name: np.asarray(server["memory"][layer.name][c]) for layer in model.structure.layers}
        dense_leaves = sum(np.asarray(v).size for k, v in jax.tree_util.tree_leaves_with_path(variables)
                           if k[-1].key == "bias")
        assert int(message_bytes(down)) == 4 * (sum(int(m.sum()) for m in memory.values()) + dense_leaves)
        expected_up = 4 * dense_leaves
        for layer in model.structure.layers:
            kernel = up["params"][layer.name]["kernel"]
            assert isinstance(kernel, SparseArray)
            nnz, size = int(np.asarray(kernel.mask).sum()), kernel.mask.size
            index = min(nnz * (2 if size <= 65536 else 4), (size + 7) // 8)
            expected_up += min(4 * nnz + index, 4 * size)
        assert int(message_bytes(up)) == expected_up
    stacked = tree_map(lambda a, b: type(a)(jnp.stack([a.values, b.values]), jnp.stack([a.mask, b.mask])),
                       ups[0], ups[1], is_leaf=is_entries)
    new = algorithm.server_update(server, stacked, jnp.array([20.0, 10.0]), info)
    a, b = (np.asarray(up["params"]["fc2"]["kernel"].values) for up in ups)
    ma, mb = (np.asarray(up["params"]["fc2"]["kernel"].mask) for up in ups)
    old = np.asarray(server["variables"]["params"]["fc2"]["kernel"])
    expected = np.where(ma & mb, (20 * a + 10 * b) / 30, np.where(ma, a, np.where(mb, b, old)))
    np.testing.assert_allclose(np.asarray(new["variables"]["params"]["fc2"]["kernel"]), expected, rtol=1e-5,
                               atol=1e-7)
    assert (ma & mb).any() and (~(ma | mb)).any()
    np.testing.assert_array_equal(np.asarray(new["memory"]["fc2"][3]), mb)


def test_cli_run_logs_the_swaps_and_density(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--algorithm", "fedspa", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "2",
                 "--local-epochs", "1", "--max-train-examples", "200", "--max-test-examples", "100",
                 "--swap-anneal-rounds", "10", "--no-progress", "--no-tensorboard", "--out", str(out)]) == 0
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["client_swapped"] > 0 and last["client_weight_density"] == pytest.approx(0.5)
    assert 0 <= last["personalized_accuracy"] <= 1 and last["test_accuracy"] is None
    assert last["train_flops"] < 0.51 * last["dense_train_flops"]
