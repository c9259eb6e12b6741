"""Fjord against independent truths: HeteroFL at a fixed width, SpaFL's U(0.4, 0.6) widths, FjORD's tiers
and per-batch widths, the ordered-dropout prefix, FjORD's self-distillation (hand-computed, and a zero
gradient at p = p_max as in its code), per-width BatchNorm statistics (trained, sent over the zoo and
averaged per width), and refused flags."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_structure import zoo_model

from conftest import initialized, synthetic_split
from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fjord import batch_width, client_width, distillation_loss, tier_width, width_step_loss
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import Known, KnownMaskArray, message_bytes
from fedjax_sparse.core.round.step import build_round, round_info
from fedjax_sparse.data.federated import Batch
from fedjax_sparse.models import MODEL_NAMES, get_model

tree_map = jax.tree_util.tree_map
is_known = lambda x: isinstance(x, KnownMaskArray)  # noqa: E731


def context(model, split, k=2):
    return BuildContext(local=LocalSGD(model, 0.1, 1, 8, 0.5), num_clients=split.num_clients, clients_per_round=k,
                        train=split, num_classes=model.num_classes, seed=0)


def build(name, ctx, **options):
    return make_algorithm(name, ctx, make_options(name, options))


def exchanges(algorithm, variables, num_clients):
    """(client, data, info, seed=2) -> (download, upload, metrics): the broadcast of the server `algorithm.init`
    makes of `variables` and the client's update with key `seed`, one program for every client (eagerly each
    operation compiles on its own, per leaf shape)."""
    @jax.jit
    def run(variables, client, data, info, key):
        server, _ = algorithm.init(jax.random.key(1), variables, num_clients)
        down = algorithm.broadcast(server, client, info)
        up, _, metrics = algorithm.client_update(down, {}, data, key, info)
        return down, up, metrics

    return lambda client, data, info, seed=2: jax.device_get(run(variables, jnp.int32(client), data, info,
                                                                 jax.random.key(seed)))


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


def mlp_variables():
    return initialized("mlp", (8, 8, 1), 10)[1]


def two_rounds(name, **options):
    """(global params, the second round's metrics) of `name` after two rounds of 2 of the clients of 9, 17, 12
    and 30 examples."""
    split = synthetic_split([9, 17, 12, 30])
    algorithm = build(name, context(get_model("mlp", (8, 8, 1), 10), split), **options)
    server, clients = algorithm.init(jax.random.key(1), mlp_variables(), 4)
    round_fn = build_round(algorithm, split, 2, seed=3)
    for r in range(2):
        server, clients, out = round_fn(server, clients, r)
    return algorithm.global_variables(server)["params"], out.metrics


@functools.cache
def heterofl_at_half():
    """HeteroFL at capacity 0.5 after `two_rounds`: run once for the two tests that compare Fjord with it."""
    return two_rounds("heterofl", capacities=(0.5,))


def test_fjord_at_a_fixed_width_is_heterofl_at_that_capacity():
    """width_low = width_high = p: every client trains the prefix HeteroFL's single capacity p keeps,
    and the two give the same model after two rounds."""
    finals = []
    for params, metrics in (two_rounds("fjord", width_low=0.5, width_high=0.5), heterofl_at_half()):
        finals.append(params)
        np.testing.assert_allclose(np.asarray(metrics["capacity"]), 0.5)
    tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), *finals)


def test_spafl_widths_are_uniform_per_client_and_round_and_keep_the_prefix(make_split, mlp):
    """p ~ U(0.4, 0.6), a pure function of (seed, round, client); the broadcast keeps units
    [0, ceil(p N)) of each hidden layer and every output unit."""
    draws = np.asarray(jax.vmap(lambda r: jax.vmap(lambda c: client_width(0, 0.4, 0.6, r, c))(jnp.arange(50)))(
        jnp.arange(40)))
    assert draws.min() >= 0.4 and draws.max() <= 0.6
    assert abs(draws.mean() - 0.5) < 0.01 and abs(draws.std() - 0.2 / np.sqrt(12)) < 0.005
    assert len(np.unique(draws)) > 0.99 * draws.size  # every client and round its own draw (float32 may collide)
    assert float(client_width(0, 0.4, 0.6, 7, 3)) == draws[7, 3]  # pure: the same draw again
    split = make_split([8, 8, 8, 8])
    algorithm = build("fjord", context(mlp, split))
    server, _ = algorithm.init(jax.random.key(1), mlp_variables(), 4)
    for r, c in ((0, 1), (5, 2)):
        down = algorithm.broadcast(server, c, round_info(0, r, jnp.array([1, 2])))
        p = float(down["capacity"].value)
        assert p == pytest.approx(draws[r, c])
        for layer in mlp.structure.layers:
            expected = np.zeros(layer.num_units)
            expected[:layer.num_units if layer is mlp.structure.layers[-1] else int(np.ceil(p * layer.num_units))] = 1
            np.testing.assert_array_equal(np.asarray(down["unit_masks"].value[layer.name]), expected)


def test_fjord_tiers_and_per_batch_widths():
    """FjORD: client i of N has the floor(i S / N)-th width as its largest (the code's floor(cid / 20)
    for 100 clients and five widths), and each batch draws uniformly among the widths up to it."""
    widths = jnp.asarray((0.2, 0.4, 0.6, 0.8, 1.0))
    tiers = np.asarray(jax.jit(jax.vmap(lambda c: tier_width(widths, c, 100)))(jnp.arange(100)))
    np.testing.assert_allclose(tiers, (np.arange(100) // 20) * 0.2 + 0.2, rtol=1e-6)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: batch_width(k, widths, jnp.float32(0.6))))(
        jax.random.split(jax.random.key(0), 3000)))
    values, counts = np.unique(np.round(draws, 3), return_counts=True)
    np.testing.assert_allclose(values, [0.2, 0.4, 0.6])
    assert np.all(np.abs(counts / 3000 - 1 / 3) < 4 * np.sqrt(2 / 9 / 3000))


def test_batch_sampling_trains_and_sends_the_tiers_sub_model_only(make_split, mlp):
    """A client of tier p_max receives and returns its p_max prefix; with per-batch widths inside it,
    every entry outside the prefix is exactly unchanged, and the prefix's first units (in every
    width) move."""
    split = make_split([16, 16, 16, 16, 16])
    algorithm = build("fjord", context(mlp, split), fjord_sampling="batch", fjord_widths=(0.25, 0.5))
    variables = mlp_variables()
    exchange = exchanges(algorithm, variables, 5)
    info = round_info(0, 0, jnp.array([0, 4]))
    for client, p_max in ((0, 0.25), (4, 0.5)):
        down, up, metrics = exchange(client, split.client(client), info)
        assert float(down["capacity"].value) == p_max
        kernel = up["variables"]["params"]["fc2"]["kernel"]
        assert isinstance(kernel, KnownMaskArray)
        kept = int(np.ceil(p_max * 256))
        mask = np.asarray(kernel.mask)
        assert mask[:kept, :kept].all() and mask.sum() == kept * kept
        before = np.asarray(variables["params"]["fc2"]["kernel"])
        after = np.asarray(kernel.values)
        np.testing.assert_array_equal(after[~mask], before[~mask])
        assert np.any(after[:64, :64] != before[:64, :64])


def test_fjord_flags_it_does_not_read_are_refused(tmp_path, capsys):
    base = ["run", "--algorithm", "fjord", "--no-progress", "--out", str(tmp_path / "r")]
    for extra, words in ((["--capacities", "0.5"], "--capacities is not read by fjord"),
                         (["--fjord-widths", "0.5,1"], "--fjord-widths is read only with --fjord-sampling batch"),
                         (["--fjord-sampling", "batch", "--width-low", "0.3"], "--width-low is read only"),
                         (["--width-low", "0.7", "--width-high", "0.6"], "--width-low 0.7 exceeds --width-high 0.6"),
                         (["--fjord-distillation"], "--fjord-distillation is read only with --fjord-sampling batch"),
                         (["--fjord-bn", "per_width"], "--fjord-bn is read only with --fjord-sampling batch"),
                         (["--fjord-sampling", "batch", "--fjord-bn", "per_width"], "add --no-static-bn")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1


def test_distillation_loss_by_hand():
    """Two real examples and a padded one, three classes: CE(teacher, labels) + CE(student, softmax(teacher)),
    each a mean over the real examples; the teacher's gradient is its own cross-entropy's alone (the soft
    target is detached), the student's is softmax(student) - softmax(teacher). With the label mask
    (-inf outside it) the same over the two kept classes."""
    teacher = np.array([[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [9.0, 9.0, 9.0]], np.float32)
    student = np.array([[1.0, 1.0, 0.0], [-1.0, 0.0, 2.0], [3.0, -3.0, 0.0]], np.float32)
    labels, mask = np.array([0, 2, 1]), np.array([True, True, False])
    held = np.array([True, False, True])  # class 1 left out of both softmaxes

    @jax.jit  # the loss and its gradients, without and with the label mask, one program
    def losses(teacher, student, labels, mask, held):
        return [jax.value_and_grad(distillation_loss, argnums=(0, 1))(teacher, student, labels, mask, *fill)
                for fill in ((), (held, -jnp.inf))]

    (value, (d_teacher, d_student)), (got, grads) = losses(teacher, student, labels, mask, held)
    t, s_ = np.asarray(teacher[:2], np.float64), np.asarray(student[:2], np.float64)
    p_t = np.exp(t) / np.exp(t).sum(1, keepdims=True)
    p_s = np.exp(s_) / np.exp(s_).sum(1, keepdims=True)
    expected = -np.log(p_t[[0, 1], [0, 2]]).mean() - (p_t * np.log(p_s)).sum(1).mean()
    assert float(value) == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(np.asarray(d_teacher)[:2], (p_t - np.eye(3)[[0, 2]]) / 2, atol=1e-7)
    np.testing.assert_allclose(np.asarray(d_student)[:2], (p_s - p_t) / 2, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(d_teacher)[2], 0.0)
    np.testing.assert_array_equal(np.asarray(d_student)[2], 0.0)
    t2, s2 = t[:, [0, 2]], s_[:, [0, 2]]
    q_t = np.exp(t2) / np.exp(t2).sum(1, keepdims=True)
    q_s = np.exp(s2) / np.exp(s2).sum(1, keepdims=True)
    expected = -np.log(q_t[[0, 1], [0, 1]]).mean() - (q_t * np.log(q_s)).sum(1).mean()
    assert float(got) == pytest.approx(expected, rel=1e-6)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_distillation_step_is_a_teacher_pass_at_the_tier_and_a_student_pass_at_the_batch_width(mlp):
    """A client of tier 1 with widths (0.5, 1): the step's loss and gradient equal, computed apart from
    Fjord's code, CE(full model, labels) + CE(the drawn width's prefix model, softmax of the full model's
    logits held constant), whichever width the step's key draws (both are drawn over the keys)."""
    widths = jnp.asarray([0.5, 1.0])
    full = {l.name: jnp.ones(l.num_units) for l in mlp.structure.layers}

    def prefix(width):  # the first ceil(width N) units of each hidden layer, every output unit
        return {l.name: (jnp.arange(l.num_units) < (l.num_units if l is mlp.structure.layers[-1]
                                                     else math.ceil(width * l.num_units))).astype(jnp.float32)
                for l in mlp.structure.layers}

    def step_masks(key, p_max):
        with jax.ensure_compile_time_eval():  # traced, the step still draws from the test's (concrete) key
            width = float(batch_width(key, widths, p_max))
        return prefix(width), jnp.float32(width)

    rng = np.random.default_rng(0)
    batch = Batch(jnp.asarray(rng.normal(size=(6, 8, 8, 1)), jnp.float32), jnp.asarray(rng.integers(0, 10, 6)),
                  jnp.ones(6, bool))
    params = mlp_variables()["params"]
    loss = width_step_loss(mlp, step_masks, full, jnp.float32(1.0), scaler=False, distillation=True, widths=None,
                           label_mask=None, label_mask_fill=-jnp.inf)

    def independent(params, width):
        logits = lambda masks: mlp.module.apply({"params": params}, batch.x, train=True,  # noqa: E731
                                                unit_masks=masks)
        teacher, student = logits(full), logits(prefix(width))
        target = jax.lax.stop_gradient(jax.nn.softmax(teacher))
        return (optax.softmax_cross_entropy_with_integer_labels(teacher, batch.y).mean()
                + optax.softmax_cross_entropy(student, target).mean())

    drawn = set()
    for k in range(8):
        key = jax.random.key(k)
        width = float(batch_width(key, widths, jnp.float32(1.0)))
        drawn.add(width)
        # both one program (eagerly each operation compiles on its own); the width decides it: two programs
        (value, _), grads, (expected, expected_grads) = jax.jit(lambda params: (
            *jax.value_and_grad(lambda p: loss({"params": p}, {}, batch, key), has_aux=True)(params),
            jax.value_and_grad(independent)(params, width)))(params)
        assert float(value) == pytest.approx(float(expected), rel=1e-6)
        tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 grads, expected_grads)
    assert drawn == {0.5, 1.0}


