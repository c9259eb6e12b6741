"""Server optimizers (FedOpt) against hand computations: sgd at lr 1 is FedAvg, server momentum and
FedAdam/FedYogi/FedAdagrad after two rounds follow Algorithm 2 of Reddi et al.; every algorithm's
server step takes the optimizer; entries no client held keep value and state. (Exact resume with
Adam's state: tests/test_checkpoint.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import linear_model
from fedjax_sparse.algorithms import ALGORITHMS, BUILT_IN, fedavg, make_algorithm, make_options
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.round.step import build_round
from fedjax_sparse.building_blocks.server_optimizer import FedOptState, ServerOptimizerOptions, server_optimizer
from fedjax_sparse.core.structure.unit_masks import variable_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores
from fedjax_sparse.models import get_model
from test_engine import SCAFFOLD_CLIENTS, SCAFFOLD_STEPS, hand_local_sgd, order_free_split, random_theta, \
    to_params, to_vector

tree_map = jax.tree_util.tree_map
B1, B2, TAU, MU = 0.9, 0.99, 1e-3, 0.9  # the defaults: FedOpt's section 5 and its FedAvgM baseline


def hand_fedopt(kind, eta, x, rounds, xs, ys, counts, lr):
    """FedAvg's clients, then the server step of `kind` (Algorithm 2 of Reddi et al.), in float64."""
    m, v, u = np.zeros_like(x), np.full_like(x, TAU ** 2), np.zeros_like(x)
    for ids in rounds:
        p = counts[ids] / counts[ids].sum()
        delta = sum(p_i * (hand_local_sgd(x, xs[i], ys[i], SCAFFOLD_STEPS[i], lr) - x) for p_i, i in zip(p, ids))
        if kind == "sgd":
            x = x + eta * delta
        elif kind == "momentum":
            u = MU * u + delta
            x = x + eta * u
        else:
            m = B1 * m + (1 - B1) * delta
            v = {"adagrad": v + delta ** 2, "adam": B2 * v + (1 - B2) * delta ** 2,
                 "yogi": v - (1 - B2) * delta ** 2 * np.sign(v - delta ** 2)}[kind]
            x = x + eta * m / (np.sqrt(v) + TAU)
    return x, m, v, u


