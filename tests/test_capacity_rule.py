"""Capacity from the device (`--capacity-from device`) against independent truths: a hand-computed example
(three levels, four devices of a profile file, a deadline), the invariant that a client's level fits the
deadline and the next level does not (every sub-model method and both Fjord samplings, devices drawn from a
preset, the MLP's sub-model sizes counted by hand), the same with the real messages and FLOPs of random
sub-models over the model zoo, the clock agreeing with the prediction, and the refusals."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_structure import zoo_model

from conftest import initialized
from fedjax_sparse.algorithms import make_algorithm, make_options
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.federation.clock import PRESETS, DeviceProfile, ProfileDistribution, Stragglers, device_profile
from fedjax_sparse.core.structure.flops import forward_flops
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import message_bytes
from fedjax_sparse.core.federation.participation import uniform_sampler
from fedjax_sparse.core.round.step import RoundConditions, build_round, round_info
from fedjax_sparse.core.structure.unit_masks import variable_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores, random_scores
from fedjax_sparse.models import MODEL_NAMES, get_model
from fedjax_sparse.run.cli import main

HIDDEN = 256  # the MLP's two hidden layers; on 8x8x1 inputs with 10 classes


def mlp_sub_model(units: int, classes: int = 10, inputs: int = 64) -> tuple[int, int]:
    """(parameters, forward FLOPs of one example) of the MLP keeping `units` of each hidden layer, by hand:
    inputs x u + u, u x u + u, u x classes + classes weights; the FLOPs count the kept inputs only."""
    params = inputs * units + units + units * units + units + units * classes + classes
    return params, inputs * units + units * units + units * classes


def context(model, split, profile, deadline):
    """One local epoch, batches of 8; FedGSE's clients are described by 2 labels."""
    return BuildContext(local=LocalSGD(model, 0.05, 1, 8), num_clients=split.num_clients,
                        clients_per_round=split.num_clients, train=split, num_classes=model.num_classes, seed=0,
                        labels_per_client=2, device_profile=profile, round_deadline=deadline,
                        train_counts=np.asarray(split.counts))


def build(name, ctx, **options):
    return make_algorithm(name, ctx, make_options(name, {"capacity_from": "device", **options}))


def one_round(algorithm, model, split, profile, deadline):
    """Every client in one round under the clock: (capacities, the clock's seconds, late) per client."""
    n = split.num_clients
    conditions = RoundConditions(uniform_sampler(n, n), profile, Stragglers(deadline=deadline))
    server, clients = algorithm.init(jax.random.key(1), initialized(model.name, model.input_shape,
                                                                    model.num_classes)[1], n)
    _, _, out = build_round(algorithm, split, n, seed=0, conditions=conditions)(server, clients, 0)
    return (np.asarray(out.metrics["capacity"]), np.asarray(out.client_seconds, np.float64),
            np.asarray(out.returns.late))


def figures(profile, n):
    """[n, 1] float64 of each figure of the first n clients' devices."""
    drawn = profile.profiles(0, jnp.arange(n))
    return {k: np.asarray(getattr(drawn, k), np.float64)[:, None] for k in
            ("flops_per_second", "downlink_bytes_per_second", "uplink_bytes_per_second", "latency_seconds")}


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", (8, 8, 1), 10)


