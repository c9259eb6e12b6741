"""FedPM (Isik et al., ICLR 2023) against its code: `src/fedssm/client.py`'s `Client` (train_local,
upload_mask), `server.py`'s `Server.sample_mask_aggregation`, `models/model.py`'s `FedModel`
(its Adam at lr 0.1), `models/masked_layers.py`'s `Mask4CNN` (frozen +-c weights, Bernoulli masks of
weights and biases), `utils/random.py`'s `Bern`.

One round: three clients of 16 examples (28x28x1, their Mask4CNN's input), one local epoch of 2
batches of 8, Adam lr 0.1, one mask sample uploaded each, the Beta posterior from a reset prior.
The library runs `fedpm` (defaults: prior reset every round, per-client Adam) at --lr 0.1 on a Flax
copy of their Mask4CNN built here from the library's Model/ModelStructure (no zoo model has its shape:
conv 64-64-128-128 3x3 'same' without normalization, pools after the 2nd and 4th, dense 6272-256-256-10);
its frozen weights and scores are set to theirs.

Random draws: both sides draw a Bernoulli mask at every forward pass and one to upload. The harness
records the library's (its `sampled_masks`, observed with a debug callback, which also records the
probabilities it sampled from) and the official run reuses them: `torch.bernoulli` (their `Bern`'s
forward) and `fedssm.client.bernoulli.rvs` (scipy's, in `upload_mask`) return the library's masks in
their call order. Imports their code cannot make (`models.pruned_layers`, `drive`, `eden`: modules the
repository lacks) are empty stubs.

Known differences:
  * gradient estimator: their `Bern.backward` returns theta dL/dm, the library's straight-through
    estimator dL/dm (algorithms/fedpm.py: the supermask estimator, on purpose). Diagnostic
    `straight_through`: their `Bern.backward` replaced by the identity.
  * aggregation: their clients map the sampled bits to 0.01 / 0.99 before the server counts them, so
    theta = 0.01 + 0.98 f (f the share of ones); the library takes theta = clip(f, 0.01, 0.99). The two
    agree when f is 0, 1/2 or 1 (always, with two clients), not with three. The comparison row
    "their theta vs 0.01 + 0.98 f of the library's bits" checks that this is the whole difference.
  * the library broadcasts theta and its client starts from logit(theta): their client starts from
    the scores themselves (one float32 sigmoid/logit round trip apart).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A

NAME = "fedpm"
REPOSITORY = "BerivanIsik/sparse-random-networks"
COMMIT = "cf6b54962cad7f085b935c4682d31940b3d9ef83"
CHECKOUT = "src"
MODEL = "their Mask4CNN (conv 64-64-128-128, dense 256-256-10, no normalization) on both sides, 28x28x1"
SEED = 0
CLIENTS, EXAMPLES, BATCH, CLASSES, SIDE = 3, 16, 8, 10, 28
LR = 0.1
LAYERS = ("conv1", "conv2", "conv3", "conv4", "dense1", "dense2", "dense3")
LIBRARY_OPTIONS = {"algorithm": "fedpm", "model": "a Flax copy of their Mask4CNN", "prior_reset": 1,
                   "fedpm_optimizer_state": "client", "lr": LR, "local_epochs": 1, "batch_size": BATCH}
CASES = {
    "published": "their code as published (Bern's gradient theta dL/dm, bits mapped to 0.01/0.99)",
    "straight_through": "diagnostic: their Bern.backward replaced by the identity (the library's estimator)",
}
ESTIMATOR = "their Bern.backward scales each score's gradient by theta; the library's straight-through does not"
ADAM = ("Adam's first step lr g / (|g| + eps) turns round-off in gradients near eps = 1e-8 into different steps "
        "(counted below)")
MAPPING = ("their bits mapped to 0.01/0.99 before counting: theta = 0.01 + 0.98 f; the library's clip(f, 0.01, "
           "0.99) differs where f is 1/3 or 2/3")


def params() -> dict:
    """Their parameter file's entries this run reads (params.yaml's layout)."""
    return {"model": {"id": "conv4", "mode": "mask", "local_epochs": 1, "init": "ME_init",
                      "optimizer": {"type": "base", "noisy": False}},
            "simulation": {"n_clients": CLIENTS, "verbose": 0}}


def score_key(layer: str, leaf: str) -> str:
    """Their name of the score of a layer's kernel or bias."""
    return f"{layer}.mask" if leaf == "kernel" else f"{layer}.bias_mask"


