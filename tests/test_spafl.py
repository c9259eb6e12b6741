"""SpaFL against independent truths: hand-computed gradients, eq. 13 and FLOPs by hand,
a hand-written training loop, the paper's byte figure."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import spafl, spafl_local
from fedjax_sparse.algorithms.spafl import (global_threshold_update, init_thresholds, local_trainer,
                                            masked_variables, reset_collapsed_layers, ste_masks,
                                            threshold_masks, unit_magnitudes)
from fedjax_sparse.cli import main
from fedjax_sparse.core.flops import forward_flops, training_flops
from fedjax_sparse.core.local_training import LocalSGD, masked_cross_entropy
from fedjax_sparse.core.messages import message_bytes
from fedjax_sparse.core.round import build_round
from fedjax_sparse.core.unit_masks import (apply_unit_masks, density, live_input_fraction,
                                           weight_masks)
from fedjax_sparse.data.federated import client_batch, epoch_permutations, steps_per_epoch
from fedjax_sparse.models import Layer, ModelStructure, get_model

tree_map = jax.tree_util.tree_map
MLP_THRESHOLDS = 256 + 256 + 10
MLP_PARAMS = 85002
LR0 = 0.02  # small enough that no threshold passes its unit in the few steps of the alpha = 0 tests


def assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol), a, b)


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


@pytest.fixture(scope="module")
def mlp_variables(mlp):
    return mlp.init(jax.random.key(0))


def one_dense_layer(units=2, fan_in=2):
    layer = Layer(name="fc", kind="dense", kernel=("fc", "kernel"), bias=("fc", "bias"), norm=None,
                  num_units=units, fan_in=fan_in, inputs_from=("input",))
    return ModelStructure((layer,))


# ------------------------------------------------------------------ eq. 1 and the STE (eq. 9)

def test_threshold_and_weight_gradients_are_the_straight_through_formulas_by_hand():
    """Kernel [in, out] = [[.5, -.1], [-.3, .2]]: unit 0 has weights (.5, -.3), mean |w| .4;
    unit 1 has (-.1, .2), mean .15. Thresholds (.1, .3) keep unit 0 and prune unit 1.
    L = sum(A * W~) + sum((5, 7) * b~), so dL/dW~ = A. By hand:
      dL/dtau_0 = -(1 * .5 + 3 * -.3) = .4,   dL/dtau_1 = -(2 * -.1 + 4 * .2) = -.6
      dL/dw (unit 0, kept)   = A + (-.4) sign(w) / 2 = (.8, 3.2)
      dL/dw (unit 1, pruned) = 0 + (.6) sign(w) / 2  = (-.3, .3)
      dL/db = (5, 7) * mask = (5, 0); the bias adds nothing to the thresholds' gradient."""
    structure = one_dense_layer()
    params = {"fc": {"kernel": jnp.array([[0.5, -0.1], [-0.3, 0.2]]), "bias": jnp.array([0.3, -0.4])}}
    tau = {"fc": jnp.array([0.1, 0.3])}
    a = jnp.array([[1.0, 2.0], [3.0, 4.0]])

    def loss(params, tau):
        masked = apply_unit_masks(structure, params, ste_masks(structure, params, tau))
        return jnp.sum(a * masked["fc"]["kernel"]) + jnp.sum(jnp.array([5.0, 7.0]) * masked["fc"]["bias"])

    g_params, g_tau = jax.grad(loss, argnums=(0, 1))(params, tau)
    np.testing.assert_allclose(g_tau["fc"], [0.4, -0.6], atol=1e-6)
    np.testing.assert_allclose(g_params["fc"]["kernel"], [[0.8, -0.3], [3.2, 0.3]], atol=1e-6)
    np.testing.assert_allclose(g_params["fc"]["bias"], [5.0, 0.0], atol=1e-6)
    np.testing.assert_array_equal(threshold_masks(structure, params, tau)["fc"], [True, False])


