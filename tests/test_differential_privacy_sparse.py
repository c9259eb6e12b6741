"""Client-level differential privacy for FedLDF and for top-k uplink compression with error feedback: the
sensitivity each declares, measured on the sums its server releases over neighbouring sets of clients; the noise's
measured spread; clipping's bound on every compressed upload, which stays sparse and priced so; the algorithms
themselves without noise or clipping; and what cannot be accounted refused in one line."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import fedavg
from fedjax_sparse.privacy.mechanism import DifferentialPrivacyOptions, private_sum_of, privatize
from fedjax_sparse.algorithms.fedldf import fedldf
from fedjax_sparse.algorithms.scaffold import scaffold
from fedjax_sparse.algorithms.uplink_compression import UplinkCompressionOptions, compress_uplink
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import KnownMaskArray, SparseArray, message_bytes
from fedjax_sparse.core.round.step import client_keys, round_info
from fedjax_sparse.core.contract.wrapping import broadcast_shapes, upload_changes, upload_shapes
from fedjax_sparse.models import MODEL_NAMES, get_model
from fedjax_sparse.run.cli import main

from conftest import jitted_exchange, synthetic_split
from test_faults import TINY, records, summary
from test_structure import zoo_model

tree_map = jax.tree_util.tree_map
SLOTS = 6


@pytest.fixture(scope="module")
def setting():
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([12, 17, 9, 30, 20, 14], seed=3)
    return model, split, model.init(jax.random.key(0))


def _context(model, split, lr):
    return BuildContext(local=LocalSGD(model, lr, 1, 8), num_clients=SLOTS, clients_per_round=SLOTS, train=split,
                        num_classes=10)


def _private_fedldf(model, split, n, clip, z, lr=0.5, sampling="poisson"):
    context = _context(model, split, lr)
    plain = fedldf(context.local, n, SLOTS)
    private = privatize(plain, context, DifferentialPrivacyOptions(dp_clip=clip, dp_clipping="per_layer"),
                        noise_multiplier=z, expected_clients=SLOTS, sampling=sampling)
    return plain, private


def _round(algorithm, split, variables, server=None):
    """The server state and every slot's upload (all six clients, stacked) of one round, each client's update
    jitted as the round runs it (eagerly each operation compiles on its own)."""
    if server is None:
        server, _ = jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), variables, SLOTS)
    info = round_info(0, 0, jnp.arange(SLOTS))
    keys = client_keys(0, 0, jnp.arange(SLOTS))
    update = jitted_exchange(algorithm, info)
    ups = [update(server, c, {}, split.client(c), keys[c])[0] for c in range(SLOTS)]
    return server, tree_map(lambda *x: jnp.stack(x), *ups), info


def _step(algorithm, server, ups, info, present, weights=None):
    """The server's new state after the round of the clients `present` ([K] bool; None: all)."""
    weights = jnp.ones(SLOTS) if weights is None else weights
    if present is not None:
        info, weights = info.replace(participating=present), weights * present
    return algorithm.server_update(server, algorithm.select_uploads(ups, weights, info), weights, info)


def _jitted_step(algorithm, server, ups, info, present, weights=None):
    return jax.jit(lambda server, ups, present, weights: _step(algorithm, server, ups, info, present, weights))(
        server, ups, present, weights)


def _flat(variables):
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(variables)])


def test_fedldf_sums_move_by_at_most_2C_when_a_client_is_added(setting):
    """Neighbouring sets drawn at random: a set of clients taking part with x, and without it. Without noise the
    server's step is the sum of the chosen clipped layers over n (sgd at lr 1): times n, the sums released. They
    move by at most 2 C, and by more than C in some draws (the clients x displaces, one per layer, count too, so
    a plain sum's sensitivity would understate it)."""
    model, split, variables = setting
    n, clip = 2, 0.05
    _, private = _private_fedldf(model, split, n, clip, 0.0)
    server, ups, info = _round(private, split, variables)
    # the round's state and uploads as arguments: closed over, they would be a program of 2.4 MB of constants
    released = functools.partial(jax.jit(lambda server, ups, present: tree_map(
        lambda new, old: n * (new - old), _step(private, server, ups, info, present)["variables"],
        server["variables"])), server, ups)
    rng = np.random.default_rng(0)
    moved = []
    for _ in range(24):
        x = rng.integers(SLOTS)
        others = rng.random(SLOTS) < 0.75
        with_x, without_x = (_flat(released(jnp.asarray(present))) for present in (
            others | (np.arange(SLOTS) == x), others & (np.arange(SLOTS) != x)))
        moved.append(np.linalg.norm(with_x - without_x))
    assert max(moved) <= 2 * clip * (1 + 1e-4), moved
    assert max(moved) > 1.2 * clip, moved


