"""FedP3 (OPU2) against independent truths: the code's id-based assignment and its generalisation, uploads of
exactly the assigned layers, the ordered-dropout downlink over the whole zoo, personal entries, and the
per-entry mean over uploaders."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_structure import zoo_model

from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fedp3 import assigned_layers
from fedjax_sparse.core.algorithm import BuildContext
from fedjax_sparse.core.layer_groups import model_layer_groups
from fedjax_sparse.core.local_training import LocalSGD
from fedjax_sparse.core.messages import KnownMaskArray, message_bytes
from fedjax_sparse.core.round import round_info
from fedjax_sparse.core.unit_masks import variable_masks
from fedjax_sparse.core.unit_selection import keep_top_units, prefix_scores
from fedjax_sparse.models import MODEL_NAMES, get_model

tree_map = jax.tree_util.tree_map
is_known = lambda x: isinstance(x, KnownMaskArray)  # noqa: E731


def build(model, num_clients, split=None, **options):
    ctx = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=num_clients, clients_per_round=2, train=split,
                       num_classes=model.num_classes, seed=0)
    return make_algorithm("fedp3", ctx, make_options("fedp3", options))


def test_assignment_is_the_codes_for_100_clients_and_generalises():
    """100 clients, 4 shared layers: floor(id / 25) and the next (the official code); 10 clients and 6
    shared layers: consecutive blocks, each layer held by 2N / L' clients."""
    code = np.asarray(jax.vmap(lambda c: assigned_layers(c, 100, 4))(jnp.arange(100)))
    for client in range(100):
        d1 = client // 25
        assert set(np.flatnonzero(code[client])) == {d1, (d1 + 1) % 4}
    six = np.asarray(jax.vmap(lambda c: assigned_layers(c, 12, 6))(jnp.arange(12)))
    assert (six.sum(axis=1) == 2).all()
    np.testing.assert_array_equal(six.sum(axis=0), [4] * 6)
    np.testing.assert_array_equal(np.flatnonzero(six[11]), [0, 5])
    one = np.asarray(assigned_layers(jnp.int32(3), 5, 1))
    np.testing.assert_array_equal(one, [True])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_downlink_is_the_assigned_layers_whole_and_the_others_ordered_dropout(name):
    """On every model of the zoo: a client receives its two shared layers' every entry (kernel, bias,
    normalization and statistics), the ordered-dropout sub-model of the other shared layers, nothing
    of the classifier, and pays 4 bytes a value."""
    model = zoo_model(name)
    # the messages' entries depend on the shapes only: zeros instead of a (slow) initialization
    variables = tree_map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(model.init, jax.random.key(0)))
    algorithm = build(model, 8, downlink_keep=0.5)
    server, _ = algorithm.init(jax.random.key(1), variables, 8)
    groups = model_layer_groups(model)
    od = variable_masks(model.structure, variables, keep_top_units(model.structure, prefix_scores(model.structure), 0.5))
    shared = len(model.structure.layers) - 1
    index = jax.tree_util.tree_leaves(groups.index)
    for client in (0, 7):
        down = jax.jit(algorithm.broadcast, static_argnums=1)(server, client, round_info(0, 0, jnp.array([0, 7])))
        assigned = set(np.flatnonzero(np.asarray(assigned_layers(jnp.int32(client), 8, shared))))
        masks = jax.tree_util.tree_leaves(tree_map(lambda leaf: np.asarray(leaf.mask), down["variables"],
                                                   is_leaf=is_known))
        total = 0
        for layer, mask, pruned in zip(index, masks, jax.tree_util.tree_leaves(od)):
            expected = (np.ones_like(mask) if layer in assigned else
                        np.zeros_like(mask) if layer == shared else np.asarray(pruned))
            np.testing.assert_array_equal(mask, expected, err_msg=f"{name} client {client} layer {layer}")
            total += int(expected.sum())
        assert int(message_bytes(down)) == 4 * total


@pytest.fixture(scope="module")
def cnn():
    return get_model("cnn4", (8, 8, 1), 10)