def test_ste_gradients_match_the_chain_rule_on_a_nonlinear_loss():
    """dL/dtau_i = -sum_j g_ij w_ij and dL/dw_ij = g_ij m_i + (sum_k g_ik w_ik) sign(w_ij) / n,
    with g = dL/dW~ taken directly at W~ = w * m."""
    n, units = 5, 4
    structure = one_dense_layer(units, n)
    k1, k2 = jax.random.split(jax.random.key(0))
    kernel = jax.random.normal(k1, (n, units))
    params = {"fc": {"kernel": kernel, "bias": jnp.zeros(units)}}
    mu = np.abs(np.asarray(kernel)).mean(0)
    tau = {"fc": jnp.asarray(mu + np.array([-0.1, 0.1, -0.2, 0.2]))}  # units 0, 2 kept; 1, 3 pruned
    x = jax.random.normal(k2, (3, n))

    def task(w_tilde):
        return jnp.sum(jnp.tanh(x @ w_tilde) ** 2)

    def loss(params, tau):
        return task(apply_unit_masks(structure, params, ste_masks(structure, params, tau))["fc"]["kernel"])

    g_params, g_tau = jax.grad(loss, argnums=(0, 1))(params, tau)
    m = np.array([1.0, 0.0, 1.0, 0.0])
    g = np.asarray(jax.grad(task)(kernel * m))
    w = np.asarray(kernel)
    c = (g * w).sum(0)
    np.testing.assert_allclose(g_tau["fc"], -c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_params["fc"]["kernel"], g * m + c * np.sign(w) / n, rtol=1e-5, atol=1e-6)


def check_whole_units_pruned(structure, variables):
    mu = unit_magnitudes(structure, variables["params"])
    tau = {k: jnp.full_like(v, jnp.median(v)) for k, v in mu.items()}  # prunes about half of every layer
    masked = jax.jit(lambda v, t: masked_variables(structure, v, t))(variables, tau)["params"]
    for layer in structure.layers:
        keep = np.asarray(mu[layer.name] > tau[layer.name])
        assert 0 < keep.sum() < len(keep)
        w = np.asarray(variables["params"][layer.name]["kernel"])
        mw = np.asarray(masked[layer.name]["kernel"])
        flat, mflat = w.reshape(-1, w.shape[-1]), mw.reshape(-1, mw.shape[-1])
        np.testing.assert_array_equal(mflat[:, keep], flat[:, keep])  # kept units: every weight intact
        assert np.all(mflat[:, ~keep] == 0)                           # pruned units: every weight zero
        if layer.bias is not None:
            np.testing.assert_array_equal(np.asarray(masked[layer.name]["bias"])[~keep], 0.0)


def test_masks_prune_whole_units_of_dense_and_conv_layers(mlp, mlp_variables):
    check_whole_units_pruned(mlp.structure, mlp_variables)
    conv = Layer(name="conv", kind="conv", kernel=("conv", "kernel"), bias=("conv", "bias"), norm=None,
                 num_units=6, fan_in=3 * 3 * 2, inputs_from=("input",), output_hw=16)
    kernel = jax.random.normal(jax.random.key(2), (3, 3, 2, 6)) * jnp.arange(1.0, 7.0)
    check_whole_units_pruned(ModelStructure((conv,)),
                             {"params": {"conv": {"kernel": kernel, "bias": jnp.ones(6)}}, "batch_stats": {}})


def test_a_pruned_unit_loses_its_bias_and_norm_entries_too():
    """Kernel column, bias and the scale/bias of the unit's normalization go together, so the
    unit outputs zero; other leaves are untouched."""
    layer = Layer(name="fc", kind="dense", kernel=("fc", "kernel"), bias=("fc", "bias"), norm=("bn",),
                  num_units=3, fan_in=2, inputs_from=("input",))
    structure = ModelStructure((layer,))
    params = {"fc": {"kernel": jnp.ones((2, 3)), "bias": jnp.array([1.0, 2.0, 3.0])},
              "bn": {"scale": jnp.array([4.0, 5.0, 6.0]), "bias": jnp.array([7.0, 8.0, 9.0])},
              "head": {"kernel": jnp.ones((3, 2))}}
    masked = apply_unit_masks(structure, params, {"fc": jnp.array([1.0, 0.0, 1.0])})
    np.testing.assert_array_equal(masked["fc"]["kernel"], [[1, 0, 1], [1, 0, 1]])
    np.testing.assert_array_equal(masked["fc"]["bias"], [1, 0, 3])
    np.testing.assert_array_equal(masked["bn"]["scale"], [4, 0, 6])
    np.testing.assert_array_equal(masked["bn"]["bias"], [7, 0, 9])
    np.testing.assert_array_equal(masked["head"]["kernel"], params["head"]["kernel"])
    wm = weight_masks(structure, params, {"fc": jnp.array([True, False, True])})
    np.testing.assert_array_equal(wm["bn"]["bias"], [True, False, True])
    assert bool(wm["head"]["kernel"].all())