def test_batch_sampling_at_one_width_is_heterofl_and_distillation_there_is_a_zero_gradient():
    """One width p = 0.5: FjORD's batch sampling with the new options at their defaults (no distillation,
    shared statistics) is HeteroFL at capacity 0.5 exactly; with distillation every step has p = p_max,
    where FjORD's code still runs the student pass, whose term's gradient is softmax(z) - softmax(z) = 0:
    the same model up to rounding, for twice the forward passes (train_flops doubled)."""
    variables = mlp_variables()
    finals, flops = [], []
    for params, metrics in (heterofl_at_half(),
                            two_rounds("fjord", fjord_sampling="batch", fjord_widths=(0.5,), fjord_distillation=False,
                                       fjord_bn="shared"),
                            two_rounds("fjord", fjord_sampling="batch", fjord_widths=(0.5,), fjord_distillation=True)):
        finals.append(params)
        flops.append(np.asarray(metrics["train_flops"]))
    tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), finals[0], finals[1])
    tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
             finals[0], finals[2])
    assert np.any(finals[0]["fc1"]["kernel"] != variables["params"]["fc1"]["kernel"])
    np.testing.assert_array_equal(flops[1], flops[0])
    np.testing.assert_allclose(flops[2], 2 * flops[0], rtol=1e-6)


