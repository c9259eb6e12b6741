"""The algorithm contract checked before the first round, abstractly (`jax.eval_shape`: nothing is computed).

An algorithm written outside the library meets the engine only inside a jitted round, where a
mistake surfaces as a JAX error about prefix pytrees or a KeyError after the round ran. `check_contract`
evaluates `init`, `broadcast`, `client_update`, `select_uploads` and `server_update` on shapes and
refuses, in one line naming the function and the leaf path with both shapes and dtypes:
  * a client state whose structure, shapes or dtypes differ from `init`'s (a state that changes
    shape cannot be stored, gathered or checkpointed);
  * a server state that differs from `init`'s after `server_update` (it could not be resumed);
  * metrics that are not a dict of scalars holding 'loss' and 'num_steps';
  * a message (down or up) holding anything but arrays and priced leaves (`core.messages.pricing`);
  * an evaluation function (`evaluation_state`, `global_variables`, `global_variants`,
    `evaluation_clients`, `client_variables`, `client_diagnostics`) that fails on init's states:
    evaluation runs after round 1, and such a failure would lose the round;
  * where the run's participation varies, a `select_uploads` or `server_update` that fails when
    `RoundInfo.participating` is a [K] bool mask rather than None. That an absent slot changes nothing
    is a matter of values, which shapes cannot show: tests/test_participation_algorithms.py checks it for
    the shipped algorithms, and an outside algorithm's author checks it the same way;
  * a `PrivateSum` that cannot describe the upload (`check_private_sum`): that its figures are true is the
    algorithm's argument, which shapes cannot check.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm, PrivateSum, server_step
from fedjax_sparse.core.messages.pricing import PRICED_LEAVES
from fedjax_sparse.core.round.step import client_keys, round_info
from fedjax_sparse.core.contract.wrapping import flat_leaves

tree_map = jax.tree_util.tree_map


class ContractError(ValueError):
    """An algorithm breaks the contract; the message names the function, where it is (file:line) and the leaf."""


TRACEBACK_VARIABLE = "FEDJAX_SPARSE_TRACEBACK"  # set to 1: the command line prints an error's whole traceback
# code that is not the algorithm author's: where a failure is raised, not where the author's mistake is
_JAX_AND_LIBRARY = (str(Path(jax.__file__).resolve().parent) + os.sep, str(Path(__file__).resolve().parents[1]) + os.sep)
_PYTHON = str(Path(os.__file__).resolve().parent) + os.sep
_PACKAGES = ("jaxlib", "flax", "optax", "chex", "numpy", "jraph")


def _authors(filename: str) -> bool:
    """Whether `filename` is the algorithm author's code: not JAX's, the library's, Python's own or a package
    the library builds on."""
    if filename.startswith("<"):
        return False
    path = str(Path(filename).resolve())
    installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    if path.startswith(_JAX_AND_LIBRARY) or (path.startswith(_PYTHON) and not installed):
        return False
    return not (installed and any(f"-packages{os.sep}{name}{os.sep}" in path for name in _PACKAGES))


def _shown(filename: str, line: int) -> str:
    """file:line, relative to the current folder where it lies below it."""
    try:
        filename = os.path.relpath(filename) if not os.path.relpath(filename).startswith("..") else filename
    except ValueError:  # another drive
        pass
    return f"{filename}:{line}"


def location(function: Callable) -> str | None:
    """Where `function` is defined (file:line), through partials and wrappers; None for a builtin."""
    while isinstance(function, functools.partial):
        function = function.func
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    return None if code is None else _shown(code.co_filename, code.co_firstlineno)


def _named(function: str, fn: Callable | None) -> str:
    where = location(fn) if fn is not None else None
    return function if where is None else f"{function} ({where})"


def _raised_at(err: BaseException) -> str | None:
    """The innermost line of the algorithm author's code that the failure passed through (file:line in
    function), skipping JAX, Flax, Optax, NumPy, the library and Python's own modules."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _authors(f.filename)]
    if not frames:
        return None
    frame = frames[-1]
    return f"{_shown(frame.filename, frame.lineno)} in {frame.name}"