def test_unit_mask_density_weight_masks_and_live_inputs_by_hand(mlp, mlp_variables):
    masks = {"fc1": jnp.arange(256) < 128, "fc2": jnp.arange(256) < 64, "fc3": jnp.ones(10, bool)}
    overall, per_layer = density(mlp.structure, masks)
    # kept kernel weights: 128 * 64 + 64 * 256 + 10 * 256 of 84,480
    assert float(overall) == pytest.approx((128 * 64 + 64 * 256 + 10 * 256) / 84480)
    assert float(per_layer["fc2"]) == 0.25
    wm = weight_masks(mlp.structure, mlp_variables["params"], masks)
    assert wm["fc2"]["kernel"].shape == (256, 256) and int(wm["fc2"]["kernel"].sum()) == 256 * 64
    assert int(wm["fc1"]["bias"].sum()) == 128
    live = live_input_fraction(mlp.structure, masks)
    assert [float(live[k]) for k in ("fc1", "fc2", "fc3")] == [1.0, 0.5, 0.25]
    # a residual sum: a unit is live while any producer keeps it
    layers = (Layer("a", "dense", ("a", "kernel"), None, None, 4, 3, ("input",)),
              Layer("b", "dense", ("b", "kernel"), None, None, 4, 4, ("a",)),
              Layer("c", "dense", ("c", "kernel"), None, None, 2, 4, ("a", "b")))
    live = live_input_fraction(ModelStructure(layers), {"a": jnp.array([1, 1, 0, 0]), "b": jnp.array([0, 1, 1, 0]),
                                                        "c": jnp.ones(2)})
    assert float(live["c"]) == 0.75


# ------------------------------------------------------------------ eq. 13 and the 1 % reset

def test_eq13_weight_update_on_a_hand_made_example():
    """Units (columns) with weight sums .2 (> 0), -.3 (< 0), 0; dtau = (.2, .4, .5); n = 2:
    unit 0 moves by -.2/2 * (+1) = -.1, unit 1 by -.4/2 * (-1) = +.2, unit 2 not at all."""
    structure = one_dense_layer(units=3, fan_in=2)
    params = {"fc": {"kernel": jnp.array([[0.5, -0.1, 0.2], [-0.3, -0.2, -0.2]]), "bias": jnp.zeros(3)}}
    new = global_threshold_update(structure, params, {"fc": jnp.array([0.2, 0.4, 0.5])})
    np.testing.assert_allclose(new["fc"]["kernel"], [[0.4, 0.1, 0.2], [-0.4, 0.0, -0.2]], atol=1e-7)
    np.testing.assert_array_equal(new["fc"]["bias"], params["fc"]["bias"])


def test_the_reset_zeroes_only_layers_below_one_percent(mlp, mlp_variables):
    params = mlp_variables["params"]
    mu = unit_magnitudes(mlp.structure, params)
    tau = {}
    for name, keep in (("fc1", 2), ("fc2", 3), ("fc3", 10)):  # 2/256 < 1 %; 3/256 > 1 %
        order = jnp.argsort(-mu[name])
        tau[name] = jnp.ones_like(mu[name]).at[order[:keep]].set(0.0)
    new, resets = reset_collapsed_layers(mlp.structure, params, tau)
    assert int(resets) == 1
    np.testing.assert_array_equal(new["fc1"], 0.0)
    np.testing.assert_array_equal(new["fc2"], tau["fc2"])
    np.testing.assert_array_equal(new["fc3"], tau["fc3"])


