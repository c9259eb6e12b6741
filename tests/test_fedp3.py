"""FedP3 (OPU2) against independent truths: the code's id-based assignment and its generalisation, the
code's client model after the download (the server's values, pruned entries zero) and its magnitude
downlink with its index priced, over the whole zoo, SpaFL's ordered-dropout reading, the classifier
uploaded and averaged as the code does, local pruning, the per-entry mean over uploaders, and the
SpaFL-convention Comm shares."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_structure import zoo_model

from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fedp3 import assigned_layers
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.structure.flops import layer_forward_flops
from fedjax_sparse.core.structure.layer_groups import model_layer_groups
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import KnownMaskArray, SparseArray, message_bytes
from fedjax_sparse.core.round.step import round_info
from fedjax_sparse.core.structure.unit_masks import variable_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores
from fedjax_sparse.models import MODEL_NAMES, get_model
from fedjax_sparse.models.structure import get_path, set_path

tree_map = jax.tree_util.tree_map
is_sent = lambda x: isinstance(x, (SparseArray, KnownMaskArray))  # noqa: E731
SPAFL_READING = {"fedp3_downlink": "ordered_dropout", "downlink_keep": 0.5, "fedp3_client_model": "own",
                 "fedp3_upload_classifier": False}


@dataclasses.dataclass(frozen=True)
class Untrained(LocalSGD):
    """Local training that changes nothing, so a client's trained model is the model it started from."""

    def train(self, variables, data, key, **kwargs):
        return variables, {"loss": jnp.zeros(()), "num_steps": jnp.zeros((), jnp.int32)}


def build(model, num_clients, split=None, local=LocalSGD, **options):
    ctx = BuildContext(local=local(model, 0.1, 1, 8), num_clients=num_clients, clients_per_round=2, train=split,
                       num_classes=model.num_classes, seed=0)
    return make_algorithm("fedp3", ctx, make_options("fedp3", options))


def leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=is_sent)


def index_bytes(n):
    return 1 if n <= 256 else 2 if n <= 65536 else 4