@pytest.fixture(scope="module")
def cnn4():
    return get_model("cnn4", (8, 8, 1), 10)


@pytest.fixture(scope="module")
def cnn4_variables(cnn4):
    return initialized("cnn4", (8, 8, 1), 10)[1]


def stats_leaves(tree):
    return jax.tree_util.tree_leaves(tree["batch_stats"], is_leaf=is_known)


def test_per_width_statistics_change_only_the_sets_of_the_widths_trained(make_split, cnn4, cnn4_variables):
    """cnn4, widths (0.25, 0.5, 1), three clients of tiers 0.25, 0.5 and 1. The tier-0.25 client trains
    width 0.25 every batch: its set of width 0.25 moves, in the first ceil(N / 4) channels only, to exactly
    what the shared statistics become there (the forward pass never reads running statistics, so the
    weights are the shared run's too); the sets of 0.5 and 1 stay as received and are not sent. The
    tier-0.5 client's sets of 0.25 and 0.5 move in their own channels only (at least one of them moves);
    width 1's stays and is not sent."""
    split = make_split([16, 16, 16])
    ctx = context(cnn4, split, k=3)
    variables = cnn4_variables
    before = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(variables["batch_stats"])]
    options = dict(fjord_sampling="batch", fjord_widths=(0.25, 0.5, 1.0), static_bn=False)
    info = round_info(0, 0, jnp.array([0, 1, 2]))

    def uploads(algorithm, clients):
        exchange = exchanges(algorithm, variables, 3)
        return [exchange(c, split.client(c), info)[1] for c in clients]

    up, up_tier_half = uploads(build("fjord", ctx, fjord_bn="per_width", **options), (0, 1))
    (up_shared,) = uploads(build("fjord", ctx, **options), (0,))
    tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values)),
             up["variables"]["params"], up_shared["variables"]["params"], is_leaf=is_known)
    for held, one, old in zip(stats_leaves(up["variables"]), stats_leaves(up_shared["variables"]), before):
        values, mask = np.asarray(held.values), np.asarray(held.mask)
        kept = math.ceil(0.25 * old.shape[0])
        np.testing.assert_array_equal(mask[0], np.arange(old.shape[0]) < kept)
        assert not mask[1:].any()
        np.testing.assert_array_equal(values[0, :kept], np.asarray(one.values)[:kept])
        assert np.all(values[0, :kept] != old[:kept])
        np.testing.assert_array_equal(values[0, kept:], old[kept:])
        np.testing.assert_array_equal(values[1:], np.broadcast_to(old, values[1:].shape))
    moved = False
    for held, old in zip(stats_leaves(up_tier_half["variables"]), before):
        values, mask = np.asarray(held.values), np.asarray(held.mask)
        for s, width in enumerate((0.25, 0.5)):
            kept = math.ceil(width * old.shape[0])
            np.testing.assert_array_equal(mask[s], np.arange(old.shape[0]) < kept)
            np.testing.assert_array_equal(values[s, kept:], old[kept:])
            moved |= bool(np.any(values[s, :kept] != old[:kept]))
        assert not mask[2].any()
        np.testing.assert_array_equal(values[2], old)
    assert moved


