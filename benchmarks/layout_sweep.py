"""Every built-in algorithm's first rounds on one CPU device and sharded over two, compared bit for bit.

The library promises a run's figures do not depend on how its clients are laid out over devices and
processes; `docs/scale.md` names the algorithms that differ in the last bits, and why. This sweep checks
every built-in algorithm (the test suite checks the ones that broke and the ones that differ:
tests/test_faults_layouts.py). It runs in a process with two CPU devices (JAX takes its device count
before it starts):

    python -m benchmarks.layout_sweep [--quick] [--algorithms fednova,fedspa]
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 2)

import sys  # noqa: E402

import numpy as np  # noqa: E402

from .common import command_line, environment, finish, markdown_table, parser  # noqa: E402
from fedjax_sparse.algorithms import BUILT_IN, make_algorithm, make_options  # noqa: E402
from fedjax_sparse.core.contract.algorithm import BuildContext  # noqa: E402
from fedjax_sparse.core.round.local_training import LocalSGD  # noqa: E402
from fedjax_sparse.core.round.step import build_round, clients_mesh, default_client_chunk  # noqa: E402
from fedjax_sparse.data.federated import federated_split  # noqa: E402
from fedjax_sparse.models import get_model  # noqa: E402

K, ROUNDS = 4, 2
# 3 to 7 steps of 4 examples: FedNova's division by ||a||_1 rounds alike in both layouts at 1 or 2 steps
COUNTS = (12, 20, 24, 28, 10, 18, 22, 26)


def random_split(counts=COUNTS, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(sum(counts), 8, 8, 1), dtype=np.uint8)
    y = rng.integers(0, 10, size=sum(counts)).astype(np.int32)
    bounds = np.cumsum((0,) + tuple(counts))
    return federated_split(x, y, [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])], mean=[0.5], std=[0.25])


def layout_differences(names) -> dict[str, list[str]]:
    """{algorithm: the parts of its first ROUNDS rounds ('server state', 'client states', 'outputs') that
    differ between one CPU device (in its default chunks) and two (`--shard-clients`: one program
    partitioned over the devices, as several processes run one)}. Needs two CPU devices."""
    model = get_model("mlp", (8, 8, 1), 10)
    split = random_split()
    context = BuildContext(local=LocalSGD(model, 0.1, 1, 4), num_clients=len(COUNTS), clients_per_round=K,
                           train=split, num_classes=10, labels_per_client=2)
    variables = model.init(jax.random.key(0))
    mesh = clients_mesh(jax.devices()[:2])
    differ = {}
    for name in names:
        algorithm = make_algorithm(name, context, make_options(name, {"clients_per_layer": 1}))
        runs = []
        for layout in (dict(client_chunk=default_client_chunk(variables, K)), dict(mesh=mesh)):
            round_fn = build_round(algorithm, split, K, seed=0, **layout)
            server, clients = algorithm.init(jax.random.key(1), variables, len(COUNTS))
            outputs = []
            for r in range(ROUNDS):
                server, clients, output = round_fn(server, clients, r)
                outputs.append(jax.device_get(output))
            runs.append(jax.device_get({"server state": server, "client states": clients, "outputs": outputs}))
        differ[name] = [part for part in runs[0] if not all(
            np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(runs[0][part]),
                                                 jax.tree_util.tree_leaves(runs[1][part])))]
    return differ


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser("benchmarks.layout_sweep", __doc__, "the algorithms the suite checks only")
    p.add_argument("--algorithms", default=None, help="comma-separated (default: every built-in algorithm)")
    args = p.parse_args(argv)
    names = (args.algorithms.split(",") if args.algorithms else
             ["fednova", "fedspa", "hdfl", "scaffold"] if args.quick else sorted(BUILT_IN))
    env = environment(command_line("benchmarks.layout_sweep", argv))
    differ = layout_differences(names)
    rows = [(name, "every figure bit for bit" if not parts else "differ: " + ", ".join(parts))
            for name, parts in differ.items()]
    text = lambda env: "\n".join([  # noqa: E731
        "# Layout sweep: one CPU device against two, first two rounds", "",
        f"Device: {env['device']}; jax {env['jax']}. Command: `{env['command']}`.", "",
        markdown_table(["algorithm", "server state, client states, round outputs"], rows), "",
        "docs/scale.md says why the algorithms that differ do (a division by a broadcast value rounds",
        "differently in a program partitioned over devices).", ""])
    finish(args.out, "layout_sweep", env, differ, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
