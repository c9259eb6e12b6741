"""Accuracy under client-level differential privacy, and what secure aggregation adds to the bytes: FedAvg, SpaFL, FedLDF and top-k with error feedback at epsilon 1, 4, 8 and without privacy.

Each arm's noise multiplier is calibrated before the run to spend its epsilon over the run's rounds at delta = 1 / N^1.1 (`--dp-target-epsilon`, dp-accounting's RDP accountant, Poisson sampling); each client's update is clipped to a norm near the median of the first rounds' updates, measured without clipping (seed 0, the median over rounds 1-5, and over all 30 in brackets): FedAvg's model change 0.55 (0.30) and SpaFL's threshold change 0.051 (0.024), clipped to 0.5 and 0.05; FedLDF's model change 0.55 (0.28), its clients training as FedAvg's, clipped to 0.5 per layer (each of the MLP's 3 layers to 0.5 / sqrt 3: FedLDF's sensitivity needs it); top-k's message (1 % of each leaf, after error feedback) 0.36 (0.54, growing as the residual builds), clipped to 0.5, after compression. FedLDF's per-layer choice moves its sums by up to 2 C per client and each layer's mean is over n = 4 clients, so its noise on a layer's mean is 2 z C / 4, ten times FedAvg's z C / 20 (docs/privacy.md); top-k's noise is FedAvg's, added dense. The `_secagg+` arms are the epsilon-4 arms with SecAgg+: the same model (the server reads only the sum), more bytes. FedLDF and top-k have none: secure aggregation refuses them in one line (FedLDF's server chooses each client's layers from every client's divergence; top-k's indexes are chosen by each client and cannot be masked into a sum), so their SecAgg+ entries are "refused", not run.

`digits` is the CPU-sized setting: scikit-learn's digits, the MLP, 100 clients, Dirichlet(0.5), Poisson sampling of 20 expected a round (q = 0.2), 30 rounds, 2 local epochs, batch 16, lr 0.1; SpaFL's alpha 0.0033 (the digits twin's scaled alpha, experiments/spafl.py); FedLDF's n = 4 clients a layer (its paper's n / K = 0.2); top-k keeps 1 % of each leaf (`--compression-ratio 0.01`, the default) with error feedback. The metric is personalized accuracy (each client's model on its own test split; FedAvg's, FedLDF's and top-k's is the global model), since SpaFL keeps personal models; it, the bytes and the share of clipped updates are figures privacy does not cover, recorded by the private arms with `--dp-record-unreleased` (a study of the simulation; a private run records only what it releases).

    python -m experiments.privacy [--quick] [--seeds 0,1,2] [--out DIR]
"""

from __future__ import annotations

from typing import Sequence

from .common import Arm, Setting, main
from fedjax_sparse.run import RunConfig

MODULE = "experiments.privacy"
DOC = __doc__.split("\n\n")

DIGITS = RunConfig.create(dataset="digits", model="mlp", num_clients=100, clients_per_round=20, rounds=30,
                          local_epochs=2, batch_size=16, lr=0.1, partition="dirichlet", alpha=0.5, sampler="poisson")

# name: (the method's overrides, its clip norm, what privacy adds to them, whether SecAgg+ can sum its uploads)
METHODS = {
    "fedavg": ({"algorithm": "fedavg"}, 0.5, {}, True),
    "spafl": ({"algorithm": "spafl", "sparsity_coef": 0.0033}, 0.05, {}, True),
    "fedldf": ({"algorithm": "fedldf", "clients_per_layer": 4}, 0.5, {"dp_clipping": "per_layer"}, False),
    "topk_ef": ({"algorithm": "fedavg", "uplink_compression": "topk", "compression_ratio": 0.01,
                 "error_feedback": True}, 0.5, {}, False),
}
EPSILONS = (8, 4, 1)
# a study of the simulation: its figures beyond what a private run releases (the clients' accuracies, bytes, how
# often the clip bound), which a deployment would not publish (docs/privacy.md)
RECORDED = {"dp_record_unreleased": True}


def _arms() -> tuple[Arm, ...]:
    arms = []
    for name, (overrides, clip, private, summable) in METHODS.items():
        arms.append(Arm(name, overrides))
        arms += [Arm(f"{name}_eps{e}", {**overrides, **private, **RECORDED, "dp_clip": clip,
                                        "dp_target_epsilon": float(e)}) for e in EPSILONS]
        if summable:
            arms.append(Arm(f"{name}_eps4_secagg+", {**overrides, **private, **RECORDED, "dp_clip": clip,
                                                     "dp_target_epsilon": 4.0, "secure_aggregation": "secagg+"}))
    return tuple(arms)


SETTINGS = {
    "digits": Setting(
        name="digits", description=DOC[0] + " " + DOC[1] + " " + DOC[2].replace("`digits` is the CPU-sized "
                                                                               "setting: ", "This setting: "),
        config=DIGITS, arms=_arms(), target_accuracy=0.8, metric="personalized_accuracy", quick={"rounds": 4},
        extra_columns=("dp_epsilon", "dp_noise_multiplier", "client_update_clipped")),
}


def run(argv: Sequence[str] | None = None) -> int:
    return main(SETTINGS, MODULE, argv, quick_setting="digits")


if __name__ == "__main__":
    raise SystemExit(run())
