"""Client-level differential privacy: the accountant against dp-accounting and a published figure, clipping's
bound on every upload, the noise's measured spread, the algorithm itself without noise or clipping, exact
resume, and what cannot be accounted refused."""

import dataclasses
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import fedavg, make_algorithm, make_options
from fedjax_sparse.privacy.mechanism import DifferentialPrivacyOptions, keeps_client_state, privatize
from fedjax_sparse.algorithms.fedldf import fedldf_random
from fedjax_sparse.core.contract.algorithm import BuildContext, server_step
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.privacy.accounting import PrivacyLedger, calibrated_noise
from fedjax_sparse.core.round.step import client_keys, round_info
from fedjax_sparse.models import get_model
from fedjax_sparse.run.cli import main

from conftest import synthetic_split
from test_faults import TINY, records, summary

tree_map = jax.tree_util.tree_map


def test_epsilon_is_dp_accountings_own_and_abadi_et_als_published_figure():
    """Abadi et al. 2016 (section 3.1): q = 0.01, sigma = 4, delta = 1e-5, 10,000 steps: epsilon ~ 1.26 by the
    moments accountant; RDP over finer orders gives a little less. Here 10 of 1,000 clients a round, Poisson."""
    ledger = PrivacyLedger(4.0, 1000, 10, "poisson", 1e-5)
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(4.0)), 10_000)
    assert ledger.epsilon(10_000) == direct.get_epsilon(1e-5)
    assert 1.0 < ledger.epsilon(10_000) <= 1.26
    # K of N without replacement: neighbours by replacement, a replaced client moves the sum by 2 C
    uniform = PrivacyLedger(4.0, 1000, 10, "uniform", 1e-5)
    replaced = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    replaced.compose(dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, dp_accounting.GaussianDpEvent(2.0)),
                     100)
    assert uniform.epsilon(100) == replaced.get_epsilon(1e-5)
    pld = dataclasses.replace(ledger, accountant="pld")
    assert 0.8 * ledger.epsilon(1000) < pld.epsilon(1000) <= ledger.epsilon(1000)  # PLD is the tighter
    assert ledger.epsilon(0) == 0 and math.isinf(dataclasses.replace(ledger, noise_multiplier=0).epsilon(5))


def test_calibration_meets_the_target_and_refuses_what_cannot():
    ledger = PrivacyLedger(1.0, 1000, 10, "poisson", 1e-5)
    z = calibrated_noise(ledger, 200, 2.0)
    assert dataclasses.replace(ledger, noise_multiplier=z).epsilon(200) <= 2.0
    assert dataclasses.replace(ledger, noise_multiplier=z * 0.99).epsilon(200) > 2.0
    everyone = PrivacyLedger(1.0, 10, 10, "uniform", 1e-5)
    with pytest.raises(ValueError, match="--dp-target-epsilon 1e-06 cannot be met in 1000 rounds"):
        calibrated_noise(everyone, 1000, 1e-6)


@pytest.fixture(scope="module")
def setting():
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([12, 17, 9, 30, 20, 14, 8, 11])
    variables = model.init(jax.random.key(0))
    return model, split, variables


def _private(model, split, clip, z, lr=0.1, **options):
    local = LocalSGD(model, lr, 1, 8)
    context = BuildContext(local=local, num_clients=8, clients_per_round=4, train=split, num_classes=10)
    return privatize(fedavg(local, "uniform"), context, DifferentialPrivacyOptions(dp_clip=clip, **options),
                     noise_multiplier=z, expected_clients=4)


def _uploads(algorithm, split, variables, ids):
    server, clients = algorithm.init(jax.random.key(1), variables, 8)
    info = round_info(0, 0, jnp.asarray(ids))
    down = algorithm.broadcast(server, 0, info)
    keys = client_keys(0, 0, jnp.asarray(ids))
    ups = [algorithm.client_update(down, {}, split.client(c), k, info)[0] for c, k in zip(ids, keys)]
    return server, down, ups, info


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_clipping_bounds_every_clients_upload(setting, clipping):
    model, split, variables = setting
    clip = 0.05
    algorithm = _private(model, split, clip, 0.0, dp_clipping=clipping)
    _, down, ups, _ = _uploads(algorithm, split, variables, [0, 3, 5])
    layers = {}
    for up in ups:
        change = tree_map(jnp.subtract, up, down)
        for path, leaf in jax.tree_util.tree_flatten_with_path(change)[0]:
            layer = "/".join(str(getattr(p, "key", p)) for p in path[:-1])
            layers[layer] = layers.get(layer, 0.0) + float(jnp.sum(jnp.square(leaf)))
        total = sum(layers.values()) ** 0.5
        assert total <= clip * (1 + 1e-5)
        if clipping == "per_layer":
            assert all(v ** 0.5 <= clip / len(layers) ** 0.5 * (1 + 1e-5) for v in layers.values()), layers
        assert total > 0.5 * clip  # an update larger than C is cut to C, not to nothing
        layers.clear()


