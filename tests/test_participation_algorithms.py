"""Variable participation (issue 37) for every shipped algorithm and wrapper: a round over K slots of which one
holds an absent client (not dispatched: `RoundInfo.participating` False, weight 0) computes what today's fixed
round over the other K - 1 clients computes: the same new server state, the same new states of the present
clients, and the absent client's state as it was.

Not bit for bit: the server of the round over K slots reduces K uploads, the absent one's zeroed or masked out,
where the reference reduces K - 1, and XLA sums them in another order or tree (a mean is also a masked sum over a
count rather than `jnp.mean`); the same sums to float rounding (measured: at most 6e-8 apart on the MLP, the
clients' states equal bit for bit), hence rtol 1e-6, atol 1e-7.

The random baselines (fedldf_random, hdfl) draw their uploaders over the K positions, which no draw over K - 1 can
equal: they are compared at clients_per_layer = K (every present client uploads, exactly), and separately an absent
client is never drawn, over many server keys.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_split
from fedjax_sparse.algorithms import BUILT_IN, make_algorithm, make_options
from fedjax_sparse.algorithms.personalization import PersonalizationOptions, personalize
from fedjax_sparse.algorithms.uplink_compression import UplinkCompressionOptions, compress_uplink
from fedjax_sparse.core.contract.algorithm import BuildContext, replicate
from fedjax_sparse.core.structure.layer_groups import model_layer_groups
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import KnownMaskArray
from fedjax_sparse.core.federation.participation import Sampler
from fedjax_sparse.core.round.step import RoundConditions, round_info, round_step
from fedjax_sparse.building_blocks.server_optimizer import STATE_KEY
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map
N, K = 6, 4
COUNTS = [9, 14, 11, 16, 7, 12]
IDS = np.array([0, 2, 3, 5], np.int32)
ABSENT_SLOTS = (1, 3)  # client 2, in the middle of the sorted ids, then client 5, the last
WARM_UP = np.array([1, 2, 4], np.int32)
ROUND = 1
SEED = 3

# (algorithm, its options, wrapper options): every built-in algorithm, the options that change a server
# reduction, and the wrappers. Server momentum where an algorithm's `held` entries matter: with sgd an entry only
# an absent client held steps by zero whether held or not; with momentum on it (`with_momentum`) it would move
MOMENTUM = {"server_optimizer": "momentum"}
CASES = [
    ("fedavg", {}, {}),
    ("fedprox", {}, {}),
    ("feddyn", {}, {}),
    ("scaffold", {}, {}),
    ("fednova", {}, {}),
    ("local", {}, {}),
    ("fedldf", {"clients_per_layer": 2}, {}),
    ("fedldf_random", {"clients_per_layer": K}, {}),
    ("hdfl", {"clients_per_layer": K}, {}),
    ("fedadp", MOMENTUM, {}),
    ("heterofl", {"submodel_aggregation": "heterofl"}, {}),
    ("fedrolex", {"submodel_aggregation": "fedrolex_counts"}, {}),
    ("feddropout", {"capacities": (0.25,), **MOMENTUM}, {}),  # a random quarter: units only the absent holds
    ("fedgse", {"similar_labels": "spl", **MOMENTUM}, {}),
    ("fjord", MOMENTUM, {}),
    ("fedp3", {"fedp3_local_keep": 0.5, **MOMENTUM}, {}),
    ("fedspa", MOMENTUM, {}),
    ("fedpm", {}, {}),
    ("spatl", MOMENTUM, {}),
    ("spatl", {"spatl_aggregation": "masked_mean"}, {}),
    ("spafl", {}, {}),
    ("spafl_local", {}, {}),
    ("fedavg", {}, {"personal": "predictor"}),
    ("scaffold", {}, {"uplink_compression": "topk", "error_feedback": True}),
    ("fedavg", {"aggregation_weights": "uniform"}, {"uplink_compression": "qsgd"}),
]


def case_id(case):
    name, options, wrapper = case
    return "-".join([name, *(f"{k}={v}" for k, v in {**options, **wrapper}.items())])


@pytest.fixture(scope="module")
def setting():
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split(COUNTS)
    local = LocalSGD(model, 0.1, 1, 8)
    context = BuildContext(local=local, num_clients=N, clients_per_round=K, train=split, num_classes=10, seed=SEED,
                           labels_per_client=2)
    return model, split, context


def build(context, name, options, wrapper):
    algorithm = make_algorithm(name, context, make_options(name, options))
    algorithm = personalize(algorithm, context, PersonalizationOptions(**{k: v for k, v in wrapper.items()
                                                                          if k == "personal"}))
    return compress_uplink(algorithm, context, UplinkCompressionOptions(**{k: v for k, v in wrapper.items()
                                                                           if k != "personal"}))


def as_numbers(x):
    x = np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return x.astype(np.float64) if x.dtype == bool else x


def assert_close(actual, expected, what):
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected), what
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(as_numbers(a), as_numbers(b), rtol=1e-6, atol=1e-7,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def with_momentum(server):
    """The server state with its optimizer's momentum 0.01 on every entry (as many rounds leave it; one round
    leaves it only on the entries held in it)."""
    if STATE_KEY not in server:
        return server
    return {**server, STATE_KEY: tree_map(lambda x: jnp.full_like(x, 0.01), server[STATE_KEY])}


def test_the_cases_cover_every_built_in_algorithm():
    assert {name for name, _, _ in CASES} == BUILT_IN


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_an_absent_slot_computes_the_round_without_it(setting, case):
    model, split, context = setting
    algorithm = build(context, *case)
    server, clients = jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), model.init(jax.random.key(0)), N)
    masked = RoundConditions(sampler=Sampler("masked", K, False, draw=None))
    assert masked.varies
    slots = jax.jit(lambda s, c, ids, dispatched: round_step(algorithm, K, seed=SEED, conditions=masked)(
        s, c, split, ids, ids, ROUND, dispatched))
    fixed = jax.jit(lambda s, c, ids, r: round_step(algorithm, K - 1, seed=SEED)(s, c, split, ids, ids, r))
    # a fixed round first, so that the round tested starts from a history (server momentum, control variates,
    # memories; client 2's state), not from the initial state
    server, warmed, _ = fixed(server, tree_map(lambda a: a[WARM_UP], clients), WARM_UP, ROUND - 1)
    server = with_momentum(server)
    clients = tree_map(lambda a, new: a.at[WARM_UP].set(new), clients, warmed)
    for absent in ABSENT_SLOTS:
        present = np.arange(K) != absent
        sampled = tree_map(lambda a: a[IDS], clients)
        new_server, new_states, out = slots(server, sampled, IDS, present)
        ref_server, ref_states, _ = fixed(server, tree_map(lambda a: a[IDS[present]], clients), IDS[present], ROUND)
        assert_close(new_server, ref_server, f"absent slot {absent}: server state")
        assert_close(tree_map(lambda a: a[present], new_states), ref_states, f"absent slot {absent}: client states")
        jax.tree_util.tree_map(lambda new, old: np.testing.assert_array_equal(as_numbers(new[absent]),
                                                                              as_numbers(old[absent])),
                               new_states, sampled)
        assert int(out.uplink_bytes[absent]) == int(out.downlink_bytes[absent]) == 0


@pytest.mark.parametrize("name", ["fedldf", "fedldf_random", "hdfl"])
def test_an_absent_client_never_uploads_a_layer(setting, name):
    """Over 200 server keys: every layer goes to min(n, present) present clients, never to an absent one;
    FedLDF's absent client would otherwise win every layer (its divergences are the largest)."""
    model, _, context = setting
    n = 2
    algorithm = build(context, name, {"clients_per_layer": n}, {})
    variables = model.init(jax.random.key(0))
    num_layers = model_layer_groups(model).num_layers
    divergence = jnp.tile(jnp.array([[1.0], [2.0], [9.0], [3.0]]), (1, num_layers))
    ups = (replicate(variables, K) if name == "hdfl"
           else {"divergence": divergence, "variables": replicate(variables, K)})
    weights = jnp.asarray(COUNTS, jnp.float32)[IDS]

    def senders(round_index, participating):
        info = round_info(SEED, round_index, IDS, participating)
        sent = algorithm.select_uploads(ups, weights * participating, info)
        sent = sent if name == "hdfl" else sent["variables"]
        kernel = sent["params"]["fc1"]["kernel"].mask  # [K, ...]: a layer's senders
        return jnp.any(kernel.reshape(K, -1), axis=1)

    for participating in ([True, True, False, True], [True, False, True, False], [False, False, True, False]):
        mask = jnp.asarray(participating)
        chosen = np.asarray(jax.jit(jax.vmap(lambda r: senders(r, mask)))(jnp.arange(200)))
        assert not chosen[:, ~np.asarray(participating)].any()
        np.testing.assert_array_equal(chosen.sum(axis=1), min(n, sum(participating)))
        if name == "fedldf":
            by_divergence = np.argsort(-np.where(participating, [1.0, 2.0, 9.0, 3.0], -np.inf), kind="stable")[:n]
            expected = np.zeros(K, bool)
            expected[by_divergence[:min(n, sum(participating))]] = True
            assert (chosen == expected).all()
        elif sum(participating) > n:
            assert (chosen.any(axis=0) == np.asarray(participating)).all()  # every present client is drawn sometimes