def test_distillation_with_per_width_statistics_updates_the_tiers_set_and_the_students(cnn4, cnn4_variables):
    """One distillation step of a tier-0.5 client (widths 0.25, 0.5, 1) on cnn4: the teacher pass updates
    width 0.5's set, the student pass the drawn width's (0.25's for the key used here, so both move), each
    in its own first ceil(w N) channels, to the momentum average with that pass's batch statistics,
    computed apart by the model at that width; width 1's set is untouched."""
    widths = jnp.asarray([0.25, 0.5, 1.0])
    structure = cnn4.structure

    def prefix(width):
        return {l.name: (jnp.arange(l.num_units) < (l.num_units if l is structure.layers[-1]
                                                     else math.ceil(width * l.num_units))).astype(jnp.float32)
                for l in structure.layers}

    def step_masks(key, p_max):
        with jax.ensure_compile_time_eval():  # traced, the step still draws from the test's (concrete) key
            width = float(batch_width(key, widths, p_max))
        return prefix(width), jnp.float32(width)

    key = next(jax.random.key(k) for k in range(20) if float(batch_width(jax.random.key(k), widths, 0.5)) == 0.25)
    variables = cnn4_variables
    held = tree_map(lambda s: np.stack([s, s + 1.0, s + 2.0]), variables["batch_stats"])  # three distinct sets
    rng = np.random.default_rng(0)
    batch = Batch(jnp.asarray(rng.normal(size=(6, 8, 8, 1)), jnp.float32), jnp.asarray(rng.integers(0, 10, 6)),
                  jnp.ones(6, bool))
    loss = width_step_loss(cnn4, step_masks, prefix(0.5), jnp.float32(0.5), scaler=False, distillation=True,
                           widths=widths, label_mask=None, label_mask_fill=-jnp.inf)

    @jax.jit  # the step and the passes apart one program (eagerly each operation compiles on its own)
    def step_and_passes(params, held, batch):
        with_statistics = lambda s, width: cnn4.apply(  # noqa: E731
            {"params": params, "batch_stats": tree_map(lambda h: h[s], held), "unit_masks": prefix(width)},
            batch.x, train=True, mask=batch.mask)[1]
        return loss({"params": params}, held, batch, key)[1], [with_statistics(0, 0.25), with_statistics(1, 0.5)]

    new, passes = step_and_passes(variables["params"], held, batch)
    for (s, width), expected in zip(((0, 0.25), (1, 0.5)), passes):
        start = tree_map(lambda h: h[s], held)
        for got, want, old in zip(jax.tree_util.tree_leaves(tree_map(lambda n: n[s], new)),
                                  jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(start)):
            kept = math.ceil(width * old.shape[0])
            np.testing.assert_allclose(np.asarray(got)[:kept], np.asarray(want)[:kept], rtol=1e-6)
            assert np.all(np.asarray(got)[:kept] != np.asarray(old)[:kept])
    tree_map(lambda n, h: np.testing.assert_array_equal(np.asarray(n[2]), np.asarray(h[2])), new, held)


