"""The JAX side's shared pieces: weight layouts between PyTorch and Flax, the library's data and round
plumbing for one client update and one server update, and a self-check of the layouts.

Layouts (`LAYOUTS`: kind -> (torch -> flax, flax -> torch)):
  conv      torch [out, in, kh, kw] (OIHW)   <-> flax [kh, kw, in, out] (HWIO);
  dense     torch [out, in]                  <-> flax [in, out];
  flat:C,H,W a dense layer reading a flattened C x H x W feature map: torch flattens NCHW (input
            index c H W + h W + w), flax NHWC ((h W + w) C + c), so the input axis is permuted too;
  vector    biases, normalization scales, shifts and statistics: the same in both.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np

Mapping = dict[str, tuple[str, tuple[str, ...], str]]  # torch key -> (collection, flax path, layout kind)


def _flat(kind: str) -> tuple[int, int, int]:
    c, h, w = (int(v) for v in kind.split(":")[1].split(","))
    return c, h, w


def from_torch(kind: str, w: np.ndarray) -> np.ndarray:
    w = np.asarray(w)
    if kind == "conv":
        return np.transpose(w, (2, 3, 1, 0))
    if kind == "dense":
        return w.T
    if kind.startswith("flat:"):
        c, h, wd = _flat(kind)
        return w.reshape(w.shape[0], c, h, wd).transpose(2, 3, 1, 0).reshape(h * wd * c, w.shape[0])
    if kind == "vector":
        return w
    raise ValueError(f"unknown layout {kind!r}; valid: conv, dense, flat:C,H,W, vector")


def to_torch(kind: str, k: np.ndarray) -> np.ndarray:
    k = np.asarray(k)
    if kind == "conv":
        return np.transpose(k, (3, 2, 0, 1))
    if kind == "dense":
        return k.T
    if kind.startswith("flat:"):
        c, h, wd = _flat(kind)
        return k.reshape(h, wd, c, k.shape[-1]).transpose(3, 2, 0, 1).reshape(k.shape[-1], c * h * wd)
    if kind == "vector":
        return k
    raise ValueError(f"unknown layout {kind!r}; valid: conv, dense, flat:C,H,W, vector")


def get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def put(tree: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of nested dict `tree` with `value` at `path` (the path must exist)."""
    if not path:
        return value
    get(tree, path)  # a KeyError names a mapping that misses the model
    return {**tree, path[0]: put(tree[path[0]], path[1:], value)}


def layer_mapping(layers: tuple[str, ...], flat_layer: str, flat_shape: str) -> dict:
    """The weights and biases of a network of convolutions (names starting 'conv') then dense layers, each
    torch `NAME.weight` / `NAME.bias` onto Flax's params/NAME/kernel and bias; `flat_layer`, the first dense
    layer, reads the flattened `flat_shape` map ('C,H,W', torch's order)."""
    out = {}
    for layer in layers:
        kind = "conv" if layer.startswith("conv") else (f"flat:{flat_shape}" if layer == flat_layer else "dense")
        out[f"{layer}.weight"] = ("params", (layer, "kernel"), kind)
        out[f"{layer}.bias"] = ("params", (layer, "bias"), "vector")
    return out


def load_torch(variables: dict, mapping: Mapping, arrays: dict[str, np.ndarray]) -> dict:
    """`variables` ({'params', 'batch_stats'}) with every mapped leaf replaced by the torch array's
    conversion; a ValueError names a leaf of the model no torch key fills."""
    import jax
    import jax.numpy as jnp
    filled = set()
    for key, (collection, path, kind) in mapping.items():
        value = from_torch(kind, arrays[key])
        old = get(variables[collection], path)
        if value.shape != old.shape:
            raise ValueError(f"{key} -> {collection}/{'/'.join(path)}: torch gives {value.shape}, the model has "
                             f"{old.shape}")
        variables = {**variables, collection: put(variables[collection], path, jnp.asarray(value, old.dtype))}
        filled.add((collection,) + path)
    leaves = {(c,) + tuple(k.key for k in p)
              for c in ("params",) for p, _ in jax.tree_util.tree_flatten_with_path(variables[c])[0]}
    missing = leaves - filled
    if missing:
        raise ValueError(f"no torch tensor fills {sorted('/'.join(m) for m in missing)}")
    return variables


def in_torch_layout(tree: dict, mapping: Mapping) -> dict[str, np.ndarray]:
    """{torch key: the library's leaf in torch layout} for a tree shaped like the model's variables."""
    return {key: to_torch(kind, np.asarray(get(tree[collection], path)))
            for key, (collection, path, kind) in mapping.items() if path_exists(tree, collection, path)}


def path_exists(tree: dict, collection: str, path: tuple[str, ...]) -> bool:
    try:
        get(tree[collection], path)
        return True
    except (KeyError, TypeError):
        return False


