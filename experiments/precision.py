"""Mixed precision: FedAvg and SpaFL trained in float32 and in bfloat16 (`--compute-dtype`), side by side.

What bfloat16 costs in accuracy: the forward and backward passes in bfloat16, with float32 master weights,
optimizer states, BatchNorm statistics, loss, thresholds, aggregation and server state (`models.structure.Model`).
Each arm runs its method's CLI defaults in both dtypes on the same seeds; the columns are those of every
experiment, and `last5_accuracy` is the mean of the last five evaluations (one round's accuracy jitters by a
point or more between seeds and between rounds, more than the dtype moves it; tests/test_precision.py checks the
same figure at seed 0).

`digits` is the CPU-sized setting: the CLI's default run (scikit-learn's digits, the MLP, 20 clients, Dirichlet(0.5),
10 per round, 30 rounds, 5 local epochs, batch 16, lr 0.1), SpaFL at its CLI defaults. On a CPU bfloat16 buys no
speed (XLA:CPU converts it to float32 to compute); the speed is an accelerator's (`python -m benchmarks.suite`'s
precision section). `cifar10` is SpaFL's CIFAR-10 setting (experiments/spafl.py: spafl_cnn, 100 clients, 10 per
round, 500 rounds, 5 local epochs, batch 16, Dirichlet(0.1), lr 0.01, momentum 0.9, alpha 0.00015), for an
accelerator, from the CIFAR-10 image folder (`FEDJAX_SPARSE_CIFAR10`).

    python -m experiments.precision [--quick] [--setting digits|cifar10] [--seeds 0,1,2] [--out DIR]
"""

from __future__ import annotations

from typing import Sequence

from .common import Arm, Setting, main
from .spafl import CIFAR10
from fedjax_sparse.run import RunConfig

MODULE = "experiments.precision"
DOC = __doc__.split("\n\n")

DIGITS = RunConfig.create(dataset="digits", model="mlp")  # the CLI's default run


def last5_accuracy(metric: str):
    def columns(config: RunConfig, history: list, summary: dict) -> dict:
        values = [h[metric] for h in history if h.get(metric) is not None][-5:]
        return {"last5_accuracy": sum(values) / len(values) if values else None,
                "wall_seconds": summary.get("wall_seconds")}

    return columns


def arms(methods: dict[str, dict]) -> tuple[Arm, ...]:
    return tuple(Arm(f"{name}_{dtype}", {**overrides, "compute_dtype": dtype})
                 for name, overrides in methods.items() for dtype in ("float32", "bfloat16"))


SETTINGS = {
    "digits": Setting(
        name="digits", description=" ".join([*DOC[0:2], DOC[2].split(" On a CPU")[0]]).replace("\n", " "),
        config=DIGITS, arms=arms({"fedavg": {"algorithm": "fedavg"}, "spafl": {"algorithm": "spafl"}}),
        target_accuracy=0.9, metric="personalized_accuracy", quick={"rounds": 5},
        run_columns=last5_accuracy("personalized_accuracy")),
    "cifar10": Setting(
        name="cifar10", description=(" ".join(DOC[0:2]) + " SpaFL's CIFAR-10 setting (experiments/spafl.py).").replace(
            "\n", " "),
        config=CIFAR10, arms=arms({"spafl": {"algorithm": "spafl"}}),
        target_accuracy=0.5, metric="personalized_accuracy",
        quick={"rounds": 2, "max_train_examples": 2000, "max_test_examples": 500, "num_clients": 20,
               "eval_every": 1},
        run_columns=last5_accuracy("personalized_accuracy")),
}


def run(argv: Sequence[str] | None = None) -> int:
    return main(SETTINGS, MODULE, argv, quick_setting="digits")


if __name__ == "__main__":
    raise SystemExit(run())