def test_the_server_averages_each_widths_statistics_over_the_clients_whose_tier_reaches_it(make_split, cnn4, cnn4_variables):
    """Three clients of tiers 0.25, 0.5, 1 upload random values and data sizes 1, 2, 3: width 0.25's set
    becomes the weighted mean over all three, 0.5's over the last two, 1's the last client's, each in its
    first ceil(w N) channels (FjORD's `fjord_average` over p_max >= w); the other channels keep the
    server's; evaluation reads width 1's set."""
    split = make_split([8, 8, 8])
    algorithm = build("fjord", context(cnn4, split, k=3), fjord_sampling="batch", fjord_widths=(0.25, 0.5, 1.0),
                      fjord_bn="per_width", static_bn=False)
    info = round_info(0, 0, jnp.array([0, 1, 2]))
    @jax.jit  # the server and its three downloads one program (eagerly each operation compiles on its own)
    def start(variables):
        server, _ = algorithm.init(jax.random.key(1), variables, 3)
        return server, jax.vmap(lambda c: algorithm.broadcast(server, c, info))(jnp.arange(3))

    server, downs = jax.device_get(start(cnn4_variables))
    rng = np.random.default_rng(0)
    ups = []
    for client in range(3):
        down = tree_map(lambda a: a[client], downs)
        assert float(down["capacity"].value) == (0.25, 0.5, 1.0)[client]
        sent = tree_map(lambda leaf: KnownMaskArray(rng.normal(size=leaf.values.shape).astype(np.float32),
                                                    leaf.mask), down["variables"], is_leaf=is_known)
        ups.append({"variables": sent, "unit_masks": down["unit_masks"], "labels_held": Known(np.ones(10, bool))})
    stacked = tree_map(lambda *xs: np.stack(xs), *ups)
    weights = np.array([1.0, 2.0, 3.0])
    new = jax.jit(algorithm.server_update)(server, stacked, jnp.asarray(weights, jnp.float32), info)
    for index, (after, before) in enumerate(zip(jax.tree_util.tree_leaves(new["variables"]["batch_stats"]),
                                                jax.tree_util.tree_leaves(server["variables"]["batch_stats"]))):
        values = np.stack([np.asarray(stats_leaves(up["variables"])[index].values) for up in ups])  # [3, S, N]
        after, before = np.asarray(after), np.asarray(before)
        expected = before.copy()
        for s, width in enumerate((0.25, 0.5, 1.0)):
            kept = math.ceil(width * before.shape[1])
            holders = [c for c, tier in enumerate((0.25, 0.5, 1.0)) if tier >= width]
            expected[s, :kept] = sum(weights[c] * values[c, s, :kept] for c in holders) / weights[holders].sum()
        np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-6)
    tree_map(lambda g, h: np.testing.assert_array_equal(np.asarray(g), np.asarray(h)[2]),
             algorithm.global_variables(new)["batch_stats"], new["variables"]["batch_stats"])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_per_width_statistics_travel_as_the_sets_up_to_the_tier_over_the_zoo(name):
    """On every model of the zoo, a client of tier 0.5 (widths 0.25, 0.5, 1) receives, besides the weights
    of shared statistics' message, width 0.25's and 0.5's statistics in their first ceil(w N) channels and
    nothing of width 1's, at 4 bytes a value; a model without BatchNorm sends the same as with shared."""
    model = zoo_model(name)
    variables = tree_map(lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(model.init, jax.random.key(0)))
    ctx = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=3, clients_per_round=2, train=None,
                       num_classes=model.num_classes, seed=0)
    options = dict(fjord_sampling="batch", fjord_widths=(0.25, 0.5, 1.0), static_bn=False)
    algorithms = [build("fjord", ctx, fjord_bn=bn, **options) for bn in ("shared", "per_width")]

    @jax.jit  # both downloads one program (eagerly each operation compiles on its own, per leaf shape)
    def downloads(variables):
        downs = [a.broadcast(a.init(jax.random.key(1), variables, 3)[0], 1, round_info(0, 0, jnp.array([1, 2])))
                 for a in algorithms]
        return [(down, message_bytes(down)) for down in downs]

    (shared, shared_bytes), (per_width, per_width_bytes) = jax.device_get(downloads(variables))
    extra = 0
    for one, held in zip(stats_leaves(shared["variables"]), stats_leaves(per_width["variables"])):
        units = np.arange(one.mask.shape[0])
        np.testing.assert_array_equal(np.asarray(one.mask), units < math.ceil(0.5 * units.size))
        for s, width in enumerate((0.25, 0.5)):
            np.testing.assert_array_equal(np.asarray(held.mask[s]), units < math.ceil(width * units.size))
        assert not np.asarray(held.mask[2]).any()
        extra += math.ceil(0.25 * units.size)
    assert bool(stats_leaves(shared["variables"])) == (name in ("spafl_cnn", "vgg9", "resnet20", "resnet32",
                                                                "preresnet18", "cnn4"))
    assert int(per_width_bytes) == int(shared_bytes) + 4 * extra
