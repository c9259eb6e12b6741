"""SPATL against independent truths: FedAvg at keep ratio 1 with zero control, eqs. 9-12 by hand,
top-L2 units with tied groups, the FLOPs target, analytic bytes, nothing private on the wire."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import initialized
from fedjax_sparse.algorithms import fedavg, make_algorithm, make_options
from fedjax_sparse.algorithms.spatl import fit_predictor
from fedjax_sparse.algorithms.spatl_selection import (encoder_flops, encoder_layers, salient_masks, uniform_keep_ratio, unit_l2_norms)
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.structure.layer_groups import leaf_paths
from fedjax_sparse.core.structure.model_parts import part_labels, take_part
from fedjax_sparse.core.round.local_training import LocalSGD, masked_cross_entropy
from fedjax_sparse.core.messages.pricing import SparseArray, message_bytes
from fedjax_sparse.core.round.step import build_round, round_info
from fedjax_sparse.core.structure.unit_masks import full_unit_masks
from fedjax_sparse.data.federated import normalize
from fedjax_sparse.models import Layer, ModelStructure, get_model

tree_map = jax.tree_util.tree_map
MLP_ENCODER = 64 * 256 + 256 + 256 * 256 + 256  # fc1 and fc2: 82,432


def assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol), a, b)


def build(model, split, *, lr=0.1, epochs=1, batch_size=8, momentum=0.0, clients_per_round=None, **options):
    local = LocalSGD(model, lr, epochs, batch_size, momentum)
    ctx = BuildContext(local=local, num_clients=split.num_clients,
                       clients_per_round=clients_per_round or split.num_clients, train=split,
                       num_classes=model.num_classes)
    return make_algorithm("spatl", ctx, make_options("spatl", options)), local


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


def test_resnet20_encoder_has_the_papers_size():
    """SPATL's ResNet-20 encoder (three stages, BatchNorm scale/bias included): 268,608 of 269,722."""
    model = get_model("resnet20", (32, 32, 3), 10)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    encoder = take_part(shapes, part_labels(model), "encoder")
    assert sum(math.prod(s.shape) for s in jax.tree_util.tree_leaves(encoder["params"])) == 268_608
    assert set(encoder["params"]) == {f"stage{s}_block{b}" for s in (1, 2, 3) for b in (1, 2, 3)}


def test_keep_ratio_one_and_zero_control_is_fedavg_on_the_encoder(make_split, mlp):
    """Round 1: controls are zero, every unit is sent, eq. 12 with eta = 1 is the uniform mean:
    the global encoder equals FedAvg's (uniform weights) encoder."""
    split = make_split([9, 17, 12, 30])
    spatl, local = build(mlp, split, momentum=0.5, salient_keep=1.0)
    variables = mlp.init(jax.random.key(0))
    server, clients = spatl.init(jax.random.key(1), variables, 4)
    server, clients, out = build_round(spatl, split, 4, seed=3)(server, clients, 0)
    avg = fedavg(local, "uniform")
    avg_server, avg_clients = avg.init(jax.random.key(1), variables, 4)
    avg_server, _, _ = build_round(avg, split, 4, seed=3)(avg_server, avg_clients, 0)
    assert_trees_close(server["encoder"], take_part(avg.global_variables(avg_server), part_labels(mlp), "encoder"))
    # and each client's predictor is its own: they differ between clients
    assert float(jnp.abs(clients["variables"]["params"]["fc3"]["kernel"][0]
                         - clients["variables"]["params"]["fc3"]["kernel"][1]).max()) > 1e-4