def test_fedp3_keeps_an_entry_only_an_absent_client_sent(setting):
    """FedP3 on the MLP assigns every client both shared layers, and its local pruning keeps the same entries of
    them on every client, so no round of it leaves an entry to an absent client alone: its server update is
    checked on uploads made by hand, each client sending a random half of every leaf. Such an entry keeps its
    value and its server momentum, as in the round without that client."""
    model, _, context = setting
    algorithm = build(context, "fedp3", MOMENTUM, {})
    variables = model.init(jax.random.key(0))
    server = with_momentum(algorithm.init(jax.random.key(1), variables, N)[0])
    keys = iter(jax.random.split(jax.random.key(2), 2 * len(jax.tree_util.tree_leaves(variables))))
    ups = tree_map(lambda v: KnownMaskArray(v + jax.random.normal(next(keys), (K, *v.shape)),
                                            jax.random.bernoulli(next(keys), 0.5, (K, *v.shape))), variables)
    weights = jnp.asarray(COUNTS, jnp.float32)[IDS]
    update = jax.jit(algorithm.server_update)
    for absent in ABSENT_SLOTS:
        present = np.arange(K) != absent
        masked = update(server, ups, weights * present, round_info(SEED, ROUND, IDS, jnp.asarray(present)))
        alone = update(server, tree_map(lambda x: x[present], ups), weights[present],
                       round_info(SEED, ROUND, IDS[present]))
        assert_close(masked, alone, f"absent slot {absent}: server state")
