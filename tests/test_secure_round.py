"""Secure aggregation in the round: the model is what the algorithm computes (it reads only the sum), every
client's bytes are the protocol's (a dropped client's too), and what needs more than the sum is refused. Also
the contract the privacy and secure-sum wrappers rest on: an algorithm that says it reads its uploads only
through their mean (`aggregates_mean`) computes the same from every slot set to that mean."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_split
from fedjax_sparse.algorithms import BUILT_IN, fedavg, make_algorithm, make_options
from fedjax_sparse.algorithms.personalization import PersonalizationOptions, personalize
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.federation.clock import Stragglers, read_profile_file
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.federation.participation import uniform_sampler
from fedjax_sparse.core.round.step import RoundConditions, round_info, round_step
from fedjax_sparse.core.messages.secure_aggregation import SecureAggregation, summed_entries
from fedjax_sparse.core.contract.wrapping import upload_shapes
from fedjax_sparse.models import MODEL_NAMES, get_model
from fedjax_sparse.run.cli import main

from test_faults import TINY, records
from test_structure import zoo_model

tree_map = jax.tree_util.tree_map
FAST = 1e30


def _context(model, split, n=6, k=4):
    local = LocalSGD(model, 0.1, 1, 8)
    return BuildContext(local=local, num_clients=n, clients_per_round=k, train=split, num_classes=10)


def test_an_algorithm_that_reads_only_the_mean_computes_the_same_from_it():
    """Every shipped algorithm that says so (and --personal over FedAvg): random uploads in 4 slots of equal
    weight, or every slot set to their mean, give the same server state."""
    model = get_model("mlp", (8, 8, 1), 10)
    context = dataclasses.replace(_context(model, synthetic_split([9, 14, 11, 16, 7, 12])), labels_per_client=2)
    declared = {}
    for name in sorted(BUILT_IN):
        declared[name] = make_algorithm(name, context, make_options(name, {"clients_per_layer": 2}))
    declared["fedavg --personal predictor"] = personalize(declared["fedavg"], context,
                                                          PersonalizationOptions(personal="predictor"))
    declared = {name: a for name, a in declared.items() if a.aggregates_mean}
    assert set(declared) == {"fedavg", "fedprox", "feddyn", "scaffold", "spafl", "fedavg --personal predictor"}
    for name, algorithm in declared.items():
        server, _ = algorithm.init(jax.random.key(0), model.init(jax.random.key(0)), 6)
        shapes = upload_shapes(algorithm, context)
        keys = iter(jax.random.split(jax.random.key(1), 64))
        ups = tree_map(lambda s: jax.random.normal(next(keys), (4, *s.shape)).astype(s.dtype), shapes)
        means = tree_map(lambda x: jnp.broadcast_to(jnp.mean(x, axis=0), x.shape), ups)
        info, weights = round_info(0, 1, jnp.arange(4)), jnp.ones(4)
        tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name),
                 algorithm.server_update(server, ups, weights, info),
                 algorithm.server_update(server, means, weights, info))


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_the_masked_input_holds_every_entry_of_the_upload(model_name):
    """Over the zoo: FedAvg's upload is summed as all its variables (weights and BatchNorm statistics) and the
    weight of the mean: the masked input is that many field elements."""
    model = zoo_model(model_name)
    variables = jax.eval_shape(model.init, jax.random.key(0))
    entries = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(variables))
    context = _context(model, None)
    algorithm = fedavg(context.local)
    assert summed_entries(algorithm, upload_shapes(algorithm, context)) == entries + 1


def test_each_clients_bytes_are_the_protocols_a_dropped_ones_too(tmp_path):
    """Four clients, one over the deadline: the three survivors send the protocol's masked input and shares and
    are told of one dropped neighbour; the dropped one sent its keys and shares only. The model's own
    broadcast bytes stay in every downlink; the model is the round's over the three on time."""
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([9, 14, 11, 16])
    context = _context(model, split, n=4, k=4)
    algorithm = fedavg(context.local)
    profile = tmp_path / "p.csv"
    profile.write_text("".join(f"{c},{FAST},{FAST},{FAST},{5.0 if c == 2 else 1.0}\n" for c in range(4)))
    protocol = SecureAggregation("secagg")
    m = summed_entries(algorithm, upload_shapes(algorithm, context))
    conditions = RoundConditions(uniform_sampler(4, 4), read_profile_file(profile, 4), Stragglers(deadline=2.0),
                                 secure=protocol, upload_entries=m)
    plain = RoundConditions(uniform_sampler(4, 4), read_profile_file(profile, 4), Stragglers(deadline=2.0))
    variables = model.init(jax.random.key(0))
    server, _ = algorithm.init(jax.random.key(0), variables, 4)
    ids = jnp.arange(4)
    outs = [jax.jit(round_step(algorithm, 4, seed=0, conditions=c))(server, {}, split, ids, ids, 0)
            for c in (conditions, plain)]
    (secure_state, _, out), (plain_state, _, plain_out) = outs
    survivor, dropped = protocol.client_bytes(4, m, 1), protocol.client_bytes(4, m, 1, survived=False)
    broadcast = int(plain_out.downlink_bytes[0])
    np.testing.assert_array_equal(out.returns.late, [False, False, True, False])
    np.testing.assert_array_equal(out.uplink_bytes, [survivor[0]] * 2 + [dropped[0]] + [survivor[0]])
    np.testing.assert_array_equal(out.downlink_bytes, [broadcast + survivor[1]] * 2 + [broadcast + dropped[1]]
                                  + [broadcast + survivor[1]])
    tree_map(np.testing.assert_array_equal, secure_state, plain_state)


def test_a_secure_run_trains_the_same_model_and_counts_the_protocol(tmp_path, capsys):
    plain, secure = tmp_path / "plain", tmp_path / "secure"
    assert main(["run", *TINY, "--rounds", "2", "--out", str(plain)]) == 0
    assert main(["run", *TINY, "--rounds", "2", "--secure-aggregation", "secagg+", "--out", str(secure)]) == 0
    for mine, theirs in zip(records(secure), records(plain)):
        assert mine["test_accuracy"] == theirs["test_accuracy"] and mine["train_loss"] == theirs["train_loss"]
        assert mine["uplink_bytes"] > theirs["uplink_bytes"] and mine["downlink_bytes"] > theirs["downlink_bytes"]
    capsys.readouterr()


@pytest.mark.parametrize("flags,words", [
    (["--algorithm", "fedldf", "--clients-per-layer", "1"], "fedldf's server chooses each client's upload"),
    (["--algorithm", "heterofl"], "heterofl's server reads each client's upload"),
    (["--uplink-compression", "topk"], "reads each client's upload"),
    (["--over-selection", "0.5", "--device-profile", "iot"], "--secure-aggregation with --over-selection"),
    (["--async-buffer", "1", "--device-profile", "iot"], "asynchronous rounds take no --secure-aggregation"),
])
def test_what_needs_more_than_the_sum_is_refused_in_one_line(tmp_path, capsys, flags, words):
    assert main(["run", *TINY, "--rounds", "1", "--secure-aggregation", "secagg", *flags,
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
