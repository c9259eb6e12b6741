"""SpaFL (Kim et al., NeurIPS 2024) in its code variant (`--spafl-variant code`) against the official
CIFAR-10 code: `main/cifar10/client/Client_Class.py`'s `Client` (th_update, local_test,
local_training), `server/Server_Class.py`'s `Server` (broadcast, aggregation), `model/net.py`'s
`masked_Conv4` with `model/binarization.py`'s `MaskedConv2d`, `MaskedMLP` and `BinaryStep`.

One round as `Simulator.py`'s loop runs it, for three clients of 32 examples (32x32x3), each with its
own weights and its own thresholds from an earlier round: eq. 13 from a given change of the global
thresholds (`th_update`), the evaluation that follows it (`local_test`, whose forward pass sets the
mask the next round's reset check reads), the server's `broadcast` of the new global thresholds,
`local_training` (two epochs of two batches of 16: four steps of momentum-0.9 SGD at lr 0.01, the
eq. 5 regularizer, gradients clipped to norm 3, their CIFAR-10 command's settings but for alpha), and
`aggregation` (the uniform mean). The library runs `spafl --spafl-variant code` on `spafl_cnn` (their
masked_Conv4: the same layers, no biases, BatchNorm after every layer but the last) from the same
weights, thresholds and batches, with its client state set to what the code's client holds: its own
thresholds and the global thresholds it received last round.

Settings chosen so that every piece of the code's step shows:
  * the thresholds: the global ones sit at -1.5, -0.5, +0.5 (and +1.5 in the output layer, which has
    no BatchNorm) per unit, plus a jitter, so units are kept and pruned both with the gate of their
    `BinaryStep` open (|mean |w| - tau| > 1) and shut; a layer keeps about half its units;
  * conv1's own thresholds (from the client's last round) prune all of it: the code's reset check
    then zeroes the thresholds conv1 receives, before its first forward pass;
  * alpha = 0.01: their CIFAR-10 command's 0.00015 moves a threshold by ~2e-5 in four steps, below
    what the comparison resolves; at 0.01 the regularizer's push is ~100 times round-off;
  * the change of the global thresholds is within +-0.05 per unit, so eq. 13 moves a conv kernel by
    up to 0.002 (dtau / k^2), a tenth of conv2's weights.

The code's departures the library documents (docs/methods/spafl.md) are matched by the setup:
  * eq. 13 timing: the code applies tau(t+1) - tau(t) to every client after each aggregation, the
    library a sampled client's change since its last download; the harness gives the official client
    that change through `th_update` just before the round, as the code's previous aggregation would;
  * upload before the reset: no layer collapses in the last step (the row of resets checks it: a
    collapse there would be counted by the library at that step, by the code at the next pass);
  * drop_last: every client holds whole batches, so the library's ceil(n/B) steps are the code's
    floor(n/B).

Their code imports unchanged, with two pieces of plumbing: `model/net.py` imports `from binarization
import *` (a module on the path by that name) while `client/Client_Class.py` and
`server/Server_Class.py` test `isinstance(layer, model.binarization.MaskedMLP)`; the harness loads
`model/binarization.py` once and registers it under both names, so the classes are the same (two
copies would make every isinstance test false and their round a no-op). einops, imported by their
ViT classes only, is an import stub. `Client.FLOP_count_weight` reads `len(tr_loader.dataset)`: the
harness's batches carry the examples as `dataset`.

The evaluation before the round. The code's reset check reads the mask of a layer's previous forward
pass, and the pass before a round is the last batch of `local_test`. With one test batch (case
`published`) that pass ran under the client's own thresholds, so the round's first pass zeroes the
conv1 thresholds the client received: the library's reading (`spafl_code.reset_after_collapse` on the
mask of the client's own thresholds). With two or more (case `two_test_batches`, and every client of
their CIFAR-10 run holding more than 16 test examples) the second test batch already resets the
client's own conv1 thresholds, its mask is then whole, and the round keeps the conv1 thresholds it
receives; the library still resets them. That difference is the library's (not documented there).

Known differences:
  * torch's BatchNorm updates its running variance with the unbiased batch variance (x n/(n-1),
    n = batch x positions), the library's (Flax's) with the biased one; the per-client rows compare
    the library's update part times n/(n-1), and the row "running variances as they are" shows the
    difference itself;
  * max pooling's near-ties: a 2x2 window whose two largest values lie within float32 round-off of
    each other can pool either, and the gradient then goes to another input. The harness records the
    closest window of each client's forward passes (their pooling, wrapped) and the gradients of each
    client's first step on both sides (at their `clip_grad_norm_` and the library's `clip_grad_norm`,
    wrapped): a client whose trained tensors differ gets a row of its first step's gradients, which
    names the tie's unit and how much of the kernel gradient's error it carries.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A

NAME = "spafl"
REPOSITORY = "news-vt/SpaFL_NeruIPS_2024"
COMMIT = "d3639ab3c6ecae3a3d09cf897b264fc44551a56c"
CHECKOUT = "main/cifar10"
MODEL = "their masked_Conv4 (conv 64-64-128-128 5x5, dense 128-128-10, BN) / the library's spafl_cnn, 32x32x3"
SEED = 0
CLIENTS, EXAMPLES, BATCH, EPOCHS, CLASSES, SIDE = 3, 32, 16, 2, 10, 32
LR, MOMENTUM, ALPHA, CLIP = 0.01, 0.9, 0.01, 3
RESET_LAYER = "conv1"
LAYERS = {"conv1": "conv1", "conv2": "conv2", "conv3": "conv3", "conv4": "conv4",
          "dense1": "fc1", "dense2": "fc2", "dense3": "fc3"}  # theirs -> the library's structure layer
# positions per example at each BatchNorm (28x28, 24x24, 8x8, 4x4 maps; the dense layers' one)
BN_POSITIONS = {"bn1": 28 * 28, "bn2": 24 * 24, "bn3": 8 * 8, "bn4": 4 * 4, "bn5": 1, "bn6": 1}
LIBRARY_OPTIONS = {"algorithm": "spafl", "spafl_variant": "code", "model": "spafl_cnn", "sparsity_coef": ALPHA,
                   "threshold_update": True, "lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0,
                   "local_epochs": EPOCHS, "batch_size": BATCH, "clients_per_round": "all"}
CASES = {
    "published": "their code as published (`--learning_rate 0.01 --batch_size 16 --clip 3`, "
                 f"`--th_coeff {ALPHA}`, `--local_epoch {EPOCHS}`), the evaluation before the round on one batch",
    "two_test_batches": "the same with the evaluation before the round (`local_test`) on two batches, as for any "
                        "client holding more than 16 test examples",
}
RESET_IN_EVALUATION = ("the code's reset fires inside the evaluation (its second batch reads the first's collapsed "
                       "conv1 and zeroes the client's own thresholds), so the round keeps the conv1 thresholds it "
                       "receives; the library resets the received ones")  # case two_test_batches
NEAR_TIE = 1e-5  # a max-pool window's top two values closer than this (relative) can swap under round-off
TIE = "a max-pool near-tie in the first step"
BESSEL = "torch's running variance takes the unbiased batch variance (x n/(n-1)), the library's the biased one"


def _args() -> list[str]:
    return ["train.py", "--model", "conv4", "--learning_rate", str(LR), "--th_coeff", str(ALPHA),
            "--batch_size", str(BATCH), "--local_epoch", str(EPOCHS), "--clip", str(CLIP), "--momentum", str(MOMENTUM),
            "--num_clients", str(CLIENTS), "--schedulingsize", str(CLIENTS)]


# ------------------------------------------------------------------ the PyTorch side

def _official(checkout: Path):
    from benchmarks.parity import torch_side as T
    T.enter_checkout(checkout)
    T.stub_module("einops", rearrange=T.refuse("einops.rearrange"), repeat=T.refuse("einops.repeat"))
    T.stub_module("einops.layers.torch", Rearrange=T.refuse("einops.layers.torch.Rearrange"))
    spec = importlib.util.spec_from_file_location("model.binarization", checkout / "model" / "binarization.py")
    binarization = importlib.util.module_from_spec(spec)
    sys.modules["model.binarization"] = sys.modules["binarization"] = binarization
    spec.loader.exec_module(binarization)
    import model
    model.binarization = binarization
    from client import Client_Class
    from model import net
    from server import Server_Class
    sys.argv = _args()
    import train_argument
    return binarization, net, Client_Class, Server_Class, train_argument.parser()


def _masked_layers(network, binarization) -> dict:
    return {name: layer for name, layer in network.named_modules()
            if isinstance(layer, (binarization.MaskedConv2d, binarization.MaskedMLP))}


def _unit_mask(layer) -> np.ndarray:
    """Their mask (one value repeated over a unit's fan-in) per unit."""
    return layer.mask.detach().numpy().reshape(layer.mask.shape[0], -1)[:, 0].astype(bool)


class _PoolGaps:
    """Wraps `torch.nn.functional.max_pool2d` (their forward's pooling, 2x2 stride 2 after ReLU) to record,
    over the training passes (gradients on), the smallest gap between the two largest values of a window
    relative to the largest: where it is within float32 round-off, the two sides can pick different maxima
    and send the gradient to different inputs. `gaps` holds, per call, (call, gap, example, channel,
    window row, window column) of its closest window."""

    def __init__(self):
        import torch.nn.functional as F
        self.original = F.max_pool2d
        self.gaps: list[tuple] = []

        def max_pool2d(x, *args, **kwargs):
            if x.requires_grad:
                self.gaps.append((len(self.gaps),) + self.smallest(x.detach().numpy()))
            return self.original(x, *args, **kwargs)

        F.max_pool2d = max_pool2d

    @staticmethod
    def smallest(x: np.ndarray) -> tuple:
        h, w = x.shape[2] // 2 * 2, x.shape[3] // 2 * 2
        x = x[:, :, :h, :w].astype(np.float64)
        windows = np.sort(np.stack([x[:, :, i::2, j::2] for i in (0, 1) for j in (0, 1)], -1), -1)
        top = windows[..., -1]
        gap = np.where(top > 0, (top - windows[..., -2]) / np.where(top > 0, top, 1.0), np.inf)
        where = np.unravel_index(np.argmin(gap), gap.shape)
        return (float(gap[where]),) + tuple(int(i) for i in where)


def torch_setup(checkout: Path) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    binarization, net, _, _, _ = _official(checkout)
    T.deterministic(SEED)
    out = {}
    for c in range(CLIENTS):
        out.update(A.prefixed(f"init/client{c}", T.state_arrays(net.masked_Conv4().state_dict())))
    rng = np.random.default_rng(SEED)
    units = {name: layer.threshold.shape[0] for name, layer in _masked_layers(net.masked_Conv4(), binarization).items()}
    for name, n in units.items():
        levels = (-1.5, -0.5, 0.5, 1.5) if name == "dense3" else (-1.5, -0.5, 0.5)
        new = rng.choice(levels, n) + rng.uniform(-0.05, 0.05, n)
        prev = new - rng.uniform(-0.05, 0.05, n)
        out[f"global/new/{name}"], out[f"global/prev/{name}"] = new.astype(np.float32), prev.astype(np.float32)
        for c in range(CLIENTS):  # the client's own thresholds, from its last round
            own = np.full(n, 1.5) if name == RESET_LAYER else prev + rng.uniform(-0.1, 0.1, n)
            out[f"init/client{c}/{name}.threshold"] = own.astype(np.float32)
    out.update({"data/x": rng.normal(size=(EXAMPLES * CLIENTS, 3, SIDE, SIDE)).astype(np.float32),
                "data/y": rng.integers(0, CLASSES, EXAMPLES * CLIENTS).astype(np.int64),
                "data/counts": np.full(CLIENTS, EXAMPLES), "keys": np.array(list(A.under(out, "init/client0")))})
    return out


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    binarization, net, Client_Class, Server_Class, args = _official(checkout)
    assert (args.learning_rate, args.momentum, args.th_coeff, args.clip, args.lr_decay, args.weight_decay) == \
        (LR, MOMENTUM, ALPHA, CLIP, 1, 0.0), args
    T.deterministic(SEED)
    norms = T.GradientNorms(clip=True)
    pools = _PoolGaps()
    first_gradients: dict = {}  # per client, the gradients its first clip call saw
    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        if training not in first_gradients:
            first_gradients[training] = {name: p.grad.detach().numpy().copy()
                                         for name, p in clients[training].model.named_parameters()}
        return clip(parameters, max_norm, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = recording_clip
    clients = []
    for c in range(CLIENTS):
        network = net.masked_Conv4()
        T.load_state(network, A.under(setup, f"init/client{c}"))
        x, y = T.client_arrays(setup, c)
        batches = T.Batches(x, y, BATCH, T.tensor_pair)
        batches.dataset = x
        tested = EXAMPLES if case == "two_test_batches" else BATCH
        test = T.Batches(x[:tested], y[:tested], BATCH, T.tensor_pair)
        clients.append(Client_Class.Client(args, network, torch.nn.CrossEntropyLoss(), c, batches, test,
                                           torch.device("cpu")))
    server_network = net.masked_Conv4()
    with torch.no_grad():
        for name, layer in _masked_layers(server_network, binarization).items():
            layer.threshold.copy_(torch.from_numpy(setup[f"global/new/{name}"]))
    server = Server_Class.Server(args, server_network)
    # what the previous aggregation left in server.global_difference
    difference = {name: torch.from_numpy(setup[f"global/new/{name}"] - setup[f"global/prev/{name}"])
                  for name in LAYERS}
    out = {}
    for c, client in enumerate(clients):  # Simulator.py: th_update, then every client's local_test
        client.th_update(difference)
        layers = _masked_layers(client.model, binarization)
        out.update({f"client{c}/eq13/{name}.weight": layer.weight.detach().numpy().copy()
                    for name, layer in layers.items()})
        client.local_test()
        out.update({f"client{c}/start_mask/{name}": _unit_mask(layer) for name, layer in layers.items()})
    sampled = np.arange(CLIENTS)
    server.broadcast(clients, sampled)  # the next round: broadcast, local_training, aggregation
    for training in sampled:
        c = int(training)
        pools.gaps.clear()
        clients[c].local_training(0)
        out.update(A.prefixed(f"client{c}/gradient", first_gradients[training]))
        out[f"client{c}/pool_gap"] = np.array(min(pools.gaps, key=lambda g: g[1]), np.float64)
    server.aggregation(clients, sampled)
    for c, client in enumerate(clients):
        layers = _masked_layers(client.model, binarization)
        out.update(A.prefixed(f"client{c}/value", T.state_arrays(client.model.state_dict())))
        # a layer whose last pass kept <= 1 % is reset by the next pass; the library resets it at that step
        out[f"client{c}/pending_resets"] = np.array([float(layer.ratio.detach()) <= 0.01 for layer in layers.values()])
        out[f"client{c}/resets"] = np.array([layer.zero_count for layer in layers.values()])
        for name, layer in layers.items():
            layer.mask_generation(layer.weight, layer.threshold)  # their mask of the trained weights
            out[f"client{c}/end_mask/{name}"] = _unit_mask(layer)
    out.update({f"global/{name}": t.detach().numpy().copy() for name, t in server.global_thresholds.items()})
    out["norms"] = np.array(norms.norms)
    return out


# ------------------------------------------------------------------ the JAX side

def mapping(setup: dict) -> dict:
    """Their convs/denses onto spafl_cnn's conv1-4/fc1-3 kernels (dense1 reads the flattened 128 x 2 x 2
    map), bn1-6 onto bn1-6 (running statistics into batch_stats); thresholds and num_batches_tracked
    are not variables."""
    out = {}
    for key in map(str, setup["keys"]):
        module, param = key.rsplit(".", 1)
        if module in LAYERS and param == "weight":
            kind = "conv" if module.startswith("conv") else ("flat:128,2,2" if module == "dense1" else "dense")
            out[key] = ("params", (LAYERS[module], "kernel"), kind)
        elif module.startswith("bn") and param in ("weight", "bias"):
            out[key] = ("params", (module, {"weight": "scale", "bias": "bias"}[param]), "vector")
        elif module.startswith("bn") and param in ("running_mean", "running_var"):
            out[key] = ("batch_stats", (module, param.removeprefix("running_")), "vector")
    return out


def _thresholds(arrays: dict, prefix: str, suffix: str = "") -> dict:
    import jax.numpy as jnp
    return {LAYERS[name]: jnp.asarray(arrays[f"{prefix}{name}{suffix}"]) for name in LAYERS}


def _their_names(tree: dict) -> dict[str, np.ndarray]:
    names = {v: k for k, v in LAYERS.items()}
    return {names[k]: np.asarray(v) for k, v in tree.items()}


def library(setup: dict) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import make_algorithm, make_options, spafl_code
    from fedjax_sparse.algorithms.spafl import global_threshold_update, threshold_masks
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.round.step import round_info
    from fedjax_sparse.models import get_model

    model = get_model("spafl_cnn", (SIDE, SIDE, 3), CLASSES)
    structure = model.structure
    maps = mapping(setup)
    blank = model.init(jax.random.key(0))
    split = J.federated_data(setup)
    local = LocalSGD(model, LR, EPOCHS, BATCH, MOMENTUM, 0.0)
    context = BuildContext(local=local, num_clients=CLIENTS, clients_per_round=CLIENTS, train=split,
                           num_classes=CLASSES, seed=0)
    algorithm = make_algorithm("spafl", context, make_options("spafl", {"spafl_variant": "code",
                                                                        "sparsity_coef": ALPHA}))
    server_state = {"thresholds": _thresholds(setup, "global/new/")}
    previous = _thresholds(setup, "global/prev/")
    delta = jax.tree_util.tree_map(jnp.subtract, server_state["thresholds"], previous)
    info = round_info(0, 0, jnp.arange(CLIENTS))
    # the gradients the code variant's clip sees, step by step: its clip is looked up in the module when
    # local training builds its optimizer (inside the trace below)
    spafl_module = sys.modules["fedjax_sparse.algorithms.spafl"]
    clip = spafl_module.clip_grad_norm
    gradients: list = []

    def recording_clip(max_norm):
        inner = clip(max_norm)

        def update(grads, state, params=None):
            jax.debug.callback(lambda g: gradients.append(g), grads, ordered=True)
            return inner.update(grads, state, params)

        return optax.GradientTransformation(inner.init, update)

    out, ups = {}, []
    spafl_module.clip_grad_norm = recording_clip
    try:
        client_update = jax.jit(algorithm.client_update)
        with J.fixed_data_order():
            for c in range(CLIENTS):
                variables = J.load_torch(blank, maps, A.under(setup, f"init/client{c}"))
                own = _thresholds(setup, f"init/client{c}/", ".threshold")
                moved = global_threshold_update(structure, variables["params"], delta, spafl_code.eq13_divisor)
                out.update(A.prefixed(f"client{c}/eq13", J.in_torch_layout({"params": moved}, maps)))
                out.update(A.prefixed(f"client{c}/start_mask", _their_names(threshold_masks(structure, moved, own))))
                state = {"variables": variables, "thresholds": own, "global_thresholds": previous,
                         "train_flops": jnp.zeros((), jnp.float32)}
                up, new, metrics = client_update(algorithm.broadcast(server_state, c, info), state, split.client(c),
                                                 jax.random.key(100 + c), info)
                jax.effects_barrier()
                ups.append(up)
                first = gradients[0]
                gradients.clear()
                out.update(A.prefixed(f"client{c}/gradient", J.in_torch_layout({"params": first["params"]}, maps)))
                out.update({f"client{c}/gradient/{k}.threshold": v
                            for k, v in _their_names(first["thresholds"]).items()})
                out.update(A.prefixed(f"client{c}/value", J.in_torch_layout(new["variables"], maps)))
                out.update({f"client{c}/value/{k}.threshold": v for k, v in _their_names(up).items()})
                out.update(A.prefixed(f"client{c}/end_mask", _their_names(
                    threshold_masks(structure, new["variables"]["params"], new["thresholds"]))))
                out[f"client{c}/resets"] = np.asarray(metrics["threshold_resets"])
    finally:
        spafl_module.clip_grad_norm = clip
    new_server = jax.jit(algorithm.server_update)(server_state, J.stack(ups), split.counts, info)
    out.update(A.prefixed("global", _their_names(new_server["thresholds"])))
    return out


def _rescaled_variance(setup: dict, library: dict, c: int, key: str, steps: int) -> np.ndarray:
    """The library's running variance with its update part (what the steps added to keep^steps times
    the start) times n/(n-1): torch's, if the batch variances agree."""
    keep = 0.9 ** steps
    start = setup[f"init/client{c}/{key}"].astype(np.float64)
    n = BATCH * BN_POSITIONS[key.split(".")[0]]
    return keep * start + (library[f"client{c}/value/{key}"].astype(np.float64) - keep * start) * n / (n - 1)


def _tie_unit(library: dict, official: dict, c: int) -> str:
    """Client c's first-step gradient error, against the nearest max-pool tie of its forward passes: a
    tie in the first step's pool after conv2 or conv4 (within NEAR_TIE) whose unit carries the kernel
    gradient's error, at least ten times any other unit's, explains it."""
    call, gap, example, unit, row, column = (int(v) if i != 1 else float(v)
                                             for i, v in enumerate(official[f"client{c}/pool_gap"]))
    layer = f"conv{2 + 2 * (call % 2)}"
    theirs = official[f"client{c}/gradient/{layer}.weight"]
    error = np.abs(library[f"client{c}/gradient/{layer}.weight"] - theirs).reshape(theirs.shape[0], -1).max(axis=1)
    others = np.delete(error, unit).max()
    scale = float(np.abs(theirs).max())
    if gap > NEAR_TIE or call >= 2 or error[unit] <= 10 * others:
        return "UNEXPLAINED"
    return (f"{TIE}; a 2x2 window after {layer} (example {example}, unit {unit}, window {row},{column}) holds two "
            f"values {gap:.1e} apart relative to their size, and float32 round-off can make either the maximum; "
            f"{layer}'s kernel gradient is off by {error[unit] / scale:.1e} (of its largest entry) in unit {unit}, "
            f"by at most {others / scale:.1e} in every other unit; the other layers' errors flow back from that unit")


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    steps = EPOCHS * EXAMPLES // BATCH

    def client_row(c, what, select, ours=None, start=None):
        theirs = A.under(official, f"client{c}/value")
        return A.group(f"client {c}: {what}",
                       [A.difference(key, library[f"client{c}/value/{key}"] if ours is None else ours(c, key),
                                     value, None if start is None else start(c, key))
                        for key, value in sorted(theirs.items()) if select(key)])

    def start(c, key):
        if key.endswith(".threshold"):
            return setup[f"global/new/{key.removesuffix('.threshold')}"]
        return setup[f"init/client{c}/{key}"]

    def trained(key):
        return key.endswith((".weight", ".bias", ".threshold"))

    eq13 = A.group("eq. 13: kernels moved by the threshold change (dtau / k^2 conv, / in_size dense)",
                   [A.difference(f"client{c}/{k}", library[f"client{c}/eq13/{k}"], v, setup[f"init/client{c}/{k}"])
                    for c in range(CLIENTS) for k, v in A.under(official, f"client{c}/eq13").items()])
    A.explain([eq13], "UNEXPLAINED")
    rows = [eq13]
    for c in range(CLIENTS):
        group = [client_row(c, "kernels, BatchNorm scales and shifts, thresholds after local training (its upload)",
                            trained, start=start),
                 client_row(c, "BatchNorm running means, and variances with the library's update x n/(n-1)",
                            lambda k: k.endswith(("running_mean", "running_var")),
                            ours=lambda c, k: (_rescaled_variance(setup, library, c, k, steps)
                                               if k.endswith("running_var") else library[f"client{c}/value/{k}"]))]
        if case != "published":
            A.explain(group, RESET_IN_EVALUATION)
        elif max(r["max_rel"] for r in group) > A.ROUND_OFF:
            # where did it start: the first step's gradients, against the nearest max-pool tie of the client
            gradient = A.group(f"client {c}: the first step's gradients (what the clip sees)",
                               [A.difference(k, library[f"client{c}/gradient/{k}"], v)
                                for k, v in sorted(A.under(official, f"client{c}/gradient").items())])
            A.explain([gradient], _tie_unit(library, official, c))
            A.explain(group, "UNEXPLAINED" if gradient["note"] == "UNEXPLAINED" else
                      f"{TIE}; the row above, carried through the later steps")
            group.insert(0, gradient)
        else:
            A.explain(group, "UNEXPLAINED")
        rows += group
    variance = A.group("BatchNorm running variances as they are",
                       [A.difference(f"client{c}/{k}", library[f"client{c}/value/{k}"], v)
                        for c in range(CLIENTS) for k, v in A.under(official, f"client{c}/value").items()
                        if k.endswith("running_var")])
    A.explain([variance], BESSEL if case == "published" else f"{RESET_IN_EVALUATION}; and {BESSEL}")
    server = A.group("server: global thresholds (uniform mean of the uploads, eq. 7)",
                     [A.difference(name, library[f"global/{name}"], official[f"global/{name}"]) for name in LAYERS])
    ties = [r["compared"].split(":")[0] for r in rows if r["note"].startswith(TIE)
            and r["compared"].endswith("(its upload)")]
    A.explain([server], RESET_IN_EVALUATION if case != "published" else
              (f"{TIE}; in the upload of {', '.join(ties)} (above)" if ties else "UNEXPLAINED"))
    # each side's mean against its own uploads: what is left is the uploads' difference
    own = max(float(np.max(np.abs(side[f"global/{name}"].astype(np.float64) - np.mean(
        [side[f"client{c}/value/{name}.threshold"] for c in range(CLIENTS)], axis=0, dtype=np.float64))))
        for side in (library, official) for name in LAYERS)
    norms = official["norms"]
    server["note"] += (f"; each side's mean equals the mean of its own uploads to {own:.1e}; gradient norms their "
                       f"clipping saw: {norms.min():.3g} to {norms.max():.3g} ({int(np.sum(norms > CLIP))} of "
                       f"{len(norms)} steps clipped to {CLIP})")

    def masks(what, prefix):
        ours = {f"client{c}/{n}": library[f"client{c}/{prefix}/{n}"] for c in range(CLIENTS) for n in LAYERS}
        theirs = {f"client{c}/{n}": official[f"client{c}/{prefix}/{n}"] for c in range(CLIENTS) for n in LAYERS}
        differing = sorted({k.split("/")[1] for k in ours if not np.array_equal(ours[k], theirs[k])})
        kept = sum(int(np.sum(v)) for v in theirs.values())
        return A.identical(what, ours, theirs, f"the same units, exactly ({kept:,} of "
                                               f"{sum(v.size for v in theirs.values()):,} kept)" if not differing
                           else f"DIFFERENT units (in {', '.join(differing)})" + (
                               "" if case == "published" else f": {RESET_IN_EVALUATION}"))

    ours_resets = {f"client{c}": library[f"client{c}/resets"] for c in range(CLIENTS)}
    theirs_resets = {f"client{c}": np.sum(official[f"client{c}/resets"]) + np.sum(official[f"client{c}/pending_resets"])
                     for c in range(CLIENTS)}
    pending = sum(int(np.sum(official[f"client{c}/pending_resets"])) for c in range(CLIENTS))
    same = all(int(ours_resets[k]) == int(theirs_resets[k]) for k in ours_resets)
    where = ("before the first step, on the thresholds received" if case == "published" else
             "the code's in the evaluation, on the client's own thresholds; the library's on those received")
    resets = A.identical("layers reset (<= 1 % kept) from the evaluation to the upload", ours_resets, theirs_resets,
                         (f"the same count: {sum(int(v) for v in theirs_resets.values())} (conv1, collapsed under "
                          f"each client's own thresholds; {where}); {pending} after the last step, so the upload "
                          f"precedes no reset" if same else "DIFFERENT counts"))
    exact = [masks("units kept under the client's own thresholds after eq. 13 (the reset check)", "start_mask"),
             resets, masks("units kept after local training (the personal model)", "end_mask")]
    return exact + rows + [variance, server]