def test_the_noise_has_the_standard_deviation_it_should(setting):
    """Central: the mean gains N(0, (z C / K)^2) per entry (85,002 entries measured); local: each client's
    update N(0, (z C)^2) (a client that learns nothing, lr 1e-30, shows the noise alone)."""
    model, split, variables = setting
    clip, z = 0.5, 2.0
    central = _private(model, split, clip, z, lr=1e-30)
    server, down, ups, info = _uploads(central, split, variables, [0, 1, 2, 3])
    stacked = tree_map(lambda *x: jnp.stack(x), *ups)
    new = central.server_update(server, stacked, jnp.ones(4), info)
    moved = np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree_util.tree_leaves(new["variables"]),
                                                             jax.tree_util.tree_leaves(server["variables"]))])
    assert moved.size == 85002
    assert abs(moved.std() / (z * clip / 4) - 1) < 0.02 and abs(moved.mean()) < 0.02 * z * clip / 4
    local = _private(model, split, clip, z, lr=1e-30, dp_noise="local")
    _, down, ups, _ = _uploads(local, split, variables, [0, 1])
    for up in ups:
        noise = np.concatenate([np.ravel(u - d) for u, d in zip(jax.tree_util.tree_leaves(up),
                                                                 jax.tree_util.tree_leaves(down))])
        assert abs(noise.std() / (z * clip) - 1) < 0.02
    assert not np.allclose(*[jax.tree_util.tree_leaves(u)[0] for u in ups])  # each client its own draw


@pytest.mark.parametrize("name", ["scaffold", "feddyn"])
def test_every_released_state_has_the_same_spread_whoever_took_part(setting, name):
    """Poisson sampling, K = 4 expected of N = 8, z = 2, C = 0.5: each released state's noise (its value with z
    less its value without, from the same uploads) has the spread of the noised sum over its fixed denominator,
    whether K' = 2 or 6 clients took part. SCAFFOLD: the model moves by the mean, z C / K, the control variate by
    the sum over N, z C / N; FedDyn: h by alpha times the sum over N, alpha z C / N, the model by the mean less
    h / alpha, z C (1 / K + 1 / N). The number taking part scaled the sums before (the control variate's spread
    was K' / K of z C / N), so their norm told K'."""
    model, split, variables = setting
    context = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=8, clients_per_round=4, train=split,
                           num_classes=10)
    algorithm = make_algorithm(name, context, make_options(name, {}))
    clip, z, alpha = 0.5, 2.0, make_options("feddyn", {}).feddyn_alpha

    def private(noise):
        return privatize(algorithm, context, DifferentialPrivacyOptions(dp_clip=clip), noise_multiplier=noise,
                         expected_clients=4, sampling="poisson")

    noised, plain = private(z), private(0.0)
    server, clients = noised.init(jax.random.key(1), variables, 8)
    ids = jnp.arange(8)
    info = round_info(0, 0, ids)
    ups = jax.jit(jax.vmap(lambda c, state, key: noised.client_update(noised.broadcast(server, c, info), state,
                                                                      split.client(c), key, info)[0]))(
        ids, clients, client_keys(0, 0, ids))

    @jax.jit
    def noise_of(present):
        step = info.replace(participating=present)
        return tree_map(jnp.subtract, noised.server_update(server, ups, present.astype(jnp.float32), step),
                        plain.server_update(server, ups, present.astype(jnp.float32), step))

    expected = ({"variables": z * clip / 4, "control": z * clip / 8} if name == "scaffold" else
                {"variables": z * clip * (1 / 4 + 1 / 8), "h": alpha * z * clip / 8})
    for taking_part in (2, 6):
        noise = noise_of(jnp.arange(8) < taking_part)
        for key, spread in expected.items():
            drawn = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(noise[key])])
            assert drawn.size > 80_000
            assert abs(drawn.std() / spread - 1) < 0.02, (taking_part, key, drawn.std(), spread)