def sparse_bytes(mask):
    """A leaf's price by hand: its values, plus the cheaper of a bitmask and an index list unless whole."""
    n, k = mask.size, int(mask.sum())
    return 4 * n if k == n else min(4 * k + min(k * index_bytes(n), -(-n // 8)), 4 * n)


def test_assignment_is_the_codes_for_100_clients_and_generalises():
    """100 clients, 4 shared layers: floor(id / 25) and the next (the official code); 10 clients and 6
    shared layers: consecutive blocks, each layer held by 2N / L' clients."""
    code = np.asarray(jax.jit(jax.vmap(lambda c: assigned_layers(c, 100, 4)))(jnp.arange(100)))
    for client in range(100):
        d1 = client // 25
        assert set(np.flatnonzero(code[client])) == {d1, (d1 + 1) % 4}
    six = np.asarray(jax.jit(jax.vmap(lambda c: assigned_layers(c, 12, 6)))(jnp.arange(12)))
    assert (six.sum(axis=1) == 2).all()
    np.testing.assert_array_equal(six.sum(axis=0), [4] * 6)
    np.testing.assert_array_equal(np.flatnonzero(six[11]), [0, 5])
    one = np.asarray(assigned_layers(jnp.int32(3), 5, 1))
    np.testing.assert_array_equal(one, [True])


@pytest.mark.parametrize("downlink", ["magnitude", "ordered_dropout"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_downlink_the_clients_model_and_the_upload_over_the_zoo(name, downlink):
    """On every model of the zoo, clients 0 and 7 of 8: the downlink holds the two assigned shared layers
    whole (kernel, bias, normalization and statistics), the other shared layers pruned, nothing of the
    classifier. By magnitude (the code's default): each of their kernels at its ceil(0.9 n) entries of
    largest |w|, their other leaves whole, a pruned kernel paying its index; by ordered dropout (SpaFL):
    the first half of the units, values only. The client's model is then the server's shared layers with
    the entries not sent zero, and its own classifier; it uploads its two layers and its classifier whole."""
    model = zoo_model(name)
    structure = model.structure
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    rng = np.random.default_rng(1)
    variables = tree_map(lambda s: rng.standard_normal(s.shape, s.dtype), shapes)  # no ties
    own = tree_map(lambda v: v + 3.0, variables)
    keep = 0.9 if downlink == "magnitude" else 0.5
    algorithm = build(model, 8, local=Untrained, fedp3_downlink=downlink, downlink_keep=keep)
    is_kernel = tree_map(lambda _: False, shapes)
    for layer in structure.layers:
        is_kernel = {**is_kernel, "params": set_path(is_kernel["params"], layer.kernel, True)}
    index = jax.tree_util.tree_leaves(model_layer_groups(model).index)
    classifier = len(structure.layers) - 1
    data = types.SimpleNamespace(count=jnp.int32(3))  # what client_update reads of the data: the count

    clients = jnp.array([0, 7])

    @jax.jit  # the whole exchange one program: eagerly each operation compiles on its own, per leaf shape
    def exchange(variables, own):
        server, _ = algorithm.init(jax.random.key(1), variables, 8)

        def one(client):  # as the round runs them: the server's downlink pruning is computed once
            down = algorithm.broadcast(server, client, round_info(0, 0, clients))
            up, state, _ = algorithm.client_update(down, own, data, jax.random.key(2), round_info(0, 0, clients))
            return (down, up, state, message_bytes(down), message_bytes(up),
                    assigned_layers(client, 8, classifier))

        od = variable_masks(structure, variables, keep_top_units(structure, prefix_scores(structure), 0.5))
        return od, jax.vmap(one)(clients)

    od, exchanged = jax.device_get(exchange(variables, own))
    for i, client in enumerate((0, 7)):
        down, up, state, down_price, up_price, assigned = tree_map(lambda a: a[i], exchanged)
        assigned = set(np.flatnonzero(np.asarray(assigned)))
        down_bytes = up_bytes = 0
        for layer, kernel, value, mine, sent, pruned, start, uploaded in zip(
                index, jax.tree_util.tree_leaves(is_kernel), leaves(variables), leaves(own),
                leaves(down["variables"]), leaves(od), leaves(state), leaves(up)):
            value, where = np.asarray(value), f"{name} client {client} layer {layer}"
            if layer in assigned or (not kernel and layer != classifier and downlink == "magnitude"):
                expected = np.ones(value.shape, bool)
            elif layer == classifier:
                expected = np.zeros(value.shape, bool)
            elif downlink == "ordered_dropout":
                expected = np.asarray(pruned)
            else:  # the kernel's ceil(0.9 n) entries of largest magnitude, ties to the lower index
                size = np.abs(value).reshape(-1)
                kept = (9 * size.size + 9) // 10
                least = np.partition(size, size.size - kept)[size.size - kept]
                expected = size > least
                expected[np.flatnonzero(size == least)[:kept - expected.sum()]] = True
                expected = expected.reshape(value.shape)
            np.testing.assert_array_equal(np.asarray(sent.mask), expected, err_msg=where)
            down_bytes += sparse_bytes(expected) if downlink == "magnitude" else 4 * int(expected.sum())
            np.testing.assert_array_equal(np.asarray(start), np.asarray(mine) if layer == classifier else
                                          np.where(expected, value, 0.0), err_msg=where)
            whole = layer in assigned or layer == classifier
            np.testing.assert_array_equal(np.asarray(uploaded.mask), np.full(value.shape, whole), err_msg=where)
            up_bytes += 4 * value.size * whole
        assert int(down_price) == down_bytes
        assert int(up_price) == up_bytes


@pytest.fixture(scope="module")
def cnn():
    return get_model("cnn4", (8, 8, 1), 10)


def ordered_by_index(variables):
    """Each leaf's entries +-(i + 1) / n by flat index i: their magnitude order is their index order."""
    def leaf(x):
        i = np.arange(x.size)
        return jnp.asarray((np.where(i % 2, -1.0, 1.0) * (i + 1) / x.size).reshape(x.shape), x.dtype)
    return tree_map(leaf, variables)


def test_the_clients_model_after_the_download_is_the_servers_with_pruned_entries_zero(cnn):
    """The code's `synchronize_with_server` by hand on cnn4 (4 shared layers), client 2 of 4 (layers 2 and 3
    assigned): conv1 and conv2 arrive pruned by magnitude to ceil(0.9 n) entries (here the last ones: |w|
    grows with the index), their biases and normalization whole; the client's model is the server's with
    the pruned entries zero, and its own classifier. The message pays the two pruned kernels' index."""
    server_values = ordered_by_index(jax.eval_shape(cnn.init, jax.random.key(0)))
    own = tree_map(lambda v: jnp.full_like(v, 7.0), server_values)
    for client_model in ("server", "own"):
        algorithm = build(cnn, 4, local=Untrained, fedp3_client_model=client_model)

        @jax.jit  # one program (eagerly each operation compiles on its own, per leaf shape)
        def download(server_values, own):
            server, _ = algorithm.init(jax.random.key(1), server_values, 4)
            info = round_info(0, 0, jnp.array([1, 2]))
            down = algorithm.broadcast(server, 2, info)
            _, start, _ = algorithm.client_update(down, own, types.SimpleNamespace(count=jnp.int32(3)),
                                                 jax.random.key(2), info)
            return start, message_bytes(down)

        start, down_price = jax.device_get(download(server_values, own))
        for name, size in (("conv1", 3 * 3 * 1 * 64), ("conv2", 3 * 3 * 64 * 128)):
            pruned = size - (9 * size + 9) // 10  # 57 and 7372: the entries of least magnitude
            kernel = np.asarray(start["params"][name]["kernel"]).reshape(-1)
            np.testing.assert_array_equal(kernel[pruned:], np.asarray(server_values["params"][name]["kernel"])
                                          .reshape(-1)[pruned:])
            np.testing.assert_array_equal(kernel[:pruned], 0.0 if client_model == "server" else 7.0)
        for path in (("params", "conv1", "bias"), ("params", "bn2", "scale"), ("batch_stats", "bn1", "var"),
                     ("params", "conv3", "kernel"), ("params", "conv4", "bias"), ("batch_stats", "bn4", "mean")):
            np.testing.assert_array_equal(np.asarray(get_path(start, path)), np.asarray(get_path(server_values, path)))
        np.testing.assert_array_equal(np.asarray(start["params"]["fc"]["kernel"]), 7.0)
        np.testing.assert_array_equal(np.asarray(start["params"]["fc"]["bias"]), 7.0)
    # values, plus the cheaper of a bitmask (ceil(n / 8) bytes) and an index list, for the two pruned kernels
    conv1 = 4 * 519 + min(519 * 2, 72)  # 576 entries, 519 kept
    conv2 = 4 * 66356 + min(66356 * 4, 9216)  # 73728 entries (> 65536: 4-byte indices), 66356 kept
    whole = (64 + 64 * 4) + (128 + 128 * 4) + (3 * 3 * 128 * 256 + 256 * 5) \
        + (3 * 3 * 256 * 512 + 512 * 5)  # conv1's and conv2's bias and norm (scale, bias, mean, var); conv3, conv4
    assert int(down_price) == conv1 + conv2 + 4 * whole


def test_local_pruning_keeps_each_kernels_largest_entries_through_training(cnn):
    """fedp3_local_keep = 0.5 on the hand-built case: after the download every kernel of the client's model
    (classifier included) keeps its ceil(n / 2) entries of largest magnitude, the last half by index, the
    others zero, and they stay zero through training while the kept ones train; the upload carries the
    assigned layers and the classifier at those entries with their index, and the FLOPs are half the
    dense model's."""
    from conftest import synthetic_split
    split = synthetic_split([10, 20, 10, 30])
    server_values = ordered_by_index(jax.eval_shape(cnn.init, jax.random.key(0)))
    algorithm = build(cnn, 4, split, fedp3_local_keep=0.5)

    @jax.jit  # one program (eagerly each operation compiles on its own, per leaf shape)
    def exchange(server_values, data):
        server, _ = algorithm.init(jax.random.key(1), server_values, 4)
        info = round_info(0, 0, jnp.array([1, 2]))
        up, trained, metrics = algorithm.client_update(algorithm.broadcast(server, 2, info), server_values, data,
                                                       jax.random.key(2), info)
        return up, trained, metrics, message_bytes(up)

    up, trained, metrics, up_price = jax.device_get(exchange(server_values, split.client(2)))
    layers = {l.name: l for l in cnn.structure.layers}
    sent_bytes = 0
    for name, layer in layers.items():
        kernel = np.asarray(get_path(trained["params"], layer.kernel)).reshape(-1)
        before = np.asarray(get_path(server_values["params"], layer.kernel)).reshape(-1)
        half = kernel.size // 2
        np.testing.assert_array_equal(kernel[:half], 0.0, err_msg=name)
        assert (kernel[half:] != before[half:]).any(), name
        mask = np.asarray(get_path(up["params"], layer.kernel).mask).reshape(-1)
        uploaded = name in ("conv3", "conv4", "fc")  # client 2's layers 2, 3 and the classifier
        np.testing.assert_array_equal(mask, np.arange(kernel.size) >= half if uploaded else False, err_msg=name)
        if uploaded:  # the kept half's values and the cheaper index
            sent_bytes += sparse_bytes(np.arange(kernel.size) >= half)
    assert all(isinstance(leaf, SparseArray) for leaf in leaves(up))
    others = sum(4 * np.asarray(leaf.values).size for leaf in leaves(up)
                 if np.asarray(leaf.mask).all())  # biases, normalization and statistics of the uploaded layers
    assert others == 4 * (256 * 5 + 512 * 5 + 10)
    assert int(up_price) == sent_bytes + others
    dense = sum(layer_forward_flops(cnn.structure).values())
    assert float(metrics["train_flops"]) == pytest.approx(3 * 10 * 0.5 * dense, rel=1e-6)  # 10 examples, 1 epoch


@pytest.fixture(scope="module")
def cnn_clients(cnn):
    """Four cnn4 clients (10, 20, 10, 30 examples) and FedP3 built for them with default options."""
    from conftest import synthetic_split
    from conftest import initialized, synthetic_split
    split = synthetic_split([10, 20, 10, 30])
    algorithm = build(cnn, 4, split)
    _, variables = initialized("cnn4", (8, 8, 1), 10)
    server, clients = jax.device_get(jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), variables, 4))
    return split, algorithm, server, clients


def uploads(algorithm, server, states, split, info):
    """[(download, upload, trained model, metrics, the upload's bytes)] of the clients `states` holds ({id: state}),
    on their data: one program for every client (eagerly each operation compiles on its own, per leaf shape)."""
    @jax.jit
    def exchange(server, client_id, state, data):
        down = algorithm.broadcast(server, client_id, info)
        up, trained, metrics = algorithm.client_update(down, state, data, jax.random.key(client_id), info)
        return down, up, trained, metrics, message_bytes(up)

    return [jax.device_get(exchange(server, c, state, split.client(c))) for c, state in states.items()]


def test_each_layer_and_the_classifier_are_the_data_weighted_mean_of_their_uploaders(cnn, cnn_clients):
    """Clients 0 (layers 0, 1) and 3 (layers 3, 0) upload, the classifier too (the code appends it to every
    client's layers and the server averages it): layer 0 and the classifier are their weighted mean,
    layers 1 and 3 one client's, and layer 2, which no sampled client holds, keeps its global value.
    Without the classifier upload (SpaFL's reading) it keeps its global value too."""
    split, algorithm, server, clients = cnn_clients
    ids = jnp.array([0, 3])
    info = round_info(0, 0, ids)
    exchanged = uploads(algorithm, server, {c: tree_map(lambda a: a[c], clients) for c in (0, 3)}, split, info)
    ups = [up for _, up, _, _, _ in exchanged]
    classifier = 512 * 10 + 10  # fc's kernel and bias
    for (_, up, _, _, price), layers in zip(exchanged, (("conv1", "conv2"), ("conv4", "conv1"))):
        assert all(isinstance(leaf, KnownMaskArray) for leaf in leaves(up))  # both sides know the layers
        entries = sum(np.asarray(leaf.values).size for name in layers for leaf in leaves(up["params"][name]))
        norms = sum(np.asarray(leaf.values).size for name in layers
                    for leaf in leaves({c: up[c].get(f"bn{name[-1]}", {}) for c in ("params", "batch_stats")}))
        assert int(price) == 4 * (entries + norms + classifier)
    stacked = tree_map(lambda *leaves: KnownMaskArray(np.stack([l.values for l in leaves]),
                                                      np.stack([l.mask for l in leaves])), *ups, is_leaf=is_sent)
    new = jax.jit(algorithm.server_update)(server, stacked, jnp.array([10.0, 30.0]), info)["variables"]["params"]
    kernel = lambda tree, layer: np.asarray(tree[cnn.structure.layers[layer].kernel[0]]["kernel"])  # noqa: E731
    first, last = [tree_map(lambda l: l.values, up, is_leaf=is_sent)["params"] for up in ups]
    for layer in (0, 4):
        np.testing.assert_allclose(kernel(new, layer), (10 * kernel(first, layer) + 30 * kernel(last, layer)) / 40,
                                   rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernel(new, 1), kernel(first, 1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(kernel(new, 3), kernel(last, 3), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(kernel(new, 2), kernel(server["variables"]["params"], 2))
    no_classifier = build(cnn, 4, local=Untrained, fedp3_upload_classifier=False)  # what is sent, not its values
    ((_, up, _, _, price),) = uploads(no_classifier, server, {0: tree_map(lambda a: a[0], clients)}, split, info)
    assert not any(np.asarray(leaf.mask).any() for leaf in leaves(up["params"]["fc"]))
    assert int(price) == int(exchanged[0][-1]) - 4 * classifier


def test_spafls_reading_sends_ordered_dropout_and_keeps_what_was_not_sent(cnn, cnn_clients):
    """SpaFL's Table 2 reading (ordered dropout at 0.5, the client's own values where nothing was sent,
    two layers up): a client uploads exactly its two layers, values only, and trains from its own
    classifier and its own values of the units not sent."""
    split, _, server, clients = cnn_clients
    algorithm = build(cnn, 4, split, **SPAFL_READING)
    own = tree_map(lambda v: v + 0.5, tree_map(lambda a: a[2], clients))  # a client model unlike the global one
    info = round_info(0, 0, jnp.array([1, 2]))
    ((down, up, state, metrics, price),) = uploads(algorithm, server, {2: own}, split, info)
    assert all(isinstance(leaf, KnownMaskArray) for leaf in leaves(down["variables"]))
    groups = model_layer_groups(cnn)
    for layer, leaf in zip(jax.tree_util.tree_leaves(groups.index), leaves(up)):
        assert np.asarray(leaf.mask).all() == (layer in (2, 3)) and np.asarray(leaf.mask).any() == (layer in (2, 3))
    uploaded = sum(np.asarray(leaf.mask).sum() for leaf in leaves(up))
    assert int(price) == 4 * uploaded
    received = tree_map(lambda d, o: np.where(d.mask, d.values, o), down["variables"], own, is_leaf=is_sent)
    units = np.asarray(down["variables"]["params"]["conv1"]["kernel"].mask)[0, 0, 0]
    np.testing.assert_array_equal(units, np.arange(64) < 32)  # the first half of conv1's units
    np.testing.assert_array_equal(np.asarray(received["params"]["conv1"]["kernel"])[..., 32:],
                                  np.asarray(own["params"]["conv1"]["kernel"])[..., 32:])
    before = np.asarray(received["params"]["fc"]["kernel"])
    np.testing.assert_array_equal(before, np.asarray(own["params"]["fc"]["kernel"]))
    assert not np.array_equal(np.asarray(state["params"]["fc"]["kernel"]), before)
    sent_kernels = sum(int(np.asarray(up["params"][l.kernel[0]][l.kernel[1]].mask).sum()) for l in cnn.structure.layers)
    assert float(metrics["upload_weight_fraction"]) == pytest.approx(sent_kernels / cnn.structure.num_prunable_weights)


def test_spafl_convention_shares_follow_the_options():
    """SpaFL's Comm convention for 4 clients and 4 shared layers of weights a..d and a classifier e (each
    shared layer assigned to 2 of the 4 clients): by default (the code) up (a+b+c+d)/2 + e and down
    (a+b+c+d)/2 whole + (a+b+c+d)/2 at 0.9; SpaFL's reading up (a+b+c+d)/2, down half at 0.5."""
    from experiments.spafl import _fedp3_fractions
    from fedjax_sparse.run import RunConfig
    weights = [100, 200, 300, 400, 50]
    d, shared = 1050, 1000
    code = RunConfig.create(algorithm="fedp3", num_clients=4)
    assert _fedp3_fractions(code, weights) == pytest.approx(((shared / 2 + 50) / d,
                                                            (shared / 2 + 0.9 * shared / 2) / d))
    spafl = RunConfig.create(algorithm="fedp3", num_clients=4, **SPAFL_READING)
    assert _fedp3_fractions(spafl, weights) == pytest.approx((shared / 2 / d, (shared / 2 + 0.5 * shared / 2) / d))
    pruned = RunConfig.create(algorithm="fedp3", num_clients=4, fedp3_local_keep=0.5)
    assert _fedp3_fractions(pruned, weights)[0] == pytest.approx(0.5 * (shared / 2 + 50) / d)
