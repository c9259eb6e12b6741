"""FedADP (Liu et al., GLOBECOM 2023; FedLDF's reference [6]): each client uploads only the neurons
it keeps, with a pruning ratio chosen per layer, adaptively. A reading, not a reproduction.

What is known. FedADP's paper could not be found: not its text, nor an abstract beyond its title, nor
code (searched by title, authors, "FedADP"/"Fedadp" with pruning, GLOBECOM 2023; the issue that asked
for it names "Wu et al.", a name under which no pruning FedADP turned up either; "FedAdp" of Wu and
Wang, IEEE TCCN 2021, is a different method, adaptive aggregation weights from gradient angles).
FedLDF describes it as "dynamically determines the pruning ratio of each layer of the client" (section
I) and as "adaptive pruning with the neuron as the smallest pruning unit" (section III.A), and compares
it at a pruning ratio set "to get the same communication overhead" as FedLDF. Everything below beyond
those sentences is our reading, chosen so that FedLDF's comparison (Figs. 3-4: test error against
uplink bytes) can be run and the global model stays a model.

The reading.
  * Down: the global model, as FedAvg (FedLDF's figures count the uplink only).
  * Each sampled client trains the whole model from it, as FedAvg.
  * Neuron scores: the update of unit i of layer l is Delta_li = the change of its incoming
    weights (its kernel slice); its score is their root mean square, sqrt(mean_j Delta_lij^2),
    a per-weight size, comparable between layers of different fan-in.
  * Adaptive per-layer ratio: the client keeps the highest-scored neurons of the whole model,
    whatever their layer, until their weights (fan-in each) reach `upload_keep` x the model's
    prunable weights. A layer whose neurons moved more keeps more of them; the ratios of the
    layers are the outcome, their weighted mean is `upload_keep` (less at most one neuron).
  * Up: the kept neurons, each with its whole incoming weights, its bias and its normalization's
    scale and shift, as unit-structured sparse leaves (`core.messages.pricing.unit_sparse` with
    `inputs=False`: a layer's kept-unit index paid once, then the values); and the BatchNorm
    running statistics of every unit, dense (2 float32s a unit: about 0.4 % of the upload on
    SpaFL's CNN at 0.2).
  * Server: per weight entry, the data-weighted mean over the clients that sent it, and the server
    optimizer's step toward it (sgd at lr 1 by default: the mean replaces the entry); an entry
    nobody sent keeps its value. The running statistics: the data-weighted mean over all the
    round's clients, as FedAvg's.
Why the statistics travel whole. A unit's running statistics describe its input as the whole
network upstream of it computes it, so they go stale whenever an upstream unit changes, whether
or not the unit itself is pruned from the upload. Sent only with their units (our first reading),
they kept the initial mean 0 and variance 1 for every unit no client had sent, and those units
fed unnormalized activations to the global model at evaluation: on the CPU-sized CIFAR-10 (SpaFL's
CNN, 10 clients a round at 0.2) 92 % of conv4's units had no sender in round 1 (the most-moved
neurons are conv1-conv3's), and the global model stayed at chance (0.10 after 25 rounds, one seed
0.075). With every unit's statistics averaged, the same run ends at 0.26, FedAvg's 0.27; also
averaging a unit's weights over every client, unsent ones counting as the global value (pruned
models filled from the global model before a plain mean), did not help (0.12), nor scoring by the
relative change ||Delta_i|| / ||w_i|| (0.23). Models without BatchNorm send no statistics.
Equal communication. FedLDF uploads n/K of the model copies (n = 4 of K = 20: 20 %) plus its
layer feedback; "pruning ratio 0.2" is read as 20 % of the weights *kept*, the ratio that makes
the uplinks equal (the other reading, 20 % removed, would upload four times more than FedLDF), so
`upload_keep` defaults to 0.2; set it to n/K for another FedLDF setting. The statistics add to
that budget as FedLDF's feedback adds to its n/K.
Per-round client figure: `upload_ratio`, the kept share of the prunable weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.core.messages.aggregation import mean_of_sent, weighted_mean
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm
from fedjax_sparse.core.messages.pricing import unit_sparse
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import ServerOptimizerOptions, from_options
from fedjax_sparse.models.structure import ModelStructure, get_path


@dataclasses.dataclass(frozen=True)
class FedADPOptions(ServerOptimizerOptions):
    upload_keep: float = option(0.2, "FedADP: the share of the model's weights each client uploads (its kept "
                                     "neurons'); 0.2 = FedLDF's n/K, equal uplinks", low=0.0, low_open=True, high=1.0)


def neuron_update_scores(structure: ModelStructure, new: dict, old: dict) -> dict[str, jax.Array]:
    """{layer: [units]}: the root mean square of each unit's incoming-weight update."""
    out = {}
    for layer in structure.layers:
        delta = get_path(new, layer.kernel) - get_path(old, layer.kernel)
        out[layer.name] = jnp.sqrt(jnp.mean(delta.reshape(-1, layer.num_units) ** 2, axis=0))
    return out


