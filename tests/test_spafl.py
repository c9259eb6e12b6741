"""SpaFL against independent truths: hand-computed gradients, eq. 13 and FLOPs by hand,
a hand-written training loop, the paper's byte figure."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import initialized
from fedjax_sparse.algorithms import spafl, spafl_code, spafl_local
from fedjax_sparse.algorithms.spafl import (global_threshold_update, init_thresholds, local_objective,
                                            reset_collapsed_layers, ste_masks, threshold_masks,
                                            unit_magnitudes)
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.structure.flops import forward_flops, training_flops
from fedjax_sparse.core.round.local_training import LocalSGD, clip_grad_norm, masked_cross_entropy
from fedjax_sparse.core.messages.pricing import message_bytes
from fedjax_sparse.core.round.step import build_round
from fedjax_sparse.core.structure.unit_masks import (density, layer_mean_density, live_input_fraction,
                                           variable_masks)
from fedjax_sparse.data.federated import client_batch, epoch_permutations, steps_per_epoch
from fedjax_sparse.core.round.step import round_info
from fedjax_sparse.models import Layer, ModelStructure, get_model
from fedjax_sparse.models.structure import get_path, set_path

tree_map = jax.tree_util.tree_map
MLP_THRESHOLDS = 256 + 256 + 10
MLP_PARAMS = 85002
MLP_WEIGHTS = 64 * 256 + 256 * 256 + 256 * 10  # the kernels: SpaFL's d
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

def ste_loss(model, x, y):
    """Task loss of the model run with straight-through threshold masks on its unit outputs."""
    def loss(params, tau, batch_stats):
        variables = {"params": params, "batch_stats": batch_stats,
                     "unit_masks": ste_masks(model.structure, params, tau)}
        logits, _ = model.apply(variables, x, train=True)
        return optax_ce(logits, y)
    return loss


def optax_ce(logits, y):
    return masked_cross_entropy(logits, y, jnp.ones(y.shape, bool))


def median_thresholds(structure, params):
    """Thresholds at each layer's median unit magnitude: about half of every layer pruned."""
    mu = unit_magnitudes(structure, params)
    return {k: jnp.full_like(v, jnp.median(v)) for k, v in mu.items()}


