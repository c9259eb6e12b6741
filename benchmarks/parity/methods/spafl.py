"""SpaFL (Kim et al., NeurIPS 2024) in its code variant (`--spafl-variant code`) against the official
CIFAR-10 code: `main/cifar10/client/Client_Class.py`'s `Client` (th_update, local_test,
local_training), `server/Server_Class.py`'s `Server` (broadcast, aggregation), `model/net.py`'s
`masked_Conv4` with `model/binarization.py`'s `MaskedConv2d`, `MaskedMLP` and `BinaryStep`.

Three rounds as `Simulator.py`'s loop runs them, two of three clients sampled each round (0 and 1, then
1 and 2, then 0 and 2), so each client sits one round out: `broadcast`, each sampled client's
`local_training`, `aggregation` (the uniform mean), every client's `th_update` (eq. 13 from the change
of the global thresholds) and every client's `local_test` (whose forward pass sets the mask the next
round's reset check reads). The clients hold 45, 30 and 28 examples (32x32x3; each epoch's last batch
holds 13, 14 and 12 where it is kept), each with its own weights and thresholds from an earlier round,
given that round's change of the global thresholds through `th_update` before the first round. Not 21
examples for the third client, as before: its last batch of 5 made the official run itself unsteady
(BatchNorm's batch statistics of 5 examples gave gradient norms up to 30, and the run under one ulp of
noise per step parted from it ~10x per epoch, 5.6e-6 to 1.9e-4 in the gradient norm over its 10 steps of
round 2, measured on the draw with seed 3; the draws with seeds 0 to 3 were all unsteady for that
client), so no comparison could resolve round-off there. Their CIFAR-10 command's settings
(`run_command.txt`): lr 0.01, momentum 0.9, batches of 16 (their loader drops the last partial one), 5
local epochs, `--th_coeff 0.00015`, `--clip 3`. The library runs `spafl --spafl-variant code` on
`spafl_cnn` (their masked_Conv4: the same layers, no biases, BatchNorm after every layer but the last)
from the same weights, thresholds and batches, its client state set to what the code's client holds: its
own thresholds and the global thresholds it last received.

Settings chosen so that the code's step shows, and its decisions stay clear of a tie:
  * the global thresholds sit at -1.5, -0.5, +0.5 (and +1.5 in the output layer, which has no
    BatchNorm) per unit, plus a jitter, so units are kept and pruned both with the gate of their
    `BinaryStep` open (|mean |w| - tau| > 1) and shut, each at least ~0.4 from the mask's and the
    gate's thresholds (the margin rows check every pass on both sides);
  * the first round's clients' own conv1 thresholds (from their last round) prune all of it: the
    code's reset check then zeroes the conv1 thresholds a client receives, before its first forward
    pass, or, when its evaluation runs two batches or more, the client's own in that evaluation (cause
    below). The third client's do not: it sits the first round out, and a second evaluation in a row
    would reset them there too;
  * the change of the global thresholds is within +-0.05 per unit.

Eq. 13's timing: the code applies tau(t+1) - tau(t) to every client after each aggregation, the
library a sampled client's change since its last download: the same total (the changes telescope),
but the code re-reads sign(sum w) at each application, and eq. 13 moves all of a unit's weights the
same way, so a unit's sign can flip in between (cause `eq13_timing` below).

Their code imports unchanged, with two pieces of plumbing: `model/net.py` imports `from binarization
import *` (a module on the path by that name) while `client/Client_Class.py` and
`server/Server_Class.py` test `isinstance(layer, model.binarization.MaskedMLP)`; the harness loads
`model/binarization.py` once and registers it under both names, so the classes are the same (two
copies would make every isinstance test false and their round a no-op). einops, imported by their
ViT classes only, is an import stub. `Client.FLOP_count_weight` reads `len(tr_loader.dataset)`: the
harness's batches carry the examples as `dataset`.

Causes:
  * `drop_last`: their loader drops each epoch's last partial batch (floor(n / B) steps), the
    library's epochs take ceil(n / B); aligned by their loader keeping it;
  * `reset_in_evaluation`: every forward pass of theirs checks the previous one's mask, evaluation's
    too: with two test batches or more (any client holding more than 16 test examples; here each
    client's evaluation runs over its examples) a layer collapsed under the client's own thresholds
    is reset during the evaluation, and the next round keeps the thresholds it receives; the library
    resets the received ones; aligned by evaluating on one batch;
  * `bessel`: torch's BatchNorm updates its running variance with the unbiased batch variance
    (x n/(n-1)), the library's (Flax's) with the biased one; aligned by the harness's wrap of
    torch's `batch_norm` that updates the running variance with the biased one (the forward pass, on
    batch statistics, is torch's).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A
from benchmarks.parity import decisions as D
from benchmarks.parity import verdicts as V
from benchmarks.parity.verdicts import Case

NAME = "spafl"
REPOSITORY = "news-vt/SpaFL_NeruIPS_2024"
COMMIT = "d3639ab3c6ecae3a3d09cf897b264fc44551a56c"
CHECKOUT = "main/cifar10"
MODEL = "their masked_Conv4 (conv 64-64-128-128 5x5, dense 128-128-10, BN) / the library's spafl_cnn, 32x32x3"
SEED = 0
COUNTS, BATCH, EPOCHS, CLASSES, SIDE = (45, 30, 28), 16, 5, 10, 32
CLIENTS = len(COUNTS)
SAMPLED = ((0, 1), (1, 2), (0, 2))  # the clients of each round
LR, MOMENTUM, ALPHA, CLIP = 0.01, 0.9, 0.00015, 3
RESET_LAYER = "conv1"
LAYERS = {"conv1": "conv1", "conv2": "conv2", "conv3": "conv3", "conv4": "conv4",
          "dense1": "fc1", "dense2": "fc2", "dense3": "fc3"}  # theirs -> the library's structure layer
THRESHOLD_MARGIN = 1e-4  # |mean |w| - tau| from 0 (the mask) and from 1 (BinaryStep's gate), absolute
SIGN_MARGIN = 1e-6  # |sum w| / sum |w| of a unit at eq. 13
SETUP = (f"{len(SAMPLED)} rounds, {len(SAMPLED[0])} of {CLIENTS} clients sampled each "
         f"({'; '.join(','.join(map(str, s)) for s in SAMPLED)}), every client's weights, thresholds and BatchNorm "
         f"statistics carried; clients holding {', '.join(map(str, COUNTS))} examples; their CIFAR-10 command's "
         f"settings: lr {LR}, momentum {MOMENTUM}, batches of {BATCH}, {EPOCHS} local epochs, `--th_coeff {ALPHA}`, "
         f"`--clip {CLIP}`.")
LIBRARY_OPTIONS = {"algorithm": "spafl", "spafl_variant": "code", "model": "spafl_cnn", "sparsity_coef": ALPHA,
                   "threshold_update": True, "lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0,
                   "local_epochs": EPOCHS, "batch_size": BATCH, "clients_per_round": len(SAMPLED[0])}
CAUSES = {"drop_last": "their loader drops each epoch's last partial batch, the library's epochs take ceil(n / B) "
                       "steps; aligned by their loader keeping it",
          "reset_in_evaluation": "their evaluation before a round (two test batches or more) already resets a layer "
                                 "collapsed under the client's own thresholds, so the round keeps the thresholds it "
                                 "receives; the library resets the received ones; aligned by evaluating on one batch",
          "bessel": "torch's BatchNorm updates its running variance with the unbiased batch variance, the library's "
                    "with the biased one; aligned by the harness's wrap of torch's batch_norm updating it with the "
                    "biased one",
          "eq13_timing": "their code applies each round's change of the global thresholds to every client after the "
                         "aggregation (eq. 13), re-reading sign(sum w) each time; the library applies the change since "
                         "a client's last download once, when it is next sampled; eq. 13 shifts a unit's weights "
                         "together, so a sign can flip between two applications; aligned by calling their th_update "
                         "once per client, with the changes since its last, at the stage before its next round"}
CASES = {"published": Case(f"their code as published (`--learning_rate {LR} --batch_size {BATCH} --clip {CLIP} "
                           f"--th_coeff {ALPHA} --local_epoch {EPOCHS}`), each client evaluated on its examples"),
         "full_batches": Case("their loader keeping the last partial batch", ("drop_last",)),
         "one_test_batch": Case("the evaluation on one batch", ("reset_in_evaluation",)),
         "biased_variance": Case("torch's running variance from the biased batch variance", ("bessel",)),
         "eq13_once": Case("their th_update once per client, before its next round", ("eq13_timing",)),
         "aligned": Case("all four", ("drop_last", "reset_in_evaluation", "bessel", "eq13_timing"))}


def _args() -> list[str]:
    return ["train.py", "--model", "conv4", "--learning_rate", str(LR), "--th_coeff", str(ALPHA),
            "--batch_size", str(BATCH), "--local_epoch", str(EPOCHS), "--clip", str(CLIP), "--momentum", str(MOMENTUM),
            "--num_clients", str(CLIENTS), "--schedulingsize", str(len(SAMPLED[0]))]


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


def unit_margins(kernels: np.ndarray, thresholds: np.ndarray) -> tuple[float, float]:
    """(min |u|, min ||u| - 1|) of u = mean |w| - tau per unit (the mask's and the gate's decisions)."""
    u = np.mean(np.abs(kernels.reshape(kernels.shape[0], -1).astype(np.float64)), axis=1) - thresholds
    return float(np.min(np.abs(u))), float(np.min(np.abs(np.abs(u) - 1.0)))


def sign_margin(kernels: np.ndarray) -> float:
    """min over units of |sum w| / sum |w| (eq. 13's sign(sum w))."""
    flat = kernels.reshape(kernels.shape[0], -1).astype(np.float64)
    return float(np.min(np.abs(flat.sum(axis=1)) / np.abs(flat).sum(axis=1)))


def _biased_running_variance():
    """Torch's batch_norm with its running variance updated from the biased batch variance (the library's):
    the output, on batch statistics, is torch's own."""
    import torch
    import torch.nn.functional as F
    original = F.batch_norm

    def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
        if not training or running_var is None:
            return original(x, running_mean, running_var, weight, bias, training, momentum, eps)
        out = original(x, None, None, weight, bias, True, momentum, eps)
        with torch.no_grad():
            dims = [0] + list(range(2, x.dim()))
            running_mean.mul_(1 - momentum).add_(momentum * x.mean(dims))
            running_var.mul_(1 - momentum).add_(momentum * x.var(dims, unbiased=False))
        return out

    F.batch_norm = batch_norm


def torch_setup(checkout: Path, seed: int) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    binarization, net, _, _, _ = _official(checkout)
    T.deterministic(seed)
    out = {}
    for c in range(CLIENTS):
        out.update(A.prefixed(f"init/client{c}", T.state_arrays(net.masked_Conv4().state_dict())))
    rng = np.random.default_rng(seed)
    units = {name: layer.threshold.shape[0] for name, layer in _masked_layers(net.masked_Conv4(), binarization).items()}
    for name, n in units.items():
        levels = (-1.5, -0.5, 0.5, 1.5) if name == "dense3" else (-1.5, -0.5, 0.5)
        new = rng.choice(levels, n) + rng.uniform(-0.05, 0.05, n)
        prev = new - rng.uniform(-0.05, 0.05, n)
        out[f"global/new/{name}"], out[f"global/prev/{name}"] = new.astype(np.float32), prev.astype(np.float32)
        for c in range(CLIENTS):  # the client's own thresholds, from its last round
            collapsed = name == RESET_LAYER and c in SAMPLED[0]
            own = np.full(n, 1.5) if collapsed else prev + rng.uniform(-0.1, 0.1, n)
            out[f"init/client{c}/{name}.threshold"] = own.astype(np.float32)
    out.update({"data/x": rng.normal(size=(sum(COUNTS), 3, SIDE, SIDE)).astype(np.float32),
                "data/y": rng.integers(0, CLASSES, sum(COUNTS)).astype(np.int64),
                "data/counts": np.array(COUNTS), "keys": np.array(list(A.under(out, "init/client0")))})
    return out


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    binarization, net, Client_Class, Server_Class, args = _official(checkout)
    assert (args.learning_rate, args.momentum, args.th_coeff, args.clip, args.lr_decay, args.weight_decay) == \
        (LR, MOMENTUM, ALPHA, CLIP, 1, 0.0), args
    T.deterministic(SEED)
    norms = T.GradientNorms(clip=True)
    decisions = D.OfficialDecisions(library)
    if "bessel" in CASES[case].aligns:
        _biased_running_variance()
    margins = {"mask": [], "gate": [], "sign": []}
    for cls in (binarization.MaskedConv2d, binarization.MaskedMLP):
        def recording(self, weight, thresholds, generate=cls.mask_generation):
            mask, gate = unit_margins(self.weight.detach().numpy(), self.threshold.detach().numpy())
            margins["mask"].append(mask)
            margins["gate"].append(gate)
            return generate(self, weight, thresholds)
        cls.mask_generation = recording
    clients = []
    drop_last = "drop_last" not in CASES[case].aligns
    for c in range(CLIENTS):
        network = net.masked_Conv4()
        T.load_state(network, A.under(setup, f"init/client{c}"))
        x, y = T.client_arrays(setup, c)
        batches = T.Batches(x, y, BATCH, T.tensor_pair, drop_last=drop_last)
        batches.dataset = x
        tested = BATCH if "reset_in_evaluation" in CASES[case].aligns else len(y)
        test = T.Batches(x[:tested], y[:tested], BATCH, T.tensor_pair)
        clients.append(Client_Class.Client(args, network, torch.nn.CrossEntropyLoss(), c, batches, test,
                                           torch.device("cpu")))
    server_network = net.masked_Conv4()
    with torch.no_grad():
        for name, layer in _masked_layers(server_network, binarization).items():
            layer.threshold.copy_(torch.from_numpy(setup[f"global/new/{name}"]))
    server = Server_Class.Server(args, server_network)
    out = {}

    once = "eq13_timing" in CASES[case].aligns
    pending = {c: None for c in range(CLIENTS)}  # with `once`: the changes a client has not applied yet

    def th_update_all(difference, sampled_next):
        """Simulator.py: every client's th_update, then every client's local_test; with `once`, a client's
        th_update waits for the stage before its next round and applies the changes since its last."""
        for c, client in enumerate(clients):
            if once:
                pending[c] = difference if pending[c] is None else {k: pending[c][k] + v for k, v in difference.items()}
                if c not in sampled_next:
                    continue
                difference_c, pending[c] = pending[c], None
            else:
                difference_c = difference
            layers = _masked_layers(client.model, binarization)
            margins["sign"] += [sign_margin(layer.weight.detach().numpy()) for layer in layers.values()]
            client.th_update(difference_c)
        for c, client in enumerate(clients):
            client.local_test()
            out.update({f"next/client{c}/start_mask/{name}": _unit_mask(layer)
                        for name, layer in _masked_layers(client.model, binarization).items()})

    # what the previous aggregation left in server.global_difference
    th_update_all({name: torch.from_numpy(setup[f"global/new/{name}"] - setup[f"global/prev/{name}"])
                   for name in LAYERS}, SAMPLED[0])
    resets_before = {c: 0 for c in range(CLIENTS)}
    for rnd, sampled in enumerate(SAMPLED):
        server.broadcast(clients, np.array(sampled))
        for c in sampled:
            layers = _masked_layers(clients[c].model, binarization)
            out.update({f"round{rnd}/client{c}/start/{name}.weight": layer.weight.detach().numpy().copy()
                        for name, layer in layers.items()})
            out.update({f"round{rnd}/client{c}/start_mask/{name}": out[f"next/client{c}/start_mask/{name}"]
                        for name in LAYERS})
            per = -(-COUNTS[c] // BATCH)  # the library's steps an epoch; their loader may drop the last
            short = drop_last and COUNTS[c] % BATCH
            decisions.start(f"decisions/r{rnd}/c{c}", passes=EPOCHS * per,
                            skipped=tuple(e * per + per - 1 for e in range(EPOCHS)) if short else ())
            clients[c].local_training(rnd)
            decisions.finish()
            out.update(A.prefixed(f"round{rnd}/client{c}/value", T.state_arrays(clients[c].model.state_dict())))
            # a layer whose last pass kept <= 1 % is reset by the next pass; the library resets it at that step
            pending_resets = sum(float(layer.ratio.detach()) <= 0.01 for layer in layers.values())
            total = sum(layer.zero_count for layer in layers.values())
            out[f"round{rnd}/client{c}/resets"] = np.array(total - resets_before[c] + pending_resets)
            resets_before[c] = total + pending_resets
            for name, layer in layers.items():
                layer.mask_generation(layer.weight, layer.threshold)  # their mask of the trained weights
                out[f"round{rnd}/client{c}/end_mask/{name}"] = _unit_mask(layer)
        server.aggregation(clients, np.array(sampled))
        out.update({f"round{rnd}/global/{name}": t.detach().numpy().copy()
                    for name, t in server.global_thresholds.items()})
        th_update_all({k: v.detach().clone() for k, v in server.global_difference.items()},
                      SAMPLED[rnd + 1] if rnd + 1 < len(SAMPLED) else ())
    out["norms"] = np.array(norms.norms)
    out.update({f"margin/{kind}": np.array(min(values)) for kind, values in margins.items()})
    return {**{k: v for k, v in out.items() if not k.startswith("next/")}, **decisions.arrays()}


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


def library(setup: dict, cases) -> dict[str, np.ndarray]:
    del cases  # every case compares with the same run
    import jax
    import jax.numpy as jnp

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import make_algorithm, make_options, spafl_code
    from fedjax_sparse.algorithms.spafl import global_threshold_update, threshold_masks
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.models import get_model
    from fedjax_sparse.models.structure import get_path

    model = get_model("spafl_cnn", (SIDE, SIDE, 3), CLASSES)
    structure = model.structure
    maps = mapping(setup)
    blank = model.init(jax.random.key(0))
    split = J.federated_data(setup)
    local = LocalSGD(model, LR, EPOCHS, BATCH, MOMENTUM, 0.0)
    context = BuildContext(local=local, num_clients=CLIENTS, clients_per_round=len(SAMPLED[0]), train=split,
                           num_classes=CLASSES, seed=0)
    algorithm = make_algorithm("spafl", context, make_options("spafl", {"spafl_variant": "code",
                                                                        "sparsity_coef": ALPHA}))
    server_state = {"thresholds": _thresholds(setup, "global/new/")}
    states = [{"variables": J.load_torch(blank, maps, A.under(setup, f"init/client{c}")),
               "thresholds": _thresholds(setup, f"init/client{c}/", ".threshold"),
               "global_thresholds": _thresholds(setup, "global/prev/"), "train_flops": jnp.zeros((), jnp.float32)}
              for c in range(CLIENTS)]
    margins = {"mask": [], "gate": [], "sign": []}
    step = spafl_code.code_step

    def recording_step(u):  # the code variant's mask and gate decisions, every pass
        def record(u):
            u = np.abs(np.asarray(u, np.float64))
            margins["mask"].append(float(u.min()))
            margins["gate"].append(float(np.abs(u - 1.0).min()))
        jax.debug.callback(record, u, ordered=True)
        return step(u)

    def before(i, c, down, state):
        params = state["variables"]["params"]
        margins["sign"].extend(sign_margin(np.moveaxis(np.asarray(get_path(params, l.kernel)), -1, 0))
                               for l in structure.layers)
        delta = jax.tree_util.tree_map(jnp.subtract, down, state["global_thresholds"])
        moved = global_threshold_update(structure, params, delta, spafl_code.eq13_divisor)
        for l in structure.layers:  # the reset check's decisions, at the round's start
            kernel = np.moveaxis(np.asarray(get_path(moved, l.kernel)), -1, 0)
            margins["mask"].append(unit_margins(kernel, np.asarray(state["thresholds"][l.name]))[0])
        return {**A.prefixed(f"round{i}/client{c}/start", J.in_torch_layout({"params": moved}, maps)),
                **A.prefixed(f"round{i}/client{c}/start_mask",
                             _their_names(threshold_masks(structure, moved, state["thresholds"])))}

    def after(i, c, up, state, metrics):
        return {**A.prefixed(f"round{i}/client{c}/value", J.in_torch_layout(state["variables"], maps)),
                **{f"round{i}/client{c}/value/{k}.threshold": v for k, v in _their_names(up).items()},
                **A.prefixed(f"round{i}/client{c}/end_mask", _their_names(
                    threshold_masks(structure, state["variables"]["params"], state["thresholds"]))),
                f"round{i}/client{c}/resets": np.asarray(metrics["threshold_resets"])}

    spafl_code.code_step = recording_step
    try:
        out = J.run_rounds(algorithm, server_state, states, split, list(enumerate(SAMPLED)), before=before,
                           after=after, after_round=lambda i, state: A.prefixed(f"round{i}/global",
                                                                                _their_names(state["thresholds"])))
    finally:
        spafl_code.code_step = step
    out.update({f"margin/{kind}": np.array(min(values)) for kind, values in margins.items()})
    return out


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    rows = []

    def masks(what, rnd, prefix):
        ours = {f"client{c}/{n}": library[f"round{rnd}/client{c}/{prefix}/{n}"] for c in SAMPLED[rnd] for n in LAYERS}
        theirs = {f"client{c}/{n}": official[f"round{rnd}/client{c}/{prefix}/{n}"] for c in SAMPLED[rnd]
                  for n in LAYERS}
        kept = sum(int(np.sum(v)) for v in theirs.values())
        return A.identical(f"round {rnd + 1}: {what}", ours, theirs,
                           f"theirs keep {kept:,} of {sum(v.size for v in theirs.values()):,}")

    def client_row(rnd, c, what, select, ours=None):
        prefix = f"round{rnd}/client{c}/value"
        return A.group(f"round {rnd + 1}: client {c}: {what}",
                       [A.difference(k, library[f"{prefix}/{k}"], v, key=f"{prefix}/{k}")
                        for k, v in sorted(A.under(official, prefix).items()) if select(k)])

    for rnd, sampled in enumerate(SAMPLED):
        rows.append(masks("units kept under each sampled client's own thresholds after eq. 13 (the reset check)",
                          rnd, "start_mask"))
        rows.append(A.group(f"round {rnd + 1}: eq. 13: kernels at the round's start, after the change of the global "
                            f"thresholds",
                            [A.difference(f"client{c}/{k}", library[f"round{rnd}/client{c}/start/{k}"], v,
                                          key=f"round{rnd}/client{c}/start/{k}")
                             for c in sampled for k, v in A.under(official, f"round{rnd}/client{c}/start").items()]))
        rows.append(A.identical(f"round {rnd + 1}: layers reset (<= 1 % kept) since the client's last upload",
                                {f"client{c}": library[f"round{rnd}/client{c}/resets"] for c in sampled},
                                {f"client{c}": official[f"round{rnd}/client{c}/resets"] for c in sampled}))
        rows.append(masks("units kept after local training (the personal model)", rnd, "end_mask"))
        for c in sampled:
            rows.append(client_row(rnd, c, "kernels, BatchNorm scales and shifts, thresholds after local training "
                                           "(its upload)", lambda k: k.endswith((".weight", ".bias", ".threshold"))))
            rows.append(client_row(rnd, c, "BatchNorm running means", lambda k: k.endswith("running_mean")))
            rows.append(client_row(rnd, c, "BatchNorm running variances", lambda k: k.endswith("running_var")))
        rows.append(A.group(f"round {rnd + 1}: server: global thresholds (uniform mean of the uploads, eq. 7)",
                            [A.difference(name, library[f"round{rnd}/global/{name}"],
                                          official[f"round{rnd}/global/{name}"], key=f"round{rnd}/global/{name}")
                             for name in LAYERS]))
    norms = official["norms"]
    rows[-1]["note"] = (f"gradient norms their clipping saw: {norms.min():.3g} to {norms.max():.3g} "
                        f"({int(np.sum(norms > CLIP))} of {len(norms)} steps clipped to {CLIP})")
    if case in V.terminal(CASES):  # the decisions of the run every other case's differences are measured by
        both = {kind: min(float(library[f"margin/{kind}"]), float(official[f"margin/{kind}"]))
                for kind in ("mask", "gate", "sign")}
        rows += [A.margin_row("threshold masks: min |mean |w| - tau| over every unit of every pass, both sides",
                              both["mask"], THRESHOLD_MARGIN),
                 A.margin_row("BinaryStep's gate: min ||mean |w| - tau| - 1| over every unit of every pass, both "
                              "sides", both["gate"], THRESHOLD_MARGIN),
                 A.margin_row("eq. 13's sign(sum w): min |sum w| / sum |w| over every unit and update, both sides",
                              both["sign"], SIGN_MARGIN)]
    rows += [D.aligned_row(official)]
    return rows
