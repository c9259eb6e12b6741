"""Asynchronous rounds (FedBuff, `core.round.buffered`): against synchronous FedAvg, a timeline worked out
by hand, exact resume, and what they refuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.algorithms.fedldf import fedldf
from fedjax_sparse.algorithms.fednova import fednova
from fedjax_sparse.algorithms.feddyn import FedDynOptions, feddyn
from fedjax_sparse.algorithms.scaffold import scaffold
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.buffered import Buffering, BufferedRound, check_buffered
from fedjax_sparse.core.client_state.store import DeviceStore, initial_server_state
from fedjax_sparse.core.federation.clock import DeviceProfile, ProfileDistribution, Stragglers, read_profile_file
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.federation.participation import poisson_sampler, sampling_order, uniform_sampler
from fedjax_sparse.core.round.step import RoundConditions, build_round, client_keys
from fedjax_sparse.building_blocks.server_optimizer import server_optimizer
from fedjax_sparse.models import get_model
from fedjax_sparse.run.cli import main

from conftest import synthetic_split
from test_faults import TINY, records

COUNTS = [9, 17, 12, 30, 5, 22, 14, 8, 11, 19]
FAST = 1e30  # rates so high that a client's time is its latency alone, exactly in float32


def _setup(num_clients=10, lr=0.1):
    train = synthetic_split(COUNTS[:num_clients])
    model = get_model("mlp", (8, 8, 1), 10)
    return train, LocalSGD(model, lr, 1, 8), model.init(jax.random.key(0))


def _latency_profile(tmp_path, latencies):
    path = tmp_path / "profile.csv"
    path.write_text("".join(f"{c},{FAST},{FAST},{FAST},{s}\n" for c, s in enumerate(latencies)))
    return read_profile_file(path, len(latencies))


@pytest.mark.parametrize("name,server", [("fedavg", "sgd"), ("fedavg", "adam"), ("scaffold", "sgd"),
                                         ("feddyn", "sgd")])
def test_buffer_k_without_staleness_is_the_synchronous_round(name, server):
    """Every client takes 1 s and K train at once: each step aggregates the K clients the synchronous round
    samples, all trained from the model before it (staleness 0), in one vmapped call of K; SCAFFOLD's client
    control variates and FedDyn's gradients are written at the step as the synchronous round writes them."""
    train, local, variables = _setup()
    optimizer = server_optimizer(server, lr=1.0 if server == "sgd" else 0.05)
    algorithm = {"fedavg": lambda: fedavg(local, server=optimizer), "scaffold": lambda: scaffold(local, 10),
                 "feddyn": lambda: feddyn(BuildContext(local=local, num_clients=10, clients_per_round=4, train=train,
                                                       num_classes=10), FedDynOptions())}[name]()
    k, key = 4, jax.random.key(1)
    same = DeviceProfile("same", ProfileDistribution("same", FAST, FAST, FAST, 1.0, 0.0))
    conditions = RoundConditions(uniform_sampler(10, k), same)
    sync_round, states = build_round(algorithm, train, k, seed=3), DeviceStore(algorithm, key, variables, 10).states
    buffered = BufferedRound(algorithm, DeviceStore(algorithm, key, variables, 10), train, Buffering(k, k), seed=3,
                             conditions=conditions, counts=COUNTS)
    sync = asyn = initial_server_state(algorithm, key, variables, 10)
    for r in range(3):
        sync, states, sync_out = sync_round(sync, states, r)
        asyn, out = buffered(asyn, r)
        np.testing.assert_array_equal(out.client_ids, sync_out.client_ids)
        np.testing.assert_array_equal(out.metrics["staleness"], 0)
        np.testing.assert_allclose(out.metrics["loss"], sync_out.metrics["loss"], rtol=1e-6)
        assert float(out.returns.seconds) == 1.0
    # the rebased upload x + (y - x) differs from y in the last bits only
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), asyn, sync)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           buffered.store.states, states)
    assert set(buffered._groups) == {k}


def test_a_timeline_worked_out_by_hand(tmp_path):
    """Concurrency 2, buffer 1. The first two clients dispatched, a and b, take 1 s and 3 s, every other 10 s.
    t=1: a returns, step 1 (staleness 0), c sent the new model x1. t=3: b returns, trained from x0: step 2
    takes x1 + (1 + 1)^-1/2 (y_b - x0); d sent x2. t=11: c returns (staleness 1), step 3."""
    train, local, variables = _setup(6)

    def first_not(seed, version, busy):
        return next(int(i) for i in sampling_order(seed, version, 6) if i not in busy)

    def timeline(seed):
        a, b = (int(c) for c in np.sort(sampling_order(seed, 0, 6)[:2]))
        c = first_not(seed, 1, {b})
        return a, b, c, first_not(seed, 2, {c})

    # a seed whose fourth client is neither a nor b (else it would return at 3 + its 1 or 3 s)
    seed = next(s for s in range(100) if timeline(s)[3] not in timeline(s)[:2])
    a, b, c, _ = timeline(seed)
    latencies = [10.0] * 6
    latencies[a], latencies[b] = 1.0, 3.0
    conditions = RoundConditions(uniform_sampler(6, 2), _latency_profile(tmp_path, latencies))
    algorithm, key = fedavg(local), jax.random.key(1)
    buffered = BufferedRound(algorithm, DeviceStore(algorithm, key, variables, 6), train, Buffering(1, 2), seed=seed,
                             conditions=conditions, counts=COUNTS[:6])
    x0 = initial_server_state(algorithm, key, variables, 6)
    x1, first = buffered(x0, 0)
    x2, second = buffered(x1, 1)
    x3, third = buffered(x2, 2)
    assert [int(o.client_ids[0]) for o in (first, second, third)] == [a, b, c]
    assert [float(o.metrics["staleness"][0]) for o in (first, second, third)] == [0.0, 1.0, 1.0]
    assert [float(o.returns.seconds) for o in (first, second, third)] == [1.0, 2.0, 8.0]
    keys = client_keys(seed, 0, jnp.asarray([a, b]))
    y_b, _ = local.train(x0["variables"], train.client(b), keys[1], round_index=0)
    expected = jax.tree_util.tree_map(lambda new, old, x: x + (new - old) / np.sqrt(2.0), y_b, x0["variables"],
                                      x1["variables"])
    jax.tree_util.tree_map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6),
                           x2["variables"], expected)