def test_ste_gradients_on_a_no_bias_no_norm_model_are_eq9_as_the_paper_writes_it():
    """LeNet-5-Caffe has no biases and no normalization. For a kept unit, masking its output is
    masking its kernel slice, and eq. 9 holds verbatim: with g = dL/dW~ of the kernel-masked model
    W~ = w * m,  dL/dtau_i = -sum_j g_ij w_ij  and  dL/dw_ij = g_ij + (sum_k g_ik w_ik) sign(w_ij) / n_i.
    For a pruned unit the kernel-masked g is 0 (ReLU's kink); the mask at its output instead gets
    the one-sided derivative of switching it back on: -dL/dtau_i = d/de L(W~ with unit i's kernel
    scaled by e) at e = 0+, checked by a forward difference (ReLU(e h) = e ReLU(h) for e > 0)."""
    model, variables = initialized("lenet5_caffe", (16, 16, 1), 10)
    params = variables["params"]
    tau = median_thresholds(model.structure, params)
    x = jax.random.normal(jax.random.key(1), (6, 16, 16, 1))
    y = jnp.arange(6) % 10
    g_params, g_tau = jax.jit(jax.grad(ste_loss(model, x, y), argnums=(0, 1)))(params, tau, {})

    masks = threshold_masks(model.structure, params, tau)

    @jax.jit
    def kernel_masked(p):
        logits, _ = model.apply({"params": p, "batch_stats": {}}, x, train=True)
        return optax_ce(logits, y)

    w_tilde = {k: {"kernel": v["kernel"] * masks[k]} for k, v in params.items()}
    g = jax.jit(jax.grad(kernel_masked))(w_tilde)
    base = float(kernel_masked(w_tilde))
    for layer in model.structure.layers:
        w = np.asarray(params[layer.name]["kernel"]).reshape(-1, layer.num_units)
        gw = np.asarray(g[layer.name]["kernel"]).reshape(-1, layer.num_units)
        m = np.asarray(masks[layer.name])
        c = (gw * w).sum(0)
        assert 0 < m.sum() < len(m)
        np.testing.assert_allclose(np.asarray(g_tau[layer.name])[m], -c[m], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(np.asarray(g_params[layer.name]["kernel"]).reshape(w.shape)[:, m],
                                   gw[:, m] + c[m] * np.sign(w[:, m]) / layer.fan_in, rtol=1e-4, atol=1e-7)
        pruned = np.flatnonzero(~m)
        for unit in pruned[np.argsort(-np.abs(np.asarray(g_tau[layer.name])[pruned]))[:2]]:
            e = 1e-2
            on = jax.tree_util.tree_map(lambda a: a, w_tilde)
            kernel = on[layer.name]["kernel"]
            on[layer.name]["kernel"] = kernel.at[..., unit].set(params[layer.name]["kernel"][..., unit] * e)
            slope = (float(kernel_masked(on)) - base) / e
            assert float(-g_tau[layer.name][unit]) == pytest.approx(slope, rel=0.05, abs=1e-6)


def _threshold_task_gradients(model, variables, key):
    """|dL/dtau| of the task loss for kept and for pruned units, at median thresholds."""
    params = variables["params"]
    tau = median_thresholds(model.structure, params)
    x = jax.random.normal(key, (16, *model.input_shape))
    y = jnp.arange(16) % model.num_classes
    g_tau = jax.jit(jax.grad(ste_loss(model, x, y), argnums=1))(params, tau, variables["batch_stats"])
    masks = threshold_masks(model.structure, params, tau)
    hidden = [l.name for l in model.structure.layers[:-1]]
    kept = np.concatenate([np.abs(g_tau[n])[np.asarray(masks[n])] for n in hidden])
    pruned = np.concatenate([np.abs(g_tau[n])[~np.asarray(masks[n])] for n in hidden])
    return kept, pruned


def test_thresholds_behind_batchnorm_get_task_gradients_for_kept_and_pruned_units(mlp, mlp_variables):
    """The review's finding: with the mask on the kernel, BatchNorm (scale invariant) gave kept
    units ~1e-7 and pruned units exactly 0. With the mask on the unit's output, both get
    gradients of the same order as on the MLP, which has no normalization."""
    kept, pruned = _threshold_task_gradients(*initialized("spafl_cnn", (28, 28, 3), 10), jax.random.key(1))
    mlp_kept, mlp_pruned = _threshold_task_gradients(mlp, mlp_variables, jax.random.key(1))
    assert np.all(pruned > 0) and np.all(kept > 0)
    for ours, reference in ((kept, mlp_kept), (pruned, mlp_pruned)):
        ratio = np.median(ours) / np.median(reference)
        assert 0.01 < ratio < 100, (np.median(ours), np.median(reference))


def _perturb_unit(variables, layer, unit, scale):
    """Variables with every leaf that belongs to one unit (kernel column, bias, norm scale/bias) changed."""
    out = jax.tree_util.tree_map(lambda a: a, variables)
    paths = [layer.kernel] + ([layer.bias] if layer.bias else [])
    if layer.norm is not None:
        paths += [layer.norm + (k,) for k in ("scale", "bias")]
    for path in paths:
        leaf = get_path(out["params"], path)
        out = {**out, "params": set_path(out["params"], path, leaf.at[..., unit].add(scale))}
    return out


@pytest.mark.parametrize("name,shape", [("mlp", (8, 8, 1)), ("spafl_cnn", (28, 28, 3)),
                                        ("preresnet18", (8, 8, 3))])
def test_a_pruned_unit_outputs_zero(name, shape):
    """Whatever a pruned unit's own kernel, bias and normalization parameters are, the network's
    output is the same: the unit contributes exactly zero (behind BN too, and in a residual
    stream when its whole unit group drops it). The output layer's pruned logits are zero."""
    model, variables = initialized(name, shape, 10)
    apply = jax.jit(lambda variables, x: model.apply(variables, x, train=False)[0])  # eagerly: op by op, per shape
    groups = {}
    for layer in model.structure.layers:
        groups.setdefault(layer.unit_group or layer.name, []).append(layer)
    masks = {l.name: (jnp.arange(l.num_units) % 3 != 1).astype(jnp.float32) for l in model.structure.layers}
    x = jax.random.normal(jax.random.key(1), (4, *shape))
    masked = {**variables, "unit_masks": masks}
    reference = apply(masked, x)
    np.testing.assert_array_equal(np.asarray(reference)[:, 1::3], 0.0)
    for members in list(groups.values())[:6]:
        changed = masked
        for layer in members:
            changed = _perturb_unit(changed, layer, 1, 3.0)
        out = apply(changed, x)
        np.testing.assert_allclose(out, reference, atol=1e-5, err_msg=str([l.name for l in members]))
    # and a kept unit does matter
    out = apply(_perturb_unit(masked, model.structure.layers[0], 0, 3.0), x)
    assert float(jnp.abs(out - reference).max()) > 1e-3


def test_variable_masks_keep_a_kernel_entry_when_its_output_and_input_units_are_kept():
    """fc reads 2 input units each twice (input_repeat 2, channel fastest: rows 0, 2 = unit 0,
    rows 1, 3 = unit 1); the producer keeps only unit 1, fc keeps units 0 and 2 of 3."""
    layers = (Layer("a", "dense", ("a", "kernel"), ("a", "bias"), ("bn",), 2, 3, ("input",)),
              Layer("fc", "dense", ("fc", "kernel"), ("fc", "bias"), None, 3, 4, ("a",), input_repeat=2))
    structure = ModelStructure(layers)
    variables = {"params": {"a": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)},
                            "bn": {"scale": jnp.ones(2), "bias": jnp.ones(2)},
                            "fc": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(3)}},
                 "batch_stats": {"bn": {"mean": jnp.zeros(2), "var": jnp.ones(2)}}}
    masks = {"a": jnp.array([0.0, 1.0]), "fc": jnp.array([1.0, 0.0, 1.0])}
    vm = variable_masks(structure, variables, masks)
    np.testing.assert_array_equal(vm["params"]["a"]["kernel"], [[False, True]] * 3)
    np.testing.assert_array_equal(vm["params"]["fc"]["kernel"],
                                  [[False, False, False], [True, False, True]] * 2)
    np.testing.assert_array_equal(vm["params"]["fc"]["bias"], [True, False, True])
    np.testing.assert_array_equal(vm["params"]["bn"]["bias"], [False, True])
    np.testing.assert_array_equal(vm["batch_stats"]["bn"]["var"], [False, True])