def test_eq12_masked_mean_fedavg_and_eq11_by_hand(make_split, mlp):
    """Two clients, one layer's entries: w_g = 1; client 0 sends 3 on the first half of every leaf,
    client 1 sends 5 everywhere. eq12 (eta 0.5): 1 + 0.5 (m0 (3 - 1) + m1 (5 - 1)) / 2 -> 2.5 or 2;
    masked_mean (eta 0.5): 1 + 0.5 (mean over the senders - 1) -> 2.5 or 3; fedavg (weights 1, 3,
    whole encoders): (3 + 15) / 4 = 4.5.
    eq. 11: c_g + (dc_0 + dc_1) / N with N = 2."""
    split = make_split([8, 8])
    variables = mlp.init(jax.random.key(0))
    expected = {"eq12": (2.5, 2.0), "masked_mean": (2.5, 3.0), "fedavg": (4.5, 4.5)}
    for aggregation, (first_half, second_half) in expected.items():
        alg, _ = build(mlp, split, server_lr=0.5 if aggregation != "fedavg" else 1.0,
                       spatl_aggregation=aggregation)
        server, _ = alg.init(jax.random.key(1), variables, 2)
        server = {**server, "encoder": tree_map(jnp.ones_like, server["encoder"]),
                  "control": tree_map(lambda c: jnp.full_like(c, 0.25), server["control"])}

        def upload(value, half):
            def leaf(w):
                mask = jnp.ones(w.shape, bool)
                if half:
                    mask = jnp.arange(w.shape[-1]) < w.shape[-1] // 2
                return SparseArray(jnp.full_like(w, value), jnp.broadcast_to(mask, w.shape))
            return tree_map(leaf, server["encoder"])

        ups = {"encoder": tree_map(lambda a, b: SparseArray(jnp.stack([a.values, b.values]),
                                                            jnp.stack([a.mask, b.mask])),
                                   upload(3.0, aggregation != "fedavg"), upload(5.0, False),
                                   is_leaf=lambda x: isinstance(x, SparseArray)),
               "control_delta": tree_map(lambda c: jnp.stack([jnp.full_like(c, 1.0), jnp.full_like(c, 3.0)]),
                                         server["control"])}
        new = alg.server_update(server, ups, jnp.array([1.0, 3.0]), round_info(0, 0, jnp.arange(2)))
        kernel = np.asarray(new["encoder"]["params"]["fc2"]["kernel"])
        np.testing.assert_allclose(kernel[:, :128], first_half)
        np.testing.assert_allclose(kernel[:, 128:], second_half)
        np.testing.assert_allclose(new["control"]["fc1"]["bias"], 0.25 + (1.0 + 3.0) / 2)


@pytest.mark.parametrize("variant,scale", [("paper", 1.0), ("code", 0.01)])
def test_one_local_step_corrects_only_the_encoder_and_eq10_updates_the_control(make_split, mlp, variant, scale):
    """One full-batch SGD step from (w_g, own predictor) with c_g - c_l = d on the encoder:
    encoder <- w - lr (g + s d), predictor <- w - lr g (g = dL/dw at the start, by jax.grad here);
    then c_l+ = c_l - c_g + (w_g - w_e) / (1 step x lr) = g_encoder + s d - d. The paper's reading has
    s = 1 (c_l+ = g_encoder); the official code's (`--spatl-control code`) subtracts lr d / 100 after
    the step: s = 1/100, so c_l+ = g_encoder - 0.99 d."""
    split = make_split([16, 16])
    lr = 0.05
    alg, _ = build(mlp, split, lr=lr, batch_size=16, salient_keep=1.0, spatl_control=variant)
    variables = jax.jit(mlp.init)(jax.random.key(0))
    server, clients = jax.jit(alg.init, static_argnums=2)(jax.random.key(1), variables, 2)
    labels = part_labels(mlp)
    c_g = tree_map(lambda c: jnp.full_like(c, 0.3), server["control"])
    c_l = tree_map(lambda c: jnp.full_like(c, 0.1), server["control"])
    state = tree_map(lambda a: a[0], clients)
    state = {**state, "control": c_l}
    info = round_info(0, 0, jnp.arange(2))
    down = {"encoder": server["encoder"], "control": c_g}
    up, new_state, stats = jax.jit(alg.client_update)(down, state, split.client(0), jax.random.key(2), info)
    assert int(stats["num_steps"]) == 1

    data = split.client(0)
    x = normalize(data.x[:16], data.mean, data.std)

    def loss(params):
        logits, _ = mlp.apply({"params": params, "batch_stats": {}}, x, train=True)
        return masked_cross_entropy(logits, data.y[:16], jnp.ones(16, bool))

    g = jax.grad(loss)(variables["params"])
    trained = new_state["variables"]["params"]
    for name in ("fc1", "fc2"):
        assert_trees_close(trained[name], tree_map(lambda w, gw: w - lr * (gw + 0.2 * scale),
                                                   variables["params"][name], g[name]))
    assert_trees_close(trained["fc3"], tree_map(lambda w, gw: w - lr * gw, variables["params"]["fc3"], g["fc3"]))
    assert_trees_close(new_state["control"], tree_map(lambda gw: gw + 0.2 * scale - 0.2,
                                                      take_part(g, labels["params"], "encoder")), atol=1e-4)
    assert_trees_close(up["control_delta"], tree_map(lambda c, ci: c - ci, new_state["control"], c_l))


