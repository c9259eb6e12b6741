"""FedP3 (Yi et al., ICLR 2024) with OPU2: each client uploads two assigned layers, the server prunes
what it sends down, and the rest of the model stays on the client.

Sources: the paper (its abstract and algorithm summary: "dual pruning", a global pruning from
server to client and a local, client-specific pruning; clients send back only selected layers;
its full text was not available to this reading, so where the paper's details are cited below
they are from that summary), the official code (SonyResearch/FedP3 at 84e1e96: `main.py`,
`models/distributed_training_utils.py`, `utils/options.py`, cited file:line), and SpaFL's
appendix A.1.1, which ran FedP3 as a baseline ("OPU2"; "for the pruning methods, we adopted the
ordered dropout"). Where they disagree an option chooses; the defaults are the code's.

Layers. The model's structure layers; the last (the classifier) never travels down (the code
synchronizes only the non-final layers, `synchronize_with_server`, :322-333). The other
L' = L - 1 layers are shared; a layer travels with its bias and its normalization, statistics
included (`core.structure.layer_groups`).

Assignment (OPU2, "uniformly selects two layers for clients from the entire network"). The
official code gives client id the layers d1 = floor(id / 25) and d2 = (d1 + 1) mod 4, for its 100
clients and 4 shared layers (main.py:170-174). Generalised to N clients and any depth:
d1 = floor(id L' / N) and d2 = (d1 + 1) mod L', so the clients split into L' equal blocks of
consecutive ids, block d holding layers d and d + 1, and every shared layer is assigned to
2N / L' clients (one layer when L' = 1). A pure function of the id, so it holds under partial
participation: a round's uploads cover the layers its sampled clients hold, and a layer no
sampled client holds keeps its value.

Down (the global pruning). The global model's shared layers: a client's two assigned layers
whole, every other shared layer pruned to `downlink_keep`, by `fedp3_downlink`:
  * `magnitude` (default, the code): each kernel keeps its ceil(p n) entries of largest
    magnitude (`core.messages.compression.top_k`, ties to the lower index), unstructured; the code's
    `sparsity` (distributed_training_utils.py:280-320) keeps torch.topk's int(p n), at most one
    entry fewer per kernel, at `global_prune` = 0.9 (utils/options.py:46), the default p. Biases
    travel whole, as in the code, and so do normalization scales, biases and statistics (the
    code's networks have none). The receiver cannot know a magnitude mask, so a pruned kernel
    pays its index (`SparseArray`: values plus the cheaper of a bitmask and an index list);
    a leaf sent whole costs its values, as a dense one.
  * `ordered_dropout` (SpaFL A.1.1: "pruning uses ordered dropout"): the layer's first
    ceil(p N) units, [0, ceil(p N)), the prefix HeteroFL and Fjord keep. Both sides know the
    assignment and the keep ratio, so the message costs its values only (`KnownMaskArray`).
    SpaFL does not state its keep ratio; its Table 2 reading here takes 0.5, its target density.

Client model after the download (`fedp3_client_model`).
  * `server` (default): every shared layer becomes what the server sent, entries not sent zero;
    only the classifier keeps the client's own values. This is the code (`synchronize_with_server`
    overwrites each non-final layer with the server's tensor or its pruned copy, :327-333), and
    the paper's: a client trains the pruned model it receives.
  * `own`: what is sent replaces those entries; the entries not sent (the pruned entries or
    dropped units of the other layers) and the classifier keep the client's own values, a reading
    of SpaFL's "clients personalize the remaining layers" (this module's reading before).

Local pruning (`fedp3_local_keep`, the paper's client-side half of its dual pruning; the code
has none: `train_cnn`, :345-640, trains every entry, and `sparsity` is called only from
`synchronize_with_server`). The paper's criterion and ratio are not known here, so this is our
reading, off by default (1, the code): after the download, each kernel of the client's model
keeps its ceil(q n) entries of largest magnitude (the code's one pruning criterion), the others
become zero and stay zero through local training (`LocalObjective.update_mask`, momentum
included). The client's upload then holds only its kept entries, with their index
(`SparseArray`: the server does not know a local mask), so an entry a client pruned does not
pull the server's mean toward zero.

Client. It trains its whole model (the code trains every layer), keeps it, and uploads its two
assigned layers and, with `fedp3_upload_classifier` (default, the code), its classifier: the
code appends the final layer to every client's upload list (main.py:194-196) and the server
averages every layer in any uploader's list (`Server.aggregate_weight_updates_subset`,
:838-876), the classifier over all of them; it never sends it back and, for OPU2, never evaluates
the server's model (main.py:230-232), so the classifier is paid for and averaged but unused, as
here. SpaFL: "clients only upload these chosen layers" (`fedp3_upload_classifier=False`).

Server. Per entry, the data-weighted mean over the clients that uploaded it (the code takes a
plain mean; the library's masked mean weighs by data size like FedAvg), and the server
optimizer's step toward it (sgd at lr 1 by default: the mean replaces the entry).

SpaFL's Table 2 reading: `fedp3_downlink=ordered_dropout downlink_keep=0.5
fedp3_client_model=own fedp3_upload_classifier=False` (and no local pruning).

Evaluation: each client's own model on its own test split; FedP3 has no global model (its
classifier is personal). Per-round client figures: `upload_weight_fraction` and
`download_weight_fraction` (kernel weights in the message / the model's prunable weights,
SpaFL's way of counting), and `train_flops`: the dense model's (every entry trains, the pruned
downlink entries too, from zero), or with local pruning each layer's dense count times its
kernel's kept share (SpaFL's A.5 convention for a sparse layer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.messages.aggregation import mean_of_sent
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm, replicate
from fedjax_sparse.core.messages.compression import top_k
from fedjax_sparse.core.structure.flops import forward_flops, layer_forward_flops
from fedjax_sparse.core.structure.layer_groups import model_layer_groups
from fedjax_sparse.core.round.local_training import LocalObjective
from fedjax_sparse.core.messages.pricing import Known, KnownMaskArray, SparseArray
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import ServerOptimizerOptions, from_options
from fedjax_sparse.core.structure.unit_masks import variable_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores
from fedjax_sparse.models.structure import ModelStructure, get_path, set_path

tree_map = jax.tree_util.tree_map
DOWNLINKS = ("magnitude", "ordered_dropout")
CLIENT_MODELS = ("server", "own")


@dataclasses.dataclass(frozen=True)
class FedP3Options(ServerOptimizerOptions):
    fedp3_downlink: str = option("magnitude", "FedP3: how the server prunes each shared layer a client is not "
                                              "assigned: magnitude (the official code: each kernel's largest "
                                              "entries, index paid) or ordered_dropout (SpaFL: the first units)",
                                 choices=DOWNLINKS)
    downlink_keep: float = option(0.9, "FedP3: the share the downlink pruning keeps, of each kernel's entries "
                                       "(magnitude; the code's global_prune 0.9) or of each layer's units "
                                       "(ordered_dropout)", low=0.0, low_open=True, high=1.0)
    fedp3_client_model: str = option("server", "FedP3: a client's shared layers after the download: server (the "
                                               "code: the server's values, entries not sent zero) or own (entries "
                                               "not sent keep the client's values)", choices=CLIENT_MODELS)
    fedp3_local_keep: float = option(1.0, "FedP3: the share of each kernel's entries a client keeps by local "
                                          "magnitude pruning before training (the paper's local pruning; 1: none, "
                                          "the code)", low=0.0, low_open=True, high=1.0)
    fedp3_upload_classifier: bool = option(True, "FedP3: clients also upload the classifier, averaged but never "
                                                 "sent down (the code); off: only the two assigned layers (SpaFL)")


def assigned_layers(client_id: jax.Array, num_clients: int, num_shared: int) -> jax.Array:
    """[num_shared] bool: OPU2's two layers of a client, d1 = floor(id L' / N), d2 = (d1 + 1) mod L'."""
    first = jnp.minimum(client_id * num_shared // num_clients, num_shared - 1)
    layers = jnp.arange(num_shared)
    return (layers == first) | (layers == (first + 1) % num_shared)


def kernel_fraction(structure: ModelStructure, entries: dict) -> jax.Array:
    """The prunable layers' kernel entries in `entries` (bools shaped like the variables) / all of them."""
    kept = sum(jnp.sum(get_path(entries["params"], l.kernel)) for l in structure.layers)
    return kept / structure.num_prunable_weights


def magnitude_entries(structure: ModelStructure, variables: dict, keep: float) -> dict:
    """Bools shaped like `variables`: each prunable layer's kernel at its ceil(keep n) entries of largest
    magnitude (`core.messages.compression.top_k`), every other leaf whole."""
    kernels = {l.name: get_path(variables["params"], l.kernel) for l in structure.layers}
    kept = tree_map(lambda leaf: leaf.mask, top_k(kernels, keep), is_leaf=lambda x: isinstance(x, SparseArray))
    entries = tree_map(lambda x: jnp.ones(jnp.shape(x), bool), variables)
    params = entries["params"]
    for layer in structure.layers:
        params = set_path(params, layer.kernel, kept[layer.name])
    return {**entries, "params": params}


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
    magnitude = options.fedp3_downlink == "magnitude"
    od_masks = None if magnitude else keep_top_units(structure, prefix_scores(structure), options.downlink_keep)
    # the receiver learns a magnitude mask from the message, an ordered-dropout one it knows already
    down_leaf = SparseArray if magnitude else KnownMaskArray
    local_pruning = options.fedp3_local_keep < 1.0
    up_leaf = SparseArray if local_pruning else KnownMaskArray
    shared = np.arange(groups.num_layers) < num_shared
    uploaded_always = ~shared if options.fedp3_upload_classifier else np.zeros_like(shared)
    dense_forward = float(forward_flops(structure))
    layer_flops = layer_forward_flops(structure)

    def layer_entries(per_layer, like):
        return groups.expand(jnp.asarray(per_layer), like)

    def assignment(client_id):
        """[L] bool over the structure layers: the client's two shared layers (never the classifier)."""
        return jnp.concatenate([assigned_layers(client_id, num_clients, num_shared), jnp.zeros((1,), bool)])

    def downlink_pruned(variables):
        """What the downlink keeps of a shared layer the client is not assigned (bools like `variables`)."""
        if magnitude:
            return magnitude_entries(structure, variables, options.downlink_keep)
        return variable_masks(structure, variables, od_masks)

    def init_clients(key, variables, ids):
        del key
        return replicate(variables, len(ids))

    def init(key, variables, n):
        return server.init_state(variables), init_clients(key, variables, jnp.arange(n))

    def broadcast(server_state, client_id, info):
        variables = server_state["variables"]
        assigned = assignment(client_id)
        whole = layer_entries(assigned, variables)
        other = layer_entries(jnp.asarray(shared) & ~assigned, variables)
        sent = tree_map(lambda w, o, p: w | (o & p), whole, other, downlink_pruned(variables))
        return {"variables": tree_map(down_leaf, variables, sent), "assigned": Known(assigned)}

    def client_update(down, client_state, data, key, info):
        is_sent = lambda x: isinstance(x, (SparseArray, KnownMaskArray))  # noqa: E731
        sent_down = tree_map(lambda leaf: leaf.mask, down["variables"], is_leaf=is_sent)
        if options.fedp3_client_model == "server":
            received = tree_map(lambda leaf, own, replaced: jnp.where(replaced, leaf.dense(), own),
                                down["variables"], client_state, layer_entries(shared, client_state), is_leaf=is_sent)
        else:
            received = tree_map(lambda leaf, own: jnp.where(leaf.mask, leaf.values, own), down["variables"],
                                client_state, is_leaf=is_sent)
        up_entries = layer_entries(down["assigned"].value | uploaded_always, received)
        objective, per_example = None, dense_forward
        if local_pruning:
            kept = magnitude_entries(structure, received, options.fedp3_local_keep)
            received = tree_map(lambda k, x: jnp.where(k, x, jnp.zeros_like(x)), kept, received)
            objective = LocalObjective(update_mask=kept)
            up_entries = tree_map(jnp.logical_and, up_entries, kept)
            per_example = sum(layer_flops[l.name] * jnp.mean(get_path(kept["params"], l.kernel))
                              for l in structure.layers)
        trained, stats = local.train(received, data, key, round_index=info.index, objective=objective)
        examples = (data.count * local.epochs).astype(jnp.float32)
        metrics = {**stats, "upload_weight_fraction": kernel_fraction(structure, up_entries),
                   "download_weight_fraction": kernel_fraction(structure, sent_down),
                   "train_flops": 3.0 * per_example * examples}
        return tree_map(up_leaf, trained, up_entries), trained, metrics

    def server_update(server_state, ups, weights, info):
        mean, held = mean_of_sent(ups, weights, server_state["variables"], info.participating)
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
                     "FedP3 (OPU2): two assigned layers (and the classifier) up, a pruned model down, the rest "
                     "on the client")