@contextlib.contextmanager
def fixed_data_order():
    """The library's local training visits a client's examples in their stored order (batch t holds
    examples [t B, (t + 1) B)), as the harness feeds the official code: the one random draw of local
    training (`epoch_permutations`, its shuffle) replaced by the identity, as their data loaders are
    replaced by ours. Patched where local training looks it up, for the jit traces made inside."""
    import jax.numpy as jnp
    from fedjax_sparse.core.round import local_training

    original = local_training.epoch_permutations

    def in_order(key, count, max_count, epochs):
        del key, count
        return jnp.broadcast_to(jnp.arange(max_count, dtype=jnp.int32), (epochs, max_count))

    local_training.epoch_permutations = in_order
    try:
        yield
    finally:
        local_training.epoch_permutations = original


def federated_data(setup: dict[str, np.ndarray]):
    """The setup's examples as the library's FederatedSplit: float32 NHWC, used as they are
    (`data.federated.normalize` leaves float inputs alone), each client a window in client order."""
    from fedjax_sparse.data.federated import federated_split
    x = np.transpose(setup["data/x"], (0, 2, 3, 1)).astype(np.float32)
    y = setup["data/y"].astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum(setup["data/counts"])])
    indices = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    channels = x.shape[-1]
    return federated_split(x, y, indices, mean=[0.0] * channels, std=[1.0] * channels)


def run_rounds(algorithm, server_state: Any, states: list, split, schedule, *, after: Callable,
               after_round: Callable, before: Callable | None = None, broadcast: Callable | None = None,
               weights: Callable | None = None) -> dict[str, np.ndarray]:
    """The library's rounds as the harness runs them, the server state and `states` (client c's at
    states[c]) carried: `schedule` is [(round index, clients)]; in round i each client c trains
    (`client_update`, jitted, with key 1000 i + 100 + c), then `server_update` takes their stacked uploads.
    The library's shuffle is off (`fixed_data_order`) and its ReLU and max-pool decisions are recorded
    (under decisions/r{i}/c{c}, `decisions.LibraryDecisions`). Hooks return arrays to keep:
    broadcast(server_state, c, info) -> down (default `algorithm.broadcast`); before(i, c, down, state);
    after(i, c, up, new_state, metrics); after_round(i, server_state); weights(clients) -> the
    server's weights (default their example counts)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.parity.decisions import LibraryDecisions
    from fedjax_sparse.core.round.step import round_info

    broadcast = broadcast or algorithm.broadcast
    out = {}
    recorder = LibraryDecisions()
    with fixed_data_order(), recorder.installed():
        client_update = jax.jit(algorithm.client_update)
        server_update = jax.jit(algorithm.server_update)
        for i, (index, clients) in enumerate(schedule):
            info = round_info(0, index, jnp.asarray(clients))
            ups = []
            for c in clients:
                down = broadcast(server_state, c, info)
                if before is not None:
                    out.update(before(i, c, down, states[c]))
                up, states[c], metrics = client_update(down, states[c], split.client(c),
                                                       jax.random.key(1000 * i + 100 + c), info)
                jax.effects_barrier()
                out.update(recorder.take(f"decisions/r{i}/c{c}"))
                out.update(after(i, c, up, states[c], metrics))
                ups.append(up)
            counts = weights(clients) if weights is not None else split.counts[np.asarray(clients)]
            server_state = server_update(server_state, stack(ups), counts, info)
            out.update(after_round(i, server_state))
    return out


def stack(trees: list) -> Any:
    """Per-client messages stacked on a leading axis, as the engine hands them to `server_update`."""
    import jax
    import jax.numpy as jnp
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def unpacked(tree: Any, leaf_type: type, field: str) -> Any:
    """Each `leaf_type` message leaf (KnownMaskArray, SparseArray, ...) replaced by its `field`."""
    import jax
    return jax.tree_util.tree_map(lambda leaf: getattr(leaf, field), tree, is_leaf=lambda x: isinstance(x, leaf_type))


def self_check() -> None:
    """The layouts against the computations they stand for, with JAX alone: a conv in NCHW/OIHW of a
    torch-layout kernel equals the NHWC/HWIO conv of its conversion; a dense layer reading a
    flattened NCHW map with a torch-layout matrix equals the NHWC flatten times its conversion;
    every conversion round-trips exactly. Raises AssertionError otherwise."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 5, 4)).astype(np.float32)  # NCHW
    w = rng.normal(size=(6, 3, 3, 2)).astype(np.float32)  # OIHW, a non-square kernel
    theirs = lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (0, 0)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
    ours = lax.conv_general_dilated(np.transpose(x, (0, 2, 3, 1)), from_torch("conv", w), (1, 1), ((1, 1), (0, 0)),
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(np.transpose(np.asarray(ours), (0, 3, 1, 2)), np.asarray(theirs), rtol=1e-5, atol=1e-5)
    dense = rng.normal(size=(7, 3 * 5 * 4)).astype(np.float32)  # [out, C*H*W]
    kind = "flat:3,5,4"
    theirs = x.reshape(2, -1) @ dense.T
    ours = jnp.asarray(np.transpose(x, (0, 2, 3, 1)).reshape(2, -1)) @ from_torch(kind, dense)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-5)
    for kind, shape in (("conv", (6, 3, 3, 2)), ("dense", (7, 4)), (kind, (7, 60)), ("vector", (5,))):
        a = rng.normal(size=shape).astype(np.float32)
        assert np.array_equal(to_torch(kind, from_torch(kind, a)), a), kind
    jax.block_until_ready(ours)