def test_hand_computed_levels_of_four_devices(tmp_path, mlp, make_split):
    """Levels 1, 1/2, 1/4 (256, 128, 64 hidden units: 85,002, 26,122 and 8,970 parameters, 4 bytes each way;
    84,480, 25,856 and 8,832 forward multiply-accumulates F an example), ten examples and one epoch
    (training: 3 x 10 F, 2 FLOPs each), a deadline of 1 s. Seconds = down / downlink + 60 F / speed + up /
    uplink + latency:
      client 0 (1 GFLOP/s, 1 MB/s both ways, 0.1 s): beta 1: 0.340008 + 0.0050688 + 0.340008 + 0.1 = 0.7850848
      client 1 (uplink 250 kB/s): beta 1: 1.80 s, too slow; beta 1/2: 0.104488 + 0.00155136 + 0.417952 + 0.1
               = 0.62399136
      client 2 (1 MFLOP/s): beta 1/2: 0.104488 + 1.55136 + 0.104488 + 0.1 = 1.860336, too slow;
               beta 1/4: 0.03588 + 0.52992 + 0.03588 + 0.1 = 0.70168
      client 3 (1 MFLOP/s, 100 kB/s both ways, 0.5 s): beta 1/4 takes 0.3588 + 0.52992 + 0.3588 + 0.5
               = 1.74752 s: nothing fits, it gets 1/4 and is late."""
    assert [mlp_sub_model(u) for u in (256, 128, 64)] == [(85002, 84480), (26122, 25856), (8970, 8832)]
    path = tmp_path / "devices.csv"
    path.write_text("client,flops_per_second,downlink_bytes_per_second,uplink_bytes_per_second,latency_seconds\n"
                    "0,1e9,1e6,1e6,0.1\n1,1e9,1e6,2.5e5,0.1\n2,1e6,1e6,1e6,0.1\n3,1e6,1e5,1e5,0.5\n")
    split = make_split([10, 10, 10, 10])
    profile = device_profile(str(path), 4)
    algorithm = build("heterofl", context(mlp, split, profile, 1.0), capacities=(1.0, 0.5, 0.25))
    info = round_info(0, 0, jnp.arange(4))
    expected = [1.0, 0.5, 0.25, 0.25]

    @jax.jit  # every client's download one program (eagerly each operation compiles on its own)
    def downloads(variables):
        server, _ = algorithm.init(jax.random.key(1), variables, 4)
        return jax.vmap(lambda c: (lambda down: (down, message_bytes(down)))(algorithm.broadcast(server, c, info)))(
            jnp.arange(4))

    downs = jax.device_get(downloads(initialized("mlp", (8, 8, 1), 10)[1]))
    for client, beta in enumerate(expected):
        down, price = jax.tree_util.tree_map(lambda a: a[client], downs)
        units = {name: int(m.sum()) for name, m in down["unit_masks"].value.items()}
        assert float(down["capacity"].value) == beta
        assert units == {"fc1": 256 * beta, "fc2": 256 * beta, "fc3": 10}
        assert int(price) == 4 * mlp_sub_model(int(256 * beta))[0]
    capacities, seconds, late = one_round(algorithm, mlp, split, profile, 1.0)
    np.testing.assert_array_equal(capacities, expected)
    np.testing.assert_allclose(seconds, [0.7850848, 0.62399136, 0.70168, 1.74752], rtol=1e-6)
    np.testing.assert_array_equal(late, [False, False, False, True])


def mlp_seconds(fig, counts, units, *, extra_up=0, flops=None):
    """[M, levels] float64 round times of MLP sub-models keeping `units` hidden units (hand counts) on the
    devices `fig` (`figures`) of clients holding `counts` examples (one epoch)."""
    params, forward = np.array([mlp_sub_model(u) for u in units], np.float64).T
    forward = forward if flops is None else flops
    down, up = 4 * params, 4 * params + extra_up
    return (down / fig["downlink_bytes_per_second"] + 2 * 3 * forward * counts[:, None] / fig["flops_per_second"]
            + up / fig["uplink_bytes_per_second"] + fig["latency_seconds"])


FJORD_WIDTHS = (0.2, 0.4, 0.6, 0.8, 1.0)
LEVELS = (1.0, 0.5, 0.25, 0.125, 0.0625)


@pytest.mark.parametrize("name,extra", [
    ("heterofl", {}), ("fedrolex", {}), ("feddropout", {}), ("fedgse", {"similar_labels": "csl"}),
    ("fjord", {"fjord_sampling": "client"}), ("fjord", {"fjord_sampling": "batch"})])
