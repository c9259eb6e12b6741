"""The sampled clients placed on a sharded round's devices in the order drawn (`id`) or by local steps
(`balanced`, `core.round.device_split`): the padded share of the vmapped steps and the round's time.

On FedProx's Synthetic(1, 1) (`--dataset synthetic:1,1`: client sizes lognormal(4, 2) + 50, capped at
1,000, a power law) with FedAvg on the MLP, K clients a round, interleaved in one process on the same
devices: several CPU devices each training whole chunks (`core.round.cpu`, `--cpu-devices`), and the
clients sharded over a mesh of the same devices (`--shard-clients`, one vmap per device); one device
(the chunked round) for reference. The figures of a run are the same in every layout
(tests/test_balanced_shares.py); only the padding and the time differ.

    python -m benchmarks.balanced_shares [--quick] [--devices 2] [--out DIR]
"""

from __future__ import annotations

import sys

from .host_devices import force_host_devices


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    force_host_devices(argv)
    import dataclasses

    import jax
    import numpy as np

    from .common import best, command_line, environment, environment_markdown, finish, fmt, interleaved, \
        markdown_table, parser, stepping
    from fedjax_sparse.core.round.cpu import CpuRound
    from fedjax_sparse.core.round.device_split import BalancedSplit, balanced_padded_step_fraction, device_groups
    from fedjax_sparse.core.round.step import build_round, clients_mesh
    from fedjax_sparse.data.federated import padded_step_fraction
    from fedjax_sparse.run import RunConfig, build_experiment
    from fedjax_sparse.run.federation import round_conditions

    p = parser("benchmarks.balanced_shares", __doc__, "K = 16 of 64 clients, 3 repeats")
    p.add_argument("--devices", type=int, default=2, help="host devices on a CPU (ignored on an accelerator)")
    args = p.parse_args(argv)
    env = environment(command_line("benchmarks.balanced_shares", argv))
    devices = jax.local_devices()
    num_clients, k, chunk, batch = (64, 16, 2, 16) if args.quick else (200, 32, 4, 16)
    repeats = 3 if args.quick else 12
    config = RunConfig.create(dataset="synthetic:1,1", model="mlp", num_clients=num_clients, clients_per_round=k,
                              local_epochs=1, batch_size=batch, client_store="device", out="unused")
    exp = build_experiment(config, progress=False)
    conditions = round_conditions(config, exp.train_counts, 0.0)
    balanced = dataclasses.replace(conditions, split=BalancedSplit(batch))
    counts = np.asarray(exp.train_counts)
    layouts = {  # name: (round, clients per group, groups per device or None for the id split)
        "one device, chunks": (build_round(exp.algorithm, exp.train, k, seed=0, client_chunk=chunk,
                                           conditions=conditions), chunk, None),
        "cpu devices, id": (CpuRound(exp.algorithm, exp.train, k, seed=0, client_chunk=chunk, devices=devices,
                                     conditions=conditions), chunk, None),
        "cpu devices, balanced": (CpuRound(exp.algorithm, exp.train, k, seed=0, client_chunk=chunk,
                                           devices=devices, conditions=balanced),
                                  *device_groups(k, client_chunk=chunk, num_devices=len(devices))),
        "mesh, id": (build_round(exp.algorithm, exp.train, k, seed=0, mesh=clients_mesh(), conditions=conditions),
                     k // len(devices), None),
        "mesh, balanced": (build_round(exp.algorithm, exp.train, k, seed=0, mesh=clients_mesh(),
                                       conditions=balanced), *device_groups(k, mesh_size=len(devices))),
    }
    draws = [np.asarray(conditions.sampler(0, r).ids) for r in range(repeats + 1)]  # the rounds run below
    padded = {}
    for name, (_, group, per_device) in layouts.items():
        padded[name] = float(np.mean([
            padded_step_fraction(counts[ids], batch, group) if per_device is None else
            balanced_padded_step_fraction(BalancedSplit(batch), counts[ids], ids, np.ones(k, bool), group, per_device)
            for ids in draws]))
    runs = {name: stepping(step, exp.server_state, exp.store.states) for name, (step, _, _) in layouts.items()}
    times = interleaved(runs, repeats)
    fastest = {name: best(t)["wall"] for name, t in times.items()}
    medians = {name: float(np.median(t["wall"])) for name, t in times.items()}
    records = [{"layout": name, "devices": 1 if name.startswith("one") else len(devices), "clients_per_round": k,
                "chunk": chunk if "mesh" not in name else None, "padded_step_fraction": padded[name],
                "best_s": fastest[name], "median_s": medians[name], "times": times[name]} for name in layouts]
    for r in records:
        print(r["layout"], fmt(r["padded_step_fraction"]), fmt(r["best_s"] * 1e3), flush=True)

    def text(env):
        rows = [(r["layout"], r["devices"], r["chunk"] or "-", fmt(r["padded_step_fraction"]),
                 fmt(r["best_s"] * 1e3), fmt(r["median_s"] * 1e3)) for r in records]
        return "\n".join([
            "# Balanced shares: a sharded round's clients placed by local steps", "",
            environment_markdown(env), "",
            f"Synthetic(1, 1), {num_clients} clients (train sizes min {counts.min()}, median "
            f"{int(np.median(counts))}, max {counts.max()}), FedAvg on the MLP, K = {k}, batch {batch}, one local "
            f"epoch. Padded fraction: mean over the {repeats + 1} rounds each layout runs (the first "
            f"compiles); times: best and median of the {repeats} timed, interleaved.", "",
            markdown_table(("layout", "devices", "chunk", "padded step fraction", "best ms/round",
                            "median ms/round"), rows), ""])

    finish(args.out, "balanced_shares", env, records, text)


if __name__ == "__main__":
    main()