@pytest.mark.parametrize("sampling,spread", [("poisson", 2.0), ("uniform", 1.0)])
def test_fedldf_noise_is_z_times_its_sensitivity_over_n(setting, sampling, spread):
    """Clients that learn nothing (lr 1e-30) show the noise alone: each layer's mean over the n gains
    N(0, (z 2 C / n)^2) where clients are added or removed (Poisson sampling), N(0, (z C / n)^2) where one is
    replaced (a replaced client also moves the sums by 2 C, which the accountant counts as z / 2)."""
    model, split, variables = setting
    n, clip, z = 3, 0.5, 2.0
    _, private = _private_fedldf(model, split, n, clip, z, lr=1e-30, sampling=sampling)
    server, ups, info = _round(private, split, variables)
    moved = _flat(_jitted_step(private, server, ups, info, None)["variables"]) - _flat(server["variables"])
    assert moved.size == 85002
    assert abs(moved.std() / (z * spread * clip / n) - 1) < 0.02 and abs(moved.mean()) < 0.02 * z * clip / n


def test_fedldf_noises_a_round_nobody_took_part_in(setting):
    """No client present, so no layer sent: FedLDF's masked mean would keep every entry as it was, telling the
    round was empty. Each layer's mean still gains the noise over n, N(0, (z 2 C / n)^2) (Poisson sampling)."""
    model, split, variables = setting
    n, clip, z = 3, 0.5, 2.0
    _, private = _private_fedldf(model, split, n, clip, z)
    server, ups, info = _round(private, split, variables)
    moved = _flat(_jitted_step(private, server, ups, info, jnp.zeros(SLOTS, bool))["variables"]) - _flat(
        server["variables"])
    assert abs(moved.std() / (z * 2 * clip / n) - 1) < 0.02


def test_fedldf_without_noise_or_clipping_is_fedldf_itself(setting):
    """z = 0 and C = inf: every upload and the server's step equal FedLDF's bit for bit (its mean at equal
    weights), with every client taking part and with some absent (n or more present)."""
    model, split, variables = setting
    plain, private = _private_fedldf(model, split, 2, 1e30, 0.0)
    server, ups, info = _round(plain, split, variables)
    _, private_ups, _ = _round(private, split, variables, server)
    tree_map(np.testing.assert_array_equal, private_ups, ups)
    sizes = jnp.asarray([12.0, 17, 9, 30, 20, 14])
    for present in (None, jnp.array([True, False, True, True, False, True])):
        tree_map(np.testing.assert_array_equal, _jitted_step(private, server, private_ups, info, present, sizes),
                 _jitted_step(plain, server, ups, info, present))


def _private_topk(model, split, clip, z, lr=0.5, ratio=0.05, compressor="topk", **options):
    context = _context(model, split, lr)
    compressed = compress_uplink(fedavg(context.local, "uniform"), context, UplinkCompressionOptions(
        uplink_compression=compressor, compression_ratio=ratio, error_feedback=True))
    private = privatize(compressed, context, DifferentialPrivacyOptions(dp_clip=clip, **options), noise_multiplier=z,
                        expected_clients=SLOTS)
    return compressed, private


@pytest.mark.parametrize("compressor,clipping", [("topk", "flat"), ("topk", "per_layer"), ("randk", "flat")])
def test_clipping_bounds_every_compressed_upload_which_stays_sparse(setting, compressor, clipping):
    """Each client's message, after top-k (random-k) and error feedback: within C (per layer, C / sqrt(layers)),
    its k entries the very ones compression chose, its price the sparse message's; its residual the
    compression's own."""
    model, split, variables = setting
    clip = 0.05
    compressed, private = _private_topk(model, split, clip, 0.0, compressor=compressor, dp_clipping=clipping)
    server, clients = jax.jit(compressed.init, static_argnums=2)(jax.random.key(1), variables, SLOTS)
    info = round_info(0, 0, jnp.arange(SLOTS))
    down = compressed.broadcast(server, 0, info)
    # jitted as the round runs them (eagerly each operation compiles on its own)
    plain_update = jax.jit(lambda *args: compressed.client_update(*args, info))
    private_update = jax.jit(lambda *args: private.client_update(*args, info))
    for c, key in enumerate(client_keys(0, 0, jnp.arange(SLOTS))):
        state = tree_map(lambda x: x[c], clients)
        plain_up, plain_state, _ = plain_update(down, state, split.client(c), key)
        up, private_state, _ = private_update(down, state, split.client(c), key)
        sent = {p: np.asarray(x.dense()) for p, x in up["compressed"].items()}
        norms = {p.rsplit("/", 1)[0]: 0.0 for p in sent}
        for p, x in sent.items():
            norms[p.rsplit("/", 1)[0]] += float(np.sum(np.square(x)))
        assert sum(norms.values()) ** 0.5 <= clip * (1 + 1e-5)
        assert sum(norms.values()) ** 0.5 > 0.5 * clip
        if clipping == "per_layer":
            assert all(v ** 0.5 <= clip / len(norms) ** 0.5 * (1 + 1e-5) for v in norms.values()), norms
        for p, x in up["compressed"].items():
            kind = SparseArray if compressor == "topk" else KnownMaskArray
            assert type(x) is type(plain_up["compressed"][p]) is kind
            np.testing.assert_array_equal(x.mask, plain_up["compressed"][p].mask)
        assert int(message_bytes(up)) == int(message_bytes(plain_up)) < 85002 * 4 / 10
        tree_map(np.testing.assert_array_equal, private_state, plain_state)


