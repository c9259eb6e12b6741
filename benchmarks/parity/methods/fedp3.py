"""FedP3 (Yi et al., ICLR 2024) at its code's defaults against the official code: `main.py`'s OPU2
round (its layer assignment, lines 170-174 and 195), `models/distributed_training_utils.py`'s
`Client` (synchronize_with_server, sparsity, compute_weight_update / train_cnn) and `Server`
(aggregate_weight_updates_subset), `models/Nets.py`'s `client_model('cifar10_LeNet')`.

The model. Their small networks are `emnist_NN` (an MLP, for which main.py's OPU2 branch uploads
every layer), `FMNIST_CNN` and `cifar10_LeNet`: conv 64@5x5 -> ReLU -> pool 2 -> conv 64@5x5 -> ReLU
-> pool 2 -> dense 1600-1024 -> dense 1024-1024 -> dense 10, with biases, no normalization. The zoo
has neither CNN: its nearest, `cnn2`, has four layers, which would make OPU2 share three layers where
their code shares four. The harness builds their cifar10_LeNet in Flax from the library's own pieces
(layers.conv/dense/relu_pool2, the ModelStructure the library's FedP3 reads).

Three rounds at round indices 3, 4, 5 (lr 0.01 x 0.997^r, their lr_decay as main.py's loop applies
it), four of 100 clients: ids 0, 25, 50 and 75, which main.py's OPU2 assigns the layer pairs (conv1,
conv2), (conv2, fc1), (fc1, fc2) and (fc2, conv1); they hold 61, 40, 29 and 13 examples (32x32x3)
and train their defaults: two local epochs of batches of 48 (the last short: their `local_epoch`
steps are ceil(n / B)), SGD without momentum or weight decay, gradients clipped to norm 10 (their
`max_norm`). Each client keeps its own model across rounds: its shared layers are overwritten by each
download, its classifier is its own. The examples are drawn with standard deviation 4, so that the
clip at 10 binds in some steps (the last row says how many).

Their run is driven from the harness in main.py's order: per round and client,
`synchronize_with_server` (global_prune 0.9) with the keys main.py computes for OPU2 (written out
here: layers int(id / 25) and that + 1 mod 4, and the classifier), then `compute_weight_update`;
then `aggregate_weight_updates_subset` ('mean'). `utils.utils_dataset` (their CIFAR download) is an
import stub holding a stand-in `Dataset` for the loader `Client.__init__` builds, which the harness
then replaces by our batches (`trn_gen`); torchvision is an import stub.

Top-k near a tie. The downlink keeps each pruned kernel's largest magnitudes; a kernel whose k-th and
(k+1)-th largest magnitudes sit within round-off of each other can be cut differently. The setup's
server kernels are drawn with a gap at both cuts (int(0.9 n) and ceil(0.9 n)): the magnitudes below
the cut are halved, those above raised by half; the margin row checks the gap at every round's
download on both sides.

Causes: `int_prune`, the downlink keeps ceil(0.9 n) entries of a pruned kernel, theirs int(0.9 n):
for fc2's 1,048,576 entries 943,719 against 943,718 (the other kernels' 0.9 n are integers); aligned
by their `--global_prune 0.90000059`, where int(g n) = ceil(0.9 n) for all four kernels.
`plain_mean`, the server's mean over a layer's uploaders: theirs plain, the library's weighted by
data size; aligned by handing the library's `server_update` equal client weights (the engine hands
it data sizes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A
from benchmarks.parity import decisions as D
from benchmarks.parity import verdicts as V
from benchmarks.parity.verdicts import Case

NAME = "fedp3"
REPOSITORY = "SonyResearch/FedP3"
COMMIT = "84e1e967fe15ea00502a236148c19b7a74e01de3"
CHECKOUT = ""
MODEL = ("their client_model('cifar10_LeNet') (conv 64-64 5x5, dense 1600-1024-1024-10, biases) on both sides "
         "(a Flax copy from the library's layers), 32x32x3")
SEED = 0
IDS, USERS, COUNTS = (0, 25, 50, 75), 100, (61, 40, 29, 13)
BATCH, LOCAL_EP, CLASSES, SIDE = 48, 2, 10, 32
LR, LR_DECAY, FIRST_ROUND, ROUNDS, KEEP, CLIP = 0.01, 0.997, 3, 3, 0.9, 10.0
INPUT_STD = 4.0  # at 1 their gradient norms stay below the clip at 10
# int(g n) = ceil(0.9 n) for n = 4,800, 102,400, 1,638,400 and 1,048,576 (fc2: 943,719)
CEIL_PRUNE = 0.90000059
LAYERS = ("conv1", "conv2", "fc1", "fc2", "fc3")
SHARED = LAYERS[:4]
GAP = 0.5  # the setup's server kernels: magnitudes below a cut x (1 - GAP), above it x (1 + GAP)
TOPK_MARGIN = 1e-4  # the smallest gap at a cut, relative to the kernel's largest magnitude
SETUP = (f"{ROUNDS} rounds at round indices {FIRST_ROUND}-{FIRST_ROUND + ROUNDS - 1}, the server model and each "
         f"client's model carried; clients {', '.join(map(str, IDS))} of {USERS} holding "
         f"{', '.join(map(str, COUNTS))} examples; their defaults: {LOCAL_EP} local epochs of batches of {BATCH} "
         f"(the last short), SGD lr {LR} x {LR_DECAY}^round, no momentum or weight decay, gradients clipped to "
         f"norm {CLIP:g}, the downlink keeping {KEEP} of each pruned kernel.")
LIBRARY_OPTIONS = {"algorithm": "fedp3", "model": "a Flax copy of their cifar10_LeNet", "fedp3_downlink": "magnitude",
                   "downlink_keep": KEEP, "fedp3_client_model": "server", "fedp3_upload_classifier": True,
                   "server_optimizer": "sgd", "server_lr": 1.0, "lr": LR, "lr_decay": LR_DECAY,
                   "rounds": ", ".join(str(FIRST_ROUND + i) for i in range(ROUNDS)), "grad_clip_norm": CLIP,
                   "momentum": 0.0, "weight_decay": 0.0, "local_epochs": LOCAL_EP, "batch_size": BATCH,
                   "num_clients": USERS, "clients": ", ".join(map(str, IDS))}
CAUSES = {"int_prune": "the library's downlink keeps ceil(0.9 n) entries of a pruned kernel, theirs int(0.9 n): one "
                       "fewer of fc2's; aligned by their `--global_prune 0.90000059` (int(g n) = ceil(0.9 n) for every "
                       "kernel here)",
          "plain_mean": "their server takes the plain mean over a layer's uploaders, the library's the data-weighted "
                        "mean; aligned by handing the library's `server_update` equal client weights"}
CASES = {"published": Case(f"their code as published (`--method OPU2 --global_prune {KEEP}`, lr_decay {LR_DECAY}, "
                           f"clip 10)"),
         "global_prune_int": Case(f"their `--global_prune {CEIL_PRUNE}`", ("int_prune",)),
         "plain_mean": Case("the library's server with equal client weights", ("plain_mean",)),
         "both": Case(f"their `--global_prune {CEIL_PRUNE}`, the library's server with equal client weights",
                      ("int_prune", "plain_mean"))}
WEIGHTS = {"published": "data", "global_prune_int": "data", "plain_mean": "equal", "both": "equal"}


def _args(prune: float) -> list[str]:
    return ["main.py", "--method", "OPU2", "--dataset", "CIFAR10", "--num_users", str(USERS), "--lr", str(LR),
            "--lr_decay", str(LR_DECAY), "--global_prune", str(prune), "--gpu", "-1", "--seed", str(SEED)]


def cuts(n: int) -> tuple[int, ...]:
    """The kept counts of an n-entry kernel on the two sides: int(0.9 n) (theirs) and ceil(0.9 n)."""
    return tuple(sorted({int(n * KEEP), int(np.ceil(round(n * KEEP, 6)))}))


def topk_gap(kernel: np.ndarray) -> float:
    """The smallest gap between a kept and a dropped magnitude at either cut, relative to the largest."""
    flat = np.sort(np.abs(kernel.astype(np.float64)).reshape(-1))
    gaps = [flat[-k] - flat[-k - 1] for k in cuts(flat.size)]
    return float(min(gaps) / flat[-1])


def gapped(kernel: np.ndarray) -> np.ndarray:
    """A kernel with its magnitudes pushed away from both cuts: below the lower x (1 - GAP), above the
    upper x (1 + GAP); the entries between the cuts (fc2's one) unchanged."""
    flat = kernel.reshape(-1).copy()
    order = np.argsort(np.abs(flat), kind="stable")
    kept = cuts(flat.size)
    flat[order[:flat.size - kept[-1]]] *= 1 - GAP
    flat[order[flat.size - kept[0]:]] *= 1 + GAP
    return flat.reshape(kernel.shape)


# ------------------------------------------------------------------ the PyTorch side

class _Examples:
    """Stands in for their `utils.utils_dataset.Dataset` (a CIFAR-10 pipeline with augmentation) in the
    loader `Client.__init__` builds; the harness replaces that loader by its batches."""

    def __init__(self, x, y=True, train=False, dataset_name=""):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        raise RuntimeError("the parity harness feeds FedP3's clients its own batches")


def _official(checkout: Path):
    from benchmarks.parity import torch_side as T
    T.enter_checkout(checkout)
    T.stub_module("torchvision")
    T.stub_module("torchvision.models")
    import utils  # noqa: F401 - their package; only its dataset module is stubbed
    T.stub_module("utils.utils_dataset", Dataset=_Examples, DatasetObject=T.refuse("utils.utils_dataset.DatasetObject"))
    from models import Nets, distributed_training_utils
    from utils import options
    return Nets, distributed_training_utils, options


def torch_setup(checkout: Path, seed: int) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    Nets, _, _ = _official(checkout)
    T.deterministic(seed)
    server = T.state_arrays(Nets.client_model("cifar10_LeNet").state_dict())
    server.update({f"{layer}.weight": gapped(server[f"{layer}.weight"]) for layer in SHARED})
    out = A.prefixed("init/server", server)
    for c in range(len(IDS)):
        out.update(A.prefixed(f"init/client{c}", T.state_arrays(Nets.client_model("cifar10_LeNet").state_dict())))
    rng = np.random.default_rng(seed)
    out.update({"data/x": (INPUT_STD * rng.normal(size=(sum(COUNTS), 3, SIDE, SIDE))).astype(np.float32),
                "data/y": rng.integers(0, CLASSES, sum(COUNTS)).astype(np.int64),
                "data/counts": np.array(COUNTS), "keys": np.array(list(A.under(out, "init/server")))})
    return out


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    Nets, training, options = _official(checkout)
    sys.argv = _args(CEIL_PRUNE if case in ("global_prune_int", "both") else KEEP)
    args = options.args_parser()
    args.device = torch.device("cpu")
    for _ in range(FIRST_ROUND):  # main.py's loop decays the rate after every round
        args.lr = args.lr * args.lr_decay
    assert (args.momentum, args.weigh_delay, args.aggregation, training.max_norm, args.local_ep, args.local_bs) == \
        (0, 0, "mean", CLIP, LOCAL_EP, BATCH), args
    T.deterministic(SEED)
    norms = T.GradientNorms(clip=True)
    decisions = D.OfficialDecisions(A.under(library, WEIGHTS[case]))
    server_model = Nets.client_model("cifar10_LeNet")
    T.load_state(server_model, A.under(setup, "init/server"))
    server = training.Server(model=server_model, args=args, n_cls=CLASSES)
    keys = server_model.weight_keys
    shared = [k for layer in keys[:4] for k in layer]  # main.py: w_glob_keys, layers 0-3; w_final_keys: layer 4
    total_layers = len(server_model.state_dict())
    clients, ops, out = [], {}, {}
    for c, client_id in enumerate(IDS):
        model = Nets.client_model("cifar10_LeNet")
        T.load_state(model, A.under(setup, f"init/client{c}"))
        x, y = T.client_arrays(setup, c)
        client = training.Client(model=model, args=args, trn_x=x, trn_y=y, tst_x=x, tst_y=y, n_cls=CLASSES,
                                 dataset_name=args.dataset, id_num=client_id)
        client.trn_gen = T.Batches(x, y, BATCH, T.tensor_pair)
        first = client_id // 25
        assigned = [first, (first + 1) % (total_layers // 2 - 1)]
        ops[client_id] = [k for i in assigned for k in keys[i]] + keys[4]
        clients.append(client)
    for rnd in range(ROUNDS):
        for c, (client_id, client) in enumerate(zip(IDS, clients)):
            client.synchronize_with_server(server, shared, args.global_prune, ops[client_id])
            out.update({f"round{rnd}/client{c}/sent/{k}": (np.ones(v.shape, bool) if k in ops[client_id]
                                                           or "bias" in k else v.detach().numpy() != 0)
                        for k, v in client.W.items() if k in shared})
            decisions.start(f"decisions/r{rnd}/c{c}")
            client.compute_weight_update(shared, server, False)
            decisions.finish()
            out.update(A.prefixed(f"round{rnd}/client{c}/value", T.state_arrays(client.model.state_dict())))
            out[f"round{rnd}/client{c}/uploaded"] = np.array([k in ops[client_id] for k in setup["keys"]])
        server.aggregate_weight_updates_subset(clients=clients, iter=FIRST_ROUND + rnd, w_glob_keys_ops=ops,
                                               aggregation=args.aggregation)
        out.update(A.prefixed(f"round{rnd}/global", T.state_arrays(server.model.state_dict())))
        args.lr = args.lr * args.lr_decay
    out["norms"] = np.array(norms.norms)
    return {**out, **decisions.arrays()}


# ------------------------------------------------------------------ the JAX side

def _model():
    """Their cifar10_LeNet in Flax, with the structure the library's FedP3 reads (five layers, biases)."""
    import flax.linen as nn

    from fedjax_sparse.models import layers as L
    from fedjax_sparse.models.structure import Model, ModelStructure

    class LeNet(nn.Module):
        @nn.compact
        def __call__(self, x, train, mask=None, unit_masks=None):
            del train, mask
            x = L.unit_output(self, L.conv(64, 5, name="conv1")(x), unit_masks, "conv1", L.relu_pool2)
            x = L.unit_output(self, L.conv(64, 5, name="conv2")(x), unit_masks, "conv2", L.relu_pool2)
            x = L.unit_output(self, L.dense(1024, name="fc1")(L.flatten(x)), unit_masks, "fc1", nn.relu)
            x = L.unit_output(self, L.dense(1024, name="fc2")(x), unit_masks, "fc2", nn.relu)
            return L.unit_output(self, L.dense(CLASSES, name="fc3")(x), unit_masks, "fc3")

    layers = (
        L.conv_layer(("conv1",), kernel=5, in_units=3, units=64, output_hw=28 * 28, inputs_from=("input",), bias=True,
                     norm=None),
        L.conv_layer(("conv2",), kernel=5, in_units=64, units=64, output_hw=10 * 10, inputs_from=("conv1",), bias=True,
                     norm=None),
        L.dense_layer(("fc1",), in_units=64, units=1024, input_repeat=5 * 5, inputs_from=("conv2",), bias=True,
                      norm=None),
        L.dense_layer(("fc2",), in_units=1024, units=1024, inputs_from=("fc1",), bias=True, norm=None),
        L.dense_layer(("fc3",), in_units=1024, units=CLASSES, inputs_from=("fc2",), bias=True, norm=None),
    )
    return Model(name="fedp3_cifar10_lenet", module=LeNet(), input_shape=(SIDE, SIDE, 3), num_classes=CLASSES,
                 structure=ModelStructure(layers), description="FedP3's cifar10_LeNet")


def mapping() -> dict:
    """Their conv1/conv2/fc1-3 onto the Flax copy's (fc1 reads the flattened 64 x 5 x 5 map)."""
    from benchmarks.parity import jax_side as J

    return J.layer_mapping(LAYERS, "fc1", "64,5,5")


def library(setup: dict, cases) -> dict[str, np.ndarray]:
    """The library's rounds, for the variants `cases` compare with: its server weighing the clients by
    data size (as the engine does), and equally (the `plain_mean` alignment)."""
    return {k: v for weights in dict.fromkeys(WEIGHTS[c] for c in cases)
            for k, v in A.prefixed(weights, library_rounds(setup, equal_weights=weights == "equal")).items()}


def library_rounds(setup: dict, equal_weights: bool) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.messages.pricing import KnownMaskArray, SparseArray

    model = _model()
    maps = mapping()
    blank = model.init(jax.random.key(0))
    split = J.federated_data(setup)
    local = LocalSGD(model, LR, LOCAL_EP, BATCH, lr_decay=LR_DECAY, grad_clip_norm=CLIP)
    context = BuildContext(local=local, num_clients=USERS, clients_per_round=len(IDS), train=split,
                           num_classes=CLASSES, seed=0)
    algorithm = make_algorithm("fedp3", context, make_options("fedp3", {}))
    server_state, _ = algorithm.init(jax.random.key(1), J.load_torch(blank, maps, A.under(setup, "init/server")),
                                     len(IDS))
    is_message = lambda x: isinstance(x, (SparseArray, KnownMaskArray))  # noqa: E731
    keys = list(map(str, setup["keys"]))

    def before(i, c, down, own):
        sent = jax.tree_util.tree_map(lambda leaf: leaf.mask, down["variables"], is_leaf=is_message)
        return A.prefixed(f"round{i}/client{c}/sent", J.in_torch_layout(sent, maps))

    def after(i, c, up, own, metrics):
        uploaded = J.in_torch_layout(jax.tree_util.tree_map(lambda leaf: leaf.mask, up, is_leaf=is_message), maps)
        return {**A.prefixed(f"round{i}/client{c}/value", J.in_torch_layout(own, maps)),
                f"round{i}/client{c}/uploaded": np.array([bool(np.all(uploaded[k])) for k in keys]),
                f"round{i}/client{c}/uploaded_any": np.array([bool(np.any(uploaded[k])) for k in keys])}

    owns = [J.load_torch(blank, maps, A.under(setup, f"init/client{c}")) for c in range(len(IDS))]
    clients = list(range(len(IDS)))
    return J.run_rounds(algorithm, server_state, owns, split, [(FIRST_ROUND + i, clients) for i in range(ROUNDS)],
                        broadcast=lambda state, c, info: algorithm.broadcast(state, IDS[c], info), before=before,
                        after=after, weights=(lambda ids: jnp.ones(len(ids), jnp.int32)) if equal_weights else None,
                        after_round=lambda i, state: A.prefixed(f"round{i}/global",
                                                                J.in_torch_layout(state["variables"], maps)))


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    library = A.under(library, WEIGHTS[case])
    keys = list(map(str, setup["keys"]))
    clients = range(len(IDS))
    rows, gaps = [], []
    for rnd in range(ROUNDS):
        sent_ours = {f"client {IDS[c]}/{k}": library[f"round{rnd}/client{c}/sent/{k}"] for c in clients for k in keys}
        # their classifier is never synchronized: nothing of it is sent
        sent_theirs = {name: official.get(f"round{rnd}/client{c}/sent/{k}", np.zeros_like(sent_ours[name]))
                       for c in clients for k in keys for name in [f"client {IDS[c]}/{k}"]}
        rows.append(A.identical(f"round {rnd + 1}: entries sent down (assigned layers whole, other shared layers' "
                                f"kernels pruned by magnitude, biases whole, classifier not sent)", sent_ours,
                                sent_theirs))
        ours_up = {f"client {IDS[c]}": library[f"round{rnd}/client{c}/uploaded"] for c in clients}
        theirs_up = {f"client {IDS[c]}": official[f"round{rnd}/client{c}/uploaded"] for c in clients}
        whole = all(np.array_equal(library[f"round{rnd}/client{c}/uploaded"],
                                   library[f"round{rnd}/client{c}/uploaded_any"]) for c in clients)
        pairs = ", ".join(f"{client}: " + "+".join(dict.fromkeys(k.split(".")[0] for k, u in zip(keys, sent) if u))
                          for client, sent in theirs_up.items())
        rows.append(A.identical(f"round {rnd + 1}: tensors uploaded (OPU2's two layers and the classifier)", ours_up,
                                theirs_up, f"each whole: {whole}; theirs: {pairs}"))
        for c in clients:
            theirs = A.under(official, f"round{rnd}/client{c}/value")
            rows.append(A.group(f"round {rnd + 1}: client {IDS[c]}'s model after local training",
                                [A.difference(k, library[f"round{rnd}/client{c}/value/{k}"], v,
                                              key=f"round{rnd}/client{c}/value/{k}") for k, v in theirs.items()]))
        for layer in LAYERS:
            uploaders = [IDS[c] for c in clients
                         if official[f"round{rnd}/client{c}/uploaded"][keys.index(f"{layer}.weight")]]
            rows.append(A.group(f"round {rnd + 1}: server {layer} (mean of clients {', '.join(map(str, uploaders))})",
                                [A.difference(k, library[f"round{rnd}/global/{k}"], official[f"round{rnd}/global/{k}"],
                                              key=f"round{rnd}/global/{k}") for k in (f"{layer}.weight", f"{layer}.bias")]))
        # the kernels each side pruned this round's download from
        for side in (library, official):
            start = A.under(setup, "init/server") if rnd == 0 else A.under(side, f"round{rnd - 1}/global")
            gaps += [topk_gap(start[f"{layer}.weight"]) for layer in SHARED]
    norms = official["norms"]
    rows[-1]["note"] = (f"gradient norms their clipping saw: {norms.min():.3g} to {norms.max():.3g} "
                        f"({int(np.sum(norms > CLIP))} of {len(norms)} steps clipped to {CLIP:g})")
    if case in V.terminal(CASES):  # the decisions of the run every other case's differences are measured by
        rows.append(A.margin_row("top-k: the smallest gap between a kept and a dropped magnitude at a pruned kernel's "
                                 "cuts, every round, both sides (relative to its largest)", min(gaps), TOPK_MARGIN))
    return rows + [D.aligned_row(official)]
