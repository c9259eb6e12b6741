"""FedPM (Isik et al., ICLR 2023) against its code: `src/fedssm/client.py`'s `Client` (train_local,
upload_mask), `server.py`'s `Server.sample_mask_aggregation`, `models/model.py`'s `FedModel`
(its Adam at lr 0.1), `models/masked_layers.py`'s `Mask4CNN` (frozen +-c weights, Bernoulli masks of
weights and biases), `utils/random.py`'s `Bern`.

Three rounds, each client's Adam state carried from round to round (their `FedModel` builds its
optimizer once), the prior reset every round (their `reset_prior`); three clients of 150, 70 and 31
examples (28x28x1, their Mask4CNN's input), their parameter files' 3 local epochs of batches of 128
(the last short), Adam lr 0.1, one mask sample uploaded each. The library runs `fedpm` at its defaults
(`--prior-reset 1 --fedpm-optimizer-state client`, the code's) at --lr 0.1 on a Flax copy of their
Mask4CNN built here from the library's Model/ModelStructure (no zoo model has its shape: conv
64-64-128-128 3x3 'same' without normalization, pools after the 2nd and 4th, dense 6272-256-256-10);
its frozen weights and scores are set to theirs.

Random draws: both sides draw a Bernoulli mask at every forward pass and one to upload. The harness
records the library's (its `sampled_masks`, observed with a debug callback) and the official run
reuses them: `torch.bernoulli` (their `Bern`'s forward) and `fedssm.client.bernoulli.rvs` (scipy's, in
`upload_mask`) return the library's masks in their call order. Imports their code cannot make
(`models.pruned_layers`, `drive`, `eden`: modules the repository lacks) are empty stubs.

Causes:
  * `estimator`: their `Bern.backward` returns theta dL/dm, the library's straight-through estimator
    dL/dm (algorithms/fedpm.py: the supermask estimator, on purpose); aligned by their
    `Bern.backward` replaced by the identity.
  * `bit_values`: their clients map the sampled bits to 0.01 / 0.99 before the server counts them,
    so theta = 0.01 + 0.98 f (f the share of ones); the library takes theta = clip(f, 0.01, 0.99).
    The two agree when f is 0, 1/2 or 1, not with three clients. Aligned by handing the library's
    posterior (`fedpm.beta_posterior`, wrapped by the harness) the bits mapped to 0.01 / 0.99: its
    counts are then the code's.
The library broadcasts theta and its client starts from logit(theta); their client starts from the
scores themselves (one float32 sigmoid/logit round trip apart).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A
from benchmarks.parity import decisions as D
from benchmarks.parity.verdicts import Case

NAME = "fedpm"
REPOSITORY = "BerivanIsik/sparse-random-networks"
COMMIT = "cf6b54962cad7f085b935c4682d31940b3d9ef83"
CHECKOUT = "src"
MODEL = "their Mask4CNN (conv 64-64-128-128, dense 256-256-10, no normalization) on both sides, 28x28x1"
SEED = 0
COUNTS, BATCH, EPOCHS, ROUNDS, CLASSES, SIDE = (150, 70, 31), 128, 3, 3, 10, 28
CLIENTS = len(COUNTS)
LR = 0.1
ADAM_EPSILON = 1e-3  # the `adam_epsilon` alignment; Adam's own is 1e-8 on both sides
LAYERS = ("conv1", "conv2", "conv3", "conv4", "dense1", "dense2", "dense3")
SETUP = (f"{ROUNDS} rounds, each client's Adam state carried, the prior reset every round; clients holding "
         f"{', '.join(map(str, COUNTS))} examples; their parameter files' {EPOCHS} local epochs of batches of "
         f"{BATCH} (the last short), Adam lr {LR}, one mask sample uploaded.")
LIBRARY_OPTIONS = {"algorithm": "fedpm", "model": "a Flax copy of their Mask4CNN", "prior_reset": 1,
                   "fedpm_optimizer_state": "client", "lr": LR, "local_epochs": EPOCHS, "batch_size": BATCH}
CAUSES = {"estimator": "their Bern.backward scales each score's gradient by theta, the library's straight-through "
                       "estimator does not; aligned by their Bern.backward replaced by the identity",
          "bit_values": "their clients map the sampled bits to 0.01/0.99 before the server counts them (theta = "
                        "0.01 + 0.98 f), the library clips f to [0.01, 0.99]; aligned by handing the library's "
                        "posterior the bits mapped to 0.01/0.99",
          "adam_epsilon": "not a departure: both sides' Adam (epsilon 1e-8) turns float32 round-off in a gradient "
                          "within round-off of zero into a full step either way (lr g / (|g| + eps)); aligned by "
                          f"epsilon {ADAM_EPSILON:g} on both sides (the harness's wraps of optax.adam in the library's "
                          "fedpm module and of torch.optim.Adam)"}
CASES = {"published": Case("their code as published (Bern's gradient theta dL/dm, bits mapped to 0.01/0.99)"),
         "straight_through": Case("their Bern.backward replaced by the identity", ("estimator",)),
         "mapped_bits": Case("the library's posterior counting bits mapped to 0.01/0.99", ("bit_values",)),
         "both": Case("both", ("estimator", "bit_values")),
         "both_epsilon": Case(f"both, and Adam's epsilon at {ADAM_EPSILON:g} on both sides",
                              ("estimator", "bit_values", "adam_epsilon"))}
RUNS = {"published": "clipped", "straight_through": "clipped", "mapped_bits": "mapped", "both": "mapped",
        "both_epsilon": "mapped_epsilon"}


def params() -> dict:
    """Their parameter file's entries this run reads (params.yaml's layout)."""
    return {"model": {"id": "conv4", "mode": "mask", "local_epochs": EPOCHS, "init": "ME_init",
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


def torch_setup(checkout: Path, seed: int) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    _, _, masked_layers, _ = _official(checkout)
    T.deterministic(seed)
    state = T.state_arrays(masked_layers.Mask4CNN(init="ME_init", device="cpu").state_dict())
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(sum(COUNTS), 1, SIDE, SIDE)).astype(np.float32)
    y = rng.integers(0, CLASSES, sum(COUNTS)).astype(np.int64)
    return {**A.prefixed("init", state), "keys": np.array(list(state)), "data/x": x, "data/y": y,
            "data/counts": np.array(COUNTS)}


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    client_module, server_module, masked_layers, random = _official(checkout)
    library = A.under(library, RUNS[case])
    T.deterministic(SEED)
    decisions = D.OfficialDecisions(library, relu_owners=((masked_layers.activation_dict, "relu"),))
    if "estimator" in CASES[case].aligns:
        random.Bern.backward = staticmethod(lambda ctx, grad_output: grad_output)
    if "adam_epsilon" in CASES[case].aligns:
        adam = torch.optim.Adam

        class Adam(adam):  # their get_model's torch.optim.Adam(params, lr=0.1), at the aligned epsilon
            def __init__(self, params, *args, **kwargs):
                super().__init__(params, *args, **{**kwargs, "eps": ADAM_EPSILON})

        torch.optim.Adam = Adam
    draws: list = []  # (their score key, the library's mask) in the order their forward draws them

    def bernoulli(p):
        key, mask = draws.pop(0)
        if tuple(p.shape) != mask.shape:
            raise RuntimeError(f"torch.bernoulli got {tuple(p.shape)}, the next library draw ({key}) is {mask.shape}")
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
    masks = [k for k in setup["keys"] if "mask" in str(k)]
    out = {}
    for rnd in range(ROUNDS):
        server.broadcast_model(range(CLIENTS))
        for c, client in enumerate(clients):
            steps = EPOCHS * -(-COUNTS[c] // BATCH)
            for t in range(steps):
                draws.extend((score_key(layer, leaf), library[f"round{rnd}/client{c}/step{t}/{score_key(layer, leaf)}"])
                             for layer in LAYERS for leaf in ("kernel", "bias"))
            decisions.start(f"decisions/r{rnd}/c{c}")
            client.train_local(rnd)
            decisions.finish()
            assert not draws, f"round {rnd} client {c}: {len(draws)} library draws left unused"
            out.update({f"round{rnd}/client{c}/theta/{k}": 1.0 / (1.0 + np.exp(-v.astype(np.float64)))
                        for k, v in T.state_arrays(client.get_local_weights()).items() if "mask" in k})
        for c in range(CLIENTS):
            uploads.extend((k, library[f"round{rnd}/client{c}/upload/{k}"]) for k in masks)
        server.sample_mask_aggregation(list(range(CLIENTS)), rnd)
        assert not uploads, f"round {rnd}: {len(uploads)} library uploads left unused"
        out.update({f"round{rnd}/global/theta/{k}": 1.0 / (1.0 + np.exp(-v.astype(np.float64)))
                    for k, v in T.state_arrays(server.global_model.get_weights()).items() if "mask" in k})
    return {**out, **decisions.arrays()}


# ------------------------------------------------------------------ the JAX side

def _model():
    """Their Mask4CNN in Flax, with the structure the library's FedPM reads (kernels and biases)."""
    import flax.linen as nn

    from fedjax_sparse.models.layers import conv, conv_layer, dense_layer, relu_pool2
    from fedjax_sparse.models.structure import Model, ModelStructure

    convs = ((64, False), (64, True), (128, False), (128, True))

    class Conv4(nn.Module):
        @nn.compact
        def __call__(self, x, train, mask=None, unit_masks=None):
            del train, mask, unit_masks
            for i, (width, pool) in enumerate(convs):
                # the library's convolution: its gradients stay on XLA:CPU's fast path inside the training
                # loop, where nn.Conv's run about 20 times slower (models/conv.py)
                x = conv(width, 3, padding=1, name=f"conv{i + 1}")(x)
                x = relu_pool2(x) if pool else nn.relu(x)
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


