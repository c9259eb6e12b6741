"""FedP3 (Yi et al., ICLR 2024) in SpaFL's OPU2 setting: each client uploads two assigned layers,
the server prunes what it sends down by ordered dropout, and the rest of the model stays personal.

Layers. The model's structure layers; the last (the classifier) is personal and never travels
(the official code never downloads the final layer; SpaFL: "clients personalize the remaining
layers"). The other L' = L - 1 layers are shared; a layer travels with its bias and its
normalization, statistics included (`core.layer_groups`).

Assignment (OPU2, "uniformly selects two layers for clients from the entire network"). The
official code gives client id the layers d1 = floor(id / 25) and d2 = (d1 + 1) mod 4, for its 100
clients and 4 shared layers. Generalised to N clients and any depth: d1 = floor(id L' / N) and
d2 = (d1 + 1) mod L', so the clients split into L' equal blocks of consecutive ids, block d
holding layers d and d + 1, and every shared layer is assigned to 2N / L' clients (one layer when
L' = 1). A pure function of the id, so it holds under partial participation: a round's uploads
cover the layers its sampled clients hold, and a layer no sampled client holds keeps its value.

Down. The global model's shared layers: a client's two assigned layers whole, every other shared
layer as its ordered-dropout sub-model (`downlink_keep` of its units, [0, ceil(p N)), the
prefix HeteroFL and Fjord keep; SpaFL A.1.1: "pruning uses ordered dropout"; its keep ratio is not
stated, 0.5 is SpaFL's target density). Both sides know the assignment and the keep ratio, so a
message costs its values only (`KnownMaskArray`).

Client. What it receives replaces those entries of its own model; the entries not sent (the
dropped units of the other layers) and its classifier keep its own values: they are the personal
part ("the rest stays personal"). It trains its whole model (FedP3's code trains every layer),
keeps it, and uploads its two assigned layers, dense values at known positions.

Server. Per entry, the data-weighted mean over the clients that uploaded it (the code takes a
plain mean; the library's masked mean weighs by data size like FedAvg), and the server
optimizer's step toward it (sgd at lr 1 by default: the mean replaces the entry).

Evaluation: each client's own model on its own test split; FedP3 has no global model (its
classifier is personal). Per-round client figures: `upload_weight_fraction` and
`download_weight_fraction` (kernel weights in the message / the model's prunable weights,
SpaFL's way of counting), and `train_flops` (the dense model's: every layer trains).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.aggregation import mean_of_sent
from fedjax_sparse.core.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm, replicate
from fedjax_sparse.core.flops import forward_flops
from fedjax_sparse.core.layer_groups import model_layer_groups
from fedjax_sparse.core.messages import Known, KnownMaskArray
from fedjax_sparse.core.options import option
from fedjax_sparse.core.server_optimizer import ServerOptimizerOptions, from_options
from fedjax_sparse.core.unit_masks import variable_masks
from fedjax_sparse.core.unit_selection import keep_top_units, prefix_scores
from fedjax_sparse.models.structure import ModelStructure, get_path

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class FedP3Options(ServerOptimizerOptions):
    downlink_keep: float = option(0.5, "FedP3: the share of units (ordered dropout) the server sends of each shared "
                                       "layer a client is not assigned", low=0.0, low_open=True, high=1.0)


def assigned_layers(client_id: jax.Array, num_clients: int, num_shared: int) -> jax.Array:
    """[num_shared] bool: OPU2's two layers of a client, d1 = floor(id L' / N), d2 = (d1 + 1) mod L'."""
    first = jnp.minimum(client_id * num_shared // num_clients, num_shared - 1)
    layers = jnp.arange(num_shared)
    return (layers == first) | (layers == (first + 1) % num_shared)


def kernel_fraction(structure: ModelStructure, entries: dict) -> jax.Array:
    """The prunable layers' kernel entries in `entries` (bools shaped like the variables) / all of them."""
    kept = sum(jnp.sum(get_path(entries["params"], l.kernel)) for l in structure.layers)
    return kept / structure.num_prunable_weights


def fedp3(context: BuildContext, options: FedP3Options) -> FederatedAlgorithm:
    local = context.local
    model = local.model
    structure = model.structure
    num_shared = len(structure.layers) - 1
    if num_shared < 1:
        raise ValueError(f"fedp3 shares every layer but the classifier; {model.name} has "
                         f"{len(structure.layers)} prunable layer(s), it needs at least 2")
    groups = model_layer_groups(model)
    num_clients = context.num_clients
    server = from_options(options)
    od_masks = keep_top_units(structure, prefix_scores(structure), options.downlink_keep)
    shared = np.arange(groups.num_layers) < num_shared
    dense_forward = float(forward_flops(structure))

    def layer_entries(per_layer, like):
        return groups.expand(jnp.asarray(per_layer), like)

    def assignment(client_id):
        """[L] bool over the structure layers: the client's two shared layers (never the classifier)."""
        return jnp.concatenate([assigned_layers(client_id, num_clients, num_shared), jnp.zeros((1,), bool)])

    def init_clients(key, variables, ids):
        del key
        return replicate(variables, len(ids))

    def init(key, variables, n):
        return server.init_state(variables), init_clients(key, variables, jnp.arange(n))

    def broadcast(server_state, client_id, info):
        variables = server_state["variables"]
        assigned = assignment(client_id)
        pruned = variable_masks(structure, variables, od_masks)
        whole = layer_entries(assigned, variables)
        other = layer_entries(jnp.asarray(shared) & ~assigned, variables)
        sent = tree_map(lambda w, o, p: w | (o & p), whole, other, pruned)
        return {"variables": tree_map(KnownMaskArray, variables, sent), "assigned": Known(assigned)}

    def client_update(down, client_state, data, key, info):
        is_known = lambda x: isinstance(x, KnownMaskArray)  # noqa: E731
        received = tree_map(lambda leaf, own: jnp.where(leaf.mask, leaf.values, own), down["variables"],
                            client_state, is_leaf=is_known)
        sent_down = tree_map(lambda leaf: leaf.mask, down["variables"], is_leaf=is_known)
        trained, stats = local.train(received, data, key, round_index=info.index)
        up_entries = layer_entries(down["assigned"].value, trained)
        examples = (data.count * local.epochs).astype(jnp.float32)
        metrics = {**stats, "upload_weight_fraction": kernel_fraction(structure, up_entries),
                   "download_weight_fraction": kernel_fraction(structure, sent_down),
                   "train_flops": 3.0 * dense_forward * examples}
        return tree_map(KnownMaskArray, trained, up_entries), trained, metrics

    def server_update(server_state, ups, weights, info):
        del info
        mean, held = mean_of_sent(ups, weights, server_state["variables"])
        return server.step_toward(server_state, mean, held)

    return FederatedAlgorithm(
        name="fedp3",
        init=init,
        init_clients=init_clients,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        client_variables=lambda server_state, client_state: client_state,
        global_variables=None,
    )


SPEC = AlgorithmSpec("fedp3", FedP3Options, fedp3,
                     "FedP3 (OPU2): two assigned layers up, an ordered-dropout model down, the rest personal")