@pytest.mark.parametrize("kind,eta", [("sgd", 1.0), ("momentum", 1.0), ("adam", 0.05)])
def test_two_rounds_of_fedavg_fedavgm_and_fedadam_match_a_hand_computation(kind, eta):
    """sgd at lr 1 is FedAvg (the mean replaces the model); momentum is FedAvgM; adam follows Algorithm 2
    without bias correction, from m = 0 and v = tau^2 (in round 2 a bias-corrected Adam's step would be
    about 1 / 0.74 times this one)."""
    split, xs, ys = order_free_split(SCAFFOLD_CLIENTS)
    lr = 0.1
    local = LocalSGD(linear_model(), learning_rate=lr, epochs=2, batch_size=4)
    algorithm = fedavg(local, server=server_optimizer(kind, lr=eta))
    theta = random_theta(1)
    server, clients = algorithm.init(jax.random.key(0), {"params": to_params(theta), "batch_stats": {}}, 4)
    round_fn = build_round(algorithm, split, 3, seed=4)
    rounds = []
    for r in range(2):
        server, clients, out = round_fn(server, clients, r)
        rounds.append(np.asarray(out.client_ids).tolist())
    assert rounds == [[0, 2, 3], [0, 1, 2]]  # both rounds mix clients of 2 to 6 steps
    x, m, v, u = hand_fedopt(kind, eta, theta, rounds, xs, ys, np.asarray(split.counts, np.float64), lr)
    np.testing.assert_allclose(to_vector(server["variables"]["params"]), x, rtol=1e-5, atol=1e-5)
    state = server["server_optimizer"][0]
    if kind == "momentum":  # optax's trace of the pseudo-gradient -Delta
        np.testing.assert_allclose(to_vector(state.trace), -u, rtol=1e-4, atol=1e-6)
    elif kind != "sgd":
        assert isinstance(state, FedOptState)
        np.testing.assert_allclose(to_vector(state.m), -m, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(to_vector(state.v), v, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("kind", ["adagrad", "adam", "yogi"])
def test_second_moment_rules_follow_algorithm_2(kind):
    """Three steps of the optimizer alone on deltas of mixed signs and sizes (yogi's sign(v - Delta^2)
    takes both values), against Algorithm 2 in float64."""
    rng = np.random.default_rng(0)
    deltas = [rng.normal(0, scale, 6) for scale in (1.0, 1e-3, 0.1)]
    opt = server_optimizer(kind, lr=0.1)
    params = {"w": jnp.zeros(6)}
    state = opt.init(params)
    m, v, x = np.zeros(6), np.full(6, TAU ** 2), np.zeros(6)
    for delta in deltas:
        params, state = opt.apply(params, {"w": jnp.asarray(delta, jnp.float32)}, state)
        m = B1 * m + (1 - B1) * delta
        v = {"adagrad": v + delta ** 2, "adam": B2 * v + (1 - B2) * delta ** 2,
             "yogi": v - (1 - B2) * delta ** 2 * np.sign(v - delta ** 2)}[kind]
        x = x + 0.1 * m / (np.sqrt(v) + TAU)
        np.testing.assert_allclose(params["w"], x, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(state[0].v["w"], v, rtol=1e-5, atol=1e-12)


def test_unheld_entries_keep_value_and_optimizer_state():
    opt = server_optimizer("momentum", lr=1.0)
    params = {"w": jnp.array([1.0, 2.0, 3.0])}
    held = {"w": jnp.array([True, False, True])}
    state = opt.init(params)
    for delta in (1.0, 2.0):
        params, state = opt.apply(params, {"w": jnp.full(3, delta)}, state, held)
    # held entries: u = 1, then 0.9 + 2 = 2.9, x += 1 + 2.9; the unheld one never moves, its trace stays 0
    np.testing.assert_allclose(params["w"], [4.9, 2.0, 6.9], rtol=1e-6)
    np.testing.assert_allclose(state[0].trace["w"], [-2.9, 0.0, -2.9], rtol=1e-6)


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


def test_every_algorithm_with_a_server_step_builds_its_optimizer_from_its_options(make_split, mlp):
    split = make_split([12, 16, 10, 14])
    ctx = BuildContext(local=LocalSGD(mlp, 0.5, 1, 8), num_clients=4, clients_per_round=2, train=split,
                       num_classes=10, seed=0, labels_per_client=2)
    users = [name for name in BUILT_IN if issubclass(ALGORITHMS[name].options, ServerOptimizerOptions)]
    assert BUILT_IN - set(users) == {"local", "spafl", "spafl_local", "fedpm", "feddyn"}  # own server steps
    for name in users:
        algorithm = make_algorithm(name, ctx, make_options(name, {"server_optimizer": "yogi", "clients_per_layer": 1,
                                                                  "salient_keep": 0.5}))
        server, _ = algorithm.init(jax.random.key(1), mlp.init(jax.random.key(0)), 4)
        assert isinstance(server["server_optimizer"][0], FedOptState), name


@pytest.mark.parametrize("name,extra", [("heterofl", {"capacities": (0.5,)}), ("spatl", {"salient_keep": 0.5})])
def test_partial_uploads_step_held_entries_only(make_split, mlp, name, extra):
    """FedAdam's first step moves every weight by at most eta (m / (sqrt(v) + tau) with m = 0.1 Delta,
    sqrt(v) >= 0.1 |Delta|), where a plain step would move it by Delta; entries no client held (HeteroFL's
    units beyond the 0.5 prefix, SPATL's channels nobody sent) keep their value and v = tau^2 exactly."""
    split = make_split([12, 16, 10, 14])
    ctx = BuildContext(local=LocalSGD(mlp, 0.5, 2, 8), num_clients=4, clients_per_round=2, train=split,
                       num_classes=10, seed=0)
    eta = 1e-3
    algorithm = make_algorithm(name, ctx, make_options(name, {"server_optimizer": "adam", "server_lr": eta, **extra}))
    variables = mlp.init(jax.random.key(0))
    server, clients = algorithm.init(jax.random.key(1), variables, 4)
    key = "encoder" if name == "spatl" else "variables"
    before = server[key]["params"]
    server, _, _ = build_round(algorithm, split, 2, seed=0)(server, clients, 0)
    after, state = server[key]["params"], server["server_optimizer"][0]
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(after),
                                                            jax.tree_util.tree_leaves(before)))
    assert 0.5 * eta < moved <= eta * (1 + 1e-4)
    untouched = tree_map(lambda v: v == TAU ** 2, state.v)
    assert 0 < sum(int(u.sum()) for u in jax.tree_util.tree_leaves(untouched)) < sum(
        u.size for u in jax.tree_util.tree_leaves(untouched))
    tree_map(lambda a, b, keep: np.testing.assert_array_equal(np.asarray(a)[keep], np.asarray(b)[keep]),
             after, before, untouched)
    if name == "heterofl":
        units = keep_top_units(mlp.structure, prefix_scores(mlp.structure), 0.5)
        held = variable_masks(mlp.structure, variables, units)["params"]
        tree_map(lambda h, keep: np.testing.assert_array_equal(np.asarray(h), ~np.asarray(keep)), held, untouched)


@pytest.mark.parametrize("algorithm,flags,refused", [
    ("fedavg", ["--server-momentum", "0.5"], "--server-momentum is read only by --server-optimizer momentum"),
    ("heterofl", ["--server-optimizer", "momentum", "--server-beta1", "0.5"], "--server-beta1 is read only by"),
    ("spatl", ["--server-optimizer", "adagrad", "--server-beta2", "0.9"], "--server-beta2 is read only by"),
    ("fedldf", ["--server-epsilon", "0.1"], "--server-epsilon is read only by"),
])
def test_server_optimizer_flags_the_chosen_optimizer_does_not_read_are_refused(tmp_path, capsys, algorithm, flags,
                                                                                refused):
    """A flag is refused, in one line and before any data is loaded, where the chosen server optimizer
    would ignore it (sgd reads no momentum; momentum no moments; adagrad no beta2); a config file's key
    set away from its default is refused alike, and the flags it does read pass."""
    from fedjax_sparse.run.cli import main

    out = tmp_path / "run"
    assert main(["run", "--algorithm", algorithm, "--out", str(out), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert refused in err and len(err.splitlines()) == 1
    assert not (out / "config.json").exists()
    config = tmp_path / "c.json"
    config.write_text('{"algorithm": "fedavg", "server_momentum": 0.5}')
    assert main(["run", "--config", str(config), "--out", str(out), "--no-progress"]) == 2
    assert "--server-momentum is read only by" in capsys.readouterr().err
    options = make_options("fedavg", {"server_optimizer": "adam", "server_beta1": 0.5, "server_beta2": 0.9,
                                      "server_epsilon": 0.1})
    assert options.ignored() == {"server_momentum": "is read only by --server-optimizer momentum; "
                                                    "--server-optimizer adam does not read it"}


def test_an_unread_option_set_from_python_is_refused_by_the_config_itself(tmp_path):
    """The config, not only the command line, refuses a value its algorithm would ignore: from Python,
    `server_momentum=0.5` with sgd (or a compression ratio without compression) is one line naming
    the option and its value, and the run writes no config.json that would record it; the same
    option at its default, or read by the chosen optimizer, passes."""
    from fedjax_sparse.run import RunConfig, run_experiment

    out = tmp_path / "run"
    config = RunConfig.create(algorithm="fedavg", server_momentum=0.5, out=str(out))
    with pytest.raises(ValueError, match=r"^--server-momentum is read only by --server-optimizer momentum; "
                                         r"--server-optimizer sgd does not read it \(it is set to 0\.5\)$"):
        run_experiment(config, progress=False)
    assert not out.exists()
    with pytest.raises(ValueError, match="--compression-ratio is read only with --uplink-compression"):
        RunConfig.create(compression_ratio=0.5).validate()
    RunConfig.create(algorithm="fedavg", server_momentum=0.9).validate()  # its default
    RunConfig.create(algorithm="fedavg", server_optimizer="momentum", server_momentum=0.5).validate()