# ------------------------------------------------------------------ the PyTorch side

def _official(checkout: Path):
    from benchmarks.parity import torch_side as T
    T.enter_checkout(checkout)
    import fedssm
    import fedssm.models
    T.stub_module("fedssm.models.pruned_layers")
    T.stub_module("fedssm.drive", drive_compress=T.refuse("drive"), drive_decompress=T.refuse("drive"),
                  drive_plus_compress=T.refuse("drive"), drive_plus_decompress=T.refuse("drive"))
    T.stub_module("fedssm.eden")
    T.stub_module("fedssm.eden.eden", eden_builder=T.refuse("eden"))
    from fedssm import client, server
    from fedssm.models import masked_layers
    from fedssm.utils import random
    del fedssm
    return client, server, masked_layers, random


def torch_setup(checkout: Path) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    _, _, masked_layers, _ = _official(checkout)
    T.deterministic(SEED)
    state = T.state_arrays(masked_layers.Mask4CNN(init="ME_init", device="cpu").state_dict())
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(EXAMPLES * CLIENTS, 1, SIDE, SIDE)).astype(np.float32)
    y = rng.integers(0, CLASSES, EXAMPLES * CLIENTS).astype(np.int64)
    return {**A.prefixed("init", state), "keys": np.array(list(state)), "data/x": x, "data/y": y,
            "data/counts": np.full(CLIENTS, EXAMPLES)}


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    client_module, server_module, _, random = _official(checkout)
    T.deterministic(SEED)
    if case == "straight_through":
        random.Bern.backward = staticmethod(lambda ctx, grad_output: grad_output)
    steps = -(-EXAMPLES // BATCH)
    draws: list = []  # (their score key, the library's mask) in the order their forward draws them
    probabilities: list = []

    def bernoulli(p):
        key, mask = draws.pop(0)
        if tuple(p.shape) != mask.shape:
            raise RuntimeError(f"torch.bernoulli got {tuple(p.shape)}, the next library draw ({key}) is {mask.shape}")
        probabilities.append((key, p.detach().numpy().copy()))
        return torch.from_numpy(mask.astype(np.float32))

    uploads: list = []

    class Bernoulli:  # scipy.stats.bernoulli as upload_mask calls it
        @staticmethod
        def rvs(theta):
            key, bits = uploads.pop(0)
            if np.shape(theta) != bits.shape:
                raise RuntimeError(f"bernoulli.rvs got {np.shape(theta)}, the next library upload ({key}) is "
                                   f"{bits.shape}")
            return bits.astype(np.int64)

    torch.bernoulli = bernoulli
    client_module.bernoulli = Bernoulli
    server = server_module.Server(params(), device="cpu")
    server.global_model.set_weights({k: torch.from_numpy(v) for k, v in A.under(setup, "init").items()})
    clients = [client_module.Client(params(), T.Batches(*T.client_arrays(setup, c), BATCH, T.tensor_pair),
                                    server.global_model.get_weights(), "cpu") for c in range(CLIENTS)]
    server.set_client_list(clients)
    server.broadcast_model(range(CLIENTS))
    out = {}
    for c, client in enumerate(clients):
        for t in range(steps):
            draws.extend((score_key(layer, leaf), library[f"client{c}/step{t}/mask/{score_key(layer, leaf)}"])
                         for layer in LAYERS for leaf in ("kernel", "bias"))
        client.train_local(0)
        assert not draws, f"client {c}: {len(draws)} library draws left unused"
        for i, (key, p) in enumerate(probabilities):
            out[f"client{c}/step{i // (2 * len(LAYERS))}/theta/{key}"] = p
        probabilities.clear()
        out.update({f"client{c}/theta/{k}": 1.0 / (1.0 + np.exp(-v.astype(np.float64)))
                    for k, v in T.state_arrays(client.get_local_weights()).items() if "mask" in k})
    for c in range(CLIENTS):
        uploads.extend((k, library[f"client{c}/upload/{k}"]) for k in setup["keys"] if "mask" in str(k))
    server.sample_mask_aggregation(list(range(CLIENTS)), 0)
    assert not uploads, f"{len(uploads)} library uploads left unused"
    for k, v in T.state_arrays(server.global_model.get_weights()).items():
        if "mask" in k:
            out[f"global/theta/{k}"] = 1.0 / (1.0 + np.exp(-v.astype(np.float64)))
    return out


# ------------------------------------------------------------------ the JAX side

def _model():
    """Their Mask4CNN in Flax, with the structure the library's FedPM reads (kernels and biases)."""
    import flax.linen as nn

    from fedjax_sparse.models.layers import conv_layer, dense_layer
    from fedjax_sparse.models.structure import Model, ModelStructure

    convs = ((64, False), (64, True), (128, False), (128, True))

    class Conv4(nn.Module):
        @nn.compact
        def __call__(self, x, train, mask=None, unit_masks=None):
            del train, mask, unit_masks
            for i, (width, pool) in enumerate(convs):
                x = nn.relu(nn.Conv(width, (3, 3), padding="SAME", name=f"conv{i + 1}")(x))
                if pool:
                    x = nn.max_pool(x, (2, 2), (2, 2))
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(256, name="dense1")(x))
            x = nn.relu(nn.Dense(256, name="dense2")(x))
            return nn.Dense(CLASSES, name="dense3")(x)

    layers, prev, width, side = [], "input", 1, SIDE
    for i, (units, pool) in enumerate(convs):
        layers.append(conv_layer((f"conv{i + 1}",), kernel=3, in_units=width, units=units, output_hw=side * side,
                                 inputs_from=(prev,), bias=True, norm=None))
        prev, width, side = f"conv{i + 1}", units, side // 2 if pool else side
    for j, units in enumerate((256, 256, CLASSES)):
        layers.append(dense_layer((f"dense{j + 1}",), in_units=width, units=units, inputs_from=(prev,), bias=True,
                                  norm=None, input_repeat=side * side if j == 0 else 1))
        prev, width = f"dense{j + 1}", units
    return Model(name="fedpm_conv4", module=Conv4(), input_shape=(SIDE, SIDE, 1), num_classes=CLASSES,
                 structure=ModelStructure(tuple(layers)), description="FedPM's Mask4CNN")