def _first_paragraph(err: BaseException, limit: int = 600) -> str:
    """The error's own statement, whole: its first paragraph, without JAX's notes on where it traced."""
    text = str(err).split("\n\n")[0]
    lines = [line for line in text.splitlines() if not line.startswith(("The error occurred while tracing",
                                                                           "See https://"))]
    text = " ".join(" ".join(lines).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _path(path) -> str:
    return "/".join(str(getattr(e, "key", getattr(e, "idx", getattr(e, "name", e)))) for e in path) or "(root)"


def _describe(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}" if hasattr(x, "shape") else type(x).__name__


def same_tree(name: str, function: str, got: Any, expected: Any, what: str, fn: Callable | None = None) -> None:
    """Raises ContractError at the first leaf where `got` differs from `expected` in place, shape or dtype;
    `fn`, the function that returned `got`, is named with where it is defined."""
    function = _named(function, fn)
    got_leaves = dict((_path(p), x) for p, x in jax.tree_util.tree_flatten_with_path(got)[0])
    expected_leaves = dict((_path(p), x) for p, x in jax.tree_util.tree_flatten_with_path(expected)[0])
    for path in expected_leaves.keys() - got_leaves.keys():
        raise ContractError(f"{name}: {function} returns a {what} without the leaf {path} "
                            f"({_describe(expected_leaves[path])} in init's); it must keep init's structure")
    for path in got_leaves.keys() - expected_leaves.keys():
        raise ContractError(f"{name}: {function} returns a {what} with a leaf {path} ({_describe(got_leaves[path])}) "
                            f"that init's has not; it must keep init's structure")
    for path, x in got_leaves.items():
        y = expected_leaves[path]
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ContractError(f"{name}: {function} returns a {what} whose leaf {path} is {_describe(x)}, init's is "
                                f"{_describe(y)}")
    if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(expected):
        raise ContractError(f"{name}: {function} returns a {what} of another pytree structure than init's "
                            f"({jax.tree_util.tree_structure(got)} against {jax.tree_util.tree_structure(expected)})")


def message_leaves(name: str, function: str, message: Any) -> None:
    """Raises ContractError unless every leaf of `message` is an array or a priced leaf."""
    flat = jax.tree_util.tree_flatten_with_path(message, is_leaf=lambda x: isinstance(x, PRICED_LEAVES))[0]
    for path, leaf in flat:
        if not isinstance(leaf, PRICED_LEAVES) and not isinstance(leaf, jax.ShapeDtypeStruct):
            raise ContractError(f"{name}: {function} returns a message whose leaf {_path(path)} is a "
                                f"{type(leaf).__name__}; messages hold arrays and priced leaves "
                                f"({', '.join(t.__name__ for t in PRICED_LEAVES)})")


def check_metrics(name: str, metrics: Any, fn: Callable | None = None) -> None:
    client_update = _named("client_update", fn)
    if not isinstance(metrics, dict):
        raise ContractError(f"{name}: {client_update} returns metrics of type {type(metrics).__name__}; they must be a "
                            f"dict of scalars with 'loss' and 'num_steps'")
    missing = [k for k in ("loss", "num_steps") if k not in metrics]
    if missing:
        raise ContractError(f"{name}: {client_update}'s metrics lack {' and '.join(repr(k) for k in missing)} (they "
                            f"hold {sorted(metrics)}); the engine weighs the loss and counts the steps")
    for key, value in metrics.items():
        if not hasattr(value, "shape") or value.shape != ():
            raise ContractError(f"{name}: {client_update}'s metric {key!r} is {_describe(value)}; metrics are "
                                f"scalars")


def _abstractly(name: str, functions: str, fn, *args):
    """`jax.eval_shape(fn, *args)`, a failure inside the algorithm's functions as one ContractError; an
    output leaf that is no array (a string, an object) is named by its path."""
    not_arrays = []

    def arrays_only(*a):
        def check(path, x):
            if hasattr(x, "shape") and hasattr(x, "dtype") or isinstance(x, (bool, int, float, complex)):
                return x
            not_arrays.append(f"{_path(path)} is a {type(x).__name__}")
            return jnp.zeros(())
        return jax.tree_util.tree_map_with_path(check, fn(*a))

    try:
        out = jax.eval_shape(arrays_only, *args)
    except ContractError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the algorithm's code raises on shapes
        at = _raised_at(err)
        raise ContractError(f"{name}: {functions} fails when evaluated on shapes{f' at {at}' if at else ''}: "
                            f"{type(err).__name__}: {_first_paragraph(err)} ({TRACEBACK_VARIABLE}=1 shows the "
                            f"whole traceback)") from err
    if not_arrays:
        raise ContractError(f"{name}: {functions} returns a leaf that is not an array: {not_arrays[0]}; states, "
                            f"messages and metrics hold arrays (and messages priced leaves, core.messages.pricing)")
    return out


def check_contract(algorithm: FederatedAlgorithm, variables: Any, num_clients: int, clients_per_round: int,
                   data: Any, seed: int = 0, varies: bool = False) -> None:
    """Evaluates one round of `algorithm` on shapes and raises `ContractError` at its first breach.

    `variables`: the model's initial variables (or their shapes); `data`: a `FederatedSplit` (or its
    shapes) whose client 0 stands for every client; `varies`: the run's participation varies, so the
    server's functions see `RoundInfo.participating` (`core.round.step.RoundConditions.varies`).
    """
    name = algorithm.name
    key = jax.random.key(seed)
    server, clients = _abstractly(name, "init", lambda k, v: algorithm.init(k, v, num_clients), key, variables)
    one = tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), clients)
    if algorithm.init_clients is not None:
        fresh = _abstractly(name, "init_clients", algorithm.init_clients, key, variables,
                            jax.ShapeDtypeStruct((1,), jnp.int32))
        same_tree(name, "init_clients", tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), fresh),
                  one, "client state", algorithm.init_clients)
    ids = jnp.arange(clients_per_round, dtype=jnp.int32)
    info = round_info(seed, 0, ids)

    def client_round(server, state, data):  # named parts, so that a bad leaf's path says where it is
        down = algorithm.broadcast(server, ids[0], info)
        up, new_state, metrics = algorithm.client_update(down, state, data.client(0), client_keys(seed, 0, ids)[0],
                                                         info)
        return {"broadcast": down, "client_update": {"message": up, "client state": new_state, "metrics": metrics}}

    out = _abstractly(name, "broadcast or client_update", client_round, server, one, data)
    down, up = out["broadcast"], out["client_update"]["message"]
    new_state, metrics = out["client_update"]["client state"], out["client_update"]["metrics"]
    message_leaves(name, "broadcast", down)
    message_leaves(name, "client_update", up)
    same_tree(name, "client_update", new_state, one, "client state", algorithm.client_update)
    check_metrics(name, metrics, algorithm.client_update)
    stacked = tree_map(lambda x: jax.ShapeDtypeStruct((clients_per_round, *x.shape), x.dtype), up)
    weights = jax.ShapeDtypeStruct((clients_per_round,), jnp.float32)
    present = jax.ShapeDtypeStruct((clients_per_round,), jnp.bool_) if varies else None
    masked = " with RoundInfo.participating a [K] bool mask (the run's participation varies)" if varies else ""
    if algorithm.select_uploads is not None:
        stacked = _abstractly(name, "select_uploads" + masked, lambda u, w, p: algorithm.select_uploads(
            u, w, info.replace(participating=p)), stacked, weights, present)
        message_leaves(name, "select_uploads", stacked)
    new_server, step_metrics = _abstractly(name, "server_update" + masked, lambda s, u, w, p: server_step(
        algorithm.server_update(s, u, w, info.replace(participating=p))), server, stacked, weights, present)
    same_tree(name, "server_update", new_server, server, "server state", algorithm.server_update)
    for key, value in step_metrics.items():
        if not hasattr(value, "shape") or value.shape != ():
            raise ContractError(f"{name}: server_update's step metric {key!r} is {_describe(value)}; metrics are "
                                f"scalars")
    if algorithm.private_sum is not None:
        check_private_sum(name, algorithm.private_sum, up, clients_per_round)
    check_evaluation(algorithm, server, clients)