def test_the_level_fits_the_deadline_and_the_next_does_not(mlp, make_split, name, extra):
    """32 phones (the preset's medians, spread wider: sigma 1.2) holding 5 to 40 examples, a 0.2 s deadline:
    each client's
    level fits and the next larger one does not, by the MLP's hand-counted sizes; the clock's seconds are the
    prediction, and exactly the clients that fit no level are late. FedGSE's upload adds its 2 labels (1 byte
    each); Fjord's client sampling chooses among the widths of [0.4, 0.6] (the sub-model changes at every j /
    256), its batch sampling among the tiers, each priced at its expected FLOPs over the widths up to it."""
    rng = np.random.default_rng(0)
    counts = rng.integers(5, 41, 32)
    split = make_split(counts.tolist())
    profile = DeviceProfile("phones", dataclasses.replace(PRESETS["phone"], sigma=1.2))
    deadline = 0.2
    algorithm = build(name, context(mlp, split, profile, deadline), **extra)
    capacities, seconds, late = one_round(algorithm, mlp, split, profile, deadline)
    profiles = figures(profile, 32)
    if name == "fjord" and extra["fjord_sampling"] == "client":
        units = np.ceil(capacities.astype(np.float64) * HIDDEN - 1e-4).astype(int)  # the kept units of its width
        assert np.all((capacities >= 0.4 - 1e-7) & (capacities <= 0.6 + 1e-7))
        unit_levels = np.arange(math.ceil(0.4 * HIDDEN), math.ceil(0.6 * HIDDEN) + 1)  # 103 ... 154 units
        chosen = np.searchsorted(unit_levels, units)
        table = mlp_seconds(profiles, counts, unit_levels)
    else:
        levels = np.array(FJORD_WIDTHS if name == "fjord" else sorted(LEVELS))
        unit_levels = np.ceil(levels * HIDDEN - 1e-4).astype(int)
        chosen = np.searchsorted(levels, capacities.astype(np.float64) - 1e-6)
        np.testing.assert_allclose(levels[chosen], capacities, rtol=1e-6)
        flops = None
        if name == "fjord":  # each batch draws a width up to the tier: the tier's mean of their FLOPs
            per_width = np.array([mlp_sub_model(u)[1] for u in unit_levels], np.float64)
            flops = np.cumsum(per_width) / np.arange(1, len(levels) + 1)
        table = mlp_seconds(profiles, counts, unit_levels, extra_up=2 if name == "fedgse" else 0, flops=flops)
    rows = np.arange(32)
    fits = table[rows, chosen] <= deadline * (1 + 1e-6)
    nothing_fits = table[:, 0] > deadline
    assert np.all(fits | (nothing_fits & (chosen == 0)))
    top = len(unit_levels) - 1
    assert np.all((chosen == top) | (table[rows, np.minimum(chosen + 1, top)] > deadline * (1 - 1e-6)))
    assert len(set(chosen.tolist())) >= 3, f"the devices should spread over the levels: {sorted(set(chosen))}"
    np.testing.assert_allclose(seconds, table[rows, chosen], rtol=1e-5)
    np.testing.assert_array_equal(late, seconds > deadline)
    np.testing.assert_array_equal(late, nothing_fits)


