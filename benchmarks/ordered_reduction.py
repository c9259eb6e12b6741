"""What reducing the uploads in client order costs a sharded round.

With a mesh, a round gathers the K sampled clients' uploads onto every device before the server's
update (`core.round.step.round_step(ordered_reduction=True)`), so the sums over clients run in client
order whatever the number of devices or processes, and a run's figures equal one process's
(`tests/test_distributed.py`). Without it, XLA sums each device's share and then across devices.
This times both on the same mesh, interleaved in one process: FedAvg and SCAFFOLD on the digits
MLP, K clients a round sharded over every device (on a CPU, `--devices D` makes D host devices).

    python -m benchmarks.ordered_reduction [--quick] [--devices 2] [--out DIR]
"""

from __future__ import annotations

import sys

from .host_devices import force_host_devices


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    force_host_devices(argv)
    from .common import (best, command_line, environment, environment_markdown, finish, fmt, interleaved,
                         markdown_table, parser, stepping)
    from fedjax_sparse.core.round.step import build_round, clients_mesh
    from fedjax_sparse.run import RunConfig, build_experiment

    p = parser("benchmarks.ordered_reduction", __doc__, "two algorithms at K = 8, 3 repeats")
    p.add_argument("--devices", type=int, default=2, help="host devices on a CPU (ignored on an accelerator)")
    args = p.parse_args(argv)
    env = environment(command_line("benchmarks.ordered_reduction", argv))
    mesh = clients_mesh()
    settings = [("fedavg", 8), ("scaffold", 8)] if args.quick else [("fedavg", 16), ("fedavg", 64), ("scaffold", 16),
                                                                       ("scaffold", 64)]
    records = []
    for algorithm, k in settings:
        k = k - k % mesh.size or mesh.size
        config = RunConfig.create(algorithm=algorithm, num_clients=max(2 * k, 20), clients_per_round=k,
                                  local_epochs=1, client_store="device", out="unused")
        exp = build_experiment(config, progress=False)
        rounds = {"ordered" if ordered else "per-device sums": stepping(
            build_round(exp.algorithm, exp.train, k, seed=0, mesh=mesh, ordered_reduction=ordered),
            exp.server_state, exp.store.states) for ordered in (True, False)}
        times = interleaved(rounds, 3 if args.quick else 10)
        fastest = {name: best(t)["wall"] for name, t in times.items()}
        records.append({"algorithm": algorithm, "clients_per_round": k, "devices": mesh.size, "times": times,
                        "ordered_s": fastest["ordered"], "unordered_s": fastest["per-device sums"],
                        "ratio": fastest["ordered"] / fastest["per-device sums"]})
        print(records[-1]["algorithm"], k, fmt(records[-1]["ratio"]), flush=True)

    def text(env):
        rows = [(r["algorithm"], r["clients_per_round"], r["devices"], fmt(r["ordered_s"] * 1e3),
                 fmt(r["unordered_s"] * 1e3), fmt(r["ratio"])) for r in records]
        return "\n".join([
            "# The uploads reduced in client order: its cost in a sharded round", "",
            environment_markdown(env), "",
            markdown_table(("algorithm", "K", "devices", "ordered ms/round", "per-device sums ms/round",
                            "ordered / per-device"), rows), "",
            "Best of the interleaved repeats; the digits MLP, one local epoch, K clients sharded over the devices.",
            ""])

    finish(args.out, "ordered_reduction", env, records, text)


if __name__ == "__main__":
    main()
