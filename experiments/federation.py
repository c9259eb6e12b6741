"""Time to accuracy on constrained devices: SpaFL, FedLDF, FedGSE, SPATL and FedAvg under one device profile with a deadline, and FedAvg asynchronously (FedBuff).

The question these methods exist for: how much sooner, in wall-clock on slow devices and links, does a sparse
method reach an accuracy? Every client's round time is its counted training FLOPs over its device's speed, plus
its counted bytes over its link's bandwidth, plus latency (`fedjax_sparse.core.federation.clock`); a synchronous round lasts
until its last aggregated client returns, or until the deadline where a client did not make it (its update is
lost). The columns: `seconds_to_0.9x_fedavg` (simulated seconds until the personalized accuracy first reaches 90 %
of FedAvg's final one, averaged over the seeds), `simulated_seconds` (the whole run), `updates_lost_share` (the
dispatched clients whose update the deadline or a failure lost).

`digits` is the CPU-sized twin: scikit-learn's digits, the MLP, 20 clients, Dirichlet(0.5), 10 per round, 30 rounds, 2 local epochs, batch 16, lr 0.1; devices from the `iot` preset (median 0.05 GFLOP/s, 2 Mbit/s down, 0.5 Mbit/s up, 200 ms, log-normal spread 0.5) and a round deadline of 10 simulated seconds, at which a median client sending the dense MLP (about 0.35 MB each way) just makes it. Each method at its CLI defaults but for: SpaFL's alpha 0.0033 (the digits twin's scaled alpha, experiments/spafl.py), FedLDF's 2 uploads per layer of the 10, FedGSE's 2 significant labels with the dynamic capacities, SPATL's FLOPs reduction 0.2; `fedbuff` is FedAvg in asynchronous rounds (`--async-buffer 5`: the 10 clients per round in flight at once, a server step every 5 updates, staleness weight 1/sqrt(1 + s)) without a deadline (a late update is aggregated, down-weighted), for 60 steps, the 300 updates of FedAvg's 30 rounds. The metric is personalized accuracy (each client's model on its own test split; FedAvg's is the global model), since SpaFL and SPATL keep personal models.

    python -m experiments.federation [--quick] [--seeds 0,1,2] [--out DIR]
"""

from __future__ import annotations

from typing import Sequence

from .common import Arm, Setting, main
from fedjax_sparse.run import RunConfig

MODULE = "experiments.federation"
DOC = __doc__.split("\n\n")

DIGITS = RunConfig.create(dataset="digits", model="mlp", num_clients=20, clients_per_round=10, rounds=30,
                          local_epochs=2, batch_size=16, lr=0.1, partition="dirichlet", alpha=0.5,
                          device_profile="iot", round_deadline=10.0)

ARMS = (
    Arm("fedavg", {"algorithm": "fedavg"}),
    Arm("spafl", {"algorithm": "spafl", "sparsity_coef": 0.0033}),
    Arm("fedldf", {"algorithm": "fedldf", "clients_per_layer": 2}),
    Arm("fedgse", {"algorithm": "fedgse", "significant_labels": 2}),
    Arm("spatl", {"algorithm": "spatl", "flops_reduction": 0.2}),
    # FedBuff: 10 clients in flight, a step every 5 updates, no deadline; 60 steps aggregate the 300 updates
    # that FedAvg's 30 rounds of 10 do
    Arm("fedbuff", {"algorithm": "fedavg", "async_buffer": 5, "round_deadline": None, "rounds": 60}),
)

SETTINGS = {
    "digits": Setting(
        name="digits", description=DOC[0] + " " + DOC[2].split(" Each method")[0].replace("`digits` is the CPU-sized "
                                                                                          "twin: ", "This setting: "),
        config=DIGITS, arms=ARMS, target_accuracy=0.9, metric="personalized_accuracy",
        quick={"rounds": 6}, relative_target=("fedavg", 0.9)),
}


def run(argv: Sequence[str] | None = None) -> int:
    return main(SETTINGS, MODULE, argv, quick_setting="digits")


if __name__ == "__main__":
    raise SystemExit(run())