ZOO_LEVELS = (0.25, 0.5, 1.0)


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_over_the_zoo_the_rule_prices_what_a_random_sub_model_costs(model_name, make_split):
    """On every model of the zoo, at each level, a sub-model of random units (Federated Dropout's draw,
    four draws) sends as many values (`variable_masks`, 4 bytes each: static BN sends weights only) and
    runs as many FLOPs (`forward_flops`) as HeteroFL's prefix of that level, which the rule prices. On 16
    devices (the deadline at the median time of the middle level), Federated Dropout under the rule gives
    each client the largest level whose cost fits, and its broadcast costs exactly that."""
    model = zoo_model(model_name)
    structure = model.structure
    counts = np.arange(3, 19)
    split = make_split(counts.tolist(), shape=model.input_shape)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    variables = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)  # values are not priced

    def cost(scores, beta):
        masks = keep_top_units(structure, scores, beta)
        held = variable_masks(structure, variables, masks)["params"]
        return (4 * sum(jnp.sum(m) for m in jax.tree_util.tree_leaves(held)),
                forward_flops(structure, masks, count_inputs=True))

    def costs(key):
        draws = jax.vmap(lambda k: random_scores(structure, k))(jax.random.split(key, 4))
        prefix = prefix_scores(structure)
        draws = {name: jnp.concatenate([d, prefix[name][None]]) for name, d in draws.items()}
        levels = jnp.asarray(ZOO_LEVELS, jnp.float32)
        return jax.vmap(lambda s: jax.vmap(lambda beta: jnp.stack(cost(s, beta)))(levels))(draws)

    table = np.asarray(jax.jit(costs)(jax.random.key(3)), np.float64)  # [draw, level, (bytes, FLOPs)]
    np.testing.assert_array_equal(table, np.broadcast_to(table[-1], table.shape))
    size, flops = table[-1].T
    # devices on which the full model's training (12 example passes a client on average) takes about as
    # long as its download, so that both weigh in the choice
    profile = DeviceProfile("zoo", ProfileDistribution("zoo", 2 * 3 * 12 * flops[-1] * 1e6 / size[-1], 1e6, 1e6,
                                                       0.01))
    fig = figures(profile, 16)
    seconds = (size / fig["downlink_bytes_per_second"] + 2 * 3 * flops * counts[:, None] / fig["flops_per_second"]
               + size / fig["uplink_bytes_per_second"] + fig["latency_seconds"])
    deadline = float(np.median(seconds[:, 1]))
    fitting = np.where(seconds <= deadline, np.arange(3), 0).max(axis=1)
    assert np.abs(seconds / deadline - 1).min() > 1e-5, "a device on the deadline: float32 and float64 may disagree"
    assert len(set(fitting.tolist())) >= 2
    algorithm = build("feddropout", context(model, split, profile, deadline), capacities=ZOO_LEVELS)
    info = round_info(0, 0, jnp.arange(16))

    @jax.jit  # the server and every download one program (eagerly each operation compiles on its own)
    def broadcasts(variables):
        server, _ = algorithm.init(jax.random.key(1), variables, 16)

        def broadcast(client_id):
            down = algorithm.broadcast(server, client_id, info)
            return (down["capacity"].value, message_bytes(down),
                    forward_flops(structure, down["unit_masks"].value, count_inputs=True))

        return jax.vmap(broadcast)(jnp.arange(16))

    capacity, sent, runs = (np.asarray(a, np.float64) for a in broadcasts(variables))
    np.testing.assert_array_equal(capacity, np.array(ZOO_LEVELS, np.float32)[fitting])
    np.testing.assert_array_equal(sent, size[fitting])
    np.testing.assert_array_equal(runs, flops[fitting])


def test_refusals_name_the_missing_flag(tmp_path, capsys):
    base = ["run", "--algorithm", "heterofl", "--capacity-from", "device", "--rounds", "1", "--no-progress",
            "--num-clients", "4", "--clients-per-round", "2", "--out", str(tmp_path / "bad")]
    cases = [([], "--capacity-from device sizes each client's sub-model for its device: give --device-profile"),
             (["--device-profile", "iot"], "--capacity-from device sizes each client's sub-model to finish by the "
                                           "deadline: give --round-deadline S"),
             (["--device-profile", "iot", "--round-deadline", "5", "--capacity-mode", "fixed"],
              "--capacity-mode is not read with --capacity-from device"),
             (["--algorithm", "fedavg", "--device-profile", "iot", "--round-deadline", "5"], "--capacity-from")]
    for args, fragment in cases:
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fragment in err, err
