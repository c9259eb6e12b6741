"""What HeteroFL's and FedRolex's parity runs share: their code's round is the same shape (the server
cuts each client's sub-model by index lists, the client trains a physically smaller network, the
server sums uploads into the index lists and divides by counts), and so is the library's (full-shape
masked sub-models, `algorithms.submodels`).

Official arrays (torch side), per round i: round{i}/client{c}/value/<key> the trained sub-model
tensor, round{i}/client{c}/rows/<key> and .../cols/<key> its output and input index lists (1-D
tensors: rows only), round{i}/global/<key> after aggregation; norms: the gradient norms their
clipping saw; decisions/...: `decisions.OfficialDecisions.arrays`.
Library arrays (JAX side, `library_rounds`): round{i}/client{c}/value/<key> the full-shape trained
tensor, round{i}/client{c}/mask/<key> the entries it sends, round{i}/global/<key> after
`server_update`; decisions/r{i}/c{c}/...: its ReLU and max-pool decisions near a tie.
"""

from __future__ import annotations

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


def library_rounds(algorithm: str, model_name: str, setup: dict, mapping, rates, rounds: tuple[int, ...],
                   options: dict, *, lr: float, momentum: float, weight_decay: float, epochs: int, batch_size: int,
                   num_classes: int, grad_clip_norm: float | None) -> dict[str, np.ndarray]:
    """The library's `algorithm` over `rounds` (their round indices) from the setup's weights, the server
    state carried: client c trains at capacity rates[c] (its `broadcast` from an algorithm built with
    capacities=(rates[c],)), gradients clipped to `grad_clip_norm`; then `server_update`. Arrays under
    round{i}/ (i counts the rounds run), and the ReLU/pool decisions under decisions/r{i}/c{c}."""
    import jax

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.messages.pricing import KnownMaskArray
    from fedjax_sparse.models import get_model

    x = setup["data/x"]
    model = get_model(model_name, (x.shape[2], x.shape[3], x.shape[1]), num_classes)
    variables = J.load_torch(model.init(jax.random.key(0)), mapping, A.under(setup, "init"))
    split = J.federated_data(setup)
    clients = len(rates)
    local = LocalSGD(model, lr, epochs, batch_size, momentum, weight_decay, grad_clip_norm=grad_clip_norm)
    context = BuildContext(local=local, num_clients=clients, clients_per_round=clients, train=split,
                           num_classes=num_classes, seed=0)

    def build(rate):
        return make_algorithm(algorithm, context, make_options(algorithm, {**options, "capacities": (rate,)}))

    built = [build(rate) for rate in rates]
    server_state, _ = built[0].init(jax.random.key(1), variables, clients)

    def after(i, c, up, state, metrics):
        values = J.unpacked(up["variables"], KnownMaskArray, "values")
        masks = J.unpacked(up["variables"], KnownMaskArray, "mask")
        return {**A.prefixed(f"round{i}/client{c}/value", J.in_torch_layout(values, mapping)),
                **A.prefixed(f"round{i}/client{c}/mask", J.in_torch_layout(masks, mapping))}

    # a client's update reads its capacity from the broadcast message (never from the options), so one
    # compiled client_update serves every capacity
    return J.run_rounds(built[0], server_state, [{} for _ in rates], split,
                        [(r, list(range(clients))) for r in rounds],
                        broadcast=lambda state, c, info: built[c].broadcast(state, c, info), after=after,
                        after_round=lambda i, state: A.prefixed(f"round{i}/global",
                                                                J.in_torch_layout(state["variables"], mapping)))


CLIP = 1.0  # HeteroFL's and FedRolex's clip_grad_norm_(..., 1) in their local step


def prefix_channels(units: int, kept: int) -> np.ndarray:
    """HeteroFL's sub-model of a layer (`decisions.ChannelMap`): its first `kept` units, in order."""
    return np.arange(kept)


def selection_row(library: dict, official: dict, rnd: int, clients: int) -> dict:
    """A round's clients: the entries the library's sub-models send are exactly those of their index lists."""
    ours, theirs = {}, {}
    for c in range(clients):
        for key, value in A.under(official, f"round{rnd}/client{c}/value").items():
            mask = np.asarray(library[f"round{rnd}/client{c}/mask/{key}"], bool)
            expected = np.zeros(mask.shape, bool)
            expected[_index(official, rnd, c, key, value.ndim)] = True
            ours[f"client{c}/{key}"], theirs[f"client{c}/{key}"] = mask, expected
    return A.identical(f"round {rnd + 1}: entries in each client's sub-model", ours, theirs)


def _index(official: dict, rnd: int, c: int, key: str, ndim: int):
    rows = official[f"round{rnd}/client{c}/rows/{key}"]
    if ndim == 1:
        return (rows,)
    return np.ix_(rows, official[f"round{rnd}/client{c}/cols/{key}"])


def client_row(setup: dict, library: dict, official: dict, rnd: int, c: int, rate: float) -> dict:
    """A client's trained sub-model: every tensor of theirs against the library's at the same entries
    (`moved`: relative to the global model it received)."""
    start = A.under(setup, "init") if rnd == 0 else A.under(official, f"round{rnd - 1}/global")
    diffs = []
    for key, value in A.under(official, f"round{rnd}/client{c}/value").items():
        index = _index(official, rnd, c, key, value.ndim)
        diffs.append(A.difference(key, np.asarray(library[f"round{rnd}/client{c}/value/{key}"])[index], value,
                                  np.asarray(start[key])[index], key=f"round{rnd}/client{c}/value/{key}"))
    return A.group(f"round {rnd + 1}: client {c} (rate {rate:g}) trained sub-model", diffs)


def global_row(library: dict, official: dict, rnd: int, what: str) -> dict:
    """The global model after a round's aggregation."""
    ours = A.under(library, f"round{rnd}/global")
    return A.group(f"round {rnd + 1}: {what}", [A.difference(k, ours[k], v, key=f"round{rnd}/global/{k}")
                                                 for k, v in A.under(official, f"round{rnd}/global").items()])


def compare_rounds(setup: dict, library: dict, official: dict, rounds: int, rates) -> list[dict]:
    """Each round's rows: the sub-models' entries, each client's trained sub-model, the global model; and
    the run's ReLU/pool decisions."""
    from benchmarks.parity import decisions as D
    rows = []
    for rnd in range(rounds):
        rows.append(selection_row(library, official, rnd, len(rates)))
        rows += [client_row(setup, library, official, rnd, c, rate) for c, rate in enumerate(rates)]
        rows.append(global_row(library, official, rnd, "server: global model after combine"))
    rows[-1]["note"] = norms_note(official)
    return rows + [D.aligned_row(official)]


def norms_note(official: dict) -> str:
    norms = official["norms"]
    return (f"gradient norms their clipping saw: {float(np.min(norms)):.3g} to {float(np.max(norms)):.3g} "
            f"({int(np.sum(norms > CLIP))} of {len(norms)} steps clipped to {CLIP:g})")