def test_kept_units_are_the_top_l2_ones_and_groups_agree():
    """ResNet-20 at keep 1/2: a lone layer keeps the 8 of 16 units of largest incoming-weight norm;
    a residual group keeps the top units of its members' summed norms, the same in every member."""
    model, variables = initialized("resnet20", (8, 8, 3), 10)
    params = variables["params"]
    layers = encoder_layers(model.structure)
    masks, norms = jax.jit(lambda params: (  # as a client computes them (op by op: a compile each)
        salient_masks(model.structure, params, {n: 0.5 for n in layers}, layers),
        unit_l2_norms(model.structure, params, layers)))(params)
    lone = "stage1_block1.conv1"
    kept = np.flatnonzero(np.asarray(masks[lone]))
    assert sorted(kept) == sorted(np.argsort(-np.asarray(norms[lone]))[:8])
    group = [l.name for l in model.structure.layers if l.unit_group == "stage2"]
    summed = sum(np.asarray(norms[n]) for n in group)
    for name in group:
        assert sorted(np.flatnonzero(np.asarray(masks[name]))) == sorted(np.argsort(-summed)[:16])
    np.testing.assert_array_equal(masks["conv1"], 1.0)  # the private stem is never pruned
    np.testing.assert_array_equal(masks["fc"], 1.0)


@pytest.mark.parametrize("name,shape", [("resnet20", (32, 32, 3)), ("mlp", (8, 8, 1)), ("vgg11", (32, 32, 3))])
def test_the_fixed_policy_meets_the_flops_target_with_the_largest_uniform_ratio(name, shape):
    structure = get_model(name, shape, 10).structure
    layers = encoder_layers(structure)
    dense = float(encoder_flops(structure, full_unit_masks(structure), layers))
    scores = {l.name: -jnp.arange(l.num_units, dtype=jnp.float32) for l in structure.layers}
    from fedjax_sparse.core.structure.unit_selection import keep_top_units
    for target in (0.2, 0.5):
        r = uniform_keep_ratio(structure, layers, target)
        kept = float(encoder_flops(structure, keep_top_units(structure, scores, r, layers=layers), layers))
        assert kept <= (1 - target) * dense
        more = keep_top_units(structure, scores, min(1.0, r + 0.02), layers=layers)
        assert float(encoder_flops(structure, more, layers)) > (1 - target) * dense


