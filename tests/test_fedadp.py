"""FedADP (our reading) against independent truths: the budgeted neuron choice by hand, the mean kept ratio on
real models, bytes equal to FedLDF's at n/K, and the per-entry mean over senders."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import jitted_exchange
from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fedadp import keep_within_budget, upload_ratio
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import SparseArray, message_bytes
from fedjax_sparse.core.round.step import build_round, round_info
from fedjax_sparse.models import Layer, ModelStructure, get_model

tree_map = jax.tree_util.tree_map


def dense_layer(name, units, fan_in, inputs_from):
    return Layer(name=name, kind="dense", kernel=(name, "kernel"), bias=None, norm=None, num_units=units,
                 fan_in=fan_in, inputs_from=inputs_from)


def test_neurons_are_kept_by_score_within_the_weight_budget_by_hand():
    """Two layers: 3 units of fan-in 4 and 2 units of fan-in 3 (18 weights). keep 0.5 = 9 weights:
    by score 0.9 (a0, 4), 0.8 (b1, 3) fit (7), then 0.7 (a2, 4) would make 11 and stops the take."""
    structure = ModelStructure((dense_layer("a", 3, 4, ("input",)), dense_layer("b", 2, 3, ("a",))))
    scores = {"a": jnp.array([0.9, 0.1, 0.7]), "b": jnp.array([0.2, 0.8])}
    # as a client computes them: one program per keep (op by op, each operation compiles on its own)
    kept = jax.jit(lambda scores, keep: (
        (masks := keep_within_budget(structure, scores, keep)), upload_ratio(structure, masks)), static_argnums=1)
    masks, ratio = kept(scores, 0.5)
    np.testing.assert_array_equal(masks["a"], [1, 0, 0])
    np.testing.assert_array_equal(masks["b"], [0, 1])
    assert float(ratio) == pytest.approx(7 / 18)
    everything, _ = kept(scores, 1.0)
    assert all(np.all(m == 1) for m in everything.values())


@pytest.mark.parametrize("name", ["mlp", "cnn4", "resnet20"])
def test_the_mean_kept_ratio_is_the_target_less_at_most_one_neuron(name):
    """Random scores on real models: the weights of the kept neurons are at most keep x the prunable
    weights and within one neuron's fan-in of it; layers end up with different ratios."""
    model = get_model(name, (8, 8, 3), 10)
    structure = model.structure
    rng = np.random.default_rng(0)
    largest = max(l.fan_in for l in structure.layers)
    for keep in (0.2, 0.5):
        scores = {l.name: jnp.asarray(rng.random(l.num_units) * rng.random()) for l in structure.layers}
        masks, ratio = jax.jit(lambda scores, keep=keep: (  # as a client computes it (op by op: one compile each)
            (masks := keep_within_budget(structure, scores, keep)), upload_ratio(structure, masks)))(scores)
        ratio = float(ratio)
        assert keep - largest / structure.num_prunable_weights <= ratio <= keep + 1e-7
        per_layer = [float(np.mean(masks[l.name])) for l in structure.layers]
        assert max(per_layer) - min(per_layer) > 0.05


@pytest.fixture(scope="module")
def setting():
    from conftest import synthetic_split
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([12, 20, 16, 8, 24])
    local = LocalSGD(model, 0.1, 1, 8)
    return model, split, local


def build(name, setting, k, **options):
    model, split, local = setting
    ctx = BuildContext(local=local, num_clients=split.num_clients, clients_per_round=k, train=split,
                       num_classes=model.num_classes, seed=0)
    return make_algorithm(name, ctx, make_options(name, options))


def test_uplink_at_n_over_k_matches_fedldfs(setting):
    """keep = n/K = 2/5: FedADP's round uploads n model copies' weights plus per-layer unit indexes,
    FedLDF's n copies plus the divergence feedback: within 1 % of each other."""
    model, split, _ = setting
    variables = model.init(jax.random.key(0))
    uplinks = {}
    for name, options in (("fedadp", {"upload_keep": 0.4}), ("fedldf", {"clients_per_layer": 2})):
        algorithm = build(name, setting, 5, **options)
        server, clients = algorithm.init(jax.random.key(1), variables, 5)
        _, _, out = build_round(algorithm, split, 5, seed=0)(server, clients, 0)
        uplinks[name] = int(np.asarray(out.uplink_bytes).sum())
    assert uplinks["fedadp"] == pytest.approx(uplinks["fedldf"], rel=0.01)
    dense = 4 * sum(x.size for x in jax.tree_util.tree_leaves(variables))
    assert uplinks["fedadp"] < 0.41 * 5 * dense


