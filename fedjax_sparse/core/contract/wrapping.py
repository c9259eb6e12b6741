"""What a wrapper around an algorithm needs (uplink compression, personal layers, differential privacy).

A wrapper keeps the algorithm's own math and changes what travels: it reads the algorithm's messages as
shapes (`broadcast_shapes`, `upload_shapes`), takes an upload apart into the client's changes of what the
server sent and the rest (`UploadChanges`), and hands the evaluations the algorithm's own part of a
wrapped client state (`reading_inner_state`). A priced message leaf (`core.messages.pricing`: a sparse leaf, a
quantized one) is one leaf here, not its parts; a sparse leaf's change is that of its values, its mask
(what it sends) kept.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from fedjax_sparse.core.contract.algorithm import BuildContext, FederatedAlgorithm
from fedjax_sparse.core.messages.pricing import PRICED_LEAVES, KnownMaskArray, SparseArray
from fedjax_sparse.core.round.step import round_info
from fedjax_sparse.data.federated import ClientData

tree_map = jax.tree_util.tree_map


def _is_message_leaf(x) -> bool:
    return isinstance(x, PRICED_LEAVES)


def flat_leaves(tree: Any) -> dict[str, Any]:
    """{'a/b/c': leaf} of a pytree of dicts (a priced message leaf is one leaf)."""
    return {"/".join(str(getattr(e, "key", e)) for e in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_message_leaf)[0]}


def on_values(f: Callable[[jax.Array], jax.Array], leaf: Any) -> Any:
    """`f` of an array, or of a sparse leaf's values (its mask kept)."""
    return leaf.replace(values=f(leaf.values)) if isinstance(leaf, (SparseArray, KnownMaskArray)) else f(leaf)


def _shape_dtype(leaf: Any) -> tuple | None:
    leaf = leaf.values if isinstance(leaf, (SparseArray, KnownMaskArray)) else leaf
    return None if _is_message_leaf(leaf) else (leaf.shape, leaf.dtype)


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


# (what, id(algorithm), id(context)) -> (weak references to both, the shapes). A wrapper, the contract check,
# the privacy ledger and the run each ask for the same algorithm's shapes, and tracing its local training costs
# seconds on the larger models; the algorithm and the context are frozen and their functions pure, so what a
# pair traced once is what it traces again. An entry goes when either object does.
_TRACED: dict[tuple[str, int, int], tuple[weakref.ref, weakref.ref, Any]] = {}


def _traced_once(what: str, algorithm: FederatedAlgorithm, context: BuildContext, trace: Callable[[], Any]) -> Any:
    key = (what, id(algorithm), id(context))
    known = _TRACED.get(key)
    if known is not None and known[0]() is algorithm and known[1]() is context:
        return known[2]
    shapes = trace()

    def forget(_, key=key):
        _TRACED.pop(key, None)

    _TRACED[key] = (weakref.ref(algorithm, forget), weakref.ref(context, forget), shapes)
    return shapes


def state_shapes(algorithm: FederatedAlgorithm, context: BuildContext) -> tuple[Any, Any]:
    """(server state, one client's state) of `algorithm`'s `init`, as shapes (traced once per algorithm and
    context); a stateless algorithm's client state has no leaves."""
    def trace():
        variables = jax.eval_shape(context.local.model.init, jax.random.key(0))
        server, clients = jax.eval_shape(lambda v: algorithm.init(jax.random.key(0), v, context.num_clients),
                                         variables)
        return server, tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), clients)

    return _traced_once("state", algorithm, context, trace)


def _shapes(algorithm: FederatedAlgorithm, context: BuildContext):
    """(server state, one client's state, round info) of `algorithm`, as shapes."""
    return *state_shapes(algorithm, context), round_info(0, 0, jnp.zeros((1,), jnp.int32))


def broadcast_shapes(algorithm: FederatedAlgorithm, context: BuildContext) -> Any:
    """The shapes of what the server sends a client (traced once per algorithm and context)."""
    server, _, info = _shapes(algorithm, context)
    return _traced_once("broadcast", algorithm, context,
                        lambda: jax.eval_shape(lambda s: algorithm.broadcast(s, jnp.int32(0), info), server))


