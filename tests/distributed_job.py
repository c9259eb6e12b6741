"""One small federated job that tests/test_distributed.py runs in one process and in two.

FedAvg on the host store, a linear model on 2x2 images, 8 clients, 4 per round, 2 rounds
(SCAFFOLD, whose clients keep state, runs in two processes through the command line there).
`main` is the entry of each launched process:
    python tests/distributed_job.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
"""

import json
import sys
from pathlib import Path

import numpy as np

COUNTS = [9, 17, 12, 30, 5, 22, 14, 8]
CLIENTS_PER_ROUND, ROUNDS, SEED = 4, 2, 3


def run(process, mesh, directory: Path) -> dict:
    """{algorithm: arrays} of this process: per-round metrics, the final server state, its own
    clients' final rows and the bytes it holds (client states, data)."""
    import jax

    from conftest import linear_model
    from fedjax_sparse.algorithms import fedavg
    from fedjax_sparse.core.client_state.choice import make_store
    from fedjax_sparse.core.client_state.store import initial_server_state
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.round.store import StoreRound
    from fedjax_sparse.data.windows import host_data

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(sum(COUNTS), 2, 2, 1), dtype=np.uint8)
    y = rng.integers(0, 3, size=sum(COUNTS))
    bounds = np.cumsum([0] + COUNTS)
    data = host_data(x, y, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])], [0.5], [0.25], process=process)
    model = linear_model()
    local = LocalSGD(model, 0.1, 2, 4, momentum=0.5)
    key, variables = jax.random.key(0), model.init(jax.random.key(1))
    results = {}
    for alg, backend in ((fedavg(local), "host"),):
        store = make_store(backend, alg, key, variables, len(COUNTS), directory=directory / alg.name,
                           process=process)
        round_fn = StoreRound(alg, store, data, CLIENTS_PER_ROUND, seed=SEED, mesh=mesh)
        server = initial_server_state(alg, key, variables, len(COUNTS))
        losses, uplink = [], []
        for r in range(ROUNDS):
            server, out = round_fn(server, r, prefetch_next=r + 1 < ROUNDS)
            losses.append(np.asarray(out.metrics["loss"]))
            uplink.append(np.asarray(out.uplink_bytes))
        round_fn.close()
        held = store.held_clients
        results[alg.name] = {"loss": np.stack(losses), "uplink": np.stack(uplink),
                             "server": [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(server)],
                             "held": held, "rows": store.read(held)[0], "state_bytes": store.nbytes,
                             "data_bytes": data.nbytes}
    return results


def main(argv):
    process_id, num_processes, port, out = int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    from fedjax_sparse.core.round import distributed
    process = distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id, timeout_s=60)
    results = run(process, distributed.process_mesh(), out / f"work{process_id}")
    flat = {f"{name}/{field}": value for name, fields in results.items() for field, value in fields.items()
            if field != "server"}
    flat.update({f"{name}/server/{i}": leaf for name, fields in results.items()
                 for i, leaf in enumerate(fields["server"])})
    np.savez(out / f"process{process_id}.npz", **flat)
    print(json.dumps({"process": process_id, "devices": len(__import__("jax").devices())}), flush=True)


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
    main(sys.argv)