def test_unit_mask_density_variable_masks_and_live_inputs_by_hand(mlp, mlp_variables):
    masks = {"fc1": jnp.arange(256) < 128, "fc2": jnp.arange(256) < 64, "fc3": jnp.ones(10, bool)}
    overall, per_layer = density(mlp.structure, masks)
    # kept kernel weights: 128 * 64 + 64 * 256 + 10 * 256 of 84,480
    assert float(overall) == pytest.approx((128 * 64 + 64 * 256 + 10 * 256) / 84480)
    assert float(per_layer["fc2"]) == 0.25
    # the official code's density: the plain mean of the layer densities (0.5 + 0.25 + 1) / 3
    assert float(layer_mean_density(mlp.structure, masks)) == pytest.approx(1.75 / 3)
    vm = variable_masks(mlp.structure, mlp_variables, masks)["params"]
    assert vm["fc2"]["kernel"].shape == (256, 256) and int(vm["fc2"]["kernel"].sum()) == 128 * 64
    assert int(vm["fc3"]["kernel"].sum()) == 64 * 10 and int(vm["fc1"]["bias"].sum()) == 128
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
        trained, stats = local.train(variables, split.client(0), jax.random.key(2),
                                     extra={"thresholds": init_thresholds(structure)},
                                     objective=local_objective(structure, alpha, True))
        tau = trained["thresholds"]
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
    task loss, plus on every kernel the STE term c_i sign(w_ij) / n_i, thresholds
    tau_i <- clip(tau_i + lr c_i, 0, 1), kernels clipped to [-1, 1], where c_i = dL/dm_i =
    sum over examples of dL/dh_i * h_i with h_i = sum_j w_ij x_j + b_i the unit's output, i.e.
    sum_j g_ij w_ij + g_bias_i b_i (the MLP has biases). Asserts that every mask stays all ones,
    which makes the dense gradient the masked model's gradient."""
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
            c = jnp.sum(gw * w, axis=0) + g[layer.name]["bias"] * params[layer.name]["bias"]
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
    info = round_info(0, 0, jnp.array([0]))
    up, new_state, metrics = client_update(algorithm.broadcast(server, 0, info), state, split.client(0), key, info)
    params, tau = reference_training(mlp, variables, split.client(0), key, LR0, 2, 8)
    assert_trees_close(new_state["variables"]["params"], params)
    assert_trees_close(new_state["thresholds"], tau, atol=1e-6)
    assert_trees_close(up, tau, atol=1e-6)
    assert float(metrics["weight_density"]) == pytest.approx(1.0)
    expected = 3 * 2 * 20 * forward_flops(mlp.structure) + 1.5 * MLP_PARAMS
    assert float(metrics["train_flops"]) == pytest.approx(expected, rel=1e-6)


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
    _, new_state, _ = client_update(server["thresholds"], state, split.client(0), key, round_info(0, 0, jnp.array([0])))
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
    down = algorithm.broadcast(server, 0, None)
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


# ------------------------------------------------------------------ the official code's variant (spafl_code)