def test_density_decreases_as_alpha_grows_and_the_reset_fires(make_split, mlp):
    """One client's local training for several alphas at once (alpha is traced). Units are
    given graded magnitudes so a rising threshold prunes them progressively."""
    split = make_split([64])
    local = LocalSGD(mlp, learning_rate=0.1, epochs=4, batch_size=16)
    params = dict(mlp.init(jax.random.key(1))["params"])
    for name in ("fc1", "fc2"):
        params[name] = {**params[name], "kernel": params[name]["kernel"] * jnp.linspace(0.3, 3.0, 256)}
    variables = {"params": params, "batch_stats": {}}
    structure = mlp.structure

    def run(alpha):
        trained, tau, stats = local_trainer(local, alpha, True)(variables, init_thresholds(structure),
                                                               split.client(0), jax.random.key(2))
        overall, per_layer = density(structure, threshold_masks(structure, trained["params"], tau))
        return overall, per_layer, stats["threshold_resets"], tau

    alphas = jnp.array([0.0, 0.005, 0.01, 0.02, 0.04, 10.0])
    overall, per_layer, resets, tau = jax.jit(jax.vmap(run))(alphas)
    overall = np.asarray(overall)
    assert np.all(np.diff(overall[:5]) <= 1e-6), overall
    assert overall[4] < overall[0] - 0.2, overall
    # alpha = 10 lifts every threshold past its units in one step: each layer collapses and is reset
    assert int(resets[5]) > 0
    assert all(float(v[5]) >= 0.01 for v in per_layer.values())
    for t in jax.tree_util.tree_leaves(tau):  # thresholds stay within [0, 1]
        assert float(t.min()) >= 0.0 and float(t.max()) <= 1.0


# ------------------------------------------------------------------ a client's training

