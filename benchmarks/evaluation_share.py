"""What evaluation costs beside the rounds of a run, as `fedjax-sparse run` builds both on this machine.

On a CPU the rounds of small clients train on every core (`core.round.cpu`), and the personalized
evaluation of every client too where it pays (`core.evaluation.cpu`). In one process, FedAvg on the
MLP: a round and the run's evaluation of every client (global model and each client's personalized
model, `run.records.evaluate`) with the personalized part on one device and on every CPU device, timed
in turn, each the best of the repeats, beside the number of devices the run picks
(`core.evaluation.cpu.evaluation_devices`). An evaluation runs once every `--eval-every` rounds,
so its share of a run is at most evaluation / (round + evaluation).

    python -m benchmarks.evaluation_share [--quick] [--out DIR]
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> list[dict]:
    from fedjax_sparse.core.round.cpu import keep_freed_memory, use_cpu_cores

    argv = list(sys.argv[1:] if argv is None else argv)
    use_cpu_cores()  # as the command line does, before JAX starts
    keep_freed_memory()

    from .common import (best, command_line, environment, environment_markdown, finish, fmt, interleaved,
                         markdown_table, parser)
    import jax

    from fedjax_sparse.core.evaluation.cpu import CpuEvaluator
    from fedjax_sparse.core.evaluation.evaluators import split_evaluator
    from fedjax_sparse.run import RunConfig, build_experiment
    from fedjax_sparse.run.experiment import evaluation_chunk
    from fedjax_sparse.run.records import evaluate

    p = parser("benchmarks.evaluation_share", __doc__, "the digits setting only, 3 repeats")
    args = p.parse_args(argv)
    env = environment(command_line("benchmarks.evaluation_share", argv))
    settings = [("digits", 200, 100)] + ([] if args.quick else [
        ("synthetic:1,1", 20, 10), ("synthetic:1,1", 50, 10), ("synthetic:1,1", 100, 10), ("synthetic:1,1", 200, 100),
        ("synthetic:1,1", 1000, 100)])
    records = []
    for dataset, num_clients, k in settings:
        config = RunConfig.create(algorithm="fedavg", dataset=dataset, num_clients=num_clients, clients_per_round=k,
                                  local_epochs=1, out="unused")
        exp = build_experiment(config, progress=False)
        state = {"server": exp.server_state, "round": 0}

        def one_round(state=state, exp=exp):
            state["server"], _ = exp.round_fn(state["server"], state["round"])
            state["round"] += 1
            return state["server"]

        alone = split_evaluator(exp.model, exp.algorithm.client_variables, client_chunk=evaluation_chunk(config))
        one_device = dataclasses.replace(exp, evaluate_personalized=alone)
        every_device = dataclasses.replace(exp, evaluate_personalized=CpuEvaluator(alone, jax.local_devices(
            backend="cpu")))

        def one_evaluation(state=state, exp=exp):
            scores, finite = evaluate(exp, state["server"])
            if not finite:
                raise FloatingPointError(f"{dataset}: a client's state is not finite after round {state['round']}")
            return scores

        times = interleaved({"round": one_round, "evaluation_1cpu": lambda: one_evaluation(exp=one_device),
                             "evaluation_every_cpu": lambda: one_evaluation(exp=every_device)}, 3 if args.quick else 10)
        round_s, one_s, every_s = (best(times[name])["wall"] for name in ("round", "evaluation_1cpu",
                                                                          "evaluation_every_cpu"))
        chosen = len(getattr(exp.evaluate_personalized, "devices", ())) or 1
        eval_s = every_s if chosen > 1 else one_s
        records.append({"dataset": dataset, "num_clients": num_clients, "clients_per_round": k,
                        "max_test_count": exp.local_test.max_count, "cpu_devices": jax.local_device_count(),
                        "round_cpu_devices": len(exp.round_fn.cpu_devices) or 1, "evaluation_cpu_devices": chosen,
                        "times": times, "round_s": round_s, "evaluation_1cpu_s": one_s,
                        "evaluation_every_cpu_s": every_s, "share": eval_s / (round_s + eval_s)})
        exp.close()
        print(dataset, num_clients, fmt(records[-1]["share"]), flush=True)

    def text(env):
        rows = [(r["dataset"], r["num_clients"], r["max_test_count"], r["num_clients"] * r["max_test_count"],
                 r["clients_per_round"], r["round_cpu_devices"], fmt(r["round_s"] * 1e3),
                 fmt(r["evaluation_1cpu_s"] * 1e3), fmt(r["evaluation_every_cpu_s"] * 1e3),
                 fmt(r["evaluation_1cpu_s"] / r["evaluation_every_cpu_s"]), r["evaluation_cpu_devices"],
                 fmt(r["share"])) for r in records]
        return "\n".join([
            "# Evaluation beside the rounds of a run", "", environment_markdown(env), "",
            markdown_table(("data", "clients", "largest test split", "padded test examples", "K",
                            "round's CPU devices", "round ms", "evaluation on one device ms",
                            f"on {records[0]['cpu_devices']} devices ms", "one device / several",
                            "evaluation's CPU devices (the run's rule)", "evaluation / (round + evaluation)"), rows), "",
            "FedAvg on the MLP, one local epoch; best of the interleaved repeats. The evaluation: the global model "
            "on the test set and each client's personalized model on its own test split, the latter on one or "
            "on every CPU device.", ""])

    finish(args.out, "evaluation_share", env, records, text)
    return records


if __name__ == "__main__":
    main()