def test_code_step_passes_the_gradient_only_where_u_is_more_than_one_from_zero():
    """BinaryStep: forward 1 where u > 0; backward g * [|u| > 1] (the paper's: g everywhere)."""
    u = jnp.array([-1.5, -1.0, -0.2, 0.0, 0.7, 1.0, 1.2])
    g = jnp.arange(1.0, 8.0)
    np.testing.assert_array_equal(spafl_code.code_step(u), [0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(jax.grad(lambda u: jnp.sum(spafl_code.code_step(u) * g))(u),
                                  [1, 0, 0, 0, 0, 0, 7])


def test_code_eq13_divides_a_conv_by_k2_and_a_dense_layer_by_its_fan_in():
    """A 2x2 conv with 3 input channels (fan-in 12, k^2 = 4): unit 0 all 0.1 (sum > 0), unit 1 all -0.1,
    dtau = (0.4, 0.8). The code: 0.1 - 0.4/4 = 0 and -0.1 + 0.8/4 = 0.1; the paper's reading:
    0.1 - 0.4/12 and -0.1 + 0.8/12. A dense layer (fan-in 2) divides by 2 in both."""
    conv = Layer(name="c", kind="conv", kernel=("c", "kernel"), bias=None, norm=None, num_units=2, fan_in=12,
                 inputs_from=("input",))
    dense = Layer(name="d", kind="dense", kernel=("d", "kernel"), bias=None, norm=None, num_units=1, fan_in=2,
                  inputs_from=("c",))
    structure = ModelStructure((conv, dense))
    params = {"c": {"kernel": jnp.stack([jnp.full((2, 2, 3), 0.1), jnp.full((2, 2, 3), -0.1)], axis=-1)},
              "d": {"kernel": jnp.array([[0.3], [0.1]])}}
    delta = {"c": jnp.array([0.4, 0.8]), "d": jnp.array([0.2])}
    code = global_threshold_update(structure, params, delta, spafl_code.eq13_divisor)
    paper = global_threshold_update(structure, params, delta)
    np.testing.assert_allclose(code["c"]["kernel"][..., 0], 0.0, atol=1e-7)
    np.testing.assert_allclose(code["c"]["kernel"][..., 1], 0.1, atol=1e-7)
    np.testing.assert_allclose(paper["c"]["kernel"][..., 0], 0.1 - 0.4 / 12, atol=1e-7)
    np.testing.assert_allclose(paper["c"]["kernel"][..., 1], -0.1 + 0.8 / 12, atol=1e-7)
    for new in (code, paper):
        np.testing.assert_allclose(new["d"]["kernel"], [[0.2], [0.0]], atol=1e-7)


def test_code_clips_the_gradients_global_norm_to_3():
    """torch's clip_grad_norm_: norm 5 (3, 4, 0 over two leaves) -> times 3 / (5 + 1e-6); norm 2 untouched."""
    clip = clip_grad_norm(3.0)
    big = {"a": jnp.array([3.0, 4.0]), "b": jnp.zeros(1)}
    out, _ = clip.update(big, clip.init(big))
    np.testing.assert_allclose(out["a"], np.array([3.0, 4.0]) * 3.0 / (5.0 + 1e-6), rtol=1e-6)
    small = {"a": jnp.array([1.2, 1.6]), "b": jnp.zeros(1)}
    np.testing.assert_array_equal(clip.update(small, clip.init(small))[0]["a"], small["a"])


def test_code_reset_fires_at_one_percent_where_the_papers_reading_needs_below():
    """A layer of 100 units keeping 1 (exactly 1 %) is reset by the code's `ratio <= 0.01`, not by the
    paper's reading's `< 1 %`; keeping 2 it is reset by neither."""
    one, two = jnp.arange(100) < 1, jnp.arange(100) < 2
    tau = jnp.full(100, 0.5)
    out, resets = spafl_code.reset_after_collapse({"one": one, "two": two}, {"one": tau, "two": tau})
    np.testing.assert_array_equal(out["one"], 0.0)
    np.testing.assert_array_equal(out["two"], tau)
    assert int(resets) == 1
    layer = Layer(name="one", kind="dense", kernel=("one", "kernel"), bias=None, norm=None, num_units=100,
                  fan_in=1, inputs_from=("input",))
    kernel = jnp.where(one, 1.0, 0.1)[None, :]  # mean |w| 1 for unit 0, 0.1 for the others: tau 0.5 keeps one
    paper, paper_resets = reset_collapsed_layers(ModelStructure((layer,)), {"one": {"kernel": kernel}}, {"one": tau})
    assert int(paper_resets) == 0
    np.testing.assert_array_equal(paper["one"], tau)


def code_reference_training(model, params, tau, data, key, lr, epochs, batch_size, alpha):
    """The official CIFAR-10 client's local training written out, plain SGD: W~ = w * m with
    m_i = [mu_i > tau_i]; g = dL/dW~; gate_i = [|mu_i - tau_i| > 1]; c_i = sum_j g_ij w_ij;
    dL/dw_ij = g_ij m_i + gate_i c_i sign(w_ij) / n_i; dL/dtau_i = -gate_i c_i - alpha exp(-tau_i);
    every gradient times min(1, 3 / (global norm + 1e-6)); no clipping of values; then a layer whose
    mask at this step kept at most 1 % of its units gets zero thresholds. Returns the trained
    (params, tau), the steps' gradient norms and the resets."""
    structure = model.structure
    order_key, step_key = jax.random.split(key)
    orders = epoch_permutations(order_key, data.count, data.max_count, epochs)
    per_epoch = int(steps_per_epoch(data.count, batch_size))

    @jax.jit
    def step(params, tau, b):
        mu = {l.name: jnp.mean(jnp.abs(params[l.name]["kernel"]), axis=tuple(range(params[l.name]["kernel"].ndim - 1)))
              for l in structure.layers}
        masks = {k: (mu[k] > tau[k]).astype(jnp.float32) for k in mu}
        gates = {k: (jnp.abs(mu[k] - tau[k]) > 1).astype(jnp.float32) for k in mu}
        w_tilde = {k: {"kernel": v["kernel"] * masks[k]} for k, v in params.items()}

        def loss(p):
            logits, _ = model.apply({"params": p, "batch_stats": {}}, b.x, train=True, mask=b.mask)
            return masked_cross_entropy(logits, b.y, b.mask)

        g = jax.grad(loss)(w_tilde)
        grads, g_tau = {}, {}
        for layer in structure.layers:
            w, gw, name = params[layer.name]["kernel"], g[layer.name]["kernel"], layer.name
            c = jnp.sum((gw * w).reshape(-1, layer.num_units), axis=0) * gates[name]
            grads[name] = {"kernel": gw * masks[name] + c * jnp.sign(w) / layer.fan_in}
            g_tau[name] = -c - alpha * jnp.exp(-tau[name])
        norm = jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves((grads, g_tau))))
        scale = jnp.minimum(1.0, 3.0 / (norm + 1e-6))
        params = tree_map(lambda w, gw: w - lr * scale * gw, params, grads)
        tau = {k: tau[k] - lr * scale * g_tau[k] for k in tau}
        collapsed = {k: 100 * jnp.sum(masks[k]) <= masks[k].size for k in masks}
        tau = {k: jnp.where(collapsed[k], 0.0, tau[k]) for k in tau}
        return params, tau, norm, sum(v.astype(jnp.int32) for v in collapsed.values())

    norms, resets = [], 0
    for t in range(epochs * per_epoch):
        batch_key, _ = jax.random.split(jax.random.fold_in(step_key, t))
        b = client_batch(data, orders[t // per_epoch], t % per_epoch, batch_size, batch_key, True)
        params, tau, norm, reset = step(params, tau, b)
        norms.append(float(norm))
        resets += int(reset)
    return params, tau, norms, resets


def test_a_code_client_is_the_official_step_written_out(make_split):
    """LeNet-5-Caffe (no biases, no normalization), alpha 0.5, two steps: eq. 13 with the code's
    divisors (k^2 = 25 for conv2, whose fan-in is 500), then `code_reference_training`. Thresholds
    are set 1.5 from their unit's magnitude (gate open, kept or pruned) or 0.5 (gate shut), outside
    [0, 1] where the code leaves them; fc1 keeps exactly 5 of its 500 units (1 %) and is reset after the
    first step (the second then moves its thresholds from zero)."""
    model, variables = initialized("lenet5_caffe", (16, 16, 1), 10)
    split = make_split([8], shape=(16, 16, 1))
    local = LocalSGD(model, learning_rate=0.05, epochs=1, batch_size=4)
    algorithm = spafl(local, 0.5, variant="code")
    server, clients = jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), variables, 1)
    state = tree_map(lambda a: a[0], clients)
    params = state["variables"]["params"]
    mu = unit_magnitudes(model.structure, params)
    offsets = {k: jnp.array([-1.5, 1.5, -0.5, 0.5])[jnp.arange(v.shape[0]) % 4] for k, v in mu.items()}
    offsets["fc1"] = jnp.where(jnp.arange(500) < 5, -1.5, 1.5)
    down = {k: mu[k] + offsets[k] for k in mu}
    delta = {k: 0.01 * jax.random.normal(jax.random.fold_in(jax.random.key(2), i), v.shape)
             for i, (k, v) in enumerate(mu.items())}
    state = {**state, "global_thresholds": {k: down[k] - delta[k] for k in down}}
    key = jax.random.key(3)
    up, new_state, metrics = jax.jit(algorithm.client_update)(down, state, split.client(0), key,
                                                              round_info(0, 0, jnp.array([0])))

    moved = {}
    for layer in model.structure.layers:
        w = np.asarray(params[layer.name]["kernel"])
        n = 25 if layer.kind == "conv" else layer.fan_in
        sums = w.reshape(-1, layer.num_units).sum(0)
        moved[layer.name] = {"kernel": jnp.asarray(w - np.asarray(delta[layer.name]) / n * np.sign(sums))}
    ref_params, ref_tau, norms, resets = code_reference_training(model, moved, down, split.client(0), key,
                                                                 0.05, 1, 4, 0.5)
    assert all(norm > 3 for norm in norms)  # the clip is exercised
    assert resets == int(metrics["threshold_resets"]) == 1
    assert_trees_close(new_state["variables"]["params"], ref_params, atol=1e-6)
    assert_trees_close(new_state["thresholds"], ref_tau, atol=1e-6)
    assert_trees_close(up, ref_tau, atol=1e-6)
    assert min(float(t.min()) for t in ref_tau.values()) < 0 < 1 < max(float(t.max()) for t in ref_tau.values())


