"""What a wrapper around an algorithm needs (uplink compression, personal layers, differential privacy).

A wrapper keeps the algorithm's own math and changes what travels: it reads the algorithm's messages as
shapes (`broadcast_shapes`, `upload_shapes`), takes an upload apart into the client's changes of what the
server sent and the rest (`UploadChanges`), and hands the evaluations the algorithm's own part of a
wrapped client state (`reading_inner_state`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.core.algorithm import BuildContext, FederatedAlgorithm
from fedjax_sparse.core.round import round_info
from fedjax_sparse.data.federated import ClientData

tree_map = jax.tree_util.tree_map


def flat_leaves(tree: Any) -> dict[str, Any]:
    """{'a/b/c': leaf} of a pytree of dicts."""
    return {"/".join(str(getattr(e, "key", e)) for e in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def reading_inner_state(algorithm: FederatedAlgorithm) -> dict:
    """`algorithm`'s functions of client states, given a wrapper's client states {'inner': the algorithm's,
    ...}: the evaluations hand them the wrapper's, and the algorithm knows only its own (a KeyError at the
    first evaluation otherwise)."""
    readers = {"client_variables": lambda server_state, state: algorithm.client_variables(server_state,
                                                                                          state["inner"])}
    if algorithm.client_diagnostics is not None:
        readers["client_diagnostics"] = lambda server_state, states: algorithm.client_diagnostics(server_state,
                                                                                                  states["inner"])
    if algorithm.evaluation_clients is not None:
        readers["evaluation_clients"] = lambda server_state, states: {
            **states, "inner": algorithm.evaluation_clients(server_state, states["inner"])}
    return readers


def _shapes(algorithm: FederatedAlgorithm, context: BuildContext):
    """(server state, one client's state, round info) of `algorithm`, as shapes."""
    variables = jax.eval_shape(context.local.model.init, jax.random.key(0))
    server, clients = jax.eval_shape(lambda v: algorithm.init(jax.random.key(0), v, context.num_clients), variables)
    one = tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), clients)
    return server, one, round_info(0, 0, jnp.zeros((1,), jnp.int32))


def broadcast_shapes(algorithm: FederatedAlgorithm, context: BuildContext) -> Any:
    server, _, info = _shapes(algorithm, context)
    return jax.eval_shape(lambda s: algorithm.broadcast(s, jnp.int32(0), info), server)


def upload_shapes(algorithm: FederatedAlgorithm, context: BuildContext) -> Any:
    """The shapes of a client's upload (a one-example client stands in for every client)."""
    server, one, info = _shapes(algorithm, context)
    model = context.local.model
    shape = model.input_shape
    example = jnp.int32 if model.input_kind == "tokens" else jnp.uint8  # token ids, or an image's bytes
    data = ClientData(x=jnp.zeros((1, *shape), example), y=jnp.zeros((1,), jnp.int32), offset=jnp.int32(0),
                      count=jnp.int32(1), mean=jnp.zeros(shape[-1:]), std=jnp.ones(shape[-1:]), max_count=1)
    return jax.eval_shape(lambda s, c: algorithm.client_update(algorithm.broadcast(s, jnp.int32(0), info), c, data,
                                                               jax.random.key(0), info)[0], server, one)


@dataclasses.dataclass(frozen=True)
class UploadChanges:
    """An upload as the client's changes: `paths` are the leaves taken; a leaf the server sent at the same
    path, shape and dtype (`referenced`: a model upload, FedAvg's variables) is taken as upload - broadcast,
    and rebuilt by the server as broadcast + change (it knows what it sent); any other (SCAFFOLD's delta,
    a control variate) is already a change and is taken as it is."""

    paths: tuple[str, ...]
    referenced: frozenset[str]
    structure: Any  # the upload's treedef
    order: tuple[str, ...]  # every leaf's path, in the treedef's order

    def split(self, up: Any, down: Any) -> tuple[dict, dict]:
        """(the changes {path: leaf}, the other leaves {path: leaf}) of one upload or of stacked ones."""
        flat_up, flat_down = flat_leaves(up), flat_leaves(down)
        return ({p: flat_up[p] - flat_down[p] if p in self.referenced else flat_up[p] for p in self.paths},
                {p: x for p, x in flat_up.items() if p not in self.paths})

    def rebuild(self, changes: dict, rest: dict, down: Any) -> Any:
        """The upload of these changes, given the broadcast they are changes of."""
        flat_down = flat_leaves(down)
        leaves = {**rest, **{p: changes[p] + flat_down[p] if p in self.referenced else changes[p] for p in changes}}
        return jax.tree_util.tree_unflatten(self.structure, [leaves[p] for p in self.order])


def upload_changes(up_shape: Any, down_shape: Any, take: Callable[[str, Any], bool]) -> UploadChanges:
    """The `UploadChanges` of an upload shaped `up_shape` (`upload_shapes`) whose leaves `take(path, leaf)`
    selects, given the broadcast's shapes."""
    up_leaves, down_leaves = flat_leaves(up_shape), flat_leaves(down_shape)
    paths = tuple(sorted(p for p, leaf in up_leaves.items() if take(p, leaf)))
    referenced = frozenset(p for p in paths if p in down_leaves and (down_leaves[p].shape, down_leaves[p].dtype)
                           == (up_leaves[p].shape, up_leaves[p].dtype))
    return UploadChanges(paths, referenced, jax.tree_util.tree_structure(up_shape), tuple(up_leaves))