def test_bytes_are_the_hand_count_and_nothing_private_travels(make_split):
    """ResNet-20 (8x8; counts do not depend on the input size) under the fixed policy at keep 0.875.
    Down: encoder weights + statistics + c_g, dense. Up: the salient sub-model's values, its units'
    index once per layer (eq. 12 indexes filters), and the dense control delta. No message and no
    server state holds a leaf of the stem or the classifier."""
    model, variables = initialized("resnet20", (8, 8, 3), 10)
    split = make_split([8, 8], shape=(8, 8, 3))
    alg, _ = build(model, split, salient_keep=0.875)
    server, clients = jax.jit(alg.init, static_argnums=2)(jax.random.key(1), variables, 2)
    labels = part_labels(model)
    encoder_paths = {p for p, part in zip(leaf_paths(labels), jax.tree_util.tree_leaves(labels)) if part == "encoder"}
    for path in leaf_paths(server["encoder"]):
        assert path in encoder_paths
    info = round_info(0, 0, jnp.arange(2))
    down = jax.jit(alg.broadcast)(server, 0, info)
    price = jax.jit(message_bytes)
    encoder = take_part(variables, labels, "encoder")
    n_encoder = sum(x.size for x in jax.tree_util.tree_leaves(encoder))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(encoder["params"]))
    assert n_params == 268_608 and int(price(down)) == 4 * (n_encoder + n_params)
    up, new_state, _ = jax.jit(alg.client_update)(down, tree_map(lambda a: a[0], clients), split.client(0),
                                                   jax.random.key(2), info)
    is_sparse = lambda x: isinstance(x, SparseArray)  # noqa: E731
    for path in leaf_paths(tree_map(lambda s: s.values, up["encoder"], is_leaf=is_sparse)):
        assert path in encoder_paths

    # By hand from the widths 16, 32, 64: every encoder conv keeps ceil(0.875 w) = 14, 28, 56 units and
    # sends, per kept unit, 9 kernel taps per live input unit and its BatchNorm's scale, bias, mean, var.
    # Live inputs: the stage-1 stream has all 16 (the private stem keeps every unit); a conv2 reads its
    # conv1's kept units; in stages 2 and 3 block 1's conv1 reads the previous stream, later conv1s their
    # stage's kept units.
    def conv(inputs, kept):
        return 9 * inputs * kept + 4 * kept

    stage1 = 3 * (conv(16, 14) + conv(14, 14))
    stage2 = conv(16, 28) + conv(28, 28) + 2 * (conv(28, 28) + conv(28, 28))
    stage3 = conv(28, 56) + conv(56, 56) + 2 * (conv(56, 56) + conv(56, 56))
    values = stage1 + stage2 + stage3
    assert values == 208_236
    # Index: per layer a bitmask over its w units (w / 8 bytes) beats a list of its kept ids (1 byte each).
    index = 6 * (16 // 8) + 6 * (32 // 8) + 6 * (64 // 8)
    assert int(price(up)) == 4 * values + index + 4 * n_params  # + the dense control delta
    # the encoder's 833,028 bytes: priced per entry (the cheaper of a bitmask and an index list per
    # leaf), its index alone cost 33,744 bytes
    assert int(price(up["encoder"])) == 4 * values + index
    np.testing.assert_array_equal(new_state["salient"]["stage3_block1.conv2"],
                                  new_state["salient"]["stage3_block3.conv2"])


def test_fit_predictor_trains_the_predictor_on_a_frozen_encoder(make_split, mlp):
    split = make_split([24])
    local = LocalSGD(mlp, 0.1, 2, 8, momentum=0.9)
    labels = part_labels(mlp)
    start = mlp.init(jax.random.key(0))
    encoder = take_part(mlp.init(jax.random.key(5)), labels, "encoder")
    fitted, stats = jax.jit(lambda v, e, d, k: fit_predictor(local, v, e, d, k))(start, encoder, split.client(0),
                                                                                 jax.random.key(1))
    assert_trees_close(take_part(fitted, labels, "encoder"), encoder, atol=0, rtol=0)
    assert float(jnp.abs(fitted["params"]["fc3"]["kernel"] - start["params"]["fc3"]["kernel"]).max()) > 1e-3


def test_a_model_without_a_split_and_bad_flags_are_refused(tmp_path, capsys):
    plain = ModelStructure((Layer("fc", "dense", ("fc", "kernel"), None, None, 3, 4, ("input",)),))
    with pytest.raises(ValueError, match="names an encoder"):
        encoder_layers(plain)
    base = ["run", "--algorithm", "spatl", "--rounds", "1", "--no-progress", "--out", str(tmp_path / "bad")]
    for args, fragment in ((["--salient-keep", "0"], "--salient-keep must be in (0, 1], got 0.0"),
                           (["--salient-keep", "1.5"], "--salient-keep must be in (0, 1], got 1.5"),
                           (["--flops-reduction", "1"], "--flops-reduction must be in [0, 1), got 1.0"),
                           (["--spatl-aggregation", "mean"], "invalid choice")):
        code = main([*base, *args]) if args[0] != "--spatl-aggregation" else None
        if code is None:
            with pytest.raises(SystemExit):
                main([*base, *args])
            assert fragment in capsys.readouterr().err
            continue
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fragment in err, err


def test_cli_logs_table2_figures(tmp_path):
    """Partial participation (3 of 4 clients a round): the evaluation runs the global encoder."""
    out = tmp_path / "spatl"
    assert main(["run", "--algorithm", "spatl", "--num-clients", "4", "--clients-per-round", "3", "--rounds", "2",
                 "--local-epochs", "1", "--no-progress", "--out", str(out)]) == 0
    import json
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["test_accuracy"] is None
    assert last["inference_encoder_flops_reduction_mean"] >= 0.2 - 1e-6  # the default target
    assert 0 < last["inference_kept_weights"] < 1
    assert 0 < last["inference_flops_reduction_mean"] <= last["inference_flops_reduction_max"]
    assert last["downlink_bytes"] == 4 * 3 * 2 * MLP_ENCODER  # encoder and c_g to each of 3 clients
    assert last["personalized_accuracy"] > 0.3


def test_experiment_settings_validate_and_the_module_runs_with_its_transfer(monkeypatch, tmp_path):
    """`python -m experiments.spatl --quick`, shrunk to its SPATL arm (the baselines' arms are the table code's
    in tests/test_experiments.py): every arm's config is valid, Table 2's columns, and a new client fits a
    predictor on SPATL's saved final encoder (transfer.json)."""
    import csv
    import dataclasses
    import json

    import experiments.spatl as module
    for setting in module.SETTINGS.values():
        for quick in (False, True):
            for arm in setting.arms:
                setting.arm_config(arm, tmp_path, quick).validate()
    r20 = module.SETTINGS["resnet20"].config
    assert (r20.num_clients, r20.clients_per_round, r20.rounds, r20.local_epochs, r20.lr, r20.alpha) == \
        (10, 10, 100, 10, 0.005, 0.1)
    tiny = {"rounds": 2, "num_clients": 4, "clients_per_round": 4, "local_epochs": 1}
    digits = module.SETTINGS["digits"]
    assert [a.label for a in digits.arms] == ["spatl", "spatl_agent", "fedavg", "fedprox", "fednova", "scaffold"]
    # the agent arm compiles a whole PPO search into the round (~40 s on 2 cores): tested on its own above
    arms = tuple(a for a in digits.arms if a.label == "spatl")
    monkeypatch.setitem(module.SETTINGS, "digits", dataclasses.replace(digits, quick=tiny, arms=arms))
    monkeypatch.setattr(module, "TRANSFER_EPOCHS", 2)
    assert module.run(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    with (tmp_path / "digits" / "results.csv").open() as f:
        rows = {r["algorithm"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["spatl"]
    assert float(rows["spatl"]["inference_flops_reduction_mean"]) >= 0.19
    assert 0 < float(rows["spatl"]["inference_kept_weights"]) < 1
    result = json.loads((tmp_path / "digits" / "transfer.json").read_text())
    assert 0.2 < result["transfer_accuracy"] <= 1 and result["epochs"] == 2
    assert result["fit_examples"] + result["validation_examples"] == 359  # the digits test split


def test_partial_participation_evaluates_the_global_encoder_and_reports_the_rounds_uploads(make_split, mlp):
    """4 clients, 1 a round, keep 1/4. After one round every client is evaluated with the global
    encoder: the sampled one with its own predictor and the salient units of that encoder at its
    ratio, the three never sampled with a predictor fitted by eq. 4 on it (and all units). The
    diagnostics describe the one upload of the round, by hand: fc1 keeps 64 of 256 units, fc2 64 of
    256 and only their inputs, so (64 x 64 + 64 + 64 x 64 + 64) / 82,432 encoder weights, and the
    model's FLOPs fall from 64 x 256 + 256 x 256 + 256 x 10 to 64 x 64 + 64 x 64 + 64 x 10."""
    from fedjax_sparse.core.evaluation.evaluators import population_diagnostics
    from fedjax_sparse.core.structure.model_parts import overlay
    from fedjax_sparse.core.round.streams import stream_key
    split = make_split([12, 16, 12, 20])
    alg, local = build(mlp, split, salient_keep=0.25, clients_per_round=1)
    variables = mlp.init(jax.random.key(0))
    server, clients = alg.init(jax.random.key(1), variables, 4)
    server, clients, out = build_round(alg, split, 1, seed=0)(server, clients, 0)
    sampled = int(out.client_ids[0])
    evaluated = alg.evaluation_clients(server, clients)
    layers = encoder_layers(mlp.structure)
    labels = part_labels(mlp)
    for i in range(4):
        mine = tree_map(lambda a: a[i], evaluated)
        assert_trees_close(take_part(mine["variables"], labels, "encoder"), server["encoder"], atol=0, rtol=0)
        if i == sampled:
            own = tree_map(lambda a: a[i], clients["variables"])
            assert_trees_close(mine["variables"], overlay(own, server["encoder"]), atol=0, rtol=0)
            expected = salient_masks(mlp.structure, mine["variables"]["params"], {n: 0.25 for n in layers}, layers)
            assert_trees_close(mine["salient"], expected, atol=0, rtol=0)
        else:
            fitted, _ = jax.jit(lambda d, k: fit_predictor(local, variables, server["encoder"], d, k))(
                split.client(i), jax.random.fold_in(stream_key(0, "predictor_fit"), i))
            assert_trees_close(mine["variables"], fitted)
            assert float(jnp.abs(fitted["params"]["fc3"]["kernel"] - variables["params"]["fc3"]["kernel"]).max()) > 0
            assert_trees_close(mine["salient"], full_unit_masks(mlp.structure), atol=0, rtol=0)
    figures = population_diagnostics(alg, server, clients)
    np.testing.assert_allclose(figures["inference_kept_weights"], (2 * 64 * 64 + 128) / MLP_ENCODER, rtol=1e-6)
    reduction = 1 - (64 * 64 + 64 * 64 + 64 * 10) / (64 * 256 + 256 * 256 + 256 * 10)
    np.testing.assert_allclose(figures["inference_flops_reduction_mean"], reduction, rtol=1e-6)
    np.testing.assert_allclose(figures["inference_flops_reduction_max"], reduction, rtol=1e-6)
    np.testing.assert_allclose(figures["upload_kept_weights"], figures["inference_kept_weights"], rtol=0)
    # the official code's aggregation: the same clients and sub-models, but the whole encoder travels
    dense_upload, _ = build(mlp, split, salient_keep=0.25, clients_per_round=1, spatl_aggregation="fedavg")
    server, clients = dense_upload.init(jax.random.key(1), variables, 4)
    server, clients, out = build_round(dense_upload, split, 1, seed=0)(server, clients, 0)
    dense_figures = population_diagnostics(dense_upload, server, clients)
    assert dense_figures["upload_kept_weights"] == 1.0
    for name in ("inference_kept_weights", "inference_flops_reduction_mean"):
        np.testing.assert_allclose(dense_figures[name], figures[name], rtol=1e-6)
    full, _ = build(mlp, split, salient_keep=0.25)
    assert full.evaluation_clients is None  # all sampled every round: each client's own last encoder


def test_flags_the_policy_ignores_and_a_bad_agent_file_are_one_line_errors(tmp_path, capsys):
    base = ["run", "--algorithm", "spatl", "--rounds", "1", "--num-clients", "2", "--clients-per-round", "2",
            "--no-progress", "--out", str(tmp_path / "bad")]
    cases = [(["--agent-updates", "3"], "--agent-updates is a setting of the learned agent; --salient-policy fixed"),
             (["--agent-reset"], "--agent-reset is a setting of the learned agent"),
             (["--salient-policy", "agent", "--salient-keep", "0.5"], "--salient-keep is the fixed policy's"),
             (["--salient-keep", "0.5", "--flops-reduction", "0.3"], "--flops-reduction is not read when --salient-keep"),
             (["--salient-policy", "agent", "--agent-init", str(tmp_path)], f"--agent-init {tmp_path}: is a folder"),
             (["--salient-policy", "agent", "--agent-init", str(tmp_path / "none.msgpack")],
              f"--agent-init {tmp_path / 'none.msgpack'}: no such file")]
    for args, fragment in cases:
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fragment in err, err


# ------------------------------------------------------------------ the learned policy (GNN + PPO agent)

def test_agent_policy_meets_the_flops_target_and_carries_its_state_over_rounds(make_split, mlp, tmp_path):
    """A tiny agent on the MLP: its keep ratios' salient masks cut the encoder FLOPs by the target
    and by at most one unit more (an fc1 unit: its 64 inputs and the 256 fc2 units reading it);
    the state a search returns is what the next search starts from (different from starting
    afresh), `agent_reset` ignores it, and a saved agent is what every client starts from."""
    from fedjax_sparse.agent import AgentConfig, GraphTemplate, save_agent
    from fedjax_sparse.agent import load_agent
    from fedjax_sparse.algorithms.spatl_selection import agent_policy
    split = make_split([40])
    variables = mlp.init(jax.random.key(0))
    layers = encoder_layers(mlp.structure)
    config = AgentConfig(updates=2, steps_per_update=6, epochs=2, hidden_size=8, message_passing_steps=1,
                         flops_target=0.3)
    options = make_options("spatl", {"salient_policy": "agent", "flops_reduction": 0.3,
                                     "agent_validation_examples": 16})
    assert agent_policy(mlp, layers, options, config).holdout == 0.1
    policy = agent_policy(mlp, layers, options, config)
    select = jax.jit(policy.select)
    start = policy.init(jax.random.key(1))
    data, key = split.client(0), jax.random.key(2)
    first, ratios, metrics = select(start, variables, data, key)
    masks = salient_masks(mlp.structure, variables["params"], ratios, layers)
    dense = float(encoder_flops(mlp.structure, full_unit_masks(mlp.structure), layers))
    kept = float(encoder_flops(mlp.structure, masks, layers))
    assert 0.7 * dense - (64 + 256) <= kept <= 0.7 * dense + 1e-3
    assert 0 <= float(metrics["agent_reward"]) <= 100
    second, _, _ = select(first, variables, data, key)
    again, _, _ = select(start, variables, data, key)
    leaves = lambda s: jax.tree_util.tree_leaves(s.params)  # noqa: E731
    assert any(float(jnp.abs(a - b).max()) > 0 for a, b in zip(leaves(first), leaves(start)))
    assert any(float(jnp.abs(a - b).max()) > 0 for a, b in zip(leaves(second), leaves(again)))

    reset = agent_policy(mlp, layers, dataclasses.replace(options, agent_reset=True), config)
    select_reset = jax.jit(reset.select)
    from_first, _, _ = select_reset(first, variables, data, key)
    from_start, _, _ = select_reset(start, variables, data, key)
    assert_trees_close(from_first.params, from_start.params, atol=0, rtol=0)

    path = tmp_path / "agent.msgpack"
    save_agent(path, first)
    loaded = load_agent(path, GraphTemplate.from_structure(mlp.structure, layers), config)
    assert_trees_close(loaded.params, first.params, atol=0, rtol=0)
    seeded = agent_policy(mlp, layers, options, config, initial=loaded)
    assert_trees_close(seeded.init(jax.random.key(9)).params, first.params, atol=0, rtol=0)
    # the networks are shared over nodes, so an agent moves to another encoder (the paper's transfer
    # of a pre-trained agent); networks of another width are refused
    with pytest.raises(ValueError, match="not an agent of this encoder"):
        load_agent(path, GraphTemplate.from_structure(mlp.structure, layers), dataclasses.replace(config, hidden_size=4))


def test_held_out_shares_are_random_stratified_and_cost_no_class_its_training_on_a_class_ordered_split():
    """An image folder lists its examples class by class, so a Dirichlet(0.1) client's window is sorted
    by label (10 clients over 10 classes of 60). Each client holds out h = ceil(10 %) of its n examples:
    every class of >= 10 examples gives its share h n_c / n rounded down or up (plus at most what the
    classes of one example keep back to train on), no class loses all its training examples, the two views split the window exactly, and the draw is the client's own (the
    same for the same seed, another for another seed). The last 10 % of the window would be one or two
    classes."""
    from fedjax_sparse.algorithms.spatl_selection import agent_holdout, split_holdout
    from fedjax_sparse.data import partition
    from fedjax_sparse.data.federated import federated_split
    y = np.repeat(np.arange(10), 60)
    clients = partition(y, 10, "dirichlet", seed=0, alpha=0.1, min_examples=2)
    split = federated_split(np.zeros((len(y), 2, 2, 1), np.uint8), y, clients, [0.5], [0.25])
    held = agent_holdout(split, 0.1, seed=0)
    views = jax.jit(jax.vmap(lambda i: split_holdout(split.client(i), held)))(jnp.arange(10))
    labels, counts = np.asarray(split.y), np.asarray(split.counts)
    lost_by_last_share = 0
    for i in range(10):
        training, validation = jax.tree_util.tree_map(lambda a: a[i], views)
        n, h = int(counts[i]), int(validation.count)
        own = labels[int(split.offsets[i]):int(split.offsets[i]) + n]
        window = lambda view: np.asarray(view.positions)[:int(view.count)]  # noqa: E731
        assert h == min(max(math.ceil(0.1 * n), 1), n - 1) and int(training.count) == n - h
        assert sorted([*window(training), *window(validation)]) == list(range(n))
        train_counts = np.bincount(own[window(training)], minlength=10)
        held_counts = np.bincount(own[window(validation)], minlength=10)
        all_counts = np.bincount(own, minlength=10)
        assert np.all(train_counts[all_counts > 0] >= 1), (i, train_counts, held_counts)
        singles = int(np.sum(all_counts == 1))
        for c in np.flatnonzero(all_counts >= 10):
            share = all_counts[c] * h / n
            assert math.floor(share) <= held_counts[c] <= math.ceil(share) + singles, (i, c, held_counts)
        last = own[n - h:]
        lost_by_last_share += len(set(last) - set(own[:n - h]))
    assert lost_by_last_share > 0  # what the old rule (the last 10 % of the window) did
    again = agent_holdout(split, 0.1, seed=0)
    other = agent_holdout(split, 0.1, seed=1)
    np.testing.assert_array_equal(again, held)
    assert not np.array_equal(np.asarray(other), np.asarray(held))
    assert agent_holdout(split, 0.0, seed=0) is None


def test_on_a_trained_mlp_the_agent_beats_uniform_pruning_at_the_same_flops():
    """The digits MLP, trained centrally, pruned to 5 % of its encoder FLOPs: fc1's units cost
    fc2's inputs too, so keeping the same share of every layer (the `fixed` policy) is not the
    best allocation. Over three agent seeds (3 PPO updates each), the agent's masks meet the same
    target and score higher than the uniform masks on the 64 validation examples that reward it
    (the issue's criterion; uniform 0.625 there, the agents about 0.79), and also on the 295
    test examples no search saw (uniform 0.715, the agents about 0.79)."""
    import optax

    from fedjax_sparse.agent import AgentConfig
    from fedjax_sparse.algorithms.spatl_selection import agent_policy
    from fedjax_sparse.data.federated import federated_split
    from fedjax_sparse.data.sources import load_digits

    target = 0.95
    ds = load_digits(seed=0)
    model = get_model("mlp", ds.x_train.shape[1:], 10)
    mean, std = jnp.asarray(ds.mean, jnp.float32), jnp.asarray(ds.std, jnp.float32)
    variables = model.init(jax.random.key(0))
    optimizer = optax.sgd(0.05, momentum=0.9)

    def loss(params, x, y):
        logits, _ = model.apply({**variables, "params": params}, x, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(carry, index):
        params, opt_state = carry
        grads = jax.grad(loss)(params, x_train[index], y_train[index])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    x_train, y_train = normalize(jnp.asarray(ds.x_train), mean, std), jnp.asarray(ds.y_train)
    batches = jnp.asarray(np.random.default_rng(0).choice(len(ds.y_train), (300, 32)))
    params = variables["params"]
    (params, _), _ = jax.jit(lambda p: jax.lax.scan(step, (p, optimizer.init(p)), batches))(params)
    variables = {**variables, "params": params}

    layers = encoder_layers(model.structure)
    validation = federated_split(ds.x_test, ds.y_test, [np.arange(64)], ds.mean, ds.std).client(0)
    options = make_options("spatl", {"salient_policy": "agent", "flops_reduction": target,
                                     "agent_validation_examples": 64})
    config = AgentConfig(updates=3, flops_target=target, hidden_size=16, message_passing_steps=1)
    policy = agent_policy(model, layers, options, config)
    seeds = jnp.arange(3)
    states = jax.jit(jax.vmap(lambda s: policy.init(jax.random.key(s))))(seeds)
    keys = jax.jit(jax.vmap(lambda s: jax.random.key(100 + s)))(seeds)
    _, ratios, metrics = jax.jit(jax.vmap(policy.select, in_axes=(0, None, None, 0)))(
        states, variables, validation, keys)

    def accuracy(keep, x, y):
        masks = salient_masks(model.structure, variables["params"], keep, layers)
        logits, _ = model.apply({**variables, "unit_masks": masks}, normalize(jnp.asarray(x), mean, std),
                                train=False)
        return float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(y)))

    dense = float(encoder_flops(model.structure, full_unit_masks(model.structure), layers))
    uniform = {name: jnp.float32(uniform_keep_ratio(model.structure, layers, target)) for name in layers}
    seen, unseen = (ds.x_test[:64], ds.y_test[:64]), (ds.x_test[64:], ds.y_test[64:])
    agents = [{name: r[i] for name, r in ratios.items()} for i in range(3)]
    for keep in agents:
        masks = salient_masks(model.structure, variables["params"], keep, layers)
        assert float(encoder_flops(model.structure, masks, layers)) <= (1 - target) * dense * (1 + 1e-5)
    np.testing.assert_allclose([accuracy(k, *seen) for k in agents], np.asarray(metrics["agent_reward"]) / 100,
                               atol=1e-6)
    assert np.mean([accuracy(k, *seen) for k in agents]) > accuracy(uniform, *seen) + 0.1
    assert np.mean([accuracy(k, *unseen) for k in agents]) > accuracy(uniform, *unseen) + 0.03
