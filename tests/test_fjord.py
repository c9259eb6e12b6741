"""Fjord against independent truths: HeteroFL at a fixed width, SpaFL's U(0.4, 0.6) widths, FjORD's tiers
and per-batch widths, the ordered-dropout prefix, and refused flags."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.fjord import batch_width, client_width, tier_width
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.algorithm import BuildContext
from fedjax_sparse.core.local_training import LocalSGD
from fedjax_sparse.core.messages import KnownMaskArray
from fedjax_sparse.core.round import build_round, round_info
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map


def context(model, split, k=2):
    return BuildContext(local=LocalSGD(model, 0.1, 1, 8, 0.5), num_clients=split.num_clients, clients_per_round=k,
                        train=split, num_classes=model.num_classes, seed=0)


def build(name, ctx, **options):
    return make_algorithm(name, ctx, make_options(name, options))


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


def test_fjord_at_a_fixed_width_is_heterofl_at_that_capacity(make_split, mlp):
    """width_low = width_high = p: every client trains the prefix HeteroFL's single capacity p keeps,
    and the two give the same model after two rounds."""
    split = make_split([9, 17, 12, 30])
    ctx = context(mlp, split)
    variables = mlp.init(jax.random.key(0))
    finals = []
    for algorithm in (build("fjord", ctx, width_low=0.5, width_high=0.5), build("heterofl", ctx, capacities=(0.5,))):
        server, clients = algorithm.init(jax.random.key(1), variables, 4)
        round_fn = build_round(algorithm, split, 2, seed=3)
        for r in range(2):
            server, clients, out = round_fn(server, clients, r)
        finals.append(algorithm.global_variables(server)["params"])
        np.testing.assert_allclose(np.asarray(out.metrics["capacity"]), 0.5)
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
    server, _ = algorithm.init(jax.random.key(1), mlp.init(jax.random.key(0)), 4)
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
    tiers = np.asarray(jax.vmap(lambda c: tier_width(widths, c, 100))(jnp.arange(100)))
    np.testing.assert_allclose(tiers, (np.arange(100) // 20) * 0.2 + 0.2, rtol=1e-6)
    draws = np.asarray(jax.vmap(lambda k: batch_width(k, widths, jnp.float32(0.6)))(
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
    variables = mlp.init(jax.random.key(0))
    server, _ = algorithm.init(jax.random.key(1), variables, 5)
    info = round_info(0, 0, jnp.array([0, 4]))
    for client, p_max in ((0, 0.25), (4, 0.5)):
        down = algorithm.broadcast(server, client, info)
        assert float(down["capacity"].value) == p_max
        up, _, metrics = algorithm.client_update(down, {}, split.client(client), jax.random.key(2), info)
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
                         (["--width-low", "0.7", "--width-high", "0.6"], "--width-low 0.7 exceeds --width-high 0.6")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1