def test_code_bounds_nothing_and_evaluates_kernel_masked_models_where_paper_clips(make_split, mlp, mlp_variables):
    """From thresholds -0.5 and kernel entries at 1.5, one client update: the paper's reading clips
    weights to [-1, 1] and thresholds to [0, 1]; the code leaves them. The code's evaluated model
    has a pruned unit's kernel zeroed and no output masks (the paper's: its kernel and masks)."""
    split = make_split([16])
    local = LocalSGD(mlp, learning_rate=0.01, epochs=1, batch_size=8)
    params = dict(mlp_variables["params"])
    params["fc2"] = {**params["fc2"], "kernel": params["fc2"]["kernel"].at[0, :].set(1.5)}
    out = {}
    for variant in ("paper", "code"):
        algorithm = spafl(local, 0.002, variant=variant)
        _, clients = algorithm.init(jax.random.key(1), {"params": params, "batch_stats": {}}, 1)
        state = tree_map(lambda a: a[0], clients)
        state = {**state, "variables": {"params": params, "batch_stats": {}}}  # the same start for both
        down = tree_map(lambda t: jnp.full_like(t, -0.5), state["thresholds"])
        state = {**state, "global_thresholds": down}
        _, new_state, _ = algorithm.client_update(down, state, split.client(0), jax.random.key(2),
                                                  round_info(0, 0, jnp.array([0])))
        out[variant] = new_state
        tau = jax.tree_util.tree_leaves(new_state["thresholds"])
        top = float(jnp.abs(new_state["variables"]["params"]["fc2"]["kernel"]).max())
        if variant == "paper":
            assert min(float(t.min()) for t in tau) >= 0.0 and top <= 1.0
        else:
            assert max(float(t.max()) for t in tau) < 0.0 and top > 1.4
    pruned = {"params": params, "batch_stats": {}}
    state = {**out["code"], "variables": pruned,
             "thresholds": {**out["code"]["thresholds"], "fc2": jnp.where(jnp.arange(256) == 3, 10.0, -1.0)}}
    code_vars = spafl(local, 0.002, variant="code").client_variables(None, state)
    assert "unit_masks" not in code_vars
    np.testing.assert_array_equal(code_vars["params"]["fc2"]["kernel"][:, 3], 0.0)
    np.testing.assert_array_equal(code_vars["params"]["fc2"]["kernel"][:, 4], params["fc2"]["kernel"][:, 4])
    paper_vars = spafl(local, 0.002).client_variables(None, state)
    assert float(paper_vars["unit_masks"]["fc2"][3]) == 0.0
    np.testing.assert_array_equal(paper_vars["params"]["fc2"]["kernel"], params["fc2"]["kernel"])