def keep_within_budget(structure: ModelStructure, scores: dict[str, jax.Array], keep: float) -> dict[str, jax.Array]:
    """{layer: [units] float 0/1}: the highest-scored units of all layers, taken in order of score
    while their weights (fan-in each) stay within `keep` x the prunable weights. Ties: the
    earlier layer, then the lower unit."""
    flat = jnp.concatenate([scores[l.name] for l in structure.layers])
    cost = jnp.asarray(np.concatenate([np.full(l.num_units, l.fan_in, np.int32) for l in structure.layers]))
    order = jnp.argsort(-flat, stable=True)
    within = jnp.cumsum(cost[order]) <= int(keep * structure.num_prunable_weights)
    kept = jnp.zeros(flat.shape, jnp.float32).at[order].set(within.astype(jnp.float32))
    bounds = np.cumsum([0] + [l.num_units for l in structure.layers])
    return {l.name: kept[bounds[i]:bounds[i + 1]] for i, l in enumerate(structure.layers)}


def upload_ratio(structure: ModelStructure, masks: dict[str, jax.Array]) -> jax.Array:
    """Kept weights / prunable weights: the mean of the layers' kept ratios, weighted by their weights."""
    return sum(jnp.sum(masks[l.name]) * l.fan_in for l in structure.layers) / structure.num_prunable_weights


def fedadp(context: BuildContext, options: FedADPOptions) -> FederatedAlgorithm:
    local = context.local
    structure = local.model.structure
    if not structure.layers:
        raise ValueError(f"fedadp prunes neurons of a model's prunable layers; {local.model.name} has none")
    server = from_options(options)
    base = fedavg(local, server=server)

    def client_update(down, client_state, data, key, info):
        trained, client_state, stats = base.client_update(down, client_state, data, key, info)
        scores = neuron_update_scores(structure, trained["params"], down["params"])
        masks = keep_within_budget(structure, scores, options.upload_keep)
        up = {"params": unit_sparse(structure, {"params": trained["params"]}, masks, inputs=False)["params"],
              "batch_stats": trained["batch_stats"]}
        return up, client_state, {**stats, "upload_ratio": upload_ratio(structure, masks)}

    def server_update(server_state, ups, weights, info):
        params, held = mean_of_sent({"params": ups["params"]}, weights, {"params": server_state["variables"]["params"]},
                                    info.participating)
        return server.step_toward(server_state, {**params, "batch_stats": weighted_mean(ups["batch_stats"], weights)},
                                  held)

    return dataclasses.replace(base, name="fedadp", client_update=client_update, server_update=server_update,
                               stale_upload=None, aggregates_mean=False)


SPEC = AlgorithmSpec("fedadp", FedADPOptions, fedadp,
                     "FedADP (a reading): each client uploads the neurons that moved most, layer ratios adaptive")
