"""Rounds and evaluations on one CPU device and shared by several, in a process of its own with 3 CPU devices
(tests/test_cpu_round.py; JAX takes its device count before it starts, the test process has one).
Prints one JSON line: which comparisons are bit for bit equal.

    python tests/cpu_round_job.py OUT_DIR
"""

import dataclasses
import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 3)

import numpy as np  # noqa: E402

from fedjax_sparse.core.evaluation.cpu import CpuEvaluator  # noqa: E402
from fedjax_sparse.core.round.cpu import CpuRound  # noqa: E402
from fedjax_sparse.core.evaluation.evaluators import split_evaluator  # noqa: E402
from fedjax_sparse.core.round.step import build_round  # noqa: E402
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
        # every client's personalized accuracy after the rounds, 17 of them scored 6 + 6 + 5 on three devices
        server, clients, _ = one
        evaluate = split_evaluator(exp.model, exp.algorithm.client_variables, client_chunk=1)
        test = exp.local_test
        test = dataclasses.replace(test, offsets=test.offsets[:17], counts=test.counts[:17])
        clients = jax.tree_util.tree_map(lambda a: a[:17], clients)
        alone = evaluate(server, clients, test)
        result[f"{name} evaluation"] = (same(alone, CpuEvaluator(evaluate, jax.local_devices())(server, clients, test))
                                        and 0 < float(alone.mean()) < 1)
    flags = ["run", "--algorithm", "scaffold", "--num-clients", "30", "--clients-per-round", "16", "--rounds", "2",
             "--no-progress"]  # the MLP's default chunk: 4
    for count in (1, 3):
        assert cli.main(flags + ["--cpu-devices", str(count), "--out", str(out / f"cli{count}")]) == 0
        summary = json.loads((out / f"cli{count}" / "summary.json").read_text())
        result[f"cli cpu_devices {count}"] = summary["cpu_devices"], summary["evaluation_cpu_devices"]
    # the padded fraction is a figure of the layout (three devices place the clients by steps: fewer padded)
    records = [[{name: value for name, value in json.loads(line).items() if name != "padded_step_fraction"}
                for line in (out / f"cli{count}" / "metrics.jsonl").read_text().splitlines()] for count in (1, 3)]
    result["cli metrics"] = records[0] == records[1]
    return result


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
