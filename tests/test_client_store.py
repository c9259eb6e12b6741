"""Client stores against the device store: the same rounds, bit for bit, through prefetch, a
checkpoint, a crash after it and a restore; storage only for clients ever written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import fedavg, make_algorithm, make_options, scaffold, spafl
from fedjax_sparse.algorithms import BUILT_IN
from fedjax_sparse.algorithms.spatl import spatl
from fedjax_sparse.algorithms.spatl_selection import SalientPolicy
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.client_state.rows import RowLayout, SlotMap
from fedjax_sparse.core.client_state.choice import choose_store, make_store
from fedjax_sparse.core.client_state.store import initial_server_state, server_init
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.federation.participation import sample_clients, sample_clients_host
from fedjax_sparse.core.round.store import StoreRound
from fedjax_sparse.data.federated import federated_split
from fedjax_sparse.data.windows import host_data, open_host_data, save_host_data
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map
COUNTS = [9, 17, 12, 30, 5, 22]
K, ROUNDS, CHECKPOINT_AFTER = 3, 4, 2


@pytest.fixture(scope="module")
def setting():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(sum(COUNTS), 8, 8, 1), dtype=np.uint8)
    y = rng.integers(0, 10, size=sum(COUNTS)).astype(np.int32)
    bounds = np.cumsum([0] + COUNTS)
    clients = [np.arange(a, b) for a, b in zip(bounds, bounds[1:])]
    model = get_model("mlp", (8, 8, 1), 10)
    split = federated_split(x, y, clients, [0.5], [0.25])
    return dict(split=split, host=host_data(x, y, clients, [0.5], [0.25]), model=model,
                local=LocalSGD(model, 0.1, 1, 8, momentum=0.5), variables=model.init(jax.random.key(1)))


def algorithm(name, setting):
    local, n = setting["local"], len(COUNTS)
    if name == "fedavg":
        return fedavg(local)
    if name == "scaffold":
        return scaffold(local, n)
    if name == "spafl":
        return spafl(local, 0.01)
    ctx = BuildContext(local=local, num_clients=n, clients_per_round=K, train=setting["split"], num_classes=10)
    return make_algorithm("spatl", ctx, make_options("spatl", {"salient_keep": 0.5}))


def test_host_sampling_equals_the_jitted_sampling():
    """The host's numpy shuffle gives the round's own ids, over zero, one and two sort rounds (N > 1625)."""
    for n, k in ((1, 1), (6, 3), (2000, 100)):
        for r in (0, 5):
            np.testing.assert_array_equal(sample_clients_host(4, r, n, k), np.asarray(sample_clients(4, r, n, k)))


def test_row_layout_round_trips_every_leaf_type():
    states = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 2, 2) - 5.5, "mask": jnp.array([[1, 0], [0, 0],
              [1, 1]], bool), "n": jnp.array([-1, 7, 2**31 - 1], jnp.int32),
              "key": jax.vmap(jax.random.key)(jnp.arange(3)), "empty": jnp.zeros((3, 0))}
    layout = RowLayout.of_states(states)
    assert layout.row_bytes == 4 * 4 + 2 + 4 + 8 + 0
    rows = jax.jit(lambda s: layout.pack(s, 3))(states)
    assert rows.shape == (3, layout.row_bytes) and rows.dtype == jnp.uint8
    back = jax.jit(layout.unpack)(rows)
    for name in ("w", "mask", "n", "empty"):
        assert back[name].dtype == states[name].dtype
        np.testing.assert_array_equal(back[name], states[name])
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), jax.random.key_data(states["key"]))


def test_per_client_init_matches_init_for_every_algorithm(setting):
    """init's client states are init_clients(arange(N)); algorithms without it keep no client state;
    a client's initial state does not depend on how many clients there are (SPATL's per-client
    policy keys included: a policy whose state is drawn from its key stands in for the agent)."""
    n = len(COUNTS)
    ctx = BuildContext(local=setting["local"], num_clients=n, clients_per_round=4, train=setting["split"],
                       num_classes=10, labels_per_client=2)
    key, variables = jax.random.key(3), setting["variables"]
    drawn = SalientPolicy(init=lambda k: {"draw": jax.random.uniform(k, (2,))},
                          select=lambda state, v, data, k: (state, {}, {}))
    algorithms = [make_algorithm(name, ctx, make_options(name, {})) for name in sorted(BUILT_IN)]
    algorithms.append(spatl(ctx, make_options("spatl", {}), policy=drawn))
    stateful = set()
    for alg in algorithms:  # jitted: eagerly each operation compiles on its own, per shape
        _, states = jax.jit(alg.init, static_argnums=2)(key, variables, n)
        if alg.init_clients is None:
            assert not jax.tree_util.tree_leaves(states), alg.name
            continue
        stateful.add(alg.name)
        init_clients = jax.jit(alg.init_clients)
        tree_map(np.testing.assert_array_equal, states, init_clients(key, variables, jnp.arange(n)))
        some = init_clients(key, variables, jnp.array([n - 1, 10**6]))
        tree_map(lambda a, b: np.testing.assert_array_equal(a[0], b[n - 1]), some, states)
    assert stateful == {"scaffold", "local", "spafl", "spafl_local", "spatl", "fedpm", "fedp3", "fedspa", "feddyn"}
    draws = np.asarray(states["policy"]["draw"])  # the last algorithm: SPATL with the drawn policy
    assert len({tuple(d) for d in draws}) == n  # every client its own key


def run(setting, alg, backend, tmp_path, rounds, *, prefetch=True, restore_from=None, first=0, server=None):
    """Rounds `first`.. of `alg` on a fresh store (restored from a snapshot folder if given)."""
    store = make_store(backend, alg, jax.random.key(0), setting["variables"], len(COUNTS),
                       directory=tmp_path / "store" if backend == "disk" else None)
    if restore_from is not None:
        store.restore(restore_from)
    data = setting["split"] if backend == "device" else setting["host"]
    if backend == "disk":  # the data memory-mapped from files too, as benchmarks/client_scale.py reads them
        folder = tmp_path / "data"
        data = open_host_data(folder if (folder / "meta.json").exists() else save_host_data(data, folder))
        assert isinstance(data.x, np.memmap)
    round_fn = StoreRound(alg, store, data, K, seed=7, prefetch=prefetch)
    server = initial_server_state(alg, jax.random.key(0), setting["variables"], len(COUNTS)) \
        if server is None else server
    outs, servers = [], []
    for r in range(first, rounds):
        server, out = round_fn(server, r)
        outs.append(out)
        servers.append(server)
    return store, round_fn, servers, outs


def all_states(store):
    return store.states if store.backend == "device" else store.client_states(np.arange(len(COUNTS)))


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "spafl", "spatl"])
def test_every_store_trains_exactly_as_the_device_store(setting, name, tmp_path):
    """Per store: rounds 0-1, a checkpoint, rounds 2-3 (prefetching each next round), then a crash:
    a fresh store restored from the checkpoint reruns rounds 2-3. Both runs equal the device
    store's four rounds bit for bit (server state, every client's state, metrics, bytes)."""
    alg = algorithm(name, setting)
    ids = [set(sample_clients_host(7, r, len(COUNTS), K).tolist()) for r in range(ROUNDS)]
    assert all(ids[r] & ids[r + 1] for r in range(ROUNDS - 1))  # prefetched rounds overlap the running one
    store, _, servers, outs = run(setting, alg, "device", tmp_path, ROUNDS)
    expected = (servers[-1], all_states(store), outs)
    checkpointed_server = servers[CHECKPOINT_AFTER - 1]
    for backend in ("host", "disk", "device"):
        folder = tmp_path / backend
        store, round_fn, servers, outs = run(setting, alg, backend, folder, CHECKPOINT_AFTER)
        server = servers[-1]
        store.snapshot(folder / "checkpoint")
        for r in range(CHECKPOINT_AFTER, ROUNDS):  # work after the checkpoint, lost in the crash
            server, out = round_fn(server, r)
            outs.append(out)
        tree_map(np.testing.assert_array_equal, (server, all_states(store), outs), expected)
        restored, _, servers, resumed = run(setting, alg, backend, folder, ROUNDS, restore_from=folder / "checkpoint",
                                            first=CHECKPOINT_AFTER, server=checkpointed_server)
        tree_map(np.testing.assert_array_equal, (servers[-1], all_states(restored), outs[:CHECKPOINT_AFTER] + resumed),
                 expected)


def test_never_sampled_clients_cost_nothing(setting, tmp_path):
    """10^6 SCAFFOLD clients (340 GB if materialized): the server state is built without them, and
    the stores hold (in memory or on disk) only the rows written; the rest read as initial states."""
    n = 10**6
    alg = scaffold(setting["local"], n)
    key, variables = jax.random.key(0), setting["variables"]
    compiled = server_init(alg, n).lower(key, variables).compile()
    used = compiled.memory_analysis()
    model_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(variables))
    assert used.temp_size_in_bytes + used.output_size_in_bytes < 4 * model_bytes
    written = np.array([3, 999_999])
    for backend in ("host", "disk"):
        store = make_store(backend, alg, key, variables, n, directory=tmp_path)
        assert store.row_bytes == 340_008  # the MLP's 85,002 float32 params: one control variate
        rows = np.random.default_rng(0).integers(0, 256, (2, store.row_bytes), dtype=np.uint8)
        rows[:, 3::4] &= 0x3F  # finite float32s
        store.write(written, rows)
        assert store.nbytes == 2 * store.row_bytes
        np.testing.assert_array_equal(store.held_clients, written)
        if backend == "disk":
            assert store.disk_bytes == 2 * store.row_bytes
        got, held = store.read(np.array([3, 4, 999_999]))
        np.testing.assert_array_equal(held, [True, False, True])
        np.testing.assert_array_equal(got[[0, 2]], rows)
        states = store.client_states(np.array([4, 999_999]))
        tree_map(lambda s: np.testing.assert_array_equal(s[0], 0.0), states)  # never written: zero control
        np.testing.assert_array_equal(jax.jit(lambda s: store.layout.pack(s, 2))(states)[1], rows[1])


def test_slots_a_checkpoint_needs_are_never_overwritten():
    slots = SlotMap(10, keep=1)
    np.testing.assert_array_equal(slots.assign(np.array([0, 1, 2])), [0, 1, 2])
    np.testing.assert_array_equal(slots.assign(np.array([0])), [0])  # no checkpoint yet: in place
    saved = slots.commit()
    np.testing.assert_array_equal(slots.assign(np.array([0, 1])), [3, 4])  # pinned by the checkpoint: moved
    np.testing.assert_array_equal(slots.assign(np.array([0, 2])), [3, 5])  # 3 is not pinned; 2 is
    np.testing.assert_array_equal(saved, [0, 1, 2] + [-1] * 7)
    slots.commit()  # keep=1: the first checkpoint's slots 0, 1, 2 are free again
    np.testing.assert_array_equal(slots.assign(np.array([9, 3])), [0, 1])
    kept_two = SlotMap(4, keep=2)
    kept_two.assign(np.array([0]))
    kept_two.commit()
    kept_two.assign(np.array([0]))
    kept_two.commit()
    np.testing.assert_array_equal(kept_two.assign(np.array([0])), [2])  # slots 0 and 1 both still pinned


def test_a_restored_disk_store_leaves_the_older_checkpoints_rows_intact(setting, tmp_path):
    """Checkpoints c1 and c2 kept (keep=2); a crash, a restore from c2 and more writes: c1 still reads
    back as saved, so deleting a damaged c2 and resuming from c1 stays exact."""
    alg, key, variables = scaffold(setting["local"], 6), jax.random.key(0), setting["variables"]
    rng = np.random.default_rng(2)
    a, b, c = (rng.integers(0, 64, (2, 340_008), dtype=np.uint8) for _ in range(3))
    ids = np.array([0, 1])
    store = make_store("disk", alg, key, variables, 6, directory=tmp_path / "rows", keep=2)
    store.write(ids, a)
    store.snapshot(tmp_path / "c1")
    store.write(ids, b)
    store.snapshot(tmp_path / "c2")
    store.close()
    resumed = make_store("disk", alg, key, variables, 6, directory=tmp_path / "rows", keep=2)
    resumed.restore(tmp_path / "c2")
    np.testing.assert_array_equal(resumed.read(ids)[0], b)
    resumed.write(ids, c)
    resumed.write(ids, c)
    older = make_store("disk", alg, key, variables, 6, directory=tmp_path / "rows", keep=2)
    older.restore(tmp_path / "c1")
    np.testing.assert_array_equal(older.read(ids)[0], a)


def test_disk_store_file_stays_near_the_clients_written():
    """Clients written + keep x K x rounds between checkpoints bounds the rows in the file."""
    rng = np.random.default_rng(1)
    n, k, every, keep = 60, 5, 3, 2
    slots = SlotMap(n, keep=keep)
    written = set()
    for r in range(60):
        ids = rng.choice(n, k, replace=False)
        slots.assign(ids)
        written.update(ids.tolist())
        live = slots.live[slots.live >= 0]
        assert len(set(live.tolist())) == len(live)  # no two clients share a row
        if (r + 1) % every == 0:
            slots.commit()
        assert slots.num_slots <= len(written) + keep * k * every
    assert slots.num_slots < 2 * n  # without reuse it would be 300


def test_auto_picks_device_then_host_then_disk():
    gib = 2**30
    assert choose_store(100, 10**6, 0, device_free=8 * gib, host_available=64 * gib)[0] == "device"
    backend, reason = choose_store(10**4, 10**6, 0, device_free=8 * gib, host_available=64 * gib)
    assert backend == "host" and "9.31 GiB" in reason
    assert choose_store(10**5, 10**6, 0, device_free=8 * gib, host_available=64 * gib)[0] == "disk"
    # on a CPU the device allocates from host memory
    assert choose_store(10**4, 10**6, 0, device_free=None, host_available=24 * gib)[0] == "device"
    # several processes never use the device store; each needs its share
    assert choose_store(10**4, 10**6, 0, processes=2, device_free=None, host_available=12 * gib)[0] == "host"
    # data read from its files a round at a time (--dataset mmap:) is never loaded whole into the device store
    assert choose_store(100, 10**6, 0, device_free=8 * gib, host_available=64 * gib,
                        data_on_disk=True)[0] == "host"


def test_a_snapshot_restores_into_another_store_but_not_into_another_run(setting, tmp_path):
    """A host snapshot's rows restore into the disk store (a resumed run may change stores); a disk
    snapshot, whose rows stay in the store's file, only into the disk store; another run's never."""
    key, variables = jax.random.key(0), setting["variables"]
    alg = scaffold(setting["local"], 6)
    host = make_store("host", alg, key, variables, 6)
    rows = np.random.default_rng(0).integers(0, 64, (2, host.row_bytes), dtype=np.uint8)
    host.write(np.array([1, 4]), rows)
    host.snapshot(tmp_path / "host")
    with pytest.raises(ValueError, match=r"another run \(num_clients: 6 there, 7 here\)"):
        make_store("host", scaffold(setting["local"], 7), key, variables, 7).restore(tmp_path / "host")
    disk = make_store("disk", alg, key, variables, 6, directory=tmp_path / "d")
    disk.write(np.array([0]), rows[:1])  # rows of its own, which the restore replaces
    disk.restore(tmp_path / "host")
    np.testing.assert_array_equal(disk.held_clients, [1, 4])
    np.testing.assert_array_equal(disk.read(np.array([1, 4]))[0], rows)
    assert disk.disk_bytes == 2 * disk.row_bytes
    disk.snapshot(tmp_path / "disk")
    with pytest.raises(ValueError, match="is a disk store's .* restore it with the disk store"):
        make_store("host", alg, key, variables, 6).restore(tmp_path / "disk")
    with pytest.raises(FileNotFoundError, match="no client-state snapshot of process 0-of-1"):
        host.restore(tmp_path / "nothing")