def reference_training(model, variables, data, key, lr, epochs, batch_size):
    """alpha = 0, thresholds from zero, plain SGD, written out: the dense gradient g of the
    task loss, plus on every kernel the STE term (sum_j g_ij w_ij) sign(w_ij) / n_i, thresholds
    tau_i <- clip(tau_i + lr sum_j g_ij w_ij, 0, 1), kernels clipped to [-1, 1]. Asserts that
    every mask stays all ones, which makes the dense gradient the masked model's gradient."""
    structure = model.structure
    order_key, step_key = jax.random.split(key)
    orders = epoch_permutations(order_key, data.count, data.max_count, epochs)
    per_epoch = int(steps_per_epoch(data.count, batch_size))

    @jax.jit
    def step(params, tau, b):
        all_ones = jnp.all(jnp.stack([jnp.all(jnp.mean(jnp.abs(params[l.name]["kernel"]), 0) > tau[l.name])
                                      for l in structure.layers]))

        def loss(p):
            logits, _ = model.apply({"params": p, "batch_stats": {}}, b.x, train=True, mask=b.mask)
            return masked_cross_entropy(logits, b.y, b.mask)

        g = jax.grad(loss)(params)
        new = tree_map(lambda w, gw: w - lr * gw, params, g)
        tau = dict(tau)
        for layer in structure.layers:
            w, gw = params[layer.name]["kernel"], g[layer.name]["kernel"]
            c = jnp.sum(gw * w, axis=0)
            kernel = jnp.clip(w - lr * (gw + c * jnp.sign(w) / layer.fan_in), -1.0, 1.0)
            new[layer.name] = {**new[layer.name], "kernel": kernel}
            tau[layer.name] = jnp.clip(tau[layer.name] + lr * c, 0.0, 1.0)
        return new, tau, all_ones

    params, tau = variables["params"], init_thresholds(structure)
    for t in range(epochs * per_epoch):
        batch_key, _ = jax.random.split(jax.random.fold_in(step_key, t))
        b = client_batch(data, orders[t // per_epoch], t % per_epoch, batch_size, batch_key, True)
        params, tau, all_ones = step(params, tau, b)
        assert bool(all_ones), f"a unit was pruned at step {t}"
    return params, tau


@pytest.fixture(scope="module")
def alpha0(mlp):
    local = LocalSGD(mlp, learning_rate=LR0, epochs=2, batch_size=8)
    algorithm = spafl(local, 0.0)
    return local, algorithm, jax.jit(algorithm.client_update)


def test_zero_alpha_and_zero_thresholds_keep_every_unit_and_train_like_dense_sgd(make_split, mlp, mlp_variables,
                                                                                   alpha0):
    """All masks are ones and the masked forward is the dense one, so the client trains exactly
    like dense SGD plus the straight-through term the mask adds to the weights' gradient
    (eq. 9 through mean |w|; with all masks ones it is the only difference) -- see
    `reference_training`. (With alpha = 0 the task gradient still trains the thresholds and
    could prune a unit after many steps; LR0 keeps this run short of that, as the reference
    asserts.) FLOPs: 3 x E x n x the dense forward, plus 1.5 d for eq. 13."""
    local, algorithm, client_update = alpha0
    split = make_split([20])
    variables = mlp_variables
    server, clients = algorithm.init(jax.random.key(1), variables, 1)
    state = tree_map(lambda a: a[0], clients)
    assert all(bool(m.all()) for m in threshold_masks(mlp.structure, variables["params"],
                                                      state["thresholds"]).values())
    x = jax.random.normal(jax.random.key(3), (4, 8, 8, 1))
    dense_logits, _ = mlp.apply(variables, x, train=False)
    sparse_logits, _ = mlp.apply(algorithm.client_variables(server, state), x, train=False)
    np.testing.assert_array_equal(sparse_logits, dense_logits)

    key = jax.random.key(4)
    up, new_state, metrics = client_update(algorithm.broadcast(server, 0), state, split.client(0), key)
    params, tau = reference_training(mlp, variables, split.client(0), key, LR0, 2, 8)
    assert_trees_close(new_state["variables"]["params"], params)
    assert_trees_close(new_state["thresholds"], tau, atol=1e-6)
    assert_trees_close(up, tau, atol=1e-6)
    assert float(metrics["density"]) == pytest.approx(1.0)
    expected = 3 * 2 * 20 * forward_flops(mlp.structure) + 1.5 * MLP_PARAMS
    assert float(metrics["train_flops"]) == pytest.approx(expected, rel=1e-6)
    assert float(new_state["train_flops_dense"]) == pytest.approx(3 * 2 * 20 * 84480, rel=1e-6)


def test_a_client_applies_eq13_with_the_change_since_its_last_download(make_split, mlp, mlp_variables, alpha0):
    """The client last received thresholds tau_last, now receives zeros: its weights first move
    by eq. 13 with dtau = 0 - tau_last (computed here with NumPy), then train as above."""
    local, algorithm, client_update = alpha0
    split = make_split([20])
    variables = mlp_variables
    server, clients = algorithm.init(jax.random.key(1), variables, 1)
    state = tree_map(lambda a: a[0], clients)
    last = {k: 0.05 * jax.random.uniform(jax.random.fold_in(jax.random.key(5), i), v.shape)
            for i, (k, v) in enumerate(state["global_thresholds"].items())}
    state = {**state, "global_thresholds": last}
    moved = {k: dict(v) for k, v in variables["params"].items()}
    for layer in mlp.structure.layers:
        w = np.asarray(moved[layer.name]["kernel"])
        dtau = -np.asarray(last[layer.name])
        moved[layer.name]["kernel"] = jnp.asarray(w - dtau / w.shape[0] * np.sign(w.sum(0)))
    key = jax.random.key(6)
    _, new_state, _ = client_update(server["thresholds"], state, split.client(0), key)
    params, tau = reference_training(mlp, {"params": moved, "batch_stats": {}}, split.client(0), key, LR0, 2, 8)
    assert_trees_close(new_state["variables"]["params"], params)
    assert_trees_close(new_state["thresholds"], tau, atol=1e-6)
    assert_trees_close(new_state["global_thresholds"], server["thresholds"])


# ------------------------------------------------------------------ rounds, bytes, FLOPs

def test_a_round_sends_only_thresholds_and_the_server_averages_them_uniformly(make_split, mlp, mlp_variables):
    split = make_split([9, 17, 12, 30])
    algorithm = spafl(LocalSGD(mlp, learning_rate=0.1, epochs=1, batch_size=8), 0.002)
    server, clients = algorithm.init(jax.random.key(1), mlp_variables, 4)
    round_fn = build_round(algorithm, split, 2, seed=3)
    previous = server
    for r in range(2):
        before = tree_map(jnp.copy, clients)
        server, clients, out = round_fn(previous, clients, r)
        ids = np.asarray(out.client_ids)
        # eq. 7: the uniform mean of the uploaded thresholds (not weighted by data size)
        assert_trees_close(server["thresholds"], tree_map(lambda t: t[ids].mean(0), clients["thresholds"]))
        assert_trees_close(tree_map(lambda t: t[ids], clients["global_thresholds"]),
                           tree_map(lambda t: jnp.broadcast_to(t, (2, *t.shape)), previous["thresholds"]))
        others = np.setdiff1d(np.arange(4), ids)
        assert_trees_close(tree_map(lambda a: a[others], clients), tree_map(lambda a: a[others], before))
        # 2 x K x (number of thresholds) x 4 bytes per round
        np.testing.assert_array_equal(out.uplink_bytes, [MLP_THRESHOLDS * 4] * 2)
        np.testing.assert_array_equal(out.downlink_bytes, [MLP_THRESHOLDS * 4] * 2)
        previous = server
    assert float(server["thresholds"]["fc2"].mean()) > 0  # alpha > 0 raised them


def test_lenet5_caffe_bytes_give_the_papers_01856_gbit():
    """580 thresholds x 4 bytes each way x K = 10 x 500 rounds = 0.1856 Gbit (SpaFL Table 2, FMNIST)."""
    lenet = get_model("lenet5_caffe", (28, 28, 1), 10)
    algorithm = spafl(LocalSGD(lenet, learning_rate=0.001, epochs=5, batch_size=64), 0.002)
    key = jax.random.key(0)
    server, _ = jax.eval_shape(lambda: algorithm.init(key, lenet.init(key), 2))  # shapes suffice
    down = algorithm.broadcast(server, 0)
    assert sum(math.prod(t.shape) for t in jax.tree_util.tree_leaves(down)) == 580
    per_message = int(message_bytes(down))
    assert per_message == 580 * 4
    up = init_thresholds(lenet.structure)  # an upload has the same shape
    gbit = 500 * 10 * (per_message + int(message_bytes(up))) * 8 / 1e9
    assert gbit == pytest.approx(0.1856)


def test_flops_of_lenet5_caffe_by_hand():
    """Per example: conv1 5*5*1 x 20 x 24*24 = 288,000; conv2 5*5*20 x 50 x 8*8 = 1,600,000;
    fc1 800 x 500 = 400,000; fc2 500 x 10 = 5,000 -> 2,293,000; training = 3 x forward."""
    structure = get_model("lenet5_caffe", (28, 28, 1), 10).structure
    assert forward_flops(structure) == 2_293_000
    assert training_flops(structure, 10) == 3 * 10 * 2_293_000
    assert training_flops(structure, 10, update_params=430_500) == 3 * 10 * 2_293_000 + 645_750
    # half of conv1, conv2 and fc1 pruned
    masks = {"conv1": jnp.arange(20) < 10, "conv2": jnp.arange(50) < 25, "fc1": jnp.arange(500) < 250,
             "fc2": jnp.ones(10, bool)}
    # the paper's formula, each layer scaled by its own density: 288,000 / 2 + 1,600,000 / 2 + 400,000 / 2 + 5,000
    assert float(forward_flops(structure, masks)) == 144_000 + 800_000 + 200_000 + 5_000
    assert float(training_flops(structure, 4, masks)) == 3 * 4 * 1_149_000
    # counting live inputs too: conv1 25 x 10 x 576 + conv2 250 x 25 x 64 + fc1 400 x 250 + fc2 250 x 10
    assert float(forward_flops(structure, masks, count_inputs=True)) == 144_000 + 400_000 + 100_000 + 2_500
    assert float(training_flops(structure, 4, masks, count_inputs=True)) == 3 * 4 * 646_500


def test_bad_sparsity_coefficient_is_refused(mlp):
    with pytest.raises(ValueError, match="sparsity-coef"):
        spafl(LocalSGD(mlp, 0.1, 1, 8), -0.1)
    with pytest.raises(ValueError, match="sparsity-coef"):
        spafl_local(LocalSGD(mlp, 0.1, 1, 8), float("nan"))


# ------------------------------------------------------------------ the command line

def test_cli_spafl_on_digits_logs_density_flops_and_threshold_bytes(tmp_path, capsys):
    out = tmp_path / "spafl"
    args = ["run", "--algorithm", "spafl", "--num-clients", "6", "--clients-per-round", "3", "--rounds", "3",
            "--local-epochs", "1", "--sparsity-coef", "0.01", "--eval-every", "2", "--no-progress",
            "--out", str(out)]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 3]
    last = rows[-1]
    assert last["test_accuracy"] is None and 0 <= last["personalized_accuracy"] <= 1
    assert last["uplink_bytes"] == last["downlink_bytes"] == 3 * MLP_THRESHOLDS * 4
    assert 0 < last["density"] <= 1 and set(last["density_per_layer"]) == {"fc1", "fc2", "fc3"}
    assert 0 < last["train_flops"] <= last["train_flops_dense"] + 3 * 3 * 1.5 * MLP_PARAMS
    assert last["train_flops_dense"] > rows[0]["train_flops_dense"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cumulative_bytes"] == 3 * 2 * 3 * MLP_THRESHOLDS * 4

    assert main([*args[:-1], str(tmp_path / "bad"), "--sparsity-coef", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sparsity-coef" in err[0]


def test_experiment_settings_are_valid_and_quick_means_digits(monkeypatch, tmp_path):
    import experiments.spafl as module
    from fedjax_sparse.algorithms import ALGORITHM_NAMES
    for setting in module.SETTINGS.values():
        assert [a.label for a in setting.arms] == ["fedavg", "local", "spafl", "spafl_no_eq13"]
        for quick in (False, True):
            for arm in setting.arms:
                config = setting.arm_config(arm, tmp_path, quick)
                config.validate()
                assert config.algorithm in ALGORITHM_NAMES
    done = module.SETTINGS["digits"].config  # the done criterion
    assert (done.model, done.num_clients, done.clients_per_round, done.rounds, done.local_epochs,
            done.batch_size, done.lr, done.alpha) == ("mlp", 20, 10, 50, 5, 16, 0.1, 0.5)
    seen = []
    monkeypatch.setattr(module, "main", lambda settings, name, argv: seen.append(argv) or 0)
    assert module.run(["--quick"]) == 0 and seen[-1] == ["--quick", "--setting", "digits"]
    assert module.run(["--quick", "--setting", "cifar10"]) == 0 and seen[-1] == ["--quick", "--setting", "cifar10"]


def test_experiment_module_runs_and_tabulates_every_arm(monkeypatch, tmp_path):
    """`python -m experiments.spafl --quick`, shrunk to 2 rounds of 3 clients: the Table 2 columns."""
    import csv
    import dataclasses

    import experiments.spafl as module
    tiny = {"rounds": 2, "num_clients": 6, "clients_per_round": 3, "local_epochs": 1}
    monkeypatch.setitem(module.SETTINGS, "digits", dataclasses.replace(module.SETTINGS["digits"], quick=tiny))
    assert module.run(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    folder = tmp_path / "digits"
    with (folder / "results.csv").open() as f:
        rows = {r["algorithm"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["fedavg", "local", "spafl", "spafl_no_eq13"]
    assert float(rows["fedavg"]["total_gbit"]) == pytest.approx(2 * 3 * 2 * MLP_PARAMS * 4 * 8 / 1e9)
    for name in ("spafl", "spafl_no_eq13"):
        assert float(rows[name]["total_gbit"]) == pytest.approx(2 * 3 * 2 * MLP_THRESHOLDS * 4 * 8 / 1e9)
        assert 0 < float(rows[name]["density"]) <= 1
        assert 0 < float(rows[name]["train_flops"]) <= float(rows[name]["train_flops_dense"]) + 6 * 1.5 * MLP_PARAMS
    assert float(rows["local"]["total_gbit"]) == 0
    assert "| spafl |" in (folder / "results.md").read_text()
    assert (folder / "comparison.png").stat().st_size > 1000
