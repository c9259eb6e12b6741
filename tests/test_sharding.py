"""The sampled-clients axis sharded over 4 (forced host) devices gives the single-device round,
with the device store (`build_round`) and with a host store (`StoreRound` on `process_mesh`)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    assert jax.device_count() == 4, jax.devices()
    from fedjax_sparse.algorithms import fedavg, scaffold
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.client_state.choice import make_store
    from fedjax_sparse.core.client_state.store import initial_server_state
    from fedjax_sparse.core.round.distributed import process_mesh
    from fedjax_sparse.core.round.step import build_round, clients_mesh
    from fedjax_sparse.core.round.store import StoreRound
    from fedjax_sparse.data.federated import federated_split
    from fedjax_sparse.data.windows import host_data
    from fedjax_sparse.models import get_model

    rng = np.random.default_rng(0)
    counts = [9, 17, 12, 30, 5, 22, 14, 8]
    x = rng.integers(0, 256, size=(sum(counts), 8, 8, 1), dtype=np.uint8)
    y = rng.integers(0, 10, size=sum(counts))
    bounds = np.cumsum([0] + counts)
    indices = [np.arange(a, b) for a, b in zip(bounds, bounds[1:])]
    split = federated_split(x, y, indices, [0.5], [0.25])
    model = get_model("mlp", (8, 8, 1), 10)
    local = LocalSGD(model, 0.1, 2, 8)
    for algorithm in (fedavg(local), scaffold(local, 8)):
        results = []
        for mesh in (None, clients_mesh()):
            server, clients = algorithm.init(jax.random.key(0), model.init(jax.random.key(1)), 8)
            round_fn = build_round(algorithm, split, 4, seed=3, mesh=mesh)
            for r in range(2):
                server, clients, out = round_fn(server, clients, r)
            results.append((server, clients, out.uplink_bytes))
        (a, ca, ba), (b, cb, bb) = results
        jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, atol=1e-5, rtol=1e-5), a, b)
        jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, atol=1e-5, rtol=1e-5), ca, cb)
        np.testing.assert_array_equal(ba, bb)
        if algorithm.name == "scaffold":  # the host store sharded over the processes x clients mesh
            store = make_store("host", algorithm, jax.random.key(0), model.init(jax.random.key(1)), 8)
            round_fn = StoreRound(algorithm, store, host_data(x, y, indices, [0.5], [0.25]), 4, seed=3,
                                  mesh=process_mesh())
            server = initial_server_state(algorithm, jax.random.key(0), model.init(jax.random.key(1)), 8)
            for r in range(2):
                server, out = round_fn(server, r)
            states = store.client_states(np.arange(8))
            jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, atol=1e-5, rtol=1e-5),
                                   (server, states), (a, ca))
    print("SHARDED_OK")
""")


def test_sharded_round_equals_single_device_round():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SHARDED_OK" in proc.stdout
