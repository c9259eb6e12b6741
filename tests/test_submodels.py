"""HeteroFL, FedRolex, Federated Dropout and FedGSE against independent truths: FedAvg at capacity 1,
the papers' parameter counts, hand-computed windows and gradients, frozen entries, SPL's memory."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import initialized, synthetic_split
from fedjax_sparse.algorithms import fedavg, make_algorithm, make_options
from fedjax_sparse.algorithms.fedgse import (public_set, similar_batch, top_labels,
                                             unit_gradient_scores)
from fedjax_sparse.algorithms.submodels import SubmodelOptions, client_capacity
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.evaluation.evaluators import population_batch_stats
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import KnownMaskArray, message_bytes
from fedjax_sparse.core.round.step import build_round, round_info
from fedjax_sparse.core.structure.unit_selection import keep_top_units, rolling_scores
from fedjax_sparse.data.federated import federated_split, normalize
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map
RULES = ("heterofl", "fedrolex", "feddropout", "fedgse")


def assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol), a, b)


def context(model, split, *, lr=0.1, epochs=1, batch_size=8, momentum=0.0, weight_decay=0.0, k=2, s=2):
    local = LocalSGD(model, lr, epochs, batch_size, momentum, weight_decay)
    return BuildContext(local=local, num_clients=split.num_clients, clients_per_round=k, train=split,
                        num_classes=model.num_classes, seed=0, labels_per_client=s)


def build(name, ctx, **options):
    return make_algorithm(name, ctx, make_options(name, options))


def start(algorithm, variables, num_clients):
    """The server state `algorithm.init` makes of `variables`, compiled (eagerly each operation compiles on its
    own, per leaf shape)."""
    return jax.jit(lambda v: algorithm.init(jax.random.key(1), v, num_clients)[0])(variables)


def exchanges(algorithm):
    """(server, client, data, info, seed=2) -> (download, upload, their bytes): the broadcast and the client's
    update with key `seed`, one program for every client and round."""
    @jax.jit
    def run(server, client, data, info, key):
        down = algorithm.broadcast(server, client, info)
        up, _, _ = algorithm.client_update(down, {}, data, key, info)
        return down, up, message_bytes(down), message_bytes(up)

    return lambda server, client, data, info, seed=2: jax.device_get(run(server, jnp.int32(client), data, info,
                                                                         jax.random.key(seed)))


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


def mlp_variables():
    return initialized("mlp", (8, 8, 1), 10)[1]


def after_two_rounds(algorithm, split, variables):
    server, clients = algorithm.init(jax.random.key(1), variables, split.num_clients)
    round_fn = build_round(algorithm, split, 2, seed=3)
    for r in range(2):
        server, clients, _ = round_fn(server, clients, r)
    return algorithm.global_variables(server)["params"]


def capacity_one_setting():
    """The MLP, four clients (9, 17, 12, 30 examples), momentum 0.5, and its variables."""
    model, variables = initialized("mlp", (8, 8, 1), 10)
    split = synthetic_split([9, 17, 12, 30])
    return context(model, split, momentum=0.5), split, variables


@functools.cache
def fedavg_after_two_rounds():
    """FedAvg's model after two rounds of `capacity_one_setting`, once for every rule compared with it."""
    ctx, split, variables = capacity_one_setting()
    return after_two_rounds(fedavg(ctx.local), split, variables)


@pytest.mark.parametrize("name,extra", [("heterofl", {}), ("fedrolex", {}), ("feddropout", {}),
                                        ("fedgse", {"similar_labels": "csl"}),
                                        ("fedgse", {"similar_labels": "spl"})])
def test_every_rule_at_capacity_one_is_fedavg(name, extra):
    """All capacities 1: every unit kept, nothing frozen, the data-weighted mean over holders is
    FedAvg's mean: the same model after two rounds."""
    ctx, split, variables = capacity_one_setting()
    assert_trees_close(fedavg_after_two_rounds(),
                       after_two_rounds(build(name, ctx, capacities=(1.0,), **extra), split, variables))


def test_capacity_one_is_fedavg_with_batchnorm_statistics_too(make_split):
    """cnn4 (BatchNorm) without static BN: running statistics travel and average like FedAvg's."""
    model, variables = initialized("cnn4", (8, 8, 1), 10)
    # equal full batches: BatchNorm over a partial batch of 2 (a 1x1 map at conv4) would amplify
    # float reordering between any two programs to ~1e-4
    split = make_split([8, 8, 8])
    finals = []
    ctx = context(model, split, batch_size=8)
    for algorithm in (fedavg(ctx.local), build("heterofl", ctx, capacities=(1.0,), static_bn=False)):
        server, clients = algorithm.init(jax.random.key(1), variables, 3)
        server, clients, _ = build_round(algorithm, split, 2, seed=1)(server, clients, 0)
        finals.append(algorithm.global_variables(server))
    assert_trees_close(finals[0], finals[1])


@pytest.mark.parametrize("name,counts", [
    ("cnn4", (1_558_026, 391_946, 99_210, 25_418, 6_666)),
    ("preresnet18", (11_172_170, 2_796_714, 701_018, 176_178, 44_510)),
])
def test_submodel_messages_cost_the_papers_parameter_counts(name, counts):
    """A sub-model message pays its kept values only (float32), at beta = 1, 1/2, ..., 1/16:
    HeteroFL's and FedGSE's parameter counts on CIFAR-10 (32x32x3, 10 classes)."""
    model = get_model(name, (32, 32, 3), 10)
    split = federated_split(np.zeros((4, 32, 32, 3), np.uint8), np.arange(4) % 10, [np.arange(2), np.arange(2, 4)],
                            [0.5] * 3, [0.25] * 3)
    variables = tree_map(lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(model.init, jax.random.key(0)))
    info = round_info(0, 3, jnp.array([0, 1]))
    cases = [(rule, beta, count) for beta, count in zip((1.0, 0.5, 0.25, 0.125, 0.0625), counts)
             for rule in (("heterofl", "fedrolex") if beta == 0.5 else ("heterofl",))]
    algorithms = [build(rule, context(model, split), capacities=(beta,)) for rule, beta, _ in cases]

    @jax.jit  # every case one program (eagerly each operation compiles on its own, per leaf shape)
    def prices(variables):
        return [message_bytes(a.broadcast(a.init(jax.random.key(1), variables, 2)[0], 0, info)) for a in algorithms]

    for (rule, beta, count), price in zip(cases, prices(variables)):
        assert int(price) == 4 * count, (rule, beta)  # values are not priced: zeros will do