def test_code_clients_start_from_one_draw_of_torchs_uniform_kernels():
    """kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(n), 1/sqrt(n)), so |w| <= 1/sqrt(n) and mean |w| = 1/(2 sqrt(n)),
    on SpaFL's CNN (n = 75 for conv1, 1,600 for conv2); every client the same; the paper's reading keeps the
    zoo's He / LeCun normal kernels."""
    model, variables = initialized("spafl_cnn", (28, 28, 3), 10)
    local = LocalSGD(model, learning_rate=0.01, epochs=1, batch_size=16)
    _, clients = jax.jit(spafl(local, 0.00015, variant="code").init, static_argnums=2)(jax.random.key(1), variables, 3)
    for layer in model.structure.layers:
        kernels = np.asarray(clients["variables"]["params"][layer.name]["kernel"])
        bound = 1.0 / math.sqrt(layer.fan_in)
        assert np.all(kernels[1:] == kernels[0]) and np.abs(kernels).max() <= bound
        assert np.abs(kernels[0]).mean() == pytest.approx(bound / 2, rel=0.08)
        assert np.abs(kernels[0]).max() > 0.95 * bound
    _, clients = jax.jit(spafl(local, 0.00015).init, static_argnums=2)(jax.random.key(1), variables, 3)
    assert_trees_close(tree_map(lambda a: a[0], clients["variables"]), variables, atol=0, rtol=0)