def test_a_round_nobody_took_part_in_is_noised_as_any_other(setting):
    """A Poisson round can draw nobody (here a sampler that dispatches no slot): the private run's model still
    moves by the noise over K, N(0, (z C / 4)^2) per entry, so that it does not tell the round was empty (a plain
    run's stays as it was: tests/test_participation.py)."""
    from fedjax_sparse.core.federation.participation import Participants, Sampler  # noqa: PLC0415
    from fedjax_sparse.core.round.step import RoundConditions, build_round  # noqa: PLC0415

    model, split, variables = setting
    nobody = Sampler("nobody", 8, False, lambda key, r: Participants(jnp.arange(8), jnp.zeros(8, bool),
                                                                      jnp.int32(0)))
    local = LocalSGD(model, 0.1, 1, 8)
    context = BuildContext(local=local, num_clients=8, clients_per_round=4, train=split, num_classes=10)
    private = privatize(fedavg(local, "uniform"), context, DifferentialPrivacyOptions(dp_clip=0.5),
                        noise_multiplier=2.0, expected_clients=4, sampling="poisson")
    server, clients = private.init(jax.random.key(1), variables, 8)
    new, _, out = build_round(private, split, 8, seed=0, conditions=RoundConditions(nobody))(server, clients, 0)
    assert not np.asarray(out.dispatched).any()
    moved = np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree_util.tree_leaves(new["variables"]),
                                                             jax.tree_util.tree_leaves(server["variables"]))])
    assert moved.std() == pytest.approx(2.0 * 0.5 / 4, rel=0.02)


@pytest.mark.parametrize("algorithm,extra", [("fedavg", ["--aggregation-weights", "uniform"]), ("scaffold", [])])
def test_without_noise_or_clipping_it_is_the_algorithm_itself(tmp_path, capsys, algorithm, extra):
    flags = [*TINY, "--rounds", "2", "--algorithm", algorithm, *extra]
    plain, private = tmp_path / "plain", tmp_path / "private"
    assert main(["run", *flags, "--out", str(plain)]) == 0
    assert main(["run", *flags, "--dp-clip", "1e30", "--dp-noise-multiplier", "0", "--out", str(private)]) == 0
    for mine, theirs in zip(records(private), records(plain)):
        assert mine["dp_epsilon"] is None  # no noise, no privacy
        assert {k: v for k, v in mine.items() if k in theirs} == theirs
    capsys.readouterr()


def test_a_private_run_records_epsilon_and_resumes_exactly(tmp_path, capsys):
    """With adaptive clipping (the clip norm resumes with the model): summary.json holds the mechanism's parts,
    from which dp-accounting's own figure is recomputed: an update noised at multiplier z_delta (sensitivity 1
    clip norm) and a count noised at sigma_b (sensitivity 1/2) are one Gaussian of multiplier
    (z_delta^-2 + (sigma_b / (1/2))^-2)^(-1/2), Poisson-sampled at q = 3/8 each round."""
    flags = [*TINY, "--num-clients", "8", "--clients-per-round", "3", "--sampler", "poisson", "--dp-clip", "0.5",
             "--dp-noise-multiplier", "0.8", "--dp-target-quantile", "0.5", "--dp-count-noise", "1",
             "--checkpoint-every", "2"]
    whole, half = tmp_path / "whole", tmp_path / "half"
    assert main(["run", *flags, "--rounds", "4", "--out", str(whole)]) == 0
    assert main(["run", *flags, "--rounds", "2", "--out", str(half)]) == 0
    assert main(["run", "--resume", str(half), "--rounds", "4", "--no-progress"]) == 0
    assert records(half) == records(whole)
    ledger = PrivacyLedger(0.8, 8, 3, "poisson", 1 / 8 ** 1.1)
    assert [r["dp_epsilon"] for r in records(whole)] == [ledger.epsilon(r) for r in (1, 2, 3, 4)]
    # what is released, and nothing else: no training loss, client figures, participation, bytes or FLOPs
    assert all(set(r) == {"round", "dp_epsilon", "test_accuracy", "test_loss", "server_dp_clip_norm"}
               for r in records(whole)), records(whole)[0]
    parts = summary(whole)
    assert not {"final_train_loss", "final_personalized_accuracy", "cumulative_bytes", "train_flops_total",
                "clients_dispatched_total", "num_train_examples"} & set(parts)
    assert parts["dp_update_noise_multiplier"] == pytest.approx((0.8 ** -2 - 2.0 ** -2) ** -0.5)
    assert parts["dp_count_noise"] == 1.0 and parts["dp_count_sensitivity"] == 0.5
    combined = (parts["dp_update_noise_multiplier"] ** -2
                + (parts["dp_count_noise"] / parts["dp_count_sensitivity"]) ** -2) ** -0.5
    assert combined == pytest.approx(parts["dp_noise_multiplier"], rel=1e-12)
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(3 / 8, dp_accounting.GaussianDpEvent(combined)), 4)
    assert parts["dp_epsilon"] == pytest.approx(direct.get_epsilon(parts["dp_delta"]), rel=1e-9)
    capsys.readouterr()


