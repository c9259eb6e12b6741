"""Rounds on one CPU device and shared by several, in a process of its own with 3 CPU devices
(tests/test_cpu_round.py; JAX takes its device count before it starts, the test process has one).
Prints one JSON line: which comparisons are bit for bit equal.

    python tests/cpu_round_job.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 3)

import numpy as np  # noqa: E402

from fedjax_sparse.core.cpu_round import CpuRound  # noqa: E402
from fedjax_sparse.core.round import build_round  # noqa: E402
from fedjax_sparse.run import RunConfig, build_experiment  # noqa: E402
from fedjax_sparse.run import cli  # noqa: E402

# the update that differed in the last bits under an SPMD program (SCAFFOLD, whose clients keep state,
# goes through the command line below)
ALGORITHMS = ("fednova",)
K, CHUNK, ROUNDS = 12, 3, 3  # 4 chunks: 2 + 1 + 1 on three devices


def same(a, b) -> bool:
    a, b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def rounds(round_fn, server, clients):
    history = []
    for r in range(ROUNDS):
        server, clients, out = round_fn(server, clients, r)
        history.append(out)
    return server, clients, history


def main(out: Path) -> dict:
    result = {"devices": jax.local_device_count()}
    for name in ALGORITHMS:
        config = RunConfig.create(algorithm=name, num_clients=18, clients_per_round=K, client_chunk=CHUNK,
                                  client_store="device", out=str(out / name))
        exp = build_experiment(config, progress=False)
        copy = lambda tree: jax.tree_util.tree_map(lambda a: a.copy(), tree)  # noqa: E731 - donated
        one = rounds(build_round(exp.algorithm, exp.train, K, seed=0, client_chunk=CHUNK), exp.server_state,
                     copy(exp.store.states))
        shared = CpuRound(exp.algorithm, exp.train, K, seed=0, client_chunk=CHUNK, devices=jax.local_devices())
        result[name] = same(one, rounds(shared, exp.server_state, copy(exp.store.states)))
    flags = ["run", "--algorithm", "scaffold", "--num-clients", "30", "--clients-per-round", "16", "--rounds", "2",
             "--client-chunk", "2", "--no-progress"]
    for count in (1, 3):
        assert cli.main(flags + ["--cpu-devices", str(count), "--out", str(out / f"cli{count}")]) == 0
        result[f"cli cpu_devices {count}"] = json.loads((out / f"cli{count}" / "summary.json").read_text())[
            "cpu_devices"]
    result["cli metrics"] = ((out / "cli1" / "metrics.jsonl").read_text()
                             == (out / "cli3" / "metrics.jsonl").read_text())
    return result


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