def test_topk_noise_is_dense(setting):
    """Each message holds 5 % of the entries, but the mean gains N(0, (z C / K)^2) at every one of them."""
    model, split, variables = setting
    clip, z = 0.5, 2.0
    _, private = _private_topk(model, split, clip, z, lr=1e-30)
    server, clients = jax.jit(private.init, static_argnums=2)(jax.random.key(1), variables, SLOTS)
    info = round_info(0, 0, jnp.arange(SLOTS))
    keys = client_keys(0, 0, jnp.arange(SLOTS))
    update = jitted_exchange(private, info)
    ups = [update(server, c, tree_map(lambda x: x[c], clients), split.client(c), keys[c])[0] for c in range(SLOTS)]
    new = jax.jit(private.server_update)(server, tree_map(lambda *x: jnp.stack(x), *ups), jnp.ones(SLOTS), info)
    moved = _flat(new["variables"]) - _flat(server["variables"])
    assert moved.size == 85002 and np.count_nonzero(moved) == moved.size
    assert abs(moved.std() / (z * clip / SLOTS) - 1) < 0.02


def test_random_k_takes_local_noise_on_the_values_it_sends(setting):
    """Random-k's entries come from the round's key, not the client's data: local noise may cover its values
    alone. A client that learns nothing (lr 1e-30) sends N(0, (z C)^2) at its k entries, nothing elsewhere."""
    model, split, variables = setting
    clip, z = 0.5, 2.0
    compressed, private = _private_topk(model, split, clip, z, lr=1e-30, ratio=0.2, compressor="randk",
                                        dp_noise="local")
    server, clients = jax.jit(compressed.init, static_argnums=2)(jax.random.key(1), variables, SLOTS)
    info = round_info(0, 0, jnp.arange(SLOTS))
    up, _, _ = jax.jit(private.client_update)(compressed.broadcast(server, 0, info), tree_map(lambda x: x[0], clients),
                                              split.client(0), client_keys(0, 0, jnp.arange(SLOTS))[0], info)
    sent = np.concatenate([np.asarray(x.values)[np.asarray(x.mask)] for x in up["compressed"].values()])
    assert sent.size == sum(math.ceil(0.2 * x.mask.size) for x in up["compressed"].values())
    assert abs(sent.std() / (z * clip) - 1) < 0.03
    assert int(message_bytes(up)) == 4 * sent.size


def test_topk_with_error_feedback_without_noise_or_clipping_is_itself(tmp_path, capsys):
    """Three rounds of top-k with error feedback (the residual carried between them): the same records, bytes
    and accuracy included, with --dp-clip 1e30 and no noise as without privacy."""
    flags = [*TINY, "--rounds", "3", "--aggregation-weights", "uniform", "--uplink-compression", "topk",
             "--compression-ratio", "0.05", "--error-feedback"]
    plain, private = tmp_path / "plain", tmp_path / "private"
    assert main(["run", *flags, "--out", str(plain)]) == 0
    assert main(["run", *flags, "--dp-clip", "1e30", "--dp-noise-multiplier", "0", "--out", str(private)]) == 0
    for mine, theirs in zip(records(private), records(plain), strict=True):
        assert mine["dp_epsilon"] is None
        assert {k: v for k, v in mine.items() if k in theirs} == theirs
    capsys.readouterr()