def test_a_calibrated_run_spends_its_target_and_is_not_extended(tmp_path, capsys):
    flags = [*TINY, "--num-clients", "8", "--clients-per-round", "3", "--sampler", "poisson", "--dp-clip", "0.5",
             "--dp-target-epsilon", "8", "--checkpoint-every", "2", "--rounds", "2"]
    run = tmp_path / "run"
    assert main(["run", *flags, "--out", str(run)]) == 0
    assert 7.9 < records(run)[-1]["dp_epsilon"] <= 8.0
    assert main(["run", "--resume", str(run), "--rounds", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "calibrated for --dp-target-epsilon 8.0 over its 2 rounds" in err and err.count("\n") == 1, err


def test_what_cannot_be_accounted_is_refused(setting, tmp_path, capsys):
    model, split, _ = setting
    local = LocalSGD(model, 0.1, 1, 8)
    context = BuildContext(local=local, num_clients=8, clients_per_round=4, train=split, num_classes=10)
    with pytest.raises(ValueError, match="fedldf_random's server needs each client's upload"):
        privatize(fedldf_random(local, 1, 4), context, DifferentialPrivacyOptions(dp_clip=1.0), noise_multiplier=1.0,
                  expected_clients=4)
    for flags, words in ((["--uplink-compression", "qsgd"], "holds integer, quantized or coded leaves"),
                         (["--async-buffer", "1", "--device-profile", "iot"], "--dp-clip with --async-buffer"),
                         (["--sampler", "data_size"], "--sampler data_size chooses clients"),
                         (["--dp-accountant", "pld"], "--dp-accountant pld accounts Poisson"),
                         (["--dp-noise-multiplier", "2", "--dp-target-epsilon", "3"], "is chosen by --dp-target")):
        assert main(["run", *TINY, "--rounds", "1", "--dp-clip", "1", *flags, "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert main(["run", *TINY, "--rounds", "1", "--dp-clipping", "per_layer", "--out", str(tmp_path / "r")]) == 2
    assert "--dp-clipping is read only with --dp-clip" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["scaffold", "spafl", "feddyn"])
def test_clients_that_keep_state_are_not_accounted_as_amplified_by_sampling_k_of_n(setting, name):
    """A stateful client's message depends on its unreleased past rounds. Poisson sampling keeps the account
    (the other clients' sampling and state may be shown to the adversary); sampling K of N cannot show them
    without revealing who took part, so a noised run there is accounted without amplification
    ('unamplified'), and the library refuses to account it as amplified; local noise and a run without noise
    (which claims no epsilon) are as before."""
    model, split, _ = setting
    local = LocalSGD(model, 0.1, 1, 8)
    context = BuildContext(local=local, num_clients=8, clients_per_round=4, train=split, num_classes=10)
    algorithm = make_algorithm(name, context, make_options(name, {}))
    assert keeps_client_state(algorithm, context) and not keeps_client_state(fedavg(local, "uniform"), context)
    options = DifferentialPrivacyOptions(dp_clip=1.0)
    with pytest.raises(ValueError) as refused:
        privatize(algorithm, context, options, noise_multiplier=1.0, expected_clients=4, sampling="uniform")
    assert str(refused.value) == (f"privatize: {name}'s clients keep state between rounds, which sampling K of N does "
                                  f"not amplify (the module docstring); account it as sampling='unamplified'")
    for sampling in ("unamplified", "poisson"):
        privatize(algorithm, context, options, noise_multiplier=1.0, expected_clients=4, sampling=sampling)
    privatize(algorithm, context, options, noise_multiplier=0.0, expected_clients=4, sampling="uniform")
    privatize(algorithm, context, dataclasses.replace(options, dp_noise="local"), noise_multiplier=1.0,
              expected_clients=4, sampling="local")
    privatize(fedavg(local, "uniform"), context, options, noise_multiplier=1.0, expected_clients=4,
              sampling="uniform")


def test_a_stateful_run_under_k_of_n_spends_the_unamplified_epsilon_and_says_so(tmp_path, capsys):
    """SCAFFOLD (control variates) under --sampler uniform: one line says epsilon is not amplified, and the
    run records dp-accounting's own figure for a Gaussian of multiplier z / 2 (a replaced client moves the
    sum by 2 C) composed over every round, far above the amplified one; FedAvg's run, stateless, keeps the
    amplified account."""
    flags = [*TINY, "--num-clients", "8", "--clients-per-round", "2", "--rounds", "2", "--dp-clip", "0.5",
             "--dp-noise-multiplier", "3"]
    stateful, stateless = tmp_path / "scaffold", tmp_path / "fedavg"
    assert main(["run", *flags, "--algorithm", "scaffold", "--out", str(stateful)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("--dp-clip: the clients keep state between rounds (scaffold's, its error "
                                     "feedback's or personal layers'), which sampling K of N does not amplify") in err
    assert main(["run", *flags, "--aggregation-weights", "uniform", "--out", str(stateless)]) == 0
    assert "does not amplify" not in capsys.readouterr().err
    delta = 1 / 8 ** 1.1
    direct = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_accounting.GaussianDpEvent(1.5), 2)
    assert summary(stateful)["dp_sampling"] == "unamplified"
    assert summary(stateful)["dp_epsilon"] == records(stateful)[-1]["dp_epsilon"] == direct.get_epsilon(delta)
    amplified = PrivacyLedger(3.0, 8, 2, "uniform", delta).epsilon(2)
    assert summary(stateless)["dp_sampling"] == "uniform" and summary(stateless)["dp_epsilon"] == amplified
    assert amplified < 0.5 * direct.get_epsilon(delta)


def test_a_stateful_algorithm_built_only_with_the_clients_data_is_accounted_unamplified_too(tmp_path, capsys,
                                                                                           monkeypatch):
    """An algorithm that reads every client's data when it is built (as SPATL, FedGSE) is built a second time,
    once the run has put the data on the device: whether its clients keep state is asked of that build (the
    first has none to ask), so SCAFFOLD built that way spends what SCAFFOLD does."""
    from fedjax_sparse.algorithms import registry

    scaffold = registry.ALGORITHMS["scaffold"]

    def build(context, options):
        context.device_train("scaffold_on_device", "reads its clients' data when built")
        return scaffold.build(context, options)

    monkeypatch.setitem(registry.ALGORITHMS, "scaffold_on_device",
                        dataclasses.replace(scaffold, name="scaffold_on_device", build=build))
    flags = [*TINY, "--num-clients", "8", "--clients-per-round", "2", "--rounds", "2", "--dp-clip", "0.5",
             "--dp-noise-multiplier", "3"]
    runs = {name: tmp_path / name for name in ("scaffold", "scaffold_on_device")}
    for name, run in runs.items():
        assert main(["run", *flags, "--algorithm", name, "--out", str(run)]) == 0
        assert "which sampling K of N does not amplify" in capsys.readouterr().err
    assert summary(runs["scaffold_on_device"])["dp_sampling"] == "unamplified"
    assert summary(runs["scaffold_on_device"])["dp_epsilon"] == summary(runs["scaffold"])["dp_epsilon"]


def test_adaptive_clipping_steps_the_norm_toward_the_quantile(setting):
    """Andrew et al.'s geometric step, worked by hand without noise: 4 clients, the share under C0 is b, and
    C1 = C0 exp(-0.2 (b - 0.5)); each client's indicator is its update's norm against the norm it was sent."""
    model, split, variables = setting
    algorithm = _private(model, split, 0.3, 0.0, dp_target_quantile=0.5, dp_clip_lr=0.2)
    server, _, ups, info = _uploads(algorithm, split, variables, [0, 1, 2, 3])
    assert float(server["dp_clip"]) == pytest.approx(0.3)
    norms = []
    for c in range(4):
        _, _, metrics = algorithm.client_update(algorithm.broadcast(server, c, info), {}, split.client(c),
                                                client_keys(0, 0, jnp.arange(4))[c], info)
        norms.append(float(metrics["update_norm"]))
    under = np.array([float(u["under_clip"]) + 0.5 for u in ups])  # each indicator is sent centred
    np.testing.assert_array_equal(under, np.array(norms) <= 0.3)
    stacked = tree_map(lambda *x: jnp.stack(x), *ups)
    new, metrics = server_step(algorithm.server_update(server, stacked, jnp.ones(4), info))
    assert float(metrics["dp_clip_norm"]) == pytest.approx(0.3)  # the norm the clients were sent, released
    assert float(new["dp_clip"]) == pytest.approx(0.3 * math.exp(-0.2 * (under.mean() - 0.5)), rel=1e-6)
    # the count's noise is paid from the same budget: z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)
    from fedjax_sparse.privacy.accounting import adaptive_update_noise  # noqa: PLC0415
    assert adaptive_update_noise(1.0, 1.0) == pytest.approx((1 - 0.25) ** -0.5)
    with pytest.raises(ValueError, match="--dp-count-noise 0.4 is too small"):
        adaptive_update_noise(1.0, 0.4)


def test_adaptive_clippings_count_moves_by_half_where_a_client_is_added(setting):
    """Andrew et al.'s estimator centres each client's indicator, so that adding or removing a client moves the
    count the server noises by 1/2, what z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) pays for. Without noise the
    count is read back off the step, K b = K (gamma - ln(C1 / C0) / eta), with each client in turn absent (Poisson
    sampling leaves slots empty): it moves by exactly 1/2 for a client under the norm and one over it alike."""
    model, split, variables = setting
    algorithm = _private(model, split, 0.3, 0.0, dp_target_quantile=0.5, dp_clip_lr=0.2)
    server, _ = algorithm.init(jax.random.key(1), variables, 8)
    ids = jnp.arange(4)
    info = round_info(0, 0, ids)
    exchange = jax.jit(jax.vmap(lambda state, c, key: algorithm.client_update(
        algorithm.broadcast(state, c, info), {}, split.client(c), key, info), in_axes=(None, 0, 0)))
    norms = sorted(np.asarray(exchange(server, ids, client_keys(0, 0, ids))[2]["update_norm"]).tolist())
    clip = (norms[1] + norms[2]) / 2  # the norm travels in the server state: two clients under it, two over it
    server = {**server, "dp_clip": jnp.float32(clip)}
    ups = exchange(server, ids, client_keys(0, 0, ids))[0]
    under = (np.asarray(ups["under_clip"]) > 0).tolist()
    assert sum(under) == 2

    @jax.jit
    def count(present):
        new, _ = server_step(algorithm.server_update(server, ups, present.astype(jnp.float32),
                                                     info.replace(participating=present)))
        return 4 * (0.5 - jnp.log(new["dp_clip"] / server["dp_clip"]) / 0.2)

    everyone = float(count(jnp.ones(4, bool)))
    for absent in range(4):
        moved = everyone - float(count(jnp.arange(4) != absent))
        assert moved == pytest.approx(0.5 if under[absent] else -0.5, abs=1e-4), (absent, moved)


def test_adaptive_clippings_default_count_noise_that_would_spend_the_budget_is_refused(tmp_path, capsys):
    """sigma_b = K / 20 = 0.2 at 4 clients a round: the count alone is a Gaussian of multiplier 2 sigma_b = 0.4,
    more than a budget of z = 1 allows."""
    assert main(["run", *TINY, "--clients-per-round", "4", "--rounds", "1", "--dp-clip", "0.5",
                 "--dp-target-quantile", "0.5", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("the default --dp-count-noise (K / 20 = 0.2 at 4 clients per round) is too "
                                     "small for the noise multiplier 1: the count alone would spend the budget") in err


def test_an_adaptive_run_raises_a_norm_that_clips_everyone(tmp_path, capsys):
    """--dp-record-unreleased records the clients' figures too (here: every update clipped), which a private run
    otherwise leaves out."""
    run = tmp_path / "run"
    assert main(["run", *TINY, "--rounds", "3", "--dp-clip", "0.01", "--dp-target-quantile", "0.5",
                 "--dp-noise-multiplier", "1", "--dp-count-noise", "2", "--dp-record-unreleased", "--out",
                 str(run)]) == 0
    clips = [r["server_dp_clip_norm"] for r in records(run)]
    assert clips[0] == pytest.approx(0.01) and clips[0] < clips[1] < clips[2]
    assert [r["client_clip_norm"] for r in records(run)] == pytest.approx(clips)
    assert all(r["client_update_clipped"] == 1.0 and r["train_loss"] > 0 for r in records(run))
    assert summary(run)["cumulative_bytes"] > 0
    capsys.readouterr()
