"""What HeteroFL's and FedRolex's parity runs share: their code's round is the same shape (the server
cuts each client's sub-model by index lists, the client trains a physically smaller network, the
server sums uploads into the index lists and divides by counts), and so is the library's (full-shape
masked sub-models, `algorithms.submodels`).

Official arrays (torch side): client{c}/value/<key> the trained sub-model tensor, client{c}/rows/<key>
and client{c}/cols/<key> its output and input index lists (1-D tensors: rows only), global/<key>
after aggregation, norms: the gradient norms their clipping saw.
Library arrays (JAX side): client{c}/value/<key> the full-shape trained tensor, client{c}/mask/<key>
the entries it sends, global_<aggregation>/<key> after `server_update`; `library_runs` keeps one such
set per gradient clipping, under clip<norm>/ or noclip/ (`run_arrays` picks a case's).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from benchmarks.parity import arrays as A


def record_indices(param_idx: dict) -> dict[str, np.ndarray]:
    """Their `param_idx[m]` ({key: (rows, cols) or rows}) as arrays rows/<key>, cols/<key>."""
    out = {}
    for key, idx in param_idx.items():
        if isinstance(idx, (tuple, list)):
            out[f"rows/{key}"] = idx[0].cpu().numpy().copy()
            out[f"cols/{key}"] = idx[1].cpu().numpy().copy()
        else:
            out[f"rows/{key}"] = idx.cpu().numpy().copy()
    return out


def library_round(algorithm: str, model_name: str, setup: dict, mapping, rates, round_index: int,
                  options: dict, *, lr: float, momentum: float, weight_decay: float, batch_size: int,
                  num_classes: int, aggregations: tuple[str, ...],
                  grad_clip_norm: float | None = None) -> dict[str, np.ndarray]:
    """One round of the library's `algorithm` from the setup's weights: client c trains at capacity
    rates[c] (its `broadcast` from an algorithm built with capacities=(rates[c],)), with its gradients
    clipped to `grad_clip_norm` (None: unclipped), then `server_update` once per submodel aggregation
    in `aggregations`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.messages.pricing import KnownMaskArray
    from fedjax_sparse.core.round.step import round_info
    from fedjax_sparse.models import get_model

    x = setup["data/x"]
    model = get_model(model_name, (x.shape[2], x.shape[3], x.shape[1]), num_classes)
    variables = J.load_torch(model.init(jax.random.key(0)), mapping, A.under(setup, "init"))
    split = J.federated_data(setup)
    clients = len(rates)
    local = LocalSGD(model, lr, 1, batch_size, momentum, weight_decay, grad_clip_norm=grad_clip_norm)
    context = BuildContext(local=local, num_clients=clients, clients_per_round=clients, train=split,
                           num_classes=num_classes, seed=0)

    def build(rate, aggregation):
        values = {**options, "capacities": (rate,), "submodel_aggregation": aggregation}
        return make_algorithm(algorithm, context, make_options(algorithm, values))

    info = round_info(0, round_index, jnp.arange(clients))
    first = build(rates[0], aggregations[0])
    server_state, _ = first.init(jax.random.key(1), variables, clients)
    # a client's update reads its capacity from the broadcast message (never from the options), so
    # one compiled client_update serves every capacity
    client_update = jax.jit(first.client_update)
    out, ups = {}, []
    with J.fixed_data_order():
        for c, rate in enumerate(rates):
            down = build(rate, aggregations[0]).broadcast(server_state, c, info)
            up, _, _ = client_update(down, {}, split.client(c), jax.random.key(100 + c), info)
            ups.append(up)
            values = J.unpacked(up["variables"], KnownMaskArray, "values")
            masks = J.unpacked(up["variables"], KnownMaskArray, "mask")
            out.update(A.prefixed(f"client{c}/value", J.in_torch_layout(values, mapping)))
            out.update(A.prefixed(f"client{c}/mask", J.in_torch_layout(masks, mapping)))
    stacked = J.stack(ups)
    for aggregation in aggregations:
        algorithm_ = build(rates[0], aggregation)
        state, _ = algorithm_.init(jax.random.key(1), variables, clients)
        new = jax.jit(algorithm_.server_update)(state, stacked, split.counts, info)
        out.update(A.prefixed(f"global_{aggregation}", J.in_torch_layout(new["variables"], mapping)))
    return out


CLIP = 1.0  # HeteroFL's and FedRolex's clip_grad_norm_(..., 1) in their local step


def library_runs(round_: Callable[..., dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """`round_(grad_clip_norm=...)` (a `library_round` with everything else bound) twice: clipped to
    norm CLIP, as their code clips (the case as published), and unclipped (their clipping lifted)."""
    return {**A.prefixed(f"clip{CLIP:g}", round_(grad_clip_norm=CLIP)),
            **A.prefixed("noclip", round_(grad_clip_norm=None))}


def run_arrays(library: dict, clipped: bool) -> dict[str, np.ndarray]:
    return A.under(library, f"clip{CLIP:g}" if clipped else "noclip")


def selection_rows(library: dict, official: dict, clients: int, rates) -> list[dict]:
    """Per client: the entries the library's sub-model sends are exactly those of their index lists."""
    rows = []
    for c in range(clients):
        theirs_value = A.under(official, f"client{c}/value")
        ours, theirs = {}, {}
        for key, value in theirs_value.items():
            mask = np.asarray(library[f"client{c}/mask/{key}"], bool)
            expected = np.zeros(mask.shape, bool)
            expected[_index(official, c, key, value.ndim)] = True
            ours[key], theirs[key] = mask, expected
        rows.append(A.identical(f"client {c} (rate {rates[c]:g}): entries in its sub-model", ours, theirs,
                                "the same entries, exactly" if all(np.array_equal(ours[k], theirs[k]) for k in ours)
                                else "DIFFERENT entries"))
    return rows


def _index(official: dict, c: int, key: str, ndim: int):
    rows = official[f"client{c}/rows/{key}"]
    if ndim == 1:
        return (rows,)
    return np.ix_(rows, official[f"client{c}/cols/{key}"])


def client_rows(setup: dict, library: dict, official: dict, clients: int, rates, note: str) -> list[dict]:
    """Per client: every trained sub-model tensor of theirs against the library's at the same entries
    (relative to the client's update of the tensor)."""
    rows = []
    for c in range(clients):
        diffs = []
        for key, value in A.under(official, f"client{c}/value").items():
            index = _index(official, c, key, value.ndim)
            ours = np.asarray(library[f"client{c}/value/{key}"])[index]
            diffs.append(A.difference(key, ours, value, setup[f"init/{key}"][index]))
        rows.append(A.group(f"client {c} (rate {rates[c]:g}): trained sub-model", diffs, note))
    return rows


def global_row(setup: dict, library: dict, official: dict, aggregation: str, what: str, note: str) -> dict:
    """The global model after aggregation, relative to the round's change of each tensor."""
    ours = A.under(library, f"global_{aggregation}")
    return A.group(what, [A.difference(k, ours[k], v, setup[f"init/{k}"])
                          for k, v in A.under(official, "global").items()], note)


def norms_note(official: dict) -> str:
    norms = official.get("norms")
    if norms is None or not len(norms):
        return ""
    return f"gradient norms their clipping saw: {float(np.min(norms)):.3g} to {float(np.max(norms)):.3g}"
