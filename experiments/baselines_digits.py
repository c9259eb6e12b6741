"""FedAvg, FedProx, SCAFFOLD and FedNova side by side on scikit-learn's digits (no download).

The CPU-sized twin of `baselines_cifar10`: the digits MLP, 20 clients with
Dirichlet(0.5) label skew, 10 per round, 5 local epochs of batch 16 at lr 0.1,
30 rounds; the quick version runs 8 rounds and is part of the test suite.

    python -m experiments.baselines_digits [--quick]
"""

from .common import Arm, Setting, main
from fedjax_sparse.run import RunConfig

SETTINGS = {
    "baselines_digits": Setting(
        name="baselines_digits",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        config=RunConfig.create(dataset="digits", model="mlp", num_clients=20, clients_per_round=10, rounds=30,
                         local_epochs=5, batch_size=16, lr=0.1, partition="dirichlet", alpha=0.5, mu=0.01),
        arms=tuple(Arm(name, {"algorithm": name}) for name in ("fedavg", "fedprox", "scaffold", "fednova")),
        target_accuracy=0.9,
        quick={"rounds": 8},
    ),
}

if __name__ == "__main__":
    raise SystemExit(main(SETTINGS, "experiments.baselines_digits"))