def mapping() -> dict:
    """Their weights and biases onto the Flax copy (dense1 reads the flattened 128 x 7 x 7 map)."""
    from benchmarks.parity import jax_side as J

    return J.layer_mapping(LAYERS, "dense1", "128,7,7")


def library(setup: dict) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import fedpm as fedpm_module
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.round.step import round_info

    model = _model()
    maps = mapping()
    init = A.under(setup, "init")
    variables = J.load_torch(model.init(jax.random.key(0)), maps, init)
    split = J.federated_data(setup)
    local = LocalSGD(model, LR, 1, BATCH)
    context = BuildContext(local=local, num_clients=CLIENTS, clients_per_round=CLIENTS, train=split,
                           num_classes=CLASSES, seed=0)
    algorithm = make_algorithm("fedpm", context, make_options("fedpm", {}))
    server_state, client_states = algorithm.init(jax.random.key(1), variables, CLIENTS)
    scores = {f"{layer}/{leaf}": jnp.asarray(J.from_torch(maps[f"{layer}.weight"][2] if leaf == "kernel" else "vector",
                                                          init[score_key(layer, leaf)]))
              for layer in LAYERS for leaf in ("kernel", "bias")}
    server_state = {**server_state, "weights": variables["params"],
                    "theta": {name: jax.nn.sigmoid(s) for name, s in scores.items()}}
    calls: list = []
    original = fedpm_module.sampled_masks

    def observed(thetas, key):
        masks = original(thetas, key)
        jax.debug.callback(lambda t, m: calls.append((t, m)), thetas, masks, ordered=True)
        return masks

    def torch_names(tree):  # {layer/leaf: array} -> {their score key: array in torch layout}
        out = {}
        for name, value in tree.items():
            layer, leaf = name.split("/")
            kind = maps[f"{layer}.weight"][2] if leaf == "kernel" else "vector"
            out[score_key(layer, leaf)] = J.to_torch(kind, np.asarray(value))
        return out

    info = round_info(0, 0, jnp.arange(CLIENTS))
    out, ups = {}, []
    fedpm_module.sampled_masks = observed
    try:
        client_update = jax.jit(algorithm.client_update)
        with J.fixed_data_order():
            for c in range(CLIENTS):
                state = jax.tree_util.tree_map(lambda leaf: leaf[c], client_states)
                up, _, _ = client_update(algorithm.broadcast(server_state, c, info), state, split.client(c),
                                         jax.random.key(100 + c), info)
                jax.effects_barrier()
                *steps, upload = calls
                calls.clear()
                for t, (thetas, masks) in enumerate(steps):
                    out.update(A.prefixed(f"client{c}/step{t}/theta", torch_names(thetas)))
                    out.update(A.prefixed(f"client{c}/step{t}/mask", torch_names(masks)))
                out.update(A.prefixed(f"client{c}/theta", torch_names(upload[0])))
                out.update(A.prefixed(f"client{c}/upload", torch_names({k: b.bits for k, b in up["mask"].items()})))
                ups.append(up)
    finally:
        fedpm_module.sampled_masks = original
    new = jax.jit(algorithm.server_update)(server_state, J.stack(ups), split.counts, info)
    out.update(A.prefixed("global/theta", torch_names(new["theta"])))
    return out