def library(setup: dict, cases) -> dict[str, np.ndarray]:
    """The library's rounds, for the variants `cases` compare with: as it is, and with its posterior
    counting the bits mapped to 0.01/0.99 (the `bit_values` alignment)."""
    return {k: v for run in dict.fromkeys(RUNS[c] for c in cases)
            for k, v in A.prefixed(run, library_rounds(setup, mapped_bits=run.startswith("mapped"),
                                                       epsilon=run.endswith("epsilon"))).items()}


def library_rounds(setup: dict, mapped_bits: bool, epsilon: bool) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import fedpm as fedpm_module
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD

    model = _model()
    maps = mapping()
    init = A.under(setup, "init")
    variables = J.load_torch(model.init(jax.random.key(0)), maps, init)
    split = J.federated_data(setup)
    local = LocalSGD(model, LR, EPOCHS, BATCH)
    context = BuildContext(local=local, num_clients=CLIENTS, clients_per_round=CLIENTS, train=split,
                           num_classes=CLASSES, seed=0)
    algorithm = make_algorithm("fedpm", context, make_options("fedpm", {}))
    server_state, client_states = algorithm.init(jax.random.key(1), variables, CLIENTS)
    scores = {f"{layer}/{leaf}": jnp.asarray(J.from_torch(maps[f"{layer}.weight"][2] if leaf == "kernel" else "vector",
                                                          init[score_key(layer, leaf)]))
              for layer in LAYERS for leaf in ("kernel", "bias")}
    server_state = {**server_state, "weights": variables["params"],
                    "theta": {name: jax.nn.sigmoid(s) for name, s in scores.items()}}
    states = [jax.tree_util.tree_map(lambda leaf: leaf[c], client_states) for c in range(CLIENTS)]
    calls: list = []
    sampled, posterior = fedpm_module.sampled_masks, fedpm_module.beta_posterior

    def observed(thetas, key):
        masks = sampled(thetas, key)
        jax.debug.callback(lambda t, m: calls.append((t, m)), thetas, masks, ordered=True)
        return masks

    def code_bits(alpha, beta, bits, reset, participating=None):  # the code's counts: bits as 0.01 / 0.99
        return posterior(alpha, beta, {k: 0.01 + 0.98 * b.astype(jnp.float32) for k, b in bits.items()}, reset,
                         participating)

    def torch_names(tree):  # {layer/leaf: array} -> {their score key: array in torch layout}
        out = {}
        for name, value in tree.items():
            layer, leaf = name.split("/")
            kind = maps[f"{layer}.weight"][2] if leaf == "kernel" else "vector"
            out[score_key(layer, leaf)] = J.to_torch(kind, np.asarray(value))
        return out

    def after(i, c, up, state, metrics):
        *steps, upload = calls
        calls.clear()
        out = {}
        for t, (_, masks) in enumerate(steps):
            out.update(A.prefixed(f"round{i}/client{c}/step{t}", {k: v.astype(bool)
                                                                  for k, v in torch_names(masks).items()}))
        out.update(A.prefixed(f"round{i}/client{c}/theta", torch_names(upload[0])))
        out.update(A.prefixed(f"round{i}/client{c}/upload", torch_names({k: b.bits for k, b in up["mask"].items()})))
        return out

    class Optax:  # the fedpm module's optax, its Adam at the aligned epsilon
        def __getattr__(self, name):
            return getattr(optax, name)

        @staticmethod
        def adam(learning_rate):
            return optax.adam(learning_rate, eps=ADAM_EPSILON)

    fedpm_module.sampled_masks = observed
    fedpm_module.beta_posterior = code_bits if mapped_bits else posterior
    if epsilon:
        fedpm_module.optax = Optax()
    try:
        clients = list(range(CLIENTS))
        return J.run_rounds(algorithm, server_state, states, split, [(i, clients) for i in range(ROUNDS)],
                            after=after, after_round=lambda i, state: A.prefixed(f"round{i}/global/theta",
                                                                                 torch_names(state["theta"])))
    finally:
        fedpm_module.sampled_masks, fedpm_module.beta_posterior, fedpm_module.optax = sampled, posterior, optax


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    ours = A.under(library, RUNS[case])
    rows = []
    for rnd in range(ROUNDS):
        for c in range(CLIENTS):
            prefix = f"round{rnd}/client{c}/theta"
            rows.append(A.group(f"round {rnd + 1}: client {c} trained theta",
                                [A.difference(k, ours[f"{prefix}/{k}"], v, key=f"{prefix}/{k}")
                                 for k, v in A.under(official, prefix).items()]))
        prefix = f"round{rnd}/global/theta"
        rows.append(A.group(f"round {rnd + 1}: server theta after aggregation",
                            [A.difference(k, ours[f"{prefix}/{k}"], v, key=f"{prefix}/{k}")
                             for k, v in A.under(official, prefix).items()]))
    return rows + [D.aligned_row(official)]