def test_fedldf_and_topk_runs_record_their_epsilon(tmp_path, capsys):
    """Poisson sampling, per-layer clipping, adaptive clipping (FedLDF's choice reads the wrapped upload): the
    runs complete and record the accountant's epsilon; top-k's uplink is still priced sparse (its bytes recorded
    with `--dp-record-unreleased`)."""
    flags = [*TINY, "--num-clients", "8", "--clients-per-round", "3", "--sampler", "poisson", "--rounds", "2",
             "--dp-clip", "0.5", "--dp-noise-multiplier", "1", "--dp-record-unreleased"]
    fedldf_run, topk_run, dense_run = tmp_path / "fedldf", tmp_path / "topk", tmp_path / "dense"
    assert main(["run", *flags, "--algorithm", "fedldf", "--clients-per-layer", "1", "--dp-clipping", "per_layer",
                 "--dp-target-quantile", "0.5", "--dp-count-noise", "2", "--out", str(fedldf_run)]) == 0
    assert main(["run", *flags, "--uplink-compression", "topk", "--compression-ratio", "0.01", "--error-feedback",
                 "--out", str(topk_run)]) == 0
    assert main(["run", *flags, "--out", str(dense_run)]) == 0
    for run in (fedldf_run, topk_run):
        assert summary(run)["dp_epsilon"] == records(dense_run)[-1]["dp_epsilon"] > 0
    assert records(fedldf_run)[0]["server_dp_clip_norm"] == pytest.approx(0.5)
    topk_bytes, dense_bytes = (sum(r["uplink_bytes"] for r in records(run)) for run in (topk_run, dense_run))
    assert 0 < topk_bytes < dense_bytes / 20
    capsys.readouterr()


@pytest.mark.parametrize("flags,words", [
    (["--algorithm", "fedldf", "--clients-per-layer", "1"], "--dp-clipping flat: fedldf's sums move by at most 2 C"),
    (["--algorithm", "fedldf", "--clients-per-layer", "1", "--dp-clipping", "per_layer", "--dp-noise", "local"],
     "--dp-noise local: fedldf's clients also send what its server chooses by (divergence)"),
    (["--algorithm", "fedldf", "--clients-per-layer", "1", "--dp-clipping", "per_layer", "--secure-aggregation",
      "secagg+"],
     "--secure-aggregation: fedldf's server chooses each client's upload"),
    (["--uplink-compression", "topk", "--error-feedback", "--dp-noise", "local"],
     "--dp-noise local: fedavg's upload holds client-chosen indexes"),
    (["--uplink-compression", "topk", "--error-feedback", "--sampler", "poisson", "--secure-aggregation", "secagg+"],
     "--secure-aggregation: fedavg's server reads each client's upload"),
])
def test_what_cannot_be_accounted_is_refused_in_one_line(tmp_path, capsys, flags, words):
    assert main(["run", *TINY, "--rounds", "1", "--dp-clip", "1", *flags, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_every_released_leaf_is_clipped_as_the_change_it_is(model_name):
    """Over the zoo, on shapes: FedLDF's released leaves are its model's variables, each a new value of the one
    broadcast (clipped as its change), each in one of the model's layers, every layer a clipping unit, its
    divergences held back; a compressed upload's messages are changes already and its dense leaves (BatchNorm
    statistics) new values of the broadcast's."""
    model = zoo_model(model_name)
    context = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=4, clients_per_round=4, train=None,
                           num_classes=10)
    variables = jax.eval_shape(model.init, jax.random.key(0))
    paths = {"/".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(variables)[0]}
    algorithm = fedldf(context.local, 2, 4)
    declared = algorithm.private_sum
    layers = dict(declared.clip_layers)
    message = upload_changes(upload_shapes(algorithm, context), broadcast_shapes(algorithm, context),
                             lambda path, leaf: path != "divergence", declared.references)
    assert message.references == {f"variables/{p}": p for p in paths}
    assert set(layers) == set(message.paths)
    assert sorted(set(layers.values())) == sorted(model.structure.names)
    compressed = compress_uplink(fedavg(context.local), context, UplinkCompressionOptions(uplink_compression="topk"))
    message = upload_changes(upload_shapes(compressed, context), broadcast_shapes(compressed, context),
                             lambda path, leaf: True, compressed.private_sum.references)
    stats = {p for p in paths if p.startswith("batch_stats/")}
    assert message.references == {f"dense/{p}": p for p in paths if f"dense/{p}" in message.paths}
    assert {f"dense/{p}" for p in stats} <= set(message.references)
    assert {p[len("compressed/"):] for p in message.paths if p.startswith("compressed/")} | \
        {p[len("dense/"):] for p in message.references} == paths
    # SCAFFOLD's deltas are changes already; its BatchNorm statistics are new values of the broadcast model's
    control = scaffold(context.local, 4)
    message = upload_changes(upload_shapes(control, context), broadcast_shapes(control, context),
                             lambda path, leaf: True, private_sum_of(control).references)
    assert message.references == {p: f"variables/{p}" for p in stats}
    assert {p for p in message.paths if not p.startswith("batch_stats/")} == (
        {f"delta/{p[len('params/'):]}" for p in paths if p.startswith("params/")}
        | {f"control_delta/{p[len('params/'):]}" for p in paths if p.startswith("params/")})
    for wrapped in (algorithm, compressed):  # the wrapper reads the declarations without refusing them
        privatize(wrapped, context, DifferentialPrivacyOptions(dp_clip=1.0, dp_clipping="per_layer"),
                  noise_multiplier=1.0, expected_clients=4)