def test_a_dropped_entry_is_unchanged_by_training_with_momentum_and_weight_decay(make_split):
    """cnn4 at beta = 1/2 with momentum 0.9 and weight decay: every entry outside the sub-model
    (kernel entries of dropped output or input units, their biases, BN parameters and running
    statistics) leaves local training exactly as it came, and is not in the upload; kept ones move."""
    model, variables = initialized("cnn4", (8, 8, 1), 10)
    split = make_split([12, 12])
    ctx = context(model, split, lr=0.05, epochs=2, batch_size=6, momentum=0.9, weight_decay=5e-3)
    algorithm = build("feddropout", ctx, capacities=(0.5,), static_bn=False)
    _, up, _, price = exchanges(algorithm)(start(algorithm, variables, 2), 1, split.client(1),
                                           round_info(0, 0, jnp.array([0, 1])))
    is_known = lambda x: isinstance(x, KnownMaskArray)  # noqa: E731
    masks = tree_map(lambda a: np.asarray(a.mask), up["variables"], is_leaf=is_known)
    after = tree_map(lambda a: np.asarray(a.values), up["variables"], is_leaf=is_known)
    moved = 0
    for m, before, new in zip(jax.tree_util.tree_leaves(masks), jax.tree_util.tree_leaves(variables),
                              jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(new[~m], np.asarray(before)[~m])
        moved += int(np.sum(new[m] != np.asarray(before)[m]))
    assert moved > 0.9 * sum(int(m.sum()) for m in jax.tree_util.tree_leaves(masks["params"]))
    kernel_mask = masks["params"]["conv2"]["kernel"]
    assert 0 < kernel_mask.mean() < 0.3  # output and input units both halved: about a quarter kept
    assert int(price) == 4 * sum(int(m.sum()) for m in jax.tree_util.tree_leaves(masks))


def test_fedrolex_window_by_hand_across_a_wrap_around(mlp):
    """8 units, beta = 1/2 (4 kept): round r keeps {(j - r) mod 8 : j < 4}."""
    structure = get_model("mlp", (8, 8, 1), 10).structure
    from fedjax_sparse.models import Layer, ModelStructure
    layers = (Layer("a", "dense", ("a", "kernel"), None, None, 8, 2, ("input",)),
              Layer("out", "dense", ("out", "kernel"), None, None, 3, 8, ("a",)))
    structure = ModelStructure(layers)
    expected = {0: [0, 1, 2, 3], 2: [6, 7, 0, 1], 6: [2, 3, 4, 5], 9: [7, 0, 1, 2]}
    for r, units in expected.items():
        masks = keep_top_units(structure, rolling_scores(structure, jnp.asarray(r)), 0.5)
        assert sorted(np.flatnonzero(np.asarray(masks["a"]))) == sorted(units)
        np.testing.assert_array_equal(masks["out"], 1.0)  # the output layer keeps every class


def test_fedgse_scores_are_the_summed_output_gradients_by_hand(mlp):
    """The MLP written out in jnp: h1 = relu(x W1 + b1), h2 = relu(h1 W2 + b2), logits = h2 W3 + b3;
    the score of a unit is sum over examples of |dL/dh| (L = mean cross-entropy of the real examples)."""
    variables = mlp_variables()
    x = np.random.default_rng(1).standard_normal((5, 8, 8, 1), np.float32)
    y = jnp.array([1, 3, 3, 7, 0])
    mask = jnp.array([True, True, True, True, False])

    @jax.jit  # one program for both (eagerly each operation compiles on its own)
    def scores_and_by_hand(variables, x):
        p = variables["params"]
        flat = x.reshape(5, -1)

        def loss_from(h1=None, h2=None):
            h1 = jax.nn.relu(flat @ p["fc1"]["kernel"] + p["fc1"]["bias"]) if h1 is None else h1
            h2 = jax.nn.relu(h1 @ p["fc2"]["kernel"] + p["fc2"]["bias"]) if h2 is None else h2
            logits = h2 @ p["fc3"]["kernel"] + p["fc3"]["bias"]
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jnp.sum(jnp.where(mask, losses, 0.0)) / 4

        h1 = jax.nn.relu(flat @ p["fc1"]["kernel"] + p["fc1"]["bias"])
        h2 = jax.nn.relu(h1 @ p["fc2"]["kernel"] + p["fc2"]["bias"])
        expected = {"fc1": jnp.abs(jax.grad(lambda h: loss_from(h1=h))(h1)).sum(0),
                    "fc2": jnp.abs(jax.grad(lambda h: loss_from(h1, h2=h))(h2)).sum(0)}
        return unit_gradient_scores(mlp, variables, x, y, mask), expected

    scores, expected = scores_and_by_hand(variables, x)
    for name, value in expected.items():
        np.testing.assert_allclose(scores[name], value, rtol=1e-5, atol=1e-7)
    assert float(expected["fc1"].max()) > 0


def small_model(name):
    """(model, variables) on 8x8x3 images."""
    return initialized(name, (8, 8, 3), 10)


def test_group_tied_selection_keeps_residual_sums_consistent_on_preresnet18():
    """Layers summed into one residual stream keep the same units, under FedGSE's gradient scores."""
    model, variables = small_model("preresnet18")
    rng = np.random.default_rng(0)
    split = federated_split(rng.integers(0, 255, (40, 8, 8, 3), dtype=np.uint8), np.arange(40) % 10,
                            [np.arange(20), np.arange(20, 40)], [0.5] * 3, [0.25] * 3)
    algorithm = build("fedgse", context(model, split, s=10), capacities=(0.25,), public_fraction=0.5,
                      similar_examples=16)
    broadcast = jax.jit(lambda v: algorithm.broadcast(algorithm.init(jax.random.key(1), v, 2)[0], 0,  # one program
                                                      round_info(0, 0, jnp.array([0, 1]))))
    masks = jax.device_get(broadcast(variables)["unit_masks"].value)
    groups = {}
    for layer in model.structure.layers:
        if layer.unit_group:
            groups.setdefault(layer.unit_group, []).append(np.asarray(masks[layer.name]))
    assert set(groups) == {"stage1", "stage2", "stage3", "stage4"}
    for name, members in groups.items():
        assert len(members) >= 3
        for m in members[1:]:
            np.testing.assert_array_equal(m, members[0], err_msg=name)
        assert m.sum() == np.ceil(0.25 * len(m))
    # not a prefix: the gradient scores chose other units for some layer
    assert any(not np.array_equal(np.flatnonzero(m), np.arange(int(m.sum())))
               for m in (np.asarray(v) for v in masks.values()) if m.sum() < len(m))


def test_spl_recovers_the_labels_of_a_client_trained_on_two_classes():
    """A client holding only digits 3 and 7 trains a full-capacity sub-model; the server scores it
    on the public set and, asked for that client's s = 2 labels, answers {3, 7}. A client never
    seen gets random labels."""
    from fedjax_sparse.data import load_digits
    data = load_digits()
    model, variables = initialized("mlp", data.input_shape, 10)
    y = data.y_train
    own = np.flatnonzero((y == 3) | (y == 7))
    rest = np.setdiff1d(np.arange(len(y)), own)
    split = federated_split(data.x_train, y, [own, rest[: len(rest) // 2], rest[len(rest) // 2:]],
                            data.mean, data.std)
    ctx = context(model, split, lr=0.1, epochs=3, batch_size=16, k=1)
    algorithm = build("fedgse", ctx, capacities=(1.0,), similar_labels="spl", public_fraction=0.3)
    info = round_info(0, 0, jnp.array([0]))

    @jax.jit  # the round one program (eagerly each operation compiles on its own)
    def one_round(variables, data):
        server, _ = algorithm.init(jax.random.key(1), variables, 3)
        up, _, _ = algorithm.client_update(algorithm.broadcast(server, 0, info), {}, data, jax.random.key(2), info)
        return algorithm.server_update(server, tree_map(lambda a: a[None], up), jnp.array([float(len(own))]), info)

    memory = jax.device_get(one_round(variables, split.client(0))["memory"])
    assert bool(memory["seen"][0]) and not bool(memory["seen"][1])
    assert sorted(np.asarray(top_labels(memory["class_accuracy"][0], 2)).tolist()) == [3, 7]


def test_csl_uploads_the_clients_top_labels_and_pays_for_them(make_split, mlp):
    split = make_split([30, 30])
    algorithm = build("fedgse", context(mlp, split, s=3), capacities=(0.5,))
    _, up, down_bytes, up_bytes = exchanges(algorithm)(start(algorithm, mlp_variables(), 2), 1, split.client(1),
                                                       round_info(0, 0, jnp.array([0, 1])))
    labels = np.asarray(split.y)[30:]
    counts = np.bincount(labels, minlength=10)
    expected = sorted(np.argsort(-counts, kind="stable")[:3].tolist())
    assert sorted(np.asarray(up["feedback"]["labels"]).tolist()) == expected
    assert up["feedback"]["labels"].dtype == jnp.uint8
    assert int(up_bytes) == int(down_bytes) + 3  # same sub-model both ways, plus s bytes


def test_similar_batches_hold_only_the_clients_labels():
    rng = np.random.default_rng(0)
    y = np.arange(200) % 10
    split = federated_split(rng.integers(0, 255, (200, 4, 4, 1), dtype=np.uint8), y,
                            [np.arange(100), np.arange(100, 200)], [0.5], [0.25])
    public = public_set(split, 0.1, seed=0)
    assert public.y.shape == (20,)  # ceil(10 %) of each client's 100 examples
    x, labels, mask = similar_batch(public, jnp.array([2, 5]), 8, jax.random.key(0))
    assert x.shape == (8, 4, 4, 1)
    assert set(np.asarray(labels)[np.asarray(mask)].tolist()) <= {2, 5}
    assert int(mask.sum()) == int(np.isin(np.asarray(public.y), [2, 5]).sum())  # all 4 eligible, rest masked


def test_capacities_are_pure_functions_of_seed_round_and_client():
    dynamic = SubmodelOptions(capacities=(1.0, 0.5, 0.25))
    fixed = dataclasses.replace(dynamic, capacity_mode="fixed")
    a = [float(client_capacity(dynamic, 0, r, 5)) for r in range(12)]
    b = [float(client_capacity(fixed, 0, r, 5)) for r in range(12)]
    assert len(set(a)) > 1 and len(set(b)) == 1
    assert a == [float(client_capacity(dynamic, 0, r, 5)) for r in range(12)]
    only_full = dataclasses.replace(dynamic, capacities=(1.0, 0.0625), capacity_proportions=(1.0, 0.0))
    assert {float(client_capacity(only_full, 0, r, c)) for r in range(5) for c in range(5)} == {1.0}
    levels = [float(client_capacity(dynamic, 1, r, c)) for r in range(40) for c in range(10)]
    assert all(abs(levels.count(v) / 400 - 1 / 3) < 0.08 for v in (1.0, 0.5, 0.25))


def conv1_outputs(model, variables, split):
    @jax.jit  # one program (eagerly each operation compiles on its own)
    def outputs(variables, x):
        _, state = model.module.apply({"params": variables["params"], "batch_stats": variables["batch_stats"]},
                                      normalize(x, split.mean, split.std), train=False, capture_intermediates=True,
                                      mutable=["intermediates"])
        return state["intermediates"]["conv1"]["__call__"][0]

    return np.asarray(outputs(variables, split.x))


def population_statistics(model, variables, split, key, batch_size):
    """`population_batch_stats`, one program (eagerly each operation compiles on its own)."""
    return jax.jit(lambda v, k: population_batch_stats(model, v, split, k, batch_size))(variables, key)


def test_static_batchnorm_statistics_are_the_average_of_batch_statistics():
    """20 examples in batches of 8, 8 and 4 of the key's permutation: bn1's mean and variance are the
    size-weighted averages of the per-batch (biased) moments of conv1's outputs, computed here in NumPy."""
    model, variables = initialized("cnn4", (8, 8, 1), 10)
    rng = np.random.default_rng(0)
    split = federated_split(rng.integers(0, 255, (20, 8, 8, 1), dtype=np.uint8), np.arange(20) % 10,
                            [np.arange(20)], [0.5], [0.25])
    key = jax.random.key(5)
    stats = population_statistics(model, variables, split, key, batch_size=8)
    conv1 = conv1_outputs(model, variables, split)[np.asarray(jax.random.permutation(key, 20))]
    batches = [conv1[:8], conv1[8:16], conv1[16:]]
    sizes = np.array([8, 8, 4])
    means = np.array([b.mean(axis=(0, 1, 2)) for b in batches])
    variances = np.array([b.var(axis=(0, 1, 2)) for b in batches])
    np.testing.assert_allclose(stats["bn1"]["mean"], (sizes[:, None] * means).sum(0) / 20, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats["bn1"]["var"], (sizes[:, None] * variances).sum(0) / 20, rtol=1e-4, atol=1e-5)


def test_static_batchnorm_statistics_of_class_sorted_data_are_the_datas_not_one_class_at_a_time():
    """Two clients of 32 examples each, one class each, the classes' images far apart (dark and
    bright): batches taken in the split's order hold one class and would average within-class
    variances; shuffled, as HeteroFL's code draws them, bn1's variance is near the whole data's."""
    model, variables = initialized("cnn4", (8, 8, 1), 10)
    rng = np.random.default_rng(1)
    dark = rng.integers(0, 40, (32, 8, 8, 1))
    bright = rng.integers(215, 255, (32, 8, 8, 1))
    split = federated_split(np.concatenate([dark, bright]).astype(np.uint8), np.repeat([0, 1], 32),
                            [np.arange(32), np.arange(32, 64)], [0.5], [0.25])
    conv1 = conv1_outputs(model, variables, split)
    whole = conv1.var(axis=(0, 1, 2))
    within = (conv1[:32].var(axis=(0, 1, 2)) + conv1[32:].var(axis=(0, 1, 2))) / 2
    assert np.median(within / whole) < 0.3  # the classes differ: sorted batches would see a third at most
    stats = population_statistics(model, variables, split, jax.random.key(2), batch_size=16)
    ratio = np.asarray(stats["bn1"]["var"]) / whole
    assert 0.8 < np.median(ratio) < 1.05  # batches of 16 of 64 mixed examples: about 15/16 of the variance


def test_heterofl_aggregation_averages_class_rows_over_the_clients_holding_the_label(mlp):
    """Two full-capacity clients send constant models 1 and 3 (weights 10, 30): masked_mean gives
    (10 + 90) / 40 = 2.5 everywhere; HeteroFL's plain mean gives 2, except output rows of labels
    only client 0 holds (-> 1), and rows nobody holds keep the old value 0."""
    split = federated_split(np.zeros((4, 8, 8, 1), np.uint8), np.array([0, 1, 1, 2]),
                            [np.arange(2), np.arange(2, 4)], [0.5], [0.25])
    ctx = context(mlp, split)
    zeros = tree_map(np.zeros_like, mlp_variables())
    info = round_info(0, 0, jnp.array([0, 1]))
    results = {}
    for aggregation in ("masked_mean", "heterofl"):
        algorithm = build("heterofl", ctx, capacities=(1.0,), submodel_aggregation=aggregation)
        server = start(algorithm, zeros, 2)
        exchange = exchanges(algorithm)
        ups = []
        for cid, value in ((0, 1.0), (1, 3.0)):
            _, up, _, _ = exchange(server, cid, split.client(cid), info, seed=cid)
            up = {**up, "variables": tree_map(lambda a: KnownMaskArray(np.full_like(a.values, value), a.mask),
                                              up["variables"], is_leaf=lambda x: isinstance(x, KnownMaskArray))}
            ups.append(up)
        stacked = tree_map(lambda *a: np.stack(a), *ups)
        results[aggregation] = jax.jit(algorithm.server_update)(server, stacked, jnp.array([10.0, 30.0]),
                                                                info)["variables"]
    np.testing.assert_allclose(results["masked_mean"]["params"]["fc3"]["kernel"], 2.5)
    het = results["heterofl"]["params"]
    np.testing.assert_allclose(het["fc2"]["kernel"], 2.0)
    # labels: client 0 holds {0, 1}, client 1 holds {1, 2}
    np.testing.assert_allclose(het["fc3"]["bias"], [1.0, 2.0, 3.0] + [0.0] * 7)
    np.testing.assert_allclose(het["fc3"]["kernel"][:, 1], 2.0)


def fedrolex_combine(old, uploads, masks, labels_held, counts, order, output_leaves):
    """FedRolex's `combine` (resnet_server.py, --weighting avg) in numpy, key by key in the state's
    order, with its aliasing: K = the entry's update count for 1-D leaves and the output layer (the
    output layer only on the rows of the client's labels), 1 for other kernels; the counts read come
    from `tmp_counts`, which after the first key *is* the copy being raised (`self.tmp_counts =
    tmp_counts_cpy` inside the loop). Returns (the aggregate, the counts after the round)."""
    tmp_counts = {k: v.copy() for k, v in counts.items()}
    tmp_counts_cpy = {k: v.copy() for k, v in tmp_counts.items()}
    out = {}
    for key in order:
        value = old[key]
        total, weight = np.zeros_like(value), np.zeros_like(value)
        counted = value.ndim == 1 or key in output_leaves
        for k, (up, mask) in enumerate(zip(uploads, masks)):
            held = mask[key].astype(bool)
            if key in output_leaves:  # the output layer's last axis is the classes
                held = held & labels_held[k]
            k_weight = tmp_counts[key].copy() if counted else np.ones_like(value)
            total += np.where(held, k_weight * up[key], 0.0)
            weight += np.where(held, k_weight, 0.0)
            tmp_counts_cpy[key][held] += 1
        out[key] = np.where(weight > 0, total / np.where(weight > 0, weight, 1.0), value)
        tmp_counts = tmp_counts_cpy
    return out, tmp_counts_cpy


def test_fedrolex_counts_is_fedrolexs_code_weighting_and_heterofl_its_papers_plain_mean(mlp):
    """FedRolex's code weighs biases, normalization parameters and output rows by each entry's count of
    past updates, and from its second key on the counts it reads are the ones its loop is raising: the
    k-th holder of an entry weighs count + (k - 1). `fedrolex_counts` equals a replica of that loop over
    two rounds on three clients of different sub-models (its counts carried in the server state); on
    those leaves it differs from `heterofl`, the paper's plain mean over holders, which equals the
    replica's kernels (weighted 1). By hand: three holders of a bias entry counted 1 give
    (a + 2 b + 3 c) / 6."""
    split = federated_split(np.zeros((9, 8, 8, 1), np.uint8), np.array([0, 1, 1, 2, 3, 3, 1, 4, 4]),
                            [np.arange(3), np.arange(3, 6), np.arange(6, 9)], [0.5], [0.25])
    ctx = context(mlp, split, k=3)
    algorithm = build("fedrolex", ctx, capacities=(1.0, 0.5, 0.25), submodel_aggregation="fedrolex_counts")
    plain = build("fedrolex", ctx, capacities=(1.0, 0.5, 0.25), submodel_aggregation="heterofl")
    variables = mlp_variables()
    server = start(algorithm, variables, 3)
    exchange, combine, combine_plainly = exchanges(algorithm), jax.jit(algorithm.server_update), jax.jit(
        plain.server_update)
    old = {"/".join(p): np.asarray(a) for p, a in layer_paths({"params": variables["params"]})}
    order = ["params/fc1/kernel", "params/fc1/bias", "params/fc2/kernel", "params/fc2/bias", "params/fc3/kernel",
             "params/fc3/bias"]  # torch's state_dict order: the first key is the first layer's weight
    assert sorted(order) == sorted(old)
    counts = {k: np.ones_like(v, np.float64) for k, v in old.items()}
    rng = np.random.default_rng(0)
    for r in range(2):
        info = round_info(r, 3, jnp.array([0, 1, 2]))
        ups, values, masks, held = [], [], [], []
        for cid in (0, 1, 2):
            _, up, _, _ = exchange(server, cid, split.client(cid), info, seed=cid)
            noisy = tree_map(lambda a: KnownMaskArray(rng.standard_normal(a.values.shape).astype(np.float32),
                                                      a.mask), up["variables"],
                             is_leaf=lambda x: isinstance(x, KnownMaskArray))
            ups.append({**up, "variables": noisy})
            flat = {"/".join(p): a for p, a in layer_paths(noisy)}
            values.append({k: np.asarray(a.values, np.float64) for k, a in flat.items()})
            masks.append({k: np.asarray(a.mask) for k, a in flat.items()})
            held.append(np.asarray(up["labels_held"].value))
        assert len({m["params/fc1/bias"].sum() for m in masks}) > 1  # sub-models of different widths
        expected, counts = fedrolex_combine(old, values, masks, held, counts, order,
                                            {"params/fc3/kernel", "params/fc3/bias"})
        stacked = tree_map(lambda *a: np.stack(a), *ups)
        sizes = jnp.array([3.0, 5.0, 7.0])  # unused by either rule
        new = combine(server, stacked, sizes, info)
        mean = combine_plainly(server, stacked, sizes, info)["variables"]["params"]
        got = {"/".join(p): np.asarray(a) for p, a in layer_paths({"params": new["variables"]["params"]})}
        plain_got = {"/".join(p): np.asarray(a) for p, a in layer_paths({"params": mean})}
        for k in old:
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_array_equal(np.asarray(get_leaf(new["update_counts"], k)), counts[k])
        for k in ("params/fc1/kernel", "params/fc2/kernel"):  # weighted 1: the plain mean
            np.testing.assert_allclose(plain_got[k], expected[k], rtol=1e-5, atol=1e-6)
        triple = np.flatnonzero(sum(m["params/fc2/bias"] for m in masks) == 3)
        assert triple.size and not np.allclose(plain_got["params/fc2/bias"][triple], expected["params/fc2/bias"][triple])
        if r == 0:  # every count still 1 when read: the weights of the three holders are 1, 2 and 3
            a, b, c = (v["params/fc2/bias"][triple] for v in values)
            np.testing.assert_allclose(got["params/fc2/bias"][triple], (a + 2 * b + 3 * c) / 6, rtol=1e-5)
        server, old = new, got


def get_leaf(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def layer_paths(tree):
    is_known = lambda x: isinstance(x, KnownMaskArray)  # noqa: E731
    return [(tuple(e.key for e in path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_known)[0]]


def test_bad_capacities_and_fractions_are_one_line_errors(tmp_path, capsys):
    base = ["run", "--partition", "labels", "--labels-per-client", "2", "--rounds", "1", "--no-progress",
            "--out", str(tmp_path / "bad")]
    cases = [(["--algorithm", "heterofl", "--capacities", "0,0.5"], "--capacities must be in (0, 1], got 0.0,0.5"),
             (["--algorithm", "heterofl", "--capacities", "1.5"], "--capacities must be in (0, 1]"),
             (["--algorithm", "fedrolex", "--capacity-proportions", "1,2"], "one weight per capacity level (5)"),
             (["--algorithm", "fedgse", "--public-fraction", "0"], "--public-fraction must be in (0, 1]"),
             (["--algorithm", "fedgse", "--similar-examples", "0"], "--similar-examples must be >= 1"),
             (["--algorithm", "fedgse", "--significant-labels", "11"], "--significant-labels must be in [1, 10]"),
             (["--algorithm", "heterofl", "--capacities", ""], "--capacities needs at least one value (in (0, 1]"),
             (["--algorithm", "fedrolex", "--label-mask-fill", "exclude"], "--label-mask-fill is read only with "
                                                                         "--label-mask")]
    for args, fragment in cases:
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fragment in err, err


def test_cli_runs_fedgse_spl_and_writes_strict_json(tmp_path):
    out = tmp_path / "gse"
    assert main(["run", "--algorithm", "fedgse", "--similar-labels", "spl", "--partition", "labels",
                 "--labels-per-client", "2", "--num-clients", "10", "--clients-per-round", "3", "--rounds", "2",
                 "--local-epochs", "1", "--lr", "0.05", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_test_accuracy"] is not None
    config = json.loads((out / "config.json").read_text())
    assert config["similar_labels"] == "spl" and config["capacities"] == [1.0, 0.5, 0.25, 0.125, 0.0625]


def test_experiment_settings_validate_and_quick_means_digits(monkeypatch, tmp_path):
    import experiments.fedgse as module
    table2 = {"cifar10_high": (2, 65.82), "cifar10_low": (4, 74.66), "emnist_high": (2, 97.44)}
    for name, (labels, spl) in table2.items():
        setting = module.SETTINGS[name]
        assert setting.config.labels_per_client == labels and setting.config.num_clients == 100
        assert setting.arms[-1].paper == {"accuracy %": spl}
        assert (setting.config.lr, setting.config.batch_size, setting.config.local_epochs) == (0.001, 16, 2)
    for setting in module.SETTINGS.values():
        for quick in (False, True):
            for arm in setting.arms:
                setting.arm_config(arm, tmp_path, quick).validate()
    import experiments.common as common
    seen = []
    monkeypatch.setattr(common, "run_setting", lambda setting, *args, **kwargs: seen.append(setting.name))
    assert module.run(["--quick"]) == 0 and seen == ["digits"]


def test_experiment_module_runs_every_arm(monkeypatch, tmp_path):
    """`python -m experiments.fedgse --quick --seeds 3,4`, shrunk to 2 rounds of 3 of 10 clients, on recorded
    runs (the table code runs on real runs in tests/test_experiments.py): every arm, each seed in its own
    folder with its own config, the seeds averaged, and the aggregation and label mask each arm ran with."""
    import csv

    from conftest import record_runs
    import experiments.fedgse as module
    tiny = {"rounds": 2, "num_clients": 10, "clients_per_round": 3, "local_epochs": 1}
    monkeypatch.setitem(module.SETTINGS, "digits", dataclasses.replace(module.SETTINGS["digits"], quick=tiny))

    def figures(config):  # seed 3 ends at 0.6, seed 4 at 0.8; sub-models move half FedAvg's bytes
        up = 100 if config.algorithm == "fedavg" else 50
        records = [{"round": r, "test_accuracy": 0.2 * config.seed + r / 10 - 0.2, "cumulative_bytes": 2 * r * up}
                   for r in (1, 2)]
        return records, {"cumulative_bytes": 4 * up, "total_uplink_bytes": 2 * up, "rounds_done": 2}

    record_runs(monkeypatch, figures)
    assert module.run(["--quick", "--seeds", "3,4", "--out", str(tmp_path), "--no-progress"]) == 0
    with (tmp_path / "digits" / "results.csv").open() as f:
        rows = {r["algorithm"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["heterofl", "fedrolex", "feddropout", "fedgse_csl", "fedgse_spl", "fedavg_full"]
    # HeteroFL and FedRolex run their code's aggregation and label-masked loss, and the table says so
    assert [(rows[a]["aggregation"], rows[a]["label mask"]) for a in rows] == \
        [("heterofl", "zero fill")] * 2 + [("masked_mean", "off")] * 3 + [("fedavg", "off")]
    for name, row in rows.items():
        assert (row["seeds"], row["final_accuracy_per_seed"]) == ("2", "0.6000 / 0.8000"), name
        assert float(row["final_accuracy"]) == pytest.approx(0.7) and float(row["final_accuracy_std"]) == \
            pytest.approx(0.1)
        for seed in (3, 4):
            config = json.loads((tmp_path / "digits" / name / f"seed_{seed}" / "config.json").read_text())
            masked = config.get("label_mask", False)  # (an option of the sub-model methods only)
            assert config["seed"] == seed and masked is (name in ("heterofl", "fedrolex")), name
    assert float(rows["heterofl"]["total_gbit"]) == pytest.approx(200 * 8 / 1e9)


def test_a_half_width_client_counts_the_training_flops_of_its_sub_model(make_split, mlp):
    """HeteroFL at capacity 0.5 (SpaFL's Table 2 arm, whose `flops_counted` column is this figure): each
    client's train_flops is 3 x its sub-model's forward multiply-adds x its examples, the MLP at 128 of
    256 hidden units: 64 x 128 + 128 x 128 + 128 x 10 = 25,856 of the dense 84,480 (about p^2, not p)."""
    counts = [9, 17, 12, 30]
    split = make_split(counts)
    algorithm = build("heterofl", context(mlp, split), capacities=(0.5,))
    server, clients = algorithm.init(jax.random.key(1), mlp_variables(), 4)
    _, _, out = build_round(algorithm, split, 2, seed=3)(server, clients, 0)
    examples = np.asarray(counts)[np.asarray(out.client_ids)]
    np.testing.assert_allclose(out.metrics["train_flops"], 3 * (64 * 128 + 128 * 128 + 128 * 10) * examples,
                               rtol=1e-6)


def test_rows_of_several_seeds_are_averaged():
    from experiments.common import combine_seeds
    rows = [{"algorithm": "a", "final_accuracy": 0.5, "total_gbit": 2.0, "rounds_to_0.8": None},
            {"algorithm": "a", "final_accuracy": 0.7, "total_gbit": 4.0, "rounds_to_0.8": 12}]
    row = combine_seeds(rows)
    assert row["final_accuracy"] == pytest.approx(0.6) and row["total_gbit"] == pytest.approx(3.0)
    assert row["final_accuracy_std"] == pytest.approx(0.1) and row["final_accuracy_per_seed"] == "0.5000 / 0.7000"
    assert row["seeds"] == 2 and row["algorithm"] == "a" and row["rounds_to_0.8"] is None


# ------------------------------------------------------------------ issue 16: the Scaler, label masks, the rules

@pytest.mark.parametrize("name", ["preresnet18", "cnn4"])
def test_the_scaler_leaves_the_batch_statistics_forward_pass_of_batchnorm_models_unchanged(name):
    """HeteroFL's and FedRolex's Scaler sits right before a norm (which batch statistics cancel) and
    never on a shortcut: at beta = 1/16 the training forward pass of preresnet18 (whose projection
    shortcuts have no norm of their own) and cnn4 is exactly the unscaled one."""
    from fedjax_sparse.algorithms.submodels import training_unit_masks
    from fedjax_sparse.core.structure.unit_selection import random_scores
    model, variables = small_model(name)

    @jax.jit  # the variables as an argument: closed over, preresnet18's become an 89 MB program of constants
    def scaled_and_plain(variables, key):
        masks = keep_top_units(model.structure, random_scores(model.structure, key), 1 / 16)
        scaled = training_unit_masks(model.structure, masks, jnp.float32(1 / 16), scaler=True)
        x = jax.random.normal(jax.random.fold_in(key, 1), (6, 8, 8, 3))
        return tuple(model.apply({**variables, "unit_masks": m}, x, train=True)[0] for m in (scaled, masks))

    scaled, plain = scaled_and_plain(variables, jax.random.key(1))
    np.testing.assert_array_equal(scaled, plain)


def test_the_scaler_divides_the_hidden_units_of_a_norm_free_model(mlp):
    """In a model without norms (their code's norm='none') the Scaler sits before each hidden
    activation: the MLP's hidden units are divided by beta, the output layer is not."""
    from fedjax_sparse.algorithms.submodels import scaled_layers, training_unit_masks
    masks = {name: jnp.ones(n) for name, n in (("fc1", 256), ("fc2", 256), ("fc3", 10))}
    scaled = training_unit_masks(mlp.structure, masks, jnp.float32(0.25), scaler=True)
    np.testing.assert_array_equal(scaled["fc1"], 4.0)
    np.testing.assert_array_equal(scaled["fc2"], 4.0)
    np.testing.assert_array_equal(scaled["fc3"], 1.0)
    unscaled = training_unit_masks(mlp.structure, masks, jnp.float32(0.25), scaler=False)
    assert all(np.array_equal(unscaled[k], masks[k]) for k in masks)
    assert scaled_layers(get_model("preresnet18", (8, 8, 3), 10).structure) == frozenset()


@pytest.mark.parametrize("fill", ["zero", "exclude"])
def test_the_label_mask_fills_other_logits_as_chosen(mlp, fill):
    """A client holding labels 1 and 3 takes one full-batch SGD step: the loss is the cross-entropy of
    the logits with every other class's logit set to 0 (HeteroFL's and FedRolex's masked_fill) or to
    -inf (left out of the softmax), written out here with jax.nn.log_softmax."""
    rng = np.random.default_rng(0)
    y = np.array([1, 3] * 8)
    split = federated_split(rng.integers(0, 255, (16, 8, 8, 1), dtype=np.uint8), y, [np.arange(16)],
                            [0.5], [0.25])
    lr = 0.1
    algorithm = build("heterofl", context(mlp, split, lr=lr, batch_size=16), capacities=(1.0,), label_mask=True,
                      label_mask_fill=fill)
    variables = mlp_variables()
    _, up, _, _ = exchanges(algorithm)(start(algorithm, variables, 1), 0, split.client(0),
                                       round_info(0, 0, jnp.array([0])))
    held = jnp.isin(jnp.arange(10), jnp.array([1, 3]))
    x = normalize(split.x, split.mean, split.std)

    def loss(params):
        logits, _ = mlp.apply({"params": params, "batch_stats": {}}, x, train=True)
        logits = jnp.where(held, logits, 0.0 if fill == "zero" else -jnp.inf)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(16), split.y])

    grads = jax.jit(jax.grad(loss))(variables["params"])
    expected = tree_map(lambda w, g: w - lr * g, variables["params"], grads)
    trained = tree_map(lambda a: a.values, up["variables"]["params"], is_leaf=lambda a: isinstance(a, KnownMaskArray))
    assert_trees_close(trained, expected)
    np.testing.assert_array_equal(trained["fc3"]["bias"][~np.asarray(held)], 0.0)  # no gradient to other rows


def _public_scores(model, variables, public, labels):
    """{layer: scores} on every public example whose label is in `labels` (the similar batch when it
    is larger than the public set), with the score function tested by hand above."""
    mask = np.isin(public.y, labels)
    return gradient_scores(model, variables, normalize(public.x, public.mean, public.std), public.y, mask)


gradient_scores = jax.jit(unit_gradient_scores, static_argnums=0)  # eagerly each operation compiles on its own


def _top_masks(structure, scores, capacity):
    """By NumPy: per hidden layer the ceil(beta N) highest scores (ties to the lower index); the output keeps all."""
    out = {}
    for layer in structure.layers:
        s = np.asarray(scores[layer.name]) if layer is not structure.layers[-1] else np.zeros(layer.num_units)
        k = layer.num_units if layer is structure.layers[-1] else int(np.ceil(capacity * layer.num_units))
        keep = np.zeros(layer.num_units)
        keep[np.argsort(-s, kind="stable")[:k]] = 1.0
        out[layer.name] = keep
    return out


@pytest.fixture(scope="module")
def four_classes():
    """A 4-class MLP, 3 clients of 40 random examples, half of them in the public set (20 per client)."""
    from conftest import synthetic_split
    model, variables = initialized("mlp", (8, 8, 1), 4)
    return model, synthetic_split([40, 40, 40], seed=3, num_classes=4), variables


def test_fedgse_keeps_the_top_gradient_units_of_the_clients_own_labels(four_classes):
    """CSL with s = 2 of 4 classes: the broadcast's unit masks are exactly the top ceil(beta N) units of
    the gradient scores on the public examples of the client's two most frequent labels, which are
    not the top units on all labels."""
    model, split, variables = four_classes
    algorithm = build("fedgse", context(model, split, s=2), capacities=(0.25,), public_fraction=0.5,
                      similar_examples=256)
    server, _ = algorithm.init(jax.random.key(1), variables, 3)
    broadcast = jax.jit(algorithm.broadcast)
    public = public_set(split, 0.5, seed=0)
    for client in range(3):
        y = np.asarray(split.y)[40 * client:40 * (client + 1)]
        labels = np.argsort(-np.bincount(y, minlength=4), kind="stable")[:2]
        down = broadcast(server, client, round_info(0, 0, jnp.arange(3)))
        masks = {k: np.asarray(v) for k, v in down["unit_masks"].value.items()}
        expected = _top_masks(model.structure, _public_scores(model, variables, public, labels), 0.25)
        for name in expected:
            np.testing.assert_array_equal(masks[name], expected[name], err_msg=f"client {client} {name}")
        everything = _top_masks(model.structure, _public_scores(model, variables, public, np.arange(4)), 0.25)
        assert any(not np.array_equal(masks[n], everything[n]) for n in ("fc1", "fc2"))


def test_spl_broadcasts_the_units_of_its_predicted_labels_and_of_random_ones_for_new_clients(four_classes):
    """SPL, s = 2: a client whose stored class accuracies rank labels 3 and 1 first gets the top units
    of the scores on labels {1, 3}; a client never seen gets the top units of some random pair of
    labels (matched here against all 6 pairs), not always the same pair."""
    import itertools
    model, split, variables = four_classes
    algorithm = build("fedgse", context(model, split, s=2), capacities=(0.25,), similar_labels="spl",
                      public_fraction=0.5, similar_examples=256)
    server, _ = algorithm.init(jax.random.key(1), variables, 3)
    server = {**server, "memory": {"class_accuracy": jnp.array([[0.2, 0.7, 0.1, 0.9]] + [[0.0] * 4] * 2),
                                   "seen": jnp.array([True, False, False])}}
    broadcast = jax.jit(algorithm.broadcast)
    public = public_set(split, 0.5, seed=0)
    pairs = list(itertools.combinations(range(4), 2))
    candidates = {p: _top_masks(model.structure, _public_scores(model, variables, public, p), 0.25) for p in pairs}

    def matching(down):
        masks = {k: np.asarray(v) for k, v in down["unit_masks"].value.items()}
        return [p for p, c in candidates.items() if all(np.array_equal(masks[n], c[n]) for n in c)]

    assert matching(broadcast(server, 0, round_info(0, 0, jnp.arange(3)))) == [(1, 3)]
    drawn = [matching(broadcast(server, client, round_info(0, r, jnp.arange(3))))
             for client in (1, 2) for r in range(4)]
    assert all(len(m) == 1 for m in drawn), drawn
    assert len({m[0] for m in drawn}) > 1


def test_federated_dropout_differs_per_client_and_per_round(make_split, mlp):
    split = make_split([10, 10, 10])
    algorithm = build("feddropout", context(mlp, split), capacities=(0.5,))
    server, _ = algorithm.init(jax.random.key(1), mlp_variables(), 3)
    broadcast = jax.jit(algorithm.broadcast)

    def fc1(client, r):
        return np.asarray(broadcast(server, client, round_info(0, r, jnp.arange(3)))["unit_masks"].value["fc1"])

    draws = [fc1(0, 0), fc1(1, 0), fc1(0, 1), fc1(1, 1)]
    for i in range(4):
        assert draws[i].sum() == 128
        for j in range(i):
            assert not np.array_equal(draws[i], draws[j]), (i, j)
    np.testing.assert_array_equal(fc1(0, 0), draws[0])  # a pure function of (seed, round, client)


def test_fedrolex_bytes_and_entries_at_a_round_where_the_window_has_wrapped(make_split, mlp):
    """Round 300, 256 units, beta 1/2: the window is {(j - 300) mod 256 : j < 128} = units 212..255
    and 0..83 in both hidden layers. Both messages carry exactly the entries between kept units:
    64 x 128 + 128 (fc1), 128 x 128 + 128 (fc2), 128 x 10 + 10 (fc3) float32 values."""
    split = make_split([12, 12])
    algorithm = build("fedrolex", context(mlp, split), capacities=(0.5,))
    down, up, down_bytes, up_bytes = exchanges(algorithm)(start(algorithm, mlp_variables(), 2), 1, split.client(1),
                                                         round_info(0, 300, jnp.arange(2)))
    window = np.zeros(256)
    window[np.r_[212:256, 0:84]] = 1
    masks = down["unit_masks"].value
    np.testing.assert_array_equal(masks["fc1"], window)
    np.testing.assert_array_equal(masks["fc2"], window)
    kernel = np.asarray(down["variables"]["params"]["fc2"]["kernel"].mask)
    np.testing.assert_array_equal(kernel, np.outer(window, window).astype(bool))
    count = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert int(down_bytes) == 4 * count
    assert int(up_bytes) == 4 * count


def test_fedgse_takes_the_labels_a_typical_client_mostly_holds_where_the_partition_gives_none():
    """The fewest labels holding 80 % of each client's examples, by hand: [8, 1, 1, 0] -> 1 (8 of 10),
    [5, 5, 0, 0] -> 2, [3, 3, 2, 2] -> 3 (8 of 10), [0, 0, 0, 0] (no examples) left out; the median is 2, and
    with [1, 1, 1, 1] too (4 labels: 0.75 < 0.8 at 3) the median of 1, 2, 3, 4 rounds up to 3."""
    from fedjax_sparse.algorithms.fedgse import typical_labels

    counts = [[8, 1, 1, 0], [5, 5, 0, 0], [3, 3, 2, 2], [0, 0, 0, 0]]
    assert typical_labels(counts) == 2
    assert typical_labels([*counts, [1, 1, 1, 1]]) == 3
