"""FedLDF, its random-layer baseline and HDFL against independent truths.

Truths: FedAvg for n = K; hand-made divergences, data sizes and client values
for the top-n selection and eqs. (5, 6); the byte formula from the models'
layer sizes written out by hand; numpy for the layer divergence (eq. 3).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import BUILT_IN, fedavg, fedldf, fedldf_random, hdfl
from fedjax_sparse.algorithms.fedldf import random_n_per_layer, top_n_per_layer
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.structure.layer_groups import layer_groups, model_layer_groups
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import message_bytes
from fedjax_sparse.core.round.step import build_round, round_info
from fedjax_sparse.models import get_model
from fedjax_sparse.models.structure import ModelStructure

tree_map = jax.tree_util.tree_map

# The digits MLP's layers by hand: kernel + bias, float32.
MLP_LAYER_FLOATS = (64 * 256 + 256, 256 * 256 + 256, 256 * 10 + 10)
MLP_LAYER_BYTES = tuple(4 * f for f in MLP_LAYER_FLOATS)
MLP_BYTES = sum(MLP_LAYER_BYTES)


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


def local_sgd(model, epochs=1):
    return LocalSGD(model, learning_rate=0.1, epochs=epochs, batch_size=8)


def one_round(algorithm, split, k, model, seed=0, rounds=1):
    variables = model.init(jax.random.key(42))
    server, clients = algorithm.init(jax.random.key(1), variables, split.num_clients)
    round_fn = build_round(algorithm, split, k, seed=seed)
    outs = []
    for r in range(rounds):
        server, clients, out = round_fn(server, clients, r)
        outs.append(out)
    return variables, server, outs


# ----------------------------------------------------------------- n = K is FedAvg

def test_n_equal_to_k_is_fedavg(make_split, mlp):
    split = make_split([13, 30, 7, 22, 17, 9])
    k = 4
    local = local_sgd(mlp)
    _, avg, avg_outs = one_round(fedavg(local), split, k, mlp, rounds=2)
    _, ldf, ldf_outs = one_round(fedldf(local, k, k), split, k, mlp, rounds=2)
    for a, b in zip(jax.tree_util.tree_leaves(avg), jax.tree_util.tree_leaves(ldf), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # every client sends the whole model, plus its 3 divergences
    np.testing.assert_array_equal(ldf_outs[-1].uplink_bytes, avg_outs[-1].uplink_bytes + 3 * 4)
    np.testing.assert_array_equal(ldf_outs[-1].downlink_bytes, avg_outs[-1].downlink_bytes)


# ----------------------------------------------------------------- eq. (4): top-n, ties

def test_top_n_per_layer_on_a_hand_made_matrix():
    div = jnp.array([[0.5, 2.0, 1.0],
                     [3.0, 0.1, 1.0],
                     [1.0, 0.2, 1.0],
                     [2.0, 0.3, 0.0]])
    expected = np.array([[0, 1, 1],
                         [1, 0, 1],
                         [0, 0, 0],
                         [1, 1, 0]], bool)  # layer 2: three-way tie, the first two clients win
    np.testing.assert_array_equal(top_n_per_layer(div, 2), expected)
    assert np.asarray(top_n_per_layer(div, 4)).all()
    np.testing.assert_array_equal(top_n_per_layer(div, 1)[:, 2], [True, False, False, False])


def test_random_selection_takes_exactly_n_per_layer_and_varies():
    sel = np.asarray(random_n_per_layer(jax.random.key(0), 20, 9, 4))
    assert sel.shape == (20, 9) and (sel.sum(axis=0) == 4).all()
    assert len({tuple(np.flatnonzero(sel[:, l])) for l in range(9)}) > 1
    again = np.asarray(random_n_per_layer(jax.random.key(0), 20, 9, 4))
    np.testing.assert_array_equal(sel, again)


# ----------------------------------------------------------------- eqs. (5, 6) by hand

def test_layers_are_aggregated_over_their_top_n_clients_by_data_size(mlp):
    """Four clients whose every fc1 / fc2 / fc3 entry is a known constant; n = 2."""
    alg = fedldf(local_sgd(mlp), 2, 4)
    prev = mlp.init(jax.random.key(0))
    # client k holds the value (k + 1) * 10 + layer in every entry of that layer
    consts = np.array([[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]], np.float32)
    names = ("fc1", "fc2", "fc3")
    div = jnp.array([[5.0, 1.0, 0.0],
                     [4.0, 2.0, 9.0],
                     [1.0, 3.0, 9.0],
                     [0.5, 4.0, 9.0]])
    weights = jnp.array([10.0, 20.0, 30.0, 40.0])
    info = round_info(0, 0, jnp.arange(4))

    @jax.jit  # one program, as a round runs it: eagerly each operation would compile on its own, per leaf shape
    def aggregate(prev, div, weights, info):
        stacked = {"params": {name: tree_map(lambda x, l=l: jnp.broadcast_to(
            jnp.asarray(consts[:, l]).reshape((4,) + (1,) * x.ndim), (4, *x.shape)), prev["params"][name])
            for l, name in enumerate(names)}, "batch_stats": {}}
        ups = alg.select_uploads({"divergence": div, "variables": stacked}, weights, info)
        new = alg.global_variables(alg.server_update(alg.init(jax.random.key(1), prev, 4)[0], ups, weights, info))
        return ups, new

    ups, new = aggregate(prev, div, weights, info)
    # fc1: clients 0, 1 -> (10*11 + 20*21) / 30; fc2: clients 2, 3 -> (30*32 + 40*42) / 70;
    # fc3: three-way tie at 9, the earlier clients 1, 2 win -> (20*23 + 30*33) / 50
    expected = {"fc1": 530 / 30, "fc2": 2640 / 70, "fc3": 1450 / 50}
    for name, value in expected.items():
        for leaf in jax.tree_util.tree_leaves(new["params"][name]):
            np.testing.assert_allclose(np.asarray(leaf), value, rtol=1e-6)
    per_client = np.asarray(jax.vmap(message_bytes)(ups))
    np.testing.assert_array_equal(per_client, [MLP_LAYER_BYTES[0] + 12,
                                               MLP_LAYER_BYTES[0] + MLP_LAYER_BYTES[2] + 12,
                                               MLP_LAYER_BYTES[1] + MLP_LAYER_BYTES[2] + 12,
                                               MLP_LAYER_BYTES[1] + 12])


def test_divergence_is_the_l2_norm_over_each_layer(make_split, mlp):
    split = make_split([12, 20])
    alg = fedldf(local_sgd(mlp), 1, 2)
    down = mlp.init(jax.random.key(3))
    up, _, _ = jax.jit(alg.client_update)(down, {}, split.client(1), jax.random.key(4), round_info(0, 0, jnp.arange(2)))
    trained = up["variables"]["params"]
    for l, name in enumerate(("fc1", "fc2", "fc3")):
        sq = sum(np.sum((np.asarray(trained[name][p], np.float64) - np.asarray(down["params"][name][p])) ** 2)
                 for p in ("kernel", "bias"))
        np.testing.assert_allclose(float(up["divergence"][l]), np.sqrt(sq), rtol=1e-5)
    assert up["divergence"].dtype == jnp.float32 and up["divergence"].shape == (3,)


# ----------------------------------------------------------------- bytes

def test_uplink_bytes_follow_the_formula(make_split, mlp):
    split = make_split([11, 25, 9, 30, 14, 20])
    k, n = 5, 2
    local = local_sgd(mlp)
    ldf_bytes = n * sum(MLP_LAYER_BYTES) + k * 3 * 4  # sum_l n x layer bytes + K x L x 4
    for alg, expected in ((fedldf(local, n, k), ldf_bytes), (fedldf_random(local, n, k), ldf_bytes),
                          (hdfl(local, n, k), n * MLP_BYTES)):
        _, _, outs = one_round(alg, split, k, mlp)
        assert int(np.asarray(outs[0].uplink_bytes).sum()) == expected, alg.name
        assert int(np.asarray(outs[0].downlink_bytes).sum()) == k * MLP_BYTES, alg.name
        if alg.name == "hdfl":  # n clients send their whole model, the others nothing
            np.testing.assert_array_equal(np.sort(np.asarray(outs[0].uplink_bytes)),
                                          [0] * (k - n) + [MLP_BYTES] * n)


def test_bytes_of_a_batchnorm_model_count_its_statistics_with_its_layers():
    """cnn4 on 8x8x1: each conv layer carries kernel, bias and BN scale, bias, mean, var."""
    model = get_model("cnn4", (8, 8, 1), 10)
    widths, prev, floats = (64, 128, 256, 512), 1, []
    for w in widths:
        floats.append(9 * prev * w + w + 4 * w)
        prev = w
    floats.append(512 * 10 + 10)
    groups = model_layer_groups(model)
    assert groups.nbytes == tuple(4 * f for f in floats)
    k, n = 3, 2
    alg = fedldf(local_sgd(model), n, k)
    shapes = jax.eval_shape(model.init, jax.random.key(0))

    @jax.jit  # one program, as a round runs it: eagerly each operation would compile on its own, per leaf shape
    def prices(div, info):
        stacked = tree_map(lambda s: jnp.zeros((k, *s.shape), s.dtype), shapes)
        ups = alg.select_uploads({"divergence": div, "variables": stacked}, jnp.ones(k), info)
        return jax.vmap(message_bytes)(ups)

    total = int(np.asarray(prices(jnp.arange(k * 5, dtype=jnp.float32).reshape(k, 5),
                                  round_info(0, 0, jnp.arange(k)))).sum())
    assert total == n * 4 * sum(floats) + k * 5 * 4


# ----------------------------------------------------------------- layer groups

def test_every_variable_of_vgg9_belongs_to_one_layer():
    model = get_model("vgg9", (32, 32, 3), 10)
    groups = model_layer_groups(model)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    assert groups.names == tuple(f"conv{i}" for i in range(1, 9)) + ("fc",)
    assert sum(groups.sizes) == sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(shapes))
    assert groups.index["batch_stats"]["bn3"] == {"mean": 2, "var": 2}
    assert groups.index["params"]["bn3"] == {"scale": 2, "bias": 2}
    assert groups.index["params"]["conv3"] == {"kernel": 2, "bias": 2}


def test_a_variable_outside_the_structure_is_an_error(mlp):
    shapes = jax.eval_shape(mlp.init, jax.random.key(0))
    partial = ModelStructure(tuple(l for l in mlp.structure.layers if l.name != "fc3"))
    with pytest.raises(ValueError, match="params/fc3/bias.*belong to no layer|belong to no layer.*fc3"):
        layer_groups(partial, shapes)


def test_groups_expand_a_layer_selection_to_full_masks(mlp):
    groups = model_layer_groups(mlp)
    like = tree_map(lambda s: jnp.zeros((2, *s.shape)), jax.eval_shape(mlp.init, jax.random.key(0)))
    masks = groups.expand(jnp.array([[True, False, True], [False, True, False]]), like)
    assert masks["params"]["fc1"]["kernel"].shape == (2, 64, 256)
    assert bool(masks["params"]["fc1"]["kernel"][0].all()) and not bool(masks["params"]["fc1"]["bias"][1].any())
    assert bool(masks["params"]["fc2"]["bias"][1].all()) and not bool(masks["params"]["fc3"]["kernel"][1].any())


# ----------------------------------------------------------------- bad n

@pytest.mark.parametrize("name", ["fedldf", "fedldf_random", "hdfl"])
@pytest.mark.parametrize("n", [0, 5])
def test_bad_n_is_refused_when_built(mlp, name, n):
    builder = {"fedldf": fedldf, "fedldf_random": fedldf_random, "hdfl": hdfl}[name]
    with pytest.raises(ValueError, match=rf"n={n}.*\[1, 4\]"):
        builder(local_sgd(mlp), n, 4)


@pytest.mark.parametrize("n", ["0", "11"])
def test_bad_n_from_the_cli_is_a_one_line_error(tmp_path, capsys, n):
    args = ["run", "--algorithm", "fedldf", "--num-clients", "20", "--clients-per-round", "10",
            "--clients-per-layer", n, "--rounds", "1", "--no-progress", "--out", str(tmp_path / "bad")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"n={n}" in err and "[1, 10]" in err, err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_the_registry_builds_every_algorithm_with_its_options(make_split, mlp):
    """Each name builds the algorithm of that name; FedLDF's n from its options reaches the upload
    choice (exactly n of the K = 4 clients upload each layer)."""
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    split = make_split([8, 8, 8, 8])
    context = BuildContext(local=local_sgd(mlp), num_clients=4, clients_per_round=4, train=split, num_classes=10,
                           labels_per_client=2)
    for name in BUILT_IN:
        assert make_algorithm(name, context, make_options(name, {})).name == name
    for name in ("fedldf", "fedldf_random"):
        algorithm = make_algorithm(name, context, make_options(name, {"clients_per_layer": 3}))
        like = tree_map(lambda s: jnp.zeros((4, *s.shape)), jax.eval_shape(mlp.init, jax.random.key(0)))
        divergence = jnp.arange(12.0).reshape(4, 3)
        ups = algorithm.select_uploads({"divergence": divergence, "variables": like}, jnp.ones(4),
                                       round_info(0, 0, jnp.arange(4)))
        sent = np.asarray(ups["variables"]["params"]["fc2"]["bias"].mask)[:, 0]
        assert sent.sum() == 3


def test_experiment_settings_and_uplink_curve():
    from experiments.fedldf import SETTINGS, cumulative_uplink
    for name, setting in SETTINGS.items():
        config = setting.config
        if name == "cifar10_cpu":  # CPU-sized: SpaFL's CNN, 2 of 10 clients per layer (the paper's n/K)
            assert (config.model, config.num_clients, config.clients_per_round) == ("spafl_cnn", 20, 10)
            assert config.options["clients_per_layer"] == 2
        else:
            assert config.model == "vgg9" and config.clients_per_round == 20
            assert config.num_clients == 50 and config.options["clients_per_layer"] == 4
        assert {a.overrides["algorithm"] for a in setting.arms} == {"fedldf", "fedldf_random", "hdfl", "fedadp",
                                                                     "fedavg"}
        fedadp = next(a for a in setting.arms if a.label == "fedadp")
        assert fedadp.overrides["upload_keep"] == 4 / 20  # n/K: FedLDF's uplink
        setting.config.validate()
    every = [{"round": r, "uplink_bytes": b} for r, b in ((1, 5), (2, 7), (3, 5))]
    assert cumulative_uplink(every) == [5, 12, 17]
    sparse = [{"round": r, "uplink_bytes": 10} for r in (10, 20)]
    assert cumulative_uplink(sparse) == [100, 200]
    with pytest.raises(ValueError, match="eval-every 1"):
        cumulative_uplink([{"round": 10, "uplink_bytes": 1}, {"round": 20, "uplink_bytes": 2}])
    logged = [{"round": 10, "uplink_bytes": 1, "cumulative_uplink_bytes": 7},  # today's records carry it
              {"round": 20, "uplink_bytes": 2, "cumulative_uplink_bytes": 19}]
    assert cumulative_uplink(logged) == [7, 19]


def test_experiment_module_writes_the_uplink_table_and_plot(monkeypatch, tmp_path):
    """`python -m experiments.fedldf --quick`, shrunk to 2 rounds of K = 5, n = 2, on recorded runs (the table
    code runs on real runs in tests/test_experiments.py; each method's uplink bytes are
    test_uplink_bytes_follow_the_formula's): the uplink table and plot from each arm's records."""
    import dataclasses
    import math

    from conftest import record_runs
    import experiments.fedldf as module
    setting = module.SETTINGS["cifar10_iid"]
    tiny = {**setting.quick, "rounds": 2, "num_clients": 10, "clients_per_round": 5, "clients_per_layer": 2,
            "local_epochs": 1}
    monkeypatch.setitem(module.SETTINGS, "cifar10_iid", dataclasses.replace(setting, quick=tiny))
    feedback = 5 * 3 * 4  # K x L x 4 bytes a round
    per_round = {"fedldf": 2 * MLP_BYTES + feedback, "fedldf_random": 2 * MLP_BYTES + feedback,
                 "hdfl": 2 * MLP_BYTES, "fedadp": MLP_BYTES + 1000, "fedavg": 5 * MLP_BYTES}
    errors = {"fedldf": 0.2, "fedldf_random": 0.25, "hdfl": 0.3, "fedadp": 0.35, "fedavg": 0.1}

    def figures(config):
        up = per_round[config.algorithm]
        records = [{"round": r, "test_accuracy": 1 - errors[config.algorithm] - 0.1 * (2 - r), "uplink_bytes": up,
                    "cumulative_uplink_bytes": r * up, "cumulative_bytes": 2 * r * up} for r in (1, 2)]
        return records, {"cumulative_bytes": 4 * up, "total_uplink_bytes": 2 * up, "rounds_done": 2}

    record_runs(monkeypatch, figures)
    assert module.run(["--quick", "--setting", "cifar10_iid", "--out", str(tmp_path), "--no-progress"]) == 0
    folder = tmp_path / "cifar10_iid"
    rows = {}
    for line in (folder / "uplink.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in per_round:
            rows[cells[0]] = cells
    assert list(rows) == ["fedldf", "fedldf_random", "hdfl", "fedadp", "fedavg"]
    for name, cells in rows.items():  # rounds, final test error, per seed, total uplink, log10, / FedAvg
        assert cells[1] == "2" and float(cells[2]) == pytest.approx(errors[name]) and cells[3] == cells[2]
        assert int(cells[4].replace(",", "")) == 2 * per_round[name]
        assert float(cells[5]) == pytest.approx(math.log10(2 * per_round[name]), abs=5e-4)
        assert float(cells[6]) == pytest.approx(per_round[name] / per_round["fedavg"], abs=1e-4)
    assert (folder / "uplink.png").stat().st_size > 1000 and (folder / "results.csv").exists()
