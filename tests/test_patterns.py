"""Uplink compression and personal layers, for any algorithm they fit: equivalences (ratio 1 is the algorithm
itself; FedPer's first round shares FedAvg's model), error feedback and QSGD by hand, the bytes, refusals,
and an exact resume of the residuals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import initialized, synthetic_split
from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.algorithms.personalization import PersonalizationOptions, personalize
from fedjax_sparse.algorithms.uplink_compression import UplinkCompressionOptions, compress_uplink
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.messages.compression import stochastic_quantization
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import QuantizedArray, SparseArray, message_bytes
from fedjax_sparse.core.round.step import build_round, round_info
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map
MLP_PARAMS = 85002


@pytest.fixture(scope="module")
def setting():
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([10, 12, 8, 9])
    context = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=4, clients_per_round=2, train=split,
                           num_classes=10)
    return model, split, context, model.init(jax.random.key(0))


def rounds(algorithm, split, variables, n=2):
    server, clients = algorithm.init(jax.random.key(1), variables, 4)
    round_fn = build_round(algorithm, split, 2, seed=0)
    outs = []
    for r in range(n):
        server, clients, out = round_fn(server, clients, r)
        outs.append(out)
    return server, clients, outs


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_topk_at_ratio_one_is_the_algorithm_itself(setting, name):
    """Every entry kept: FedAvg's model upload (rebuilt as broadcast + change) and SCAFFOLD's deltas give the
    algorithm's own model, to float rounding, at the cost of each leaf's dense bytes (an index is dearer)."""
    model, split, context, variables = setting
    base = make_algorithm(name, context, make_options(name, {}))
    whole = compress_uplink(base, context, UplinkCompressionOptions("topk", 1.0))
    (a, _, out_a), (b, _, out_b) = rounds(base, split, variables, 1), rounds(whole, split, variables, 1)
    tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a["variables"], b["variables"])
    np.testing.assert_array_equal(out_a[-1].uplink_bytes, out_b[-1].uplink_bytes)


def test_error_feedback_sends_the_largest_corrected_entries_and_keeps_the_rest(setting):
    """Client update by hand: the message is top-k of (trained - broadcast + residual), the new residual is
    what it left out, and a second update adds that residual before choosing."""
    model, split, context, variables = setting
    algorithm = compress_uplink(make_algorithm("fedavg", context, make_options("fedavg", {})), context,
                                UplinkCompressionOptions("topk", 0.1, error_feedback=True))
    server, clients = algorithm.init(jax.random.key(1), variables, 4)
    info = round_info(0, 0, jnp.array([0, 1]))
    update = jax.jit(algorithm.client_update)
    state = tree_map(lambda a: a[0], clients)
    down = algorithm.broadcast(server, 0, info)
    residual = {p: np.zeros(r.shape, np.float32) for p, r in state["residual"].items()}
    for step in range(2):
        up, state, _ = update(down, state, split.client(0), jax.random.key(step), info)
        plain = jax.jit(make_algorithm("fedavg", context, make_options("fedavg", {})).client_update)(
            down, {}, split.client(0), jax.random.key(step), info)[0]
        for path, sent in up["compressed"].items():
            keys = path.split("/")
            change = np.asarray(plain[keys[0]][keys[1]][keys[2]]) - np.asarray(down[keys[0]][keys[1]][keys[2]])
            corrected = change + residual[path]
            k = int(np.ceil(0.1 * corrected.size))
            expected = np.zeros(corrected.size, bool)
            expected[np.argsort(-np.abs(corrected).ravel(), kind="stable")[:k]] = True
            assert isinstance(sent, SparseArray) and int(np.asarray(sent.mask).sum()) == k
            np.testing.assert_array_equal(np.asarray(sent.mask).ravel(), expected)
            residual[path] = np.where(expected.reshape(corrected.shape), 0.0, corrected)
            np.testing.assert_allclose(state["residual"][path], residual[path], rtol=1e-6, atol=1e-7)
    assert set(up["dense"]) == set()  # the MLP has no statistics: everything is compressed


def test_qsgd_is_unbiased_and_priced_at_its_bits():
    x = {"w": jnp.array([0.3, -1.2, 0.0, 2.5, -0.7])}
    # jitted, as a client compresses (op by op, each operation would compile on its own)
    message, price = jax.jit(lambda k: ((m := stochastic_quantization(x, 2, k)["w"]), message_bytes(m)))(
        jax.random.key(0))
    assert isinstance(message, QuantizedArray) and int(jnp.abs(message.levels).max()) <= 3
    assert int(price) == 4 + (5 * 3 + 7) // 8  # the norm, then 2 bits + a sign each
    draws = jax.jit(jax.vmap(lambda k: stochastic_quantization(x, 2, k)["w"].dense()))(
        jax.random.split(jax.random.key(1), 20000))
    norm = float(jnp.linalg.norm(x["w"]))
    np.testing.assert_allclose(np.asarray(draws).mean(0), x["w"], atol=4 * norm / 3 / np.sqrt(20000) + 1e-6)


def test_random_k_pays_values_only_and_personal_layers_never_travel(setting):
    model, split, context, variables = setting
    fedavg = make_algorithm("fedavg", context, make_options("fedavg", {}))
    randk = compress_uplink(fedavg, context, UplinkCompressionOptions("randk", 0.2))
    _, _, (out,) = rounds(randk, split, variables, 1)
    sizes = [x.size for x in jax.tree_util.tree_leaves(variables)]
    assert int(out.uplink_bytes[0]) == 4 * sum(int(np.ceil(0.2 * n)) for n in sizes)
    fedper = personalize(fedavg, context, PersonalizationOptions("predictor"))
    server, clients, (out,) = rounds(fedper, split, variables, 1)
    head = 4 * (256 * 10 + 10)
    assert int(out.uplink_bytes[0]) == int(out.downlink_bytes[0]) == 4 * MLP_PARAMS - head
    np.testing.assert_allclose(server["variables"]["params"]["fc3"]["kernel"], variables["params"]["fc3"]["kernel"],
                               rtol=1e-6)  # the server's own head, averaged with itself
    heads = np.asarray(clients["personal"]["params"]["fc3"]["kernel"])
    sampled = np.asarray(out.client_ids)
    assert not np.array_equal(heads[sampled[0]], heads[sampled[1]])  # each client its own predictor
    plain = rounds(fedavg, split, variables, 1)[0]  # round 1: every client starts from the same head
    np.testing.assert_allclose(server["variables"]["params"]["fc1"]["kernel"],
                               plain["variables"]["params"]["fc1"]["kernel"], rtol=1e-5, atol=1e-7)


def test_fedbn_keeps_every_normalization_on_the_clients():
    model = get_model("cnn4", (8, 8, 1), 10)
    split = synthetic_split([8, 8, 8, 8])
    context = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=4, clients_per_round=2, train=split,
                           num_classes=10)
    algorithm = personalize(make_algorithm("fedavg", context, make_options("fedavg", {})), context,
                            PersonalizationOptions("norm"))
    # jitted, as a round runs them (op by op each operation compiles on its own, per leaf shape); only shapes count
    server, _ = jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), initialized("cnn4", (8, 8, 1), 10)[1], 4)
    down = jax.jit(algorithm.broadcast)(server, 0, round_info(0, 0, jnp.array([0, 1])))
    assert down["batch_stats"] == {} and all("bn" not in name for name in down["params"])
    norms = sum(x.size for name, layer in server["variables"]["params"].items() if name.startswith("bn")
                for x in jax.tree_util.tree_leaves(layer)) + sum(x.size for x in jax.tree_util.tree_leaves(
                    server["variables"]["batch_stats"]))
    total = sum(x.size for x in jax.tree_util.tree_leaves(server["variables"]))
    assert int(jax.jit(message_bytes)(down)) == 4 * (total - norms)


def test_patterns_refuse_what_they_cannot_apply_to(setting, tmp_path, capsys):
    model, split, context, variables = setting
    for name, options, words in (("fedldf", UplinkCompressionOptions("topk"), "chooses what its clients upload"),
                                 ("spafl", UplinkCompressionOptions("qsgd"), None),
                                 ("heterofl", UplinkCompressionOptions("randk"), "already priced entry by entry")):
        algorithm = make_algorithm(name, context, make_options(name, {"clients_per_layer": 1}))
        if words is None:
            compress_uplink(algorithm, context, options)  # thresholds are a dense upload: compressible
            continue
        with pytest.raises(ValueError, match=words):
            compress_uplink(algorithm, context, options)
    with pytest.raises(ValueError, match="does not send the model's variables both ways"):
        personalize(make_algorithm("scaffold", context, make_options("scaffold", {})), context,
                    PersonalizationOptions("predictor"))
    with pytest.raises(ValueError, match="mlp has no norm layers"):
        personalize(make_algorithm("fedavg", context, make_options("fedavg", {})), context,
                    PersonalizationOptions("norm"))
    assert main(["run", "--quantization-bits", "3", "--uplink-compression", "topk", "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 2
    assert "--quantization-bits is read only by --uplink-compression qsgd" in capsys.readouterr().err


def test_error_feedback_residuals_resume_exactly(tmp_path):
    base = ["run", "--num-clients", "4", "--clients-per-round", "2", "--local-epochs", "1", "--max-train-examples",
            "200", "--max-test-examples", "100", "--uplink-compression", "topk", "--compression-ratio", "0.05",
            "--error-feedback", "--no-progress", "--no-tensorboard"]
    assert main([*base, "--rounds", "3", "--out", str(tmp_path / "whole")]) == 0
    assert main([*base, "--rounds", "2", "--checkpoint-every", "1", "--out", str(tmp_path / "parts")]) == 0
    assert main(["run", "--resume", str(tmp_path / "parts"), "--rounds", "3", "--no-progress"]) == 0
    whole, parts = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                    for d in ("whole", "parts"))
    drop = ("wall_seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in whole] == \
        [{k: v for k, v in r.items() if k not in drop} for r in parts]