def test_sent_entries_are_the_kept_neurons_and_aggregate_over_their_senders(setting):
    """A client's upload holds exactly its kept neurons' incoming weights and biases (whatever their
    inputs), priced as one unit index per layer plus the values; the server's new entry is the
    data-weighted mean over the clients that sent it, the old value where nobody did."""
    model, split, _ = setting
    algorithm = build("fedadp", setting, 2, upload_keep=0.3)
    variables = jax.jit(model.init)(jax.random.key(0))
    server, _ = jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), variables, 5)
    info = round_info(0, 0, jnp.array([1, 4]))
    update = jitted_exchange(algorithm, info)
    ups = [update(server, c, {}, split.client(c), jax.random.key(c)) for c in (1, 4)]
    is_sparse = lambda x: isinstance(x, SparseArray)  # noqa: E731
    for up, _, metrics in ups:
        index_bytes = 0
        for layer in model.structure.layers:
            kernel, bias = up["params"][layer.name]["kernel"], up["params"][layer.name]["bias"]
            units = np.asarray(kernel.units)
            np.testing.assert_array_equal(np.asarray(kernel.mask), np.broadcast_to(units, kernel.mask.shape))
            np.testing.assert_array_equal(np.asarray(bias.mask), units)
            if not units.all():  # a whole layer is cheaper sent dense, without an index
                index_bytes += min(int(units.sum()), (layer.num_units + 7) // 8)  # 1-byte ids (< 256 units)
        values = sum(int(np.asarray(l.mask).sum()) for l in jax.tree_util.tree_leaves(up, is_leaf=is_sparse))
        assert int(message_bytes(up)) == 4 * values + index_bytes
        assert float(metrics["upload_ratio"]) <= 0.3
    stacked = tree_map(lambda a, b: SparseArray(jnp.stack([a.values, b.values]), jnp.stack([a.mask, b.mask])),
                       ups[0][0], ups[1][0], is_leaf=is_sparse)
    new = jax.jit(algorithm.server_update)(server, stacked, jnp.array([20.0, 24.0]), info)["variables"]["params"]
    a, b = (np.asarray(up[0]["params"]["fc2"]["kernel"].values) for up in ups)
    ma, mb = (np.asarray(up[0]["params"]["fc2"]["kernel"].mask) for up in ups)
    old = np.asarray(variables["params"]["fc2"]["kernel"])
    expected = np.where(ma & mb, (20 * a + 24 * b) / 44, np.where(ma, a, np.where(mb, b, old)))
    np.testing.assert_allclose(np.asarray(new["fc2"]["kernel"]), expected, rtol=1e-5, atol=1e-7)
    assert (~(ma | mb)).any()


def test_every_units_batchnorm_statistics_travel_and_average_over_all_clients():
    """The running statistics describe a unit's input as the whole network upstream computes it, so
    they travel for every unit (dense, priced as such) and the server takes their data-weighted mean
    over all the round's clients, also for a unit no client sent; the weights still aggregate over
    their senders only. (Sent only with their units, a unit nobody sent kept mean 0 and variance 1
    and the global model fell to chance on the CPU-sized CIFAR-10.)"""
    from conftest import synthetic_split
    model = get_model("cnn4", (8, 8, 1), 10)
    split = synthetic_split([12, 20], shape=(8, 8, 1))
    ctx = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=2, clients_per_round=2, train=split,
                       num_classes=10, seed=0)
    algorithm = make_algorithm("fedadp", ctx, make_options("fedadp", {"upload_keep": 0.05}))
    # jitted as the round runs them (eagerly each operation compiles on its own, per leaf shape)
    variables = jax.jit(model.init)(jax.random.key(0))
    server, _ = jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), variables, 2)
    info = round_info(0, 0, jnp.array([0, 1]))
    update = jitted_exchange(algorithm, info)
    prices = jax.jit(lambda up: (message_bytes(up), message_bytes(up["params"])))
    ups = [(up, *prices(up)) for up in (update(server, c, {}, split.client(c), jax.random.key(c))[0] for c in (0, 1))]
    is_sparse = lambda x: isinstance(x, SparseArray)  # noqa: E731
    for up, price, params_price in ups:
        stats = jax.tree_util.tree_leaves(up["batch_stats"])
        assert stats and not any(is_sparse(x) for x in stats)
        sparse = jax.tree_util.tree_leaves(up["params"], is_leaf=is_sparse)
        assert int(price) == int(params_price) + 4 * sum(x.size for x in stats)
        assert all(is_sparse(x) for x in sparse)
    ups = [up for up, _, _ in ups]
    stacked = tree_map(lambda a, b: SparseArray(jnp.stack([a.values, b.values]), jnp.stack([a.mask, b.mask]))
                       if is_sparse(a) else jnp.stack([a, b]), ups[0], ups[1], is_leaf=is_sparse)
    new = jax.jit(algorithm.server_update)(server, stacked, jnp.array([12.0, 20.0]), info)["variables"]
    unsent = ~(np.asarray(ups[0]["params"]["conv4"]["kernel"].units) | np.asarray(ups[1]["params"]["conv4"]["kernel"].units))
    assert unsent.any()
    for key in ("mean", "var"):
        a, b = (np.asarray(up["batch_stats"]["bn4"][key]) for up in ups)
        got = np.asarray(new["batch_stats"]["bn4"][key])
        np.testing.assert_allclose(got, (12 * a + 20 * b) / 32, rtol=1e-5, atol=1e-7)
        assert not np.allclose(got[unsent], np.asarray(variables["batch_stats"]["bn4"][key])[unsent])
    np.testing.assert_array_equal(np.asarray(new["params"]["conv4"]["kernel"])[..., unsent],
                                  np.asarray(variables["params"]["conv4"]["kernel"])[..., unsent])
