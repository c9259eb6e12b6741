"""FedP3 (Yi et al., ICLR 2024) at its code's defaults against the official code: `main.py`'s OPU2
round (its layer assignment, lines 170-174 and 195), `models/distributed_training_utils.py`'s
`Client` (synchronize_with_server, sparsity, compute_weight_update / train_cnn) and `Server`
(aggregate_weight_updates_subset), `models/Nets.py`'s `client_model('cifar10_LeNet')`.

The model. Their small networks are `emnist_NN` (an MLP, for which main.py's OPU2 branch uploads
every layer), `FMNIST_CNN` and `cifar10_LeNet`: conv 64@5x5 -> ReLU -> pool 2 -> conv 64@5x5 -> ReLU
-> pool 2 -> dense 1600-1024 -> dense 1024-1024 -> dense 10, with biases, no normalization. The zoo
has neither CNN: its nearest, `cnn2` (FedAvg's CNN: conv 32 and 64 padded, one hidden dense layer),
has four layers, which would make OPU2 share three layers where their code shares four. The harness
builds their cifar10_LeNet in Flax from the library's own pieces (layers.conv/dense/relu_pool2, the
ModelStructure the library's FedP3 reads), as the FedPM harness builds Mask4CNN. cifar10_LeNet rather
than FMNIST_CNN: its kernels allow the diagnostic case below.

One round at round index 3 (lr 0.01 x 0.997^3, their lr_decay default applied three times as main.py's
loop does), four of 100 clients: ids 0, 25, 50 and 75, which main.py's OPU2 assigns the layer pairs
(conv1, conv2), (conv2, fc1), (fc1, fc2) and (fc2, conv1); each holds 20 examples (32x32x3), trains two
local epochs of batches of 8 (8, 8, 4: their `local_epoch` steps, ceil(n / B)), SGD without momentum
or weight decay (their defaults), gradients clipped to norm 10 (their `max_norm`), and holds its own
model from an earlier round: its shared layers are then overwritten by the download, its classifier
is its own. The examples are drawn with standard deviation 4: at 1 the gradient norms stay at 1.5-3.6
and the clip at 10 never binds; at 4 it binds in some steps (the last row says how many).
The library runs `fedp3` at its defaults (the code's: magnitude downlink at 0.9, client
model from the server, classifier uploaded) with `--lr-decay 0.997 --grad-clip-norm 10`.

Their run is driven from the harness in main.py's order: per client, `synchronize_with_server`
(global_prune 0.9) with the keys main.py computes for OPU2 (written out here: layers int(id / 25) and
that + 1 mod 4, and the classifier), then `compute_weight_update`; then
`aggregate_weight_updates_subset` ('mean'). `utils.utils_dataset` (their CIFAR download) is an import
stub holding a stand-in `Dataset` for the loader `Client.__init__` builds, which the harness then
replaces by our batches (`trn_gen`); torchvision is an import stub.

The library's documented departures, and how the setup meets them:
  * the server's mean: theirs plain over a layer's uploaders, the library's weighted by data size:
    every client holds 20 examples, so the weights are equal;
  * the downlink keeps ceil(0.9 n) entries of a pruned kernel, theirs int(0.9 n): for fc2's 1,048,576
    entries 943,719 against 943,718 (the other kernels' 0.9 n are integers). Clients 0 and 25 receive
    fc2 pruned, one entry more in the library (case `published`). Case `global_prune_int` runs their
    code at `--global_prune 0.90000059`, where int(g n) = ceil(0.9 n) for all four kernels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A

NAME = "fedp3"
REPOSITORY = "SonyResearch/FedP3"
COMMIT = "84e1e967fe15ea00502a236148c19b7a74e01de3"
CHECKOUT = ""
MODEL = ("their client_model('cifar10_LeNet') (conv 64-64 5x5, dense 1600-1024-1024-10, biases) on both sides "
         "(a Flax copy from the library's layers), 32x32x3")
SEED = 0
IDS, USERS = (0, 25, 50, 75), 100
EXAMPLES, BATCH, LOCAL_EP, CLASSES, SIDE = 20, 8, 2, 10, 32
LR, LR_DECAY, ROUND, KEEP, CLIP = 0.01, 0.997, 3, 0.9, 10.0
INPUT_STD = 4.0  # at 1 their gradient norms stay at 1.5-3.6 and the clip at 10 never binds
# int(g n) = ceil(0.9 n) for n = 4,800, 102,400, 1,638,400 and 1,048,576 (fc2: 943,719)
CEIL_PRUNE = 0.90000059
LAYERS = ("conv1", "conv2", "fc1", "fc2", "fc3")
LIBRARY_OPTIONS = {"algorithm": "fedp3", "model": "a Flax copy of their cifar10_LeNet", "fedp3_downlink": "magnitude",
                   "downlink_keep": KEEP, "fedp3_client_model": "server", "fedp3_upload_classifier": True,
                   "server_optimizer": "sgd", "server_lr": 1.0, "lr": LR, "lr_decay": LR_DECAY, "round": ROUND,
                   "grad_clip_norm": CLIP, "momentum": 0.0, "weight_decay": 0.0, "local_epochs": LOCAL_EP,
                   "batch_size": BATCH, "num_clients": USERS, "clients": ", ".join(map(str, IDS))}
CASES = {
    "published": f"their code as published (`--method OPU2 --global_prune {KEEP}`, lr_decay {LR_DECAY}, clip 10)",
    "global_prune_int": f"diagnostic: their `--global_prune {CEIL_PRUNE}`, whose int(g n) keeps the library's "
                        f"ceil(0.9 n) entries of every kernel",
}
ONE_MORE = "the library's downlink keeps ceil(0.9 n) of fc2's entries, theirs int(0.9 n)"


def _args(prune: float) -> list[str]:
    return ["main.py", "--method", "OPU2", "--dataset", "CIFAR10", "--num_users", str(USERS), "--lr", str(LR),
            "--lr_decay", str(LR_DECAY), "--local_ep", str(LOCAL_EP), "--local_bs", str(BATCH),
            "--global_prune", str(prune), "--gpu", "-1", "--seed", str(SEED)]


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


def torch_setup(checkout: Path) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    Nets, _, _ = _official(checkout)
    T.deterministic(SEED)
    out = A.prefixed("init/server", T.state_arrays(Nets.client_model("cifar10_LeNet").state_dict()))
    for c in range(len(IDS)):
        out.update(A.prefixed(f"init/client{c}", T.state_arrays(Nets.client_model("cifar10_LeNet").state_dict())))
    rng = np.random.default_rng(SEED)
    out.update({"data/x": (INPUT_STD * rng.normal(size=(EXAMPLES * len(IDS), 3, SIDE, SIDE))).astype(np.float32),
                "data/y": rng.integers(0, CLASSES, EXAMPLES * len(IDS)).astype(np.int64),
                "data/counts": np.full(len(IDS), EXAMPLES), "keys": np.array(list(A.under(out, "init/server")))})
    return out


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    Nets, training, options = _official(checkout)
    sys.argv = _args(CEIL_PRUNE if case == "global_prune_int" else KEEP)
    args = options.args_parser()
    args.device = torch.device("cpu")
    for _ in range(ROUND):  # main.py's loop decays the rate after every round
        args.lr = args.lr * args.lr_decay
    assert (args.momentum, args.weigh_delay, args.aggregation, training.max_norm) == (0, 0, "mean", CLIP), args
    T.deterministic(SEED)
    norms = T.GradientNorms(clip=True)
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
        client.synchronize_with_server(server, shared, args.global_prune, ops[client_id])
        out.update({f"client{c}/sent/{k}": (np.ones(v.shape, bool) if k in ops[client_id] or "bias" in k
                                            else v.detach().numpy() != 0)
                    for k, v in client.W.items() if k in shared})
        client.compute_weight_update(shared, server, False)
        out.update(A.prefixed(f"client{c}/value", T.state_arrays(client.model.state_dict())))
        out[f"client{c}/uploaded"] = np.array([k in ops[client_id] for k in setup["keys"]])
        clients.append(client)
    server.aggregate_weight_updates_subset(clients=clients, iter=ROUND, w_glob_keys_ops=ops,
                                           aggregation=args.aggregation)
    out.update(A.prefixed("global", T.state_arrays(server.model.state_dict())))
    out["norms"] = np.array(norms.norms)
    return out


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


def library(setup: dict) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.messages.pricing import KnownMaskArray, SparseArray
    from fedjax_sparse.core.round.step import round_info

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
    info = round_info(0, ROUND, jnp.asarray(IDS))
    client_update = jax.jit(algorithm.client_update)
    is_message = lambda x: isinstance(x, (SparseArray, KnownMaskArray))  # noqa: E731
    out, ups = {}, []
    with J.fixed_data_order():
        for c, client_id in enumerate(IDS):
            down = algorithm.broadcast(server_state, client_id, info)
            sent = jax.tree_util.tree_map(lambda leaf: leaf.mask, down["variables"], is_leaf=is_message)
            out.update(A.prefixed(f"client{c}/sent", J.in_torch_layout(sent, maps)))
            own = J.load_torch(blank, maps, A.under(setup, f"init/client{c}"))
            up, trained, _ = client_update(down, own, split.client(c), jax.random.key(100 + c), info)
            ups.append(up)
            out.update(A.prefixed(f"client{c}/value", J.in_torch_layout(trained, maps)))
            uploaded = J.in_torch_layout(jax.tree_util.tree_map(lambda leaf: leaf.mask, up, is_leaf=is_message), maps)
            out[f"client{c}/uploaded"] = np.array([bool(np.all(uploaded[k])) for k in map(str, setup["keys"])])
            out[f"client{c}/uploaded_any"] = np.array([bool(np.any(uploaded[k])) for k in map(str, setup["keys"])])
    new = jax.jit(algorithm.server_update)(server_state, J.stack(ups), split.counts, info)
    out.update(A.prefixed("global", J.in_torch_layout(new["variables"], maps)))
    return out


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    keys = list(map(str, setup["keys"]))
    clients = range(len(IDS))
    sent_ours = {f"client {IDS[c]}/{k}": library[f"client{c}/sent/{k}"] for c in clients for k in keys}
    # their classifier is never synchronized: nothing of it is sent
    sent_theirs = {name: official.get(f"client{c}/sent/{k}", np.zeros_like(sent_ours[name]))
                   for c in clients for k in keys for name in [f"client {IDS[c]}/{k}"]}
    extra = {k: int(np.sum(sent_ours[k] & ~sent_theirs[k])) for k in sent_ours}
    missing = {k: int(np.sum(~sent_ours[k] & sent_theirs[k])) for k in sent_ours}
    one_more = sorted(k for k, n in extra.items() if n == 1 and k.endswith("fc2.weight"))
    if not any(missing.values()) and all(n == 0 for k, n in extra.items() if k not in one_more):
        note = ("the same entries, exactly" if not one_more else
                f"the library sends one more entry in {', '.join(one_more)}: ceil(0.9 n) = 943,719 of fc2's "
                f"1,048,576, theirs int(0.9 n) = 943,718; every other entry the same")
    else:
        note = "DIFFERENT entries"
    down = A.identical("entries sent down (assigned layers whole, other shared layers' kernels pruned by "
                       "magnitude, biases whole, classifier not sent)", sent_ours, sent_theirs, note)
    ours_up = {f"client {IDS[c]}": library[f"client{c}/uploaded"] for c in clients}
    theirs_up = {f"client {IDS[c]}": official[f"client{c}/uploaded"] for c in clients}
    whole = all(np.array_equal(library[f"client{c}/uploaded"], library[f"client{c}/uploaded_any"]) for c in clients)
    same = all(np.array_equal(ours_up[k], theirs_up[k]) for k in ours_up)
    pairs = ", ".join(f"{client}: " + "+".join(dict.fromkeys(k.split(".")[0] for k, u in zip(keys, sent) if u))
                      for client, sent in theirs_up.items())
    up = A.identical("tensors uploaded (OPU2's two layers and the classifier)", ours_up, theirs_up,
                     f"the same tensors, each whole ({pairs})" if same and whole else "DIFFERENT tensors")
    rows = []
    for c in clients:
        theirs = A.under(official, f"client{c}/value")
        row = A.group(f"client {IDS[c]}: its model after local training",
                      [A.difference(k, library[f"client{c}/value/{k}"], v) for k, v in theirs.items()])
        received_more = any(k.startswith(f"client {IDS[c]}/") for k in one_more)
        A.explain([row], f"{ONE_MORE}; this client received one more fc2 entry (the server's value where theirs "
                         f"has 0)" if received_more else "UNEXPLAINED")
        rows.append(row)
    differing = {IDS[c] for c, row in zip(clients, rows) if row["max_rel"] > A.ROUND_OFF}
    for layer in LAYERS:
        uploaders = [IDS[c] for c in clients if official[f"client{c}/uploaded"][keys.index(f"{layer}.weight")]]
        row = A.group(f"server: {layer} (mean of clients {', '.join(map(str, uploaders))})",
                      [A.difference(k, library[f"global/{k}"], official[f"global/{k}"], setup[f"init/server/{k}"])
                       for k in (f"{layer}.weight", f"{layer}.bias")])
        late = sorted(differing & set(uploaders))
        A.explain([row], (f"{ONE_MORE}; through the upload{'s' if len(late) > 1 else ''} of "
                          f"client{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} (above)") if late
                  else "UNEXPLAINED")
        rows.append(row)
    norms = official["norms"]
    rows[-1]["note"] += (f"; gradient norms their clipping saw: {norms.min():.3g} to {norms.max():.3g} "
                         f"({int(np.sum(norms > CLIP))} of {len(norms)} steps clipped to {CLIP:g})")
    return [down, up] + rows