@pytest.fixture(scope="module")
def cnn_clients(cnn):
    """Four cnn4 clients (10, 20, 10, 30 examples), FedP3 built for them, and its jitted client update."""
    from conftest import synthetic_split
    split = synthetic_split([10, 20, 10, 30])
    algorithm = build(cnn, 4, split, downlink_keep=0.5)
    server, clients = algorithm.init(jax.random.key(1), cnn.init(jax.random.key(0)), 4)
    return split, algorithm, server, clients, jax.jit(algorithm.client_update)


def test_a_client_uploads_exactly_its_two_layers_and_keeps_the_rest_personal(cnn, cnn_clients):
    split, algorithm, server, clients, update = cnn_clients
    own = tree_map(lambda v: v + 0.5, tree_map(lambda a: a[2], clients))  # a client model unlike the global one
    info = round_info(0, 0, jnp.array([1, 2]))
    down = algorithm.broadcast(server, 2, info)
    up, state, metrics = update(down, own, split.client(2), jax.random.key(2), info)
    groups = model_layer_groups(cnn)
    assigned = set(np.flatnonzero(np.asarray(assigned_layers(jnp.int32(2), 4, 4))))  # cnn4: 4 shared layers
    assert assigned == {2, 3}
    for layer, leaf in zip(jax.tree_util.tree_leaves(groups.index), jax.tree_util.tree_leaves(up, is_leaf=is_known)):
        assert np.asarray(leaf.mask).all() == (layer in assigned) and np.asarray(leaf.mask).any() == (layer in assigned)
    uploaded = sum(np.asarray(leaf.mask).sum() for leaf in jax.tree_util.tree_leaves(up, is_leaf=is_known))
    assert int(message_bytes(up)) == 4 * uploaded
    # what was not sent down started from the client's own values: the classifier is its own, trained
    received = tree_map(lambda d, o: jnp.where(d.mask, d.values, o), down["variables"], own, is_leaf=is_known)
    classifier = cnn.structure.layers[-1].kernel
    before = np.asarray(received["params"][classifier[0]][classifier[1]])
    np.testing.assert_array_equal(before, np.asarray(own["params"][classifier[0]][classifier[1]]))
    assert not np.array_equal(np.asarray(state["params"][classifier[0]][classifier[1]]), before)
    kernel_total = cnn.structure.num_prunable_weights
    sent_kernels = sum(int(np.asarray(up["params"][l.kernel[0]][l.kernel[1]].mask).sum())
                       for l in cnn.structure.layers)
    assert float(metrics["upload_weight_fraction"]) == pytest.approx(sent_kernels / kernel_total)


def test_each_layer_is_the_data_weighted_mean_of_its_uploaders(cnn, cnn_clients):
    """Clients 0 (layers 0, 1) and 3 (layers 3, 0) upload: layer 0 is their weighted mean, layers 1 and
    3 one client's, and layer 2, which no sampled client holds, keeps its global value."""
    split, algorithm, server, clients, update = cnn_clients
    ids = jnp.array([0, 3])
    info = round_info(0, 0, ids)
    ups = [update(algorithm.broadcast(server, c, info), tree_map(lambda a: a[c], clients), split.client(c),
                  jax.random.key(c), info)[0] for c in (0, 3)]
    stacked = tree_map(lambda *leaves: KnownMaskArray(jnp.stack([l.values for l in leaves]),
                                                      jnp.stack([l.mask for l in leaves])), *ups, is_leaf=is_known)
    new = algorithm.server_update(server, stacked, jnp.array([10.0, 30.0]), info)["variables"]["params"]
    kernel = lambda tree, layer: np.asarray(tree[cnn.structure.layers[layer].kernel[0]]["kernel"])  # noqa: E731
    first, last = [tree_map(lambda l: l.values, up, is_leaf=is_known)["params"] for up in ups]
    np.testing.assert_allclose(kernel(new, 0), (10 * kernel(first, 0) + 30 * kernel(last, 0)) / 40, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(kernel(new, 1), kernel(first, 1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(kernel(new, 3), kernel(last, 3), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(kernel(new, 2), kernel(server["variables"]["params"], 2))