def test_a_bad_variant_is_refused(mlp):
    from fedjax_sparse.run import RunConfig
    with pytest.raises(ValueError, match="--spafl-variant must be one of paper, code, got codes$"):
        spafl(LocalSGD(mlp, 0.1, 1, 8), 0.1, variant="codes")
    with pytest.raises(ValueError, match="--spafl-variant must be one of paper, code, got x"):
        RunConfig.create(algorithm="spafl_local", spafl_variant="x").validate()
    with pytest.raises(ValueError, match="--weight-bounds is not read by --spafl-variant code"):
        RunConfig.create(algorithm="spafl", spafl_variant="code", weight_bounds=False).validate()


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
    assert 0 < last["weight_density"] <= 1 and set(last["density_per_layer"]) == {"fc1", "fc2", "fc3"}
    assert last["mean_layer_density"] == pytest.approx(np.mean(list(last["density_per_layer"].values())))
    # per-client figures: totals / 6 clients; 3 rounds x 3 clients each pay 1.5 d for eq. 13
    assert last["train_flops"] == pytest.approx(last["train_flops_total"] / 6)
    assert 0 < last["train_flops"] <= last["dense_train_flops"] + 3 * 3 * 1.5 * MLP_PARAMS / 6
    assert last["dense_train_flops"] > rows[0]["dense_train_flops"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cumulative_bytes"] == 3 * 2 * 3 * MLP_THRESHOLDS * 4
    # the clients in host memory, evaluated and diagnosed a round's three at a time: the same figures
    assert main([*args[:-1], str(tmp_path / "host"), "--client-store", "host"]) == 0
    assert (tmp_path / "host" / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()

    assert main([*args[:-1], str(tmp_path / "bad"), "--sparsity-coef", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sparsity-coef" in err[0]


def test_experiment_settings_are_valid_and_quick_means_digits(monkeypatch, tmp_path):
    """Every setting lays out Table 2's eight rows and the eq. 13 ablation, each arm as appendix A.1.1
    runs it and at its Table 7 learning rate."""
    import experiments.spafl as module
    algorithms = {"fedavg": "fedavg", "local": "spafl_local", "spafl": "spafl", "spafl_no_eq13": "spafl",
                  "fedpm": "fedpm", "heterofl": "heterofl", "fjord": "fjord", "fedspa": "fedspa", "fedp3": "fedp3",
                  "spafl_alpha_scaled": "spafl"}
    rates = {"cifar10": {"heterofl": 0.005, "fedpm": 0.1}, "cifar10_cpu": {"heterofl": 0.005, "fedpm": 0.1},
             "fmnist": {"fedpm": 0.1}, "digits": {}}
    scaled = {"cifar10_cpu": 0.064174, "digits": 0.0032837}  # see test_the_scaled_alpha_rows_by_hand
    for setting in module.SETTINGS.values():
        extra = ["spafl_alpha_scaled"] if setting.name in scaled else []
        assert [a.label for a in setting.arms] == list(module.ROWS) + extra
        for quick in (False, True):
            for arm in setting.arms:
                config = setting.arm_config(arm, tmp_path, quick)
                config.validate()
                assert config.algorithm == algorithms[arm.label]
                assert config.lr == rates[setting.name].get(arm.label, setting.config.lr), (setting.name, arm.label)
                options = config.algorithm_options
                if arm.label == "fedavg":  # appendix A.1.1: FedAvg's clients weigh equally
                    assert options.aggregation_weights == "uniform"
                elif arm.label == "spafl_alpha_scaled":
                    assert options.sparsity_coef == pytest.approx(scaled[setting.name], rel=1e-4)
                    assert options.threshold_update and options.spafl_variant == "paper"
                elif arm.label in ("spafl", "spafl_no_eq13"):
                    assert options.threshold_update is (arm.label == "spafl")
                elif arm.label == "heterofl":
                    assert options.capacities == (0.5,)
                elif arm.label == "fjord":
                    assert (options.width_low, options.width_high) == (0.4, 0.6)
                elif arm.label == "fedspa":
                    assert (options.sparse_density, options.swap_rate, options.swap_anneal_rounds) == (
                        0.5, 0.5, setting.config.rounds)
    done = module.SETTINGS["digits"].config  # the done criterion
    assert (done.model, done.num_clients, done.clients_per_round, done.rounds, done.local_epochs,
            done.batch_size, done.lr, done.alpha) == ("mlp", 20, 10, 50, 5, 16, 0.1, 0.5)
    import experiments.common as common
    seen = []
    monkeypatch.setattr(common, "run_setting", lambda setting, *args, **kwargs: seen.append(setting.name))
    assert module.run(["--quick"]) == 0 and seen == ["digits"]
    assert module.run(["--quick", "--setting", "cifar10"]) == 0 and seen == ["digits", "cifar10"]


def test_experiment_module_tabulates_every_arm_by_spafls_conventions(monkeypatch, tmp_path):
    """`python -m experiments.spafl --quick`, shrunk to 2 rounds of 3 of 6 clients, on recorded runs (the
    table code runs on real runs in tests/test_experiments.py): all eight rows of Table 2 (and the eq. 13
    ablation and the scaled alpha), each with SpaFL's own Comm and FLOPs accounting (appendix A.4/A.5)
    beside the counted one, by hand. d = the MLP's 84,480 kernel weights, 6 client-rounds, dense training
    FLOPs 6e9 per run (1e9 per client)."""
    import csv
    import dataclasses

    from conftest import record_runs
    import experiments.spafl as module
    tiny = {"rounds": 2, "num_clients": 6, "clients_per_round": 3, "local_epochs": 1}
    monkeypatch.setitem(module.SETTINGS, "digits", dataclasses.replace(module.SETTINGS["digits"], quick=tiny))
    dense = 6e9
    # per algorithm: (cumulative bytes, counted training FLOPs, the records' own figures per round)
    runs = {"fedavg": (2 * 6 * MLP_PARAMS * 4, dense, {}),
            "spafl": (2 * 6 * MLP_THRESHOLDS * 4, 0.3 * dense, {"mean_layer_density": 0.6, "weight_density": 0.4}),
            "spafl_local": (0, 0.5 * dense, {"mean_layer_density": 0.7, "weight_density": 0.5}),
            "heterofl": (6 * MLP_PARAMS * 4 // 2, 0.26 * dense, {"client_capacity": [0.5, 0.5]}),
            "fjord": (6 * MLP_PARAMS * 4 // 2, 0.25 * dense, {"client_capacity": [0.4, 0.6]}),
            "fedspa": (6 * MLP_PARAMS * 4, 0.5 * dense, {}),
            "fedpm": (6 * MLP_PARAMS * 4, 0.5 * dense, {"client_mask_density": [0.25, 0.75]}),
            "fedp3": (6 * MLP_PARAMS * 4, dense, {})}

    def figures(config):
        cumulative, counted, own = runs[config.algorithm]
        records = [{"round": r + 1, "personalized_accuracy": 0.5 + 0.1 * r, "dense_train_flops": dense / 2,
                    "cumulative_bytes": cumulative * (r + 1) // 2,
                    **{k: (v[r] if isinstance(v, list) else v) for k, v in own.items()}} for r in range(2)]
        return records, {"cumulative_bytes": cumulative, "total_uplink_bytes": cumulative // 2, "rounds_done": 2,
                         "dense_train_flops_total": dense, "train_flops_total": counted,
                         "prunable_layer_weights": {"fc1": 64 * 256, "fc2": 256 * 256, "fc3": 256 * 10}}

    record_runs(monkeypatch, figures)
    assert module.run(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    folder = tmp_path / "digits"
    with (folder / "results.csv").open() as f:
        rows = {r["algorithm"]: r for r in csv.DictReader(f)}
    assert list(rows) == list(module.ROWS) + ["spafl_alpha_scaled"]
    gbit = lambda bits_per_client_round: pytest.approx(6 * bits_per_client_round / 1e9)  # noqa: E731
    d = MLP_WEIGHTS  # SpaFL's d: the kernels' weights, 32 bits each way
    assert float(rows["fedavg"]["comm_gbit_spafl"]) == gbit(2 * d * 32)
    assert float(rows["fedavg"]["total_gbit"]) == pytest.approx(2 * 6 * MLP_PARAMS * 4 * 8 / 1e9)
    assert float(rows["heterofl"]["comm_gbit_spafl"]) == gbit(d * 32)  # width 0.5 counts 0.5
    assert float(rows["fjord"]["comm_gbit_spafl"]) == gbit(d * 32)  # its widths' mean, 0.5
    assert float(rows["fedspa"]["comm_gbit_spafl"]) == gbit(d * 32)  # density 0.5
    h = -(0.5 * math.log2(0.5) * 2)  # FedPM: the mean mask density 0.5, one bit per weight up
    assert float(rows["fedpm"]["comm_gbit_spafl"]) == gbit(d * 32 + d * h + math.log2(d))
    # FedP3 in SpaFL's reading: 2 shared layers, both assigned to every client: fc1 and fc2 up and down
    assert float(rows["fedp3"]["comm_gbit_spafl"]) == gbit(2 * (64 * 256 + 256 * 256) * 32)
    for name in ("spafl", "spafl_no_eq13", "spafl_alpha_scaled"):  # thresholds both ways, as counted
        assert float(rows[name]["total_gbit"]) == pytest.approx(2 * 6 * MLP_THRESHOLDS * 4 * 8 / 1e9)
        assert float(rows[name]["comm_gbit_spafl"]) == pytest.approx(float(rows[name]["total_gbit"]))
        assert float(rows[name]["flops_spafl"]) == float(rows[name]["flops_counted"]) == 0.3e9  # eq. 50: counted
        assert (float(rows[name]["mean_layer_density"]), float(rows[name]["weight_density"])) == (0.6, 0.4)
    per_client = dense / 6
    for name, share in (("fedavg", 1), ("heterofl", 0.5), ("fjord", 0.5), ("fedspa", 0.5), ("fedpm", 0.5),
                        ("fedp3", 1)):
        assert float(rows[name]["flops_spafl"]) == pytest.approx(share * per_client), name
        assert float(rows[name]["flops_counted"]) == pytest.approx(runs[name][1] / 6), name  # (label: algorithm)
    assert float(rows["local"]["total_gbit"]) == 0 == float(rows["local"]["comm_gbit_spafl"])
    assert float(rows["local"]["flops_spafl"]) == pytest.approx(0.5 * per_client)
    assert float(rows["fedavg"]["dense_train_flops"]) == dense / 2  # the last record's
    assert "| fedpm |" in (folder / "results.md").read_text()
    assert (folder / "comparison.png").stat().st_size > 1000


def test_fmnist_fedavg_flops_per_client_match_the_papers_table2_figure():
    """SpaFL Table 2, FedAvg on FMNIST: 1.0345e12 FLOPs. The official code divides the total by the
    number of clients; with that convention the experiment's config gives 500 rounds x 10 clients x
    600 examples x 5 epochs x 3 x 2,293,000 / 100 = 1.0319e12 (0.3 % from the paper's figure)."""
    import experiments.spafl as module
    config = module.SETTINGS["fmnist"].config
    structure = get_model(config.model, (28, 28, 1), 10).structure
    examples = config.rounds * config.clients_per_round * (60_000 // config.num_clients) * config.local_epochs
    per_client = training_flops(structure, examples) / config.num_clients
    assert per_client == pytest.approx(1.0345e12, rel=0.01)


def test_the_scaled_alpha_rows_by_hand():
    """The regularizer alone lifts a threshold to about ln(1 + alpha x lr x M), M = rounds x the momentum
    steps of a round (fresh momentum each round: (S - 0.9 (1 - 0.9^S) / 0.1) / 0.1 for S steps, S without
    momentum). CIFAR-10: the paper 500 x 1,510.0 (S = 5 x ceil(500 / 16) = 160) at lr 0.01, cifar10_cpu
    25 x 70.589 (S = 2 x ceil(2,000 / 20 / 16) = 14): 7,550 / 17.647 = 427.8x, alpha 0.00015 x 427.8 = 0.06417.
    digits against FMNIST: 500 x 410.46 (S = 5 x ceil(600 / 64) = 50) at lr 0.001 against 50 x 25
    (S = 5 x ceil(1,438 / 20 / 16)) at lr 0.1: 205.23 / 125 = 1.642x, alpha 0.002 x 1.642 = 0.003284. A
    regularizer-only simulation (momentum SGD on -alpha exp(-tau), restarted every round) ends each scaled run
    within 1 % of the paper's threshold, where the unscaled CPU run ends 286x below it."""
    import experiments.spafl as module
    from fedjax_sparse.data.sources import load_digits
    assert module.regularizer_push(module.CIFAR10, 50_000) == pytest.approx(7550.0, rel=1e-6)
    assert module.regularizer_push(module.CIFAR10_CPU, 50_000) == pytest.approx(17.6473, rel=1e-4)
    assert module.regularizer_push(module.DIGITS, len(load_digits().x_train)) == 125.0
    assert module.regularizer_push(module.FMNIST, 60_000) == pytest.approx(205.232, rel=1e-5)
    for steps in (1, 14, 160):
        local = LocalSGD(get_model("mlp", (8, 8, 1), 10), 0.01, 1, 16, momentum=0.9)
        assert module.momentum_steps(steps, 0.9) == pytest.approx(float(local.effective_steps(steps)), rel=1e-5)

    def threshold_after(alpha, rounds, steps, lr, momentum):
        tau = 0.0
        for _ in range(rounds):
            velocity = 0.0
            for _ in range(steps):
                velocity = momentum * velocity - alpha * math.exp(-tau)
                tau -= lr * velocity
        return tau

    paper = threshold_after(0.00015, 500, 160, 0.01, 0.9)
    assert paper == pytest.approx(math.log(1 + 0.00015 * 7550), rel=1e-3)
    cpu_alpha = module.scaled_alpha(module.CIFAR10_CPU, 50_000, module.CIFAR10, 50_000)
    assert threshold_after(cpu_alpha, 25, 14, 0.01, 0.9) == pytest.approx(paper, rel=0.01)
    assert paper / threshold_after(0.00015, 25, 14, 0.01, 0.9) == pytest.approx(286, rel=0.01)
    fmnist = threshold_after(0.002, 500, 50, 0.001, 0.9)
    digits_alpha = module.scaled_alpha(module.DIGITS, 1_438, module.FMNIST, 60_000)
    assert threshold_after(digits_alpha, 50, 25, 0.1, 0.0) == pytest.approx(fmnist, rel=0.01)