def check_private_sum(name: str, declared: PrivateSum, up: Any, clients_per_round: int) -> None:
    """Raises ContractError where `declared` (an algorithm's `PrivateSum`) cannot describe uploads shaped `up`
    (one client's): a sensitivity that is not a positive number, a denominator no round can reach, a feedback
    path or a clipping layer's path that names no upload leaf, a released leaf without a clipping layer."""
    for field in ("sensitivity", "replace_sensitivity"):
        value = getattr(declared, field)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
            raise ContractError(f"{name}: PrivateSum.{field} must be a positive number of clip norms, got {value!r}")
    if declared.denominator is not None and not (isinstance(declared.denominator, int)
                                                 and 1 <= declared.denominator <= clients_per_round):
        raise ContractError(f"{name}: PrivateSum.denominator must be None or a count of uploads from 1 to the "
                            f"round's {clients_per_round} slots, got {declared.denominator!r}")
    leaves = flat_leaves(up)
    for prefix in declared.feedback:
        if not any(p == prefix or p.startswith(prefix + "/") for p in leaves):
            raise ContractError(f"{name}: PrivateSum.feedback names {prefix!r}, which is no upload leaf or folder "
                                f"(the upload's leaves: {', '.join(sorted(leaves))})")
    if declared.clip_layers is None:
        return
    layered = dict(declared.clip_layers)
    for path in sorted(layered.keys() - leaves.keys()):
        raise ContractError(f"{name}: PrivateSum.clip_layers names {path!r}, which is no upload leaf (the upload's "
                            f"leaves: {', '.join(sorted(leaves))})")
    for path in sorted(leaves.keys() - layered.keys()):
        if not any(path == f or path.startswith(f + "/") for f in declared.feedback):
            raise ContractError(f"{name}: PrivateSum.clip_layers gives the upload's {path} no clipping layer (every "
                                f"released leaf needs one; a leaf the server only chooses by goes in feedback)")


def check_evaluation(algorithm: FederatedAlgorithm, server: Any, clients: Any) -> None:
    """Evaluates every function the evaluations call, on the shapes of `server` and `clients` ([N, ...])."""
    name = algorithm.name
    if algorithm.evaluation_state is not None:
        server = _abstractly(name, "evaluation_state", algorithm.evaluation_state, server)
    if algorithm.global_variables is not None:
        _abstractly(name, "global_variables", algorithm.global_variables, server)
    if algorithm.global_variants is not None:
        _abstractly(name, "global_variants", algorithm.global_variants, server)
    if algorithm.client_diagnostics is not None:
        _abstractly(name, "client_diagnostics", algorithm.client_diagnostics, server, clients)
    if algorithm.evaluation_clients is not None:
        clients = _abstractly(name, "evaluation_clients", algorithm.evaluation_clients, server, clients)
    one = tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), clients)
    _abstractly(name, "client_variables", algorithm.client_variables, server, one)