def test_asynchronous_scaffolds_control_variate_stays_the_mean_of_the_clients_under_staleness(tmp_path):
    """SCAFFOLD's invariant c = (1/N) sum_i c_i (both start at zero; each step adds (1/N) sum of the buffer's
    control deltas to c, and each of its clients adds its own to c_i) holds after every buffered step, with
    updates of staleness 1 to 3 weighted by (1 + tau)^-1/2: the model's delta is down-weighted, the control
    delta counts whole."""
    train, local, variables = _setup()
    algorithm, key = scaffold(local, 10), jax.random.key(1)
    conditions = RoundConditions(uniform_sampler(10, 4), _latency_profile(tmp_path, [1.0 + 0.7 * c for c in range(10)]))
    buffered = BufferedRound(algorithm, DeviceStore(algorithm, key, variables, 10), train, Buffering(1, 4), seed=3,
                             conditions=conditions, counts=COUNTS)
    server, staleness = initial_server_state(algorithm, key, variables, 10), []
    for r in range(6):
        server, out = buffered(server, r)
        staleness += np.asarray(out.metrics["staleness"]).tolist()
        mean = jax.tree_util.tree_map(lambda c: jnp.mean(c, axis=0), buffered.store.states)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                               server["control"], mean)
    assert max(staleness) >= 2 and min(staleness) == 0, staleness


def test_an_asynchronous_run_resumes_exactly_on_every_client_store(tmp_path, capsys):
    """4 rounds on the device store; 2 on the disk store resumed to 4: the same records (the clients' states
    and data read from rows and windows, the updates in flight and the clock kept by the checkpoint)."""
    flags = [*TINY, "--num-clients", "8", "--clients-per-round", "4", "--async-buffer", "2", "--device-profile",
             "phone", "--checkpoint-every", "2", "--algorithm", "fedavg", "--personal", "predictor"]
    whole, half = tmp_path / "whole", tmp_path / "half"
    assert main(["run", *flags, "--rounds", "4", "--client-store", "device", "--out", str(whole)]) == 0
    assert main(["run", *flags, "--rounds", "2", "--client-store", "disk", "--out", str(half)]) == 0
    assert main(["run", "--resume", str(half), "--rounds", "4", "--no-progress"]) == 0
    assert records(half) == records(whole)
    assert all(r["clients_returned"] == 2 and r["simulated_seconds"] >= 0 for r in records(whole))
    assert any(r["client_staleness"] > 0 for r in records(whole))
    seconds = records(whole)[-1]["cumulative_simulated_seconds"]
    assert f"({seconds:,.1f} simulated s); results in {whole}" in capsys.readouterr().out


def test_what_asynchronous_rounds_refuse(tmp_path):
    train, local, _ = _setup()
    clock = DeviceProfile("phone", ProfileDistribution("p", 1e9, 1e6, 1e6, 0.1))
    ok = RoundConditions(uniform_sampler(10, 4), clock)
    for algorithm, words in ((fednova(local), "--algorithm fednova cannot aggregate asynchronously"),
                             (fedldf(local, 1, 4), "--algorithm fedldf cannot aggregate asynchronously")):
        with pytest.raises(ValueError, match=words):
            check_buffered(algorithm, Buffering(2, 4), ok, 10)
    cases = [(RoundConditions(uniform_sampler(10, 4)), "need a clock"),
             (RoundConditions(uniform_sampler(10, 4), clock, Stragglers(dropout=0.1)), "take no --round-deadline"),
             (RoundConditions(poisson_sampler(10, 4), clock), "--sampler poisson is for synchronous rounds")]
    for conditions, words in cases:
        with pytest.raises(ValueError, match=words):
            check_buffered(fedavg(local), Buffering(2, 4), conditions, 10)
    with pytest.raises(ValueError, match="exceed the 10 clients"):
        check_buffered(fedavg(local), Buffering(7, 4), ok, 10)
    with pytest.raises(ValueError, match="--async-buffer must be at least 1"):
        Buffering(0, 4)


@pytest.mark.parametrize("flags,words", [
    (["--async-buffer", "2"], "need a clock"),
    (["--async-buffer", "2", "--device-profile", "iot", "--shard-clients"], "one process on one device"),
    (["--async-buffer", "2", "--device-profile", "iot", "--cpu-devices", "2"], "no --cpu-devices above 1"),
    (["--staleness-exponent", "1"], "--staleness-exponent is read only with --async-buffer"),
])
def test_asynchronous_flags_that_cannot_apply_are_one_line(tmp_path, capsys, flags, words):
    assert main(["run", *TINY, "--rounds", "1", *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