def _first_adam_step(library: dict, official: dict, c: int, case: str) -> dict:
    """Adam's first step moves a score by lr g / (|g| + eps) (its moments are g and g^2): below
    |g| ~ 100 eps = 1e-6 that ratio turns float32 round-off in g into differences of the score.
    The row counts the entries whose theta after that step differs by more than 1e-5, and says how many
    of them moved less than 0.99 lr in the library (|g| < 100 eps)."""
    def logit(t):
        return np.log(t) - np.log1p(-t)

    differing, small, entries = 0, 0, 0
    for key, theirs in A.under(official, f"client{c}/step1/theta").items():
        ours = library[f"client{c}/step1/theta/{key}"].astype(np.float64)
        moved = np.abs(logit(ours) - logit(library[f"client{c}/step0/theta/{key}"].astype(np.float64)))
        far = np.abs(ours - theirs) > 1e-5
        differing += int(far.sum())
        small += int((moved[far] < 0.99 * LR).sum())
        entries += ours.size
    return {"compared": f"client {c}: theta after the first Adam step, entries differing by > 1e-5",
            "tensors": 2 * len(LAYERS), "mismatched_entries": differing, "max_rel": 0.0, "max_abs": 0.0,
            "note": f"of {entries:,} entries; {small} of the {differing} stepped < 0.99 lr in the library, i.e. had "
                    f"|g| < 100 x Adam's eps, where lr g / (|g| + eps) turns round-off in g into a different step"
                    + ("" if case == "straight_through" else "; the others: their gradient is theta g, which puts "
                       "other entries near eps")}


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    steps = -(-EXAMPLES // BATCH)
    rows = []
    for c in range(CLIENTS):
        for t in range(steps):
            theirs = A.under(official, f"client{c}/step{t}/theta")
            rows.append(A.group(f"client {c}: theta sampled at step {t + 1}",
                                [A.difference(k, library[f"client{c}/step{t}/theta/{k}"], v)
                                 for k, v in theirs.items()]))
        theirs = A.under(official, f"client{c}/theta")
        rows.append(A.group(f"client {c}: trained theta", [A.difference(k, library[f"client{c}/theta/{k}"], v,
                                                                          1 / (1 + np.exp(-setup[f"init/{k}"])))
                                                             for k, v in theirs.items()]))
    A.explain(rows, (ESTIMATOR if case == "published" else ADAM) + "; a step's theta follows from the previous steps")
    rows += [_first_adam_step(library, official, c, case) for c in range(CLIENTS)]
    theirs = A.under(official, "global/theta")
    server = A.group("server: theta after aggregation",
                     [A.difference(k, library[f"global/theta/{k}"], v) for k, v in theirs.items()])
    A.explain([server], MAPPING)
    share = {k: np.mean([library[f"client{c}/upload/{k}"] for c in range(CLIENTS)], axis=0) for k in theirs}
    mapped = A.group("server: their theta vs 0.01 + 0.98 f of the library's uploaded bits",
                     [A.difference(k, 0.01 + 0.98 * share[k], v) for k, v in theirs.items()])
    A.explain([mapped], "UNEXPLAINED")
    return rows + [server, mapped]
