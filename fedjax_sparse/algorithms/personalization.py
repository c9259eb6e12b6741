"""Personal layers for any algorithm that sends the model: FedPer's predictor or FedBN's normalization kept on
each client, as one wrapper around the algorithm's own functions.

`personal=predictor` (FedPer, Arivazhagan et al. 2019): the layers the model's structure names its
predictor (`Layer.part`; a model no paper splits: its output layer) stay on each client.
`personal=norm` (FedBN, Li et al. 2021): every normalization layer's scale, shift and running
statistics stay on each client.
The personal leaves never travel: the broadcast leaves them out, a client puts its own in place
(its initial ones until it first trains), trains the whole model as the algorithm does, keeps the
personal leaves it trained and uploads the rest; the server sees its own current values in their
place, so its rule leaves them as they were (a mean of equal values, to float rounding). Each client is evaluated with its personal leaves over
the algorithm's model (`client_variables`); the global model, if the algorithm has one, keeps the
personal leaves it started with.

Applies to algorithms whose broadcast and upload are the model's variables ({'params',
'batch_stats'}: FedAvg, FedProx, FedDyn); one clear line for the others, HDFL included (its server
chooses which layers its clients upload after they answer, and could choose a personal one). The
wrapped client state is {'inner': the algorithm's, 'personal': ...}; the algorithm's functions of
client states read their own part (`reading_inner_state`), so `--uplink-compression` may wrap this.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_sparse.core.contract.algorithm import MODEL_UPLOAD, BuildContext, FederatedAlgorithm, replicate
from fedjax_sparse.core.structure.layer_groups import model_layer_groups
from fedjax_sparse.core.structure.model_parts import overlay, part_labels, take_part
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.core.contract.wrapping import broadcast_shapes, flat_leaves, reading_inner_state, upload_shapes

tree_map = jax.tree_util.tree_map
PERSONAL = ("none", "predictor", "norm")


@dataclasses.dataclass(frozen=True)
class PersonalizationOptions:
    OPTION_GROUP = "compression"  # the command line's help group (`core.contract.options.option_group`)

    personal: str = option("none", "keep these layers on each client, never sent: predictor (FedPer) or norm "
                                   "(FedBN's normalization layers)", choices=PERSONAL)


def personal_labels(model, personal: str):
    """A tree shaped like the model's variables: 'personal' or 'shared' per leaf."""
    if personal == "predictor":
        parts = part_labels(model)
        predictor = "predictor" if "predictor" in jax.tree_util.tree_leaves(parts) else None
        last = len(model.structure.layers) - 1
        groups = model_layer_groups(model)
        return tree_map(lambda part, layer: "personal" if (part == predictor if predictor else layer == last)
                        else "shared", parts, groups.index)
    structure = model.structure
    norms = {layer.norm for layer in structure.layers if layer.norm is not None}
    shapes = jax.eval_shape(model.init, jax.random.key(0))

    def label(path, _):
        keys = tuple(str(e.key) for e in path)
        return "personal" if any(keys[1:1 + len(n)] == n for n in norms) else "shared"

    return jax.tree_util.tree_map_with_path(label, shapes)


def personalize(algorithm: FederatedAlgorithm, context: BuildContext, options: PersonalizationOptions
                ) -> FederatedAlgorithm:
    """`algorithm` with the personal leaves `options.personal` names kept on each client (module docstring)."""
    if options.personal == "none":
        return algorithm
    model = context.local.model
    flag = f"--personal {options.personal}"
    variables = jax.eval_shape(model.init, jax.random.key(0))
    if algorithm.select_uploads is not None:
        raise ValueError(f"{flag}: {algorithm.name}'s server chooses what its clients upload after they answer; "
                         f"personal layers apply to algorithms that send the model's variables both ways (fedavg, "
                         f"fedprox, feddyn)")
    structure_of = jax.tree_util.tree_structure
    if structure_of(broadcast_shapes(algorithm, context)) != structure_of(variables) or \
            structure_of(upload_shapes(algorithm, context)) != structure_of(variables):
        raise ValueError(f"{flag}: {algorithm.name} does not send the model's variables both ways; personal layers "
                         f"apply to algorithms that do (fedavg, fedprox, feddyn)")
    labels = personal_labels(model, options.personal)
    if "personal" not in jax.tree_util.tree_leaves(labels):
        raise ValueError(f"{flag}: {model.name} has no {options.personal} layers to keep on the clients")

    def shared(tree):  # every collection stays, empty where all of it is personal (a model still reads it)
        part = take_part(tree, labels, "shared")
        return {collection: part.get(collection, {}) for collection in tree}

    def init_clients(key, variables, ids):
        inner = algorithm.init_clients(key, variables, ids) if algorithm.init_clients is not None else {}
        return {"inner": inner, "personal": replicate(take_part(variables, labels, "personal"), len(ids))}

    def init(key, variables, n):
        server_state, _ = algorithm.init(key, variables, n)
        return server_state, init_clients(key, variables, jnp.arange(n))

    def client_update(down, state, data, key, info):
        up, inner, metrics = algorithm.client_update(overlay(down, state["personal"]), state["inner"], data, key, info)
        return shared(up), {"inner": inner, "personal": take_part(up, labels, "personal")}, metrics

    def server_update(server_state, ups, weights, info):  # the server's own values where nothing was sent
        own = jax.vmap(lambda c: algorithm.broadcast(server_state, c, info))(info.client_ids)
        return algorithm.server_update(server_state, overlay(own, ups), weights, info)

    def client_variables(server_state, state):
        return overlay(algorithm.client_variables(server_state, state["inner"]), state["personal"])

    # the shared part both ways: an elementwise increment of the model still is one of its shared part
    stale_upload = algorithm.stale_upload if algorithm.stale_upload is MODEL_UPLOAD else None
    declared = algorithm.private_sum
    if declared is not None and declared.clip_layers is not None:  # the personal leaves are no longer uploaded
        sent = set(flat_leaves(shared(variables)))
        declared = dataclasses.replace(declared, clip_layers=tuple((p, layer) for p, layer in declared.clip_layers
                                                                   if p in sent))
    return dataclasses.replace(
        algorithm, init=init, init_clients=init_clients, client_update=client_update, server_update=server_update,
        stale_upload=stale_upload, private_sum=declared,
        broadcast=lambda server_state, client_id, info: shared(algorithm.broadcast(server_state, client_id, info)),
        **{**reading_inner_state(algorithm), "client_variables": client_variables})