def upload_shapes(algorithm: FederatedAlgorithm, context: BuildContext) -> Any:
    """The shapes of a client's upload (a one-example client stands in for every client; traced once per
    algorithm and context)."""
    server, one, info = _shapes(algorithm, context)
    model = context.local.model
    shape = model.input_shape
    example = jnp.int32 if model.input_kind == "tokens" else jnp.uint8  # token ids, or an image's bytes
    data = ClientData(x=jnp.zeros((1, *shape), example), y=jnp.zeros((1,), jnp.int32), offset=jnp.int32(0),
                      count=jnp.int32(1), mean=jnp.zeros(shape[-1:]), std=jnp.ones(shape[-1:]), max_count=1)
    return _traced_once("upload", algorithm, context, lambda: jax.eval_shape(
        lambda s, c: algorithm.client_update(algorithm.broadcast(s, jnp.int32(0), info), c, data, jax.random.key(0),
                                             info)[0], server, one))


@dataclasses.dataclass(frozen=True)
class UploadChanges:
    """An upload as the client's changes: `paths` are the leaves taken; a leaf the server sent at the same
    path (or the path `references` maps it to), shape and dtype (a model upload, FedAvg's variables) is taken
    as upload - broadcast, and rebuilt by the server as broadcast + change (it knows what it sent); any other
    (SCAFFOLD's delta, a control variate) is already a change and is taken as it is."""

    paths: tuple[str, ...]
    references: dict[str, str]  # {upload path: the broadcast path it is a new value of}
    structure: Any  # the upload's treedef
    order: tuple[str, ...]  # every leaf's path, in the treedef's order

    def split(self, up: Any, down: Any) -> tuple[dict, dict]:
        """(the changes {path: leaf}, the other leaves {path: leaf}) of one upload or of stacked ones."""
        flat_up, flat_down = flat_leaves(up), flat_leaves(down)
        return ({p: on_values(lambda x: x - flat_down[self.references[p]], flat_up[p]) if p in self.references
                 else flat_up[p] for p in self.paths},
                {p: x for p, x in flat_up.items() if p not in self.paths})

    def rebuild(self, changes: dict, rest: dict, down: Any) -> Any:
        """The upload of these changes, given the broadcast they are changes of."""
        flat_down = flat_leaves(down)
        leaves = {**rest, **{p: on_values(lambda x: x + flat_down[self.references[p]], changes[p])
                             if p in self.references else changes[p] for p in changes}}
        return jax.tree_util.tree_unflatten(self.structure, [leaves[p] for p in self.order])


def _referenced(path: str, prefixes: Sequence[tuple[str, str]]) -> list[str]:
    """The broadcast paths `path` may be a new value of: for each (upload prefix, broadcast prefix), the rest
    of `path` after the first, under the second."""
    out = []
    for up, down in prefixes:
        if up and not path.startswith(up + "/"):
            continue
        rest = path[len(up) + 1:] if up else path
        out.append(f"{down}/{rest}" if down else rest)
    return out


def upload_changes(up_shape: Any, down_shape: Any, take: Callable[[str, Any], bool],
                   prefixes: Sequence[tuple[str, str]] = (("", ""),)) -> UploadChanges:
    """The `UploadChanges` of an upload shaped `up_shape` (`upload_shapes`) whose leaves `take(path, leaf)`
    selects, given the broadcast's shapes. `prefixes`: (upload prefix, broadcast prefix) pairs under which an
    upload leaf may be a new value of a broadcast leaf (by default, at its own path)."""
    up_leaves, down_leaves = flat_leaves(up_shape), flat_leaves(down_shape)
    paths = tuple(sorted(p for p, leaf in up_leaves.items() if take(p, leaf)))
    references = {}
    for p in paths:
        like = _shape_dtype(up_leaves[p])
        matches = [d for d in _referenced(p, prefixes)
                   if like is not None and d in down_leaves and _shape_dtype(down_leaves[d]) == like]
        if matches:
            references[p] = matches[0]
    return UploadChanges(paths, references, jax.tree_util.tree_structure(up_shape, is_leaf=_is_message_leaf),
                         tuple(up_leaves))
