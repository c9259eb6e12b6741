"""Who takes part and how long each client takes (issue 37): samplers, the simulated clock, stragglers, and the
clients' accuracy distribution, each against a hand-computed figure, a probability bound or an equivalence."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import binom

from fedjax_sparse import plugins
from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.core.federation.clock import (DeviceProfile, ProfileDistribution, Stragglers, client_seconds, device_profile,
                                      read_profile_file, round_returns)
from fedjax_sparse.core.evaluation.evaluators import client_accuracy_figures
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import message_bytes
from fedjax_sparse.core.federation.participation import (SamplerContext, SamplerSpec, build_sampler, data_size_sampler,
                                              diurnal_online, poisson_sampler, poisson_slots,
                                              read_availability_trace, register_sampler, sample_clients,
                                              uniform_sampler, SAMPLERS)
from fedjax_sparse.core.round.step import RoundConditions, build_round, client_keys, round_info
from fedjax_sparse.core.structure.flops import forward_flops
from fedjax_sparse.models import get_model
from fedjax_sparse.run.cli import main
from conftest import synthetic_split
from test_faults import TINY, records, summary


def context(**kw):
    base = dict(num_clients=30, clients_per_round=6, seed=3, counts=np.arange(1, 31))
    return SamplerContext(**{**base, **kw})


def test_uniform_sampler_is_todays_draw_and_its_host_twin():
    sampler = uniform_sampler(50, 10)
    for r in range(4):
        drawn = sampler(3, r)
        np.testing.assert_array_equal(drawn.ids, sample_clients(3, r, 50, 10))
        assert bool(drawn.dispatched.all()) and sampler.fixed
        ids, dispatched = sampler.host(3, r)
        np.testing.assert_array_equal(ids, drawn.ids)


@pytest.mark.parametrize("name,extra", [("poisson", {}), ("data_size", {}), ("availability", {}),
                                        ("availability", {"online_fraction": 0.2, "hours_per_round": 5.0})])
def test_every_sampler_fills_distinct_sorted_slots_and_the_host_draws_the_same(name, extra):
    sampler = build_sampler(name, context(**extra))
    draw = jax.jit(sampler)  # as a round draws: one program, not each operation compiled on its own
    for r in range(6):
        drawn = draw(3, r)
        ids, dispatched = np.asarray(drawn.ids), np.asarray(drawn.dispatched)
        assert ids.shape == dispatched.shape == (sampler.slots,)
        assert len(set(ids.tolist())) == sampler.slots and (np.diff(ids) > 0).all()
        assert dispatched.sum() == min(int(drawn.drawn), sampler.slots)
        host_ids, host_dispatched = sampler.host(3, r)
        np.testing.assert_array_equal(host_ids, ids)
        np.testing.assert_array_equal(host_dispatched, dispatched)


def test_poisson_takes_each_client_with_probability_k_over_n_within_its_slots():
    n, k, rounds = 40, 8, 400
    sampler = poisson_sampler(n, k)
    bound = poisson_slots(n, k / n)  # 26: P(Binomial(40, 0.2) > 26) < 1e-9 <= P(> 25)
    assert binom.sf(bound, n, k / n) < 1e-9 <= binom.sf(bound - 2, n, k / n) and sampler.slots == 32
    draw = jax.jit(jax.vmap(lambda r: sampler(0, r)))
    drawn = draw(jnp.arange(rounds))
    taken = np.zeros(n)
    for ids, dispatched in zip(np.asarray(drawn.ids), np.asarray(drawn.dispatched)):
        taken[ids[dispatched]] += 1
    # each client's count ~ Binomial(rounds, q): within 5 standard deviations, and the counts vary from round to round
    q = k / n
    assert np.abs(taken - rounds * q).max() < 5 * math.sqrt(rounds * q * (1 - q))
    sizes = np.asarray(drawn.dispatched).sum(axis=1)
    assert sizes.min() < k < sizes.max() and abs(sizes.mean() - k) < 5 * math.sqrt(k * (1 - q) / rounds)


def test_data_size_sampler_picks_a_single_client_in_proportion_to_its_examples():
    counts = np.array([1, 2, 3, 4, 10])
    sampler = data_size_sampler(5, 1, counts)
    ids = np.asarray(jax.jit(jax.vmap(lambda r: sampler(0, r).ids))(jnp.arange(4000)))[:, 0]
    frequency = np.bincount(ids, minlength=5) / 4000
    p = counts / counts.sum()
    assert np.all(np.abs(frequency - p) < 5 * np.sqrt(p * (1 - p) / 4000))
    with pytest.raises(ValueError, match="--clients-per-round 3 clients with examples; 2 of 5 have any"):
        data_size_sampler(5, 3, np.array([0, 0, 4, 0, 1]))


def test_diurnal_clients_are_online_for_their_share_of_the_day_and_only_online_clients_are_dispatched():
    hours = jnp.arange(0, 24, 0.25)
    online = np.asarray(jax.jit(jax.vmap(lambda h: diurnal_online(1, 200, 0.3, h)))(hours))
    np.testing.assert_allclose(online.mean(axis=0), 0.3, atol=0.02)  # each client: 30 % of its day
    sampler = build_sampler("availability", context(num_clients=200, clients_per_round=10, online_fraction=0.3,
                                                    seed=1))
    draw, online_now = jax.jit(sampler), jax.jit(diurnal_online, static_argnums=1)
    for r in range(24):
        drawn = draw(1, r)
        now = np.asarray(online_now(1, 200, 0.3, jnp.float32(r)))
        ids = np.asarray(drawn.ids)[np.asarray(drawn.dispatched)]
        assert now[ids].all() and len(ids) == min(10, now.sum())


def test_an_availability_trace_is_followed_hour_by_hour(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,start,end\n0,0,2\n1,1,3\n2,0,1  # client 2 leaves at hour 1\n3,5,6\n")
    sampler = build_sampler("availability", context(num_clients=4, clients_per_round=3, availability_trace=str(trace)))
    expected = {0: {0, 2}, 1: {0, 1}, 2: {1}, 3: set(), 4: set(), 5: {3}}
    for r, clients in expected.items():
        drawn = sampler(3, r)
        assert set(np.asarray(drawn.ids)[np.asarray(drawn.dispatched)].tolist()) == clients
    trace.write_text("client,start,end\n0,4,2\n")
    with pytest.raises(ValueError, match="line 2: client 0 must be in \\[0, 4\\) and start <= end"):
        read_availability_trace(trace, 4)


def test_an_outside_sampler_registers_and_a_run_uses_it(tmp_path, capsys, monkeypatch):
    def first_clients(ctx):
        def draw(key, round_index):
            ids = jnp.arange(ctx.clients_per_round, dtype=jnp.int32)
            return type(uniform_sampler(2, 1)(0, 0))(ids, jnp.ones_like(ids, bool), jnp.int32(ctx.clients_per_round))
        return uniform_sampler(ctx.num_clients, ctx.clients_per_round).__class__("first", ctx.clients_per_round,
                                                                                  True, draw)

    monkeypatch.setitem(SAMPLERS, "first", SamplerSpec("first", first_clients))
    with pytest.raises(ValueError, match="registered already"):
        register_sampler(SamplerSpec("first", first_clients))
    assert main(["run", *TINY, "--rounds", "2", "--sampler", "first", "--out", str(tmp_path / "run")]) == 0
    assert summary(tmp_path / "run")["status"] == "completed"
    assert main(["run", *TINY, "--rounds", "1", "--sampler", "nobody", "--out", str(tmp_path / "x")]) == 2
    assert "unknown --sampler 'nobody'; the samplers are" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the clock

def test_client_seconds_and_the_round_by_hand():
    profiles = DeviceProfile("p", table=np.array([[1e9, 1e6, 5e5, 0.1], [2e9, 2e6, 1e6, 0.0], [1e8, 1e6, 1e6, 0.5]]))
    macs = jnp.array([2e9, 2e9, 5e7])  # the library's FLOPs: multiply-accumulates, 2 FLOPs each at a FLOP/s rate
    down = jnp.array([2e6, 2e6, 1e6])
    up = jnp.array([1e6, 1e6, 0.0])
    seconds = client_seconds(profiles.profiles(0, jnp.arange(3)), macs, down, up)
    # 2 + 2 x 2e9 / 1e9 + 2 + 0.1; 1 + 2 x 2e9 / 2e9 + 1 + 0; 1 + 2 x 5e7 / 1e8 + 0 + 0.5
    np.testing.assert_allclose(seconds, [8.1, 4.0, 2.5], rtol=1e-6)
    reporting, failed = jnp.array([True, True, True]), jnp.zeros(3, bool)
    everyone = round_returns(reporting, failed, seconds, Stragglers())
    assert float(everyone.seconds) == pytest.approx(8.1) and bool(everyone.returned.all())
    deadline = round_returns(reporting, failed, seconds, Stragglers(deadline=5.0))
    assert deadline.returned.tolist() == [False, True, True] and deadline.late.tolist() == [True, False, False]
    assert float(deadline.seconds) == 5.0  # the server waited for the late client until the deadline
    first_two = round_returns(reporting, failed, seconds, Stragglers(target=2))
    assert first_two.returned.tolist() == [False, True, True] and first_two.surplus.tolist() == [True, False, False]
    assert float(first_two.seconds) == pytest.approx(4.0)  # over-selection: the round ends at the second return
    one_failed = round_returns(jnp.array([True, True, False]), jnp.array([False, False, True]), seconds,
                               Stragglers(deadline=10.0))
    assert one_failed.returned.tolist() == [True, True, False] and float(one_failed.seconds) == 10.0
    # two returned of the three a round needs: it is abandoned after the server waited to the deadline
    short = round_returns(jnp.array([True, True, False]), jnp.array([False, False, True]), seconds,
                          Stragglers(deadline=10.0, min_reports=3))
    assert short.returned.tolist() == [False, False, False] and short.abandoned.tolist() == [True, True, False]
    assert float(short.seconds) == 10.0
    enough = round_returns(reporting, failed, seconds, Stragglers(min_reports=3))
    assert enough.returned.tolist() == [True, True, True] and not enough.abandoned.any()


def test_profiles_are_a_pure_function_of_seed_and_client_with_the_presets_medians():
    profile = device_profile("phone", 10)
    profiles = jax.jit(profile.profiles)  # as a round draws them: one program, not each operation on its own
    a = profiles(0, jnp.array([3, 7]))
    b = profiles(0, jnp.array([7, 3, 9]))
    np.testing.assert_array_equal(a.flops_per_second, b.flops_per_second[jnp.array([1, 0])])
    many = profiles(0, jnp.arange(20000))
    np.testing.assert_allclose(np.median(np.asarray(many.uplink_bytes_per_second)),
                               profile.distribution.uplink_bytes_per_second, rtol=0.05)
    with pytest.raises(ValueError, match="neither a preset \\(phone, iot, edge\\) nor a file"):
        device_profile("tablet", 10)


def test_profile_files_are_read_and_bad_rows_named(tmp_path):
    table = tmp_path / "devices.csv"
    table.write_text("client,flops_per_second,downlink_bytes_per_second,uplink_bytes_per_second,latency_seconds\n"
                     "1,2e9,1e6,1e6,0\n0,1e9,1e6,5e5,0.1\n")
    profile = read_profile_file(table, 2)
    np.testing.assert_allclose(profile.profiles(0, jnp.array([0, 1])).latency_seconds, [0.1, 0.0])
    table.write_text("client,a,b,c,d\n0,1e9,1e6,5e5,0.1\n")
    with pytest.raises(ValueError, match="no row for 1 of the 2 clients \\(client 1 first\\)"):
        read_profile_file(table, 2)
    spread = tmp_path / "lab.json"
    spread.write_text(json.dumps({"flops_per_second": 1e9, "downlink_bytes_per_second": 1e6,
                                  "uplink_bytes_per_second": 1e6, "latency_seconds": 0.0, "sigma": 0.0}))
    assert read_profile_file(spread, 4).distribution == ProfileDistribution("lab", 1e9, 1e6, 1e6, 0.0, 0.0)


@pytest.fixture(scope="module")
def round_parts():
    split = synthetic_split([9, 17, 12, 30, 5, 22])
    model = get_model("mlp", (64,), 10)
    local = LocalSGD(model, learning_rate=0.1, epochs=2, batch_size=8)
    algorithm = fedavg(local)
    server, clients = algorithm.init(jax.random.key(1), model.init(jax.random.key(0)), 6)
    return split, model, algorithm, server, clients


def test_a_round_with_a_clock_trains_exactly_as_without_and_lasts_its_slowest_client(round_parts):
    split, model, algorithm, server, clients = round_parts
    speeds = np.array([[1e9 * (i + 1), 1e6, 5e5, 0.01 * i] for i in range(6)])
    per_example = 3.0 * forward_flops(model.structure) * 2
    timed = RoundConditions(uniform_sampler(6, 3), DeviceProfile("t", table=speeds), Stragglers(), per_example)
    plain_server, _, plain = build_round(algorithm, split, 3, seed=0)(server, clients, 0)
    clocked_server, _, out = build_round(algorithm, split, 3, seed=0, conditions=timed)(server, clients, 0)
    jax.tree_util.tree_map(np.testing.assert_array_equal, plain_server, clocked_server)  # bit for bit
    ids = np.asarray(out.client_ids)
    model_bytes = int(message_bytes(server["variables"]))
    by_hand = (model_bytes / 1e6 + 2 * per_example * np.asarray(split.counts)[ids] / speeds[ids, 0]
               + model_bytes / 5e5 + speeds[ids, 3])
    np.testing.assert_allclose(out.client_seconds, by_hand, rtol=1e-5)
    assert float(out.returns.seconds) == pytest.approx(by_hand.max(), rel=1e-5)


def test_a_conv_models_round_lasts_its_multiply_accumulates_as_two_flops_each_by_hand():
    """LeNet-5-Caffe on 16x16x1 (16 -> conv 12 -> pool 6 -> conv 2 -> pool 1), forward multiply-accumulates of
    one example: conv1 5*5*1*20 * 12*12 = 72,000, conv2 5*5*20*50 * 2*2 = 100,000, fc1 50*500 = 25,000, fc2
    500*10 = 5,000: 202,000; training 3 x that an example an epoch. A device of s FLOP/s takes 2 x MACs / s."""
    split = synthetic_split([5, 7, 3], shape=(16, 16, 1))
    model = get_model("lenet5_caffe", (16, 16, 1), 10)
    assert forward_flops(model.structure) == 202_000
    algorithm = fedavg(LocalSGD(model, learning_rate=0.1, epochs=2, batch_size=8))
    server, clients = algorithm.init(jax.random.key(1), model.init(jax.random.key(0)), 3)
    speeds = np.array([[1e7, 1e9, 1e9, 0.0], [2e7, 1e9, 1e9, 0.5], [4e6, 1e9, 1e9, 0.0]])
    per_example = 3 * 202_000 * 2  # the dense count the run gives the clock: 3 x forward x epochs
    conditions = RoundConditions(uniform_sampler(3, 2), DeviceProfile("t", table=speeds), Stragglers(), per_example)
    _, _, out = build_round(algorithm, split, 2, seed=0, conditions=conditions)(server, clients, 0)
    ids = np.asarray(out.client_ids)
    model_bytes = 4 * (500 + 25_000 + 25_000 + 5_000)  # float32 weights, no biases, both ways
    by_hand = 2 * model_bytes / 1e9 + 2 * per_example * np.array([5, 7, 3])[ids] / speeds[ids, 0] + speeds[ids, 3]
    np.testing.assert_allclose(out.client_seconds, by_hand, rtol=1e-6)
    assert float(out.returns.seconds) == pytest.approx(by_hand.max(), rel=1e-6)
    assert by_hand.max() > 1.0  # compute, not the links, is what the round waits for


def test_a_client_past_the_deadline_is_lost_and_the_round_equals_the_one_without_it(round_parts):
    split, model, algorithm, server, clients = round_parts
    per_example = 3.0 * forward_flops(model.structure) * 2
    ids = np.asarray(sample_clients(0, 0, 6, 4))
    slow = int(ids[1])  # a client in the middle of the round's slots, the one too slow for a deadline of 1 s
    speeds = np.array([[1e12, 1e9, 1e9, 0.0]] * 6)
    speeds[slow, 0] = 1.0
    conditions = RoundConditions(uniform_sampler(6, 4), DeviceProfile("t", table=speeds), Stragglers(deadline=1.0),
                                 per_example)
    new_server, new_clients, out = build_round(algorithm, split, 4, seed=0, conditions=conditions)(server, clients, 0)
    assert out.returns.late.tolist() == [c == slow for c in ids] and float(out.returns.seconds) == 1.0
    assert int(np.asarray(out.uplink_bytes)[list(ids).index(slow)]) == 0
    # the same clients' round without the slow one: the data-weighted mean of the others' models, by hand
    kept = [c for c in ids if c != slow]
    ups = []
    info = round_info(0, 0, jnp.asarray(ids))
    keys = client_keys(0, 0, jnp.asarray(ids))
    for c in kept:
        down = algorithm.broadcast(server, c, info)
        up, _, _ = jax.jit(algorithm.client_update)(down, {}, split.client(c), keys[list(ids).index(c)], info)
        ups.append(up)
    weights = np.asarray(split.counts)[kept].astype(np.float32)
    expected = jax.tree_util.tree_map(lambda *xs: sum(w * x for w, x in zip(weights, xs)) / weights.sum(), *ups)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           new_server["variables"], expected)


def test_a_round_below_its_minimum_reports_is_abandoned_and_counted(round_parts):
    """4 dispatched, one past the deadline: 3 return, below --min-reports 4. The server keeps its model and
    every client its state; the 3 uploads that arrived count as sent; the round is counted abandoned and its
    3 updates lost beside the late one."""
    from fedjax_sparse.run.federation import federation_record, federation_totals
    from fedjax_sparse.run.records import Counters

    split, model, algorithm, server, clients = round_parts
    ids = np.asarray(sample_clients(0, 0, 6, 4))
    speeds = np.array([[1e12, 1e9, 1e9, 0.0]] * 6)
    speeds[int(ids[2]), 0] = 1.0
    conditions = RoundConditions(uniform_sampler(6, 4), DeviceProfile("t", table=speeds),
                                 Stragglers(deadline=1.0, min_reports=4), 3.0 * forward_flops(model.structure) * 2)
    new_server, new_clients, out = build_round(algorithm, split, 4, seed=0, conditions=conditions)(server, clients, 0)
    jax.tree_util.tree_map(np.testing.assert_array_equal, new_server, server)
    jax.tree_util.tree_map(np.testing.assert_array_equal, new_clients, clients)
    model_bytes = int(message_bytes(server["variables"]))
    assert np.asarray(out.uplink_bytes).tolist() == [0 if c == ids[2] else model_bytes for c in ids]
    counters = Counters()
    record = federation_record(out, conditions, counters)
    assert {k: record[k] for k in ("clients_returned", "updates_late", "round_abandoned", "updates_abandoned")} == {
        "clients_returned": 0, "updates_late": 1, "round_abandoned": True, "updates_abandoned": 3}
    totals = federation_totals(conditions, counters)
    assert totals["rounds_abandoned_total"] == 1 and totals["updates_lost_total"] == 4
    with pytest.raises(ValueError, match="--min-reports 5 exceeds the 4 clients a round dispatches"):
        RoundConditions(uniform_sampler(6, 4), stragglers=Stragglers(min_reports=5))


# -------------------------------------------------------------------------------------- the run and its files

def test_client_accuracy_figures_by_hand():
    figures = client_accuracy_figures(np.array([0.5, 1.0, 0.0, 0.75, 0.25, 0.9, 0.1, 0.6, 0.4, 0.3, 0.8]))
    assert figures["client_accuracy_min"] == 0.0 and figures["client_accuracy_max"] == 1.0
    # 11 clients: the worst and best 10 % are ceil(1.1) = 2 clients each
    assert figures["client_accuracy_worst10"] == pytest.approx(0.05)
    assert figures["client_accuracy_best10"] == pytest.approx(0.95)
    assert figures["client_accuracy_p50"] == pytest.approx(0.5)
    assert figures["client_accuracy_mean"] == pytest.approx(5.6 / 11)


def test_the_run_records_the_federation_and_resumes_exactly(tmp_path, capsys):
    flags = [*TINY, "--num-clients", "8", "--clients-per-round", "3", "--sampler", "poisson", "--device-profile",
             "iot", "--round-deadline", "4", "--dropout", "0.2", "--min-reports", "2", "--checkpoint-every", "2"]
    whole, half = tmp_path / "whole", tmp_path / "half"
    assert main(["run", *flags, "--rounds", "4", "--out", str(whole)]) == 0
    assert main(["run", *flags, "--rounds", "2", "--out", str(half)]) == 0
    assert main(["run", "--resume", str(half), "--rounds", "4", "--no-progress"]) == 0
    assert records(half) == records(whole)
    last = records(whole)[-1]
    assert last["cumulative_simulated_seconds"] == pytest.approx(sum(r["simulated_seconds"] for r in records(whole)))
    assert all(r["simulated_seconds"] <= 4.0 + 1e-6 for r in records(whole))
    lost = sum(r["updates_late"] + r["updates_failed"] + r["updates_abandoned"] for r in records(whole))
    assert summary(whole)["updates_lost_total"] == lost
    assert summary(whole)["rounds_abandoned_total"] == sum(r["round_abandoned"] for r in records(whole))
    assert all(r["round_abandoned"] == (r["clients_returned"] + r["updates_abandoned"] < 2) for r in records(whole))
    assert summary(whole)["clients_dispatched_total"] == sum(r["clients_dispatched"] for r in records(whole))
    capsys.readouterr()


@pytest.mark.parametrize("flags,words", [
    (["--round-deadline", "3"], "--round-deadline needs a clock: give --device-profile"),
    (["--over-selection", "0.5"], "--over-selection needs a clock"),
    (["--online-fraction", "0.3"], "--online-fraction is read only with --sampler availability"),
    (["--dropout", "1"], "--dropout"),
    (["--min-reports", "3"], "--min-reports 3 exceeds the 2 clients a round dispatches"),
    (["--min-reports", "1", "--dp-clip", "1"], "--dp-clip with --min-reports"),
])
def test_federation_flags_that_cannot_apply_are_one_line(tmp_path, capsys, flags, words):
    assert main(["run", *TINY, "--rounds", "1", *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_an_installed_sampler_is_found_through_its_entry_point_and_a_broken_one_skipped(monkeypatch):
    from fedjax_sparse.core.federation import participation

    class Entry:
        def __init__(self, name, spec):
            self.name, self.value, self.spec = name, f"pkg:{name}", spec

        def load(self):
            if isinstance(self.spec, Exception):
                raise self.spec
            return self.spec

    spec = SamplerSpec("every_other", lambda c: uniform_sampler(c.num_clients, c.clients_per_round))
    entries = [Entry("every_other", spec), Entry("broken", ImportError("no module named pkg")),
               Entry("uniform", spec)]
    monkeypatch.setattr(plugins.metadata, "entry_points", lambda group: entries)
    monkeypatch.setattr(participation.INSTALLED, "loaded", False)
    monkeypatch.setattr(participation, "SAMPLERS", dict(participation.SAMPLERS))
    with pytest.warns(UserWarning) as warned:
        names = participation.sampler_names()
    assert "every_other" in names and "broken" not in names
    assert participation.SAMPLERS["uniform"].build is not spec.build  # a built-in's name is not taken over
    messages = sorted(str(w.message) for w in warned)
    assert messages[0].startswith("skipped the installed sampler 'broken' (pkg:broken): ImportError: no module named pkg")
    assert "skipped the installed sampler 'uniform'" in messages[1]
    assert build_sampler("every_other", context()).slots == 6


def test_poisson_slots_split_evenly_over_a_sharded_rounds_devices(monkeypatch):
    from fedjax_sparse.core.federation.participation import poisson_slots
    from fedjax_sparse.run import federation
    from fedjax_sparse.run.config import RunConfig

    monkeypatch.setattr(federation.jax, "device_count", lambda: 3)
    config = RunConfig.create(num_clients=200, clients_per_round=10, sampler="poisson", shard_clients=True)
    sharded = federation.round_conditions(config, np.ones(200), 0.0).sampler.slots
    assert sharded % 24 == 0 and sharded >= poisson_slots(200, 0.05)
    alone = federation.round_conditions(config.replace(shard_clients=False), np.ones(200), 0.0).sampler.slots
    assert alone % 8 == 0 and alone % 3 != 0 and alone < sharded


def test_a_round_that_samples_nobody_trains_nothing_and_the_run_goes_on(tmp_path, capsys):
    """Poisson sampling can draw no client (here q = 1/6 over 6 clients: (5/6)^6 = 0.33 a round)."""
    run = tmp_path / "run"
    assert main(["run", *TINY, "--num-clients", "6", "--clients-per-round", "1", "--sampler", "poisson",
                 "--rounds", "4", "--out", str(run)]) == 0
    empty = [r for r in records(run) if r["clients_dispatched"] == 0]
    assert empty and all(r["train_loss"] is None and r["uplink_bytes"] == 0 for r in empty)
    assert summary(run)["status"] == "completed"
    capsys.readouterr()
