"""SPATL (Yu et al., CVPR 2023): the encoder update with its control variate, against its code:
`spatl_federated_learning.py` run as a script (`--alg noselect`: its SCAFFOLD-style round without the
RL pruning search), which calls `federated_learning/network_training.py`'s `local_update_scaffold`
and `train_net_scaffold` and aggregates the encoders; `networks/vgg.py`'s `vgg11`.

One round: two clients of 16 examples (32x32x3), one local epoch of 2 batches of 8, SGD lr 0.01 without
momentum (their `--rho` default 0), weight decay 1e-5 (their `--reg` default), full participation.
The library runs `spatl` on `vgg11` (the same network: the convolutions are the encoder, the three
dense layers the private predictor) with `--spatl-aggregation fedavg` (their data-weighted mean of
whole encoders), `--salient-policy fixed`, `--gradient-control`. The salient selection changes
nothing either side sends under fedavg; their `--alg scaffold` runs the RL pruning search on a copy it
then discards (the weights are those of `noselect`), and it needs their data pipeline and
torch_geometric.

Their run is fed from the harness: `partition_data`/`get_dataloader` (their data module, an import
stub) give our examples; `init_nets` (called unchanged) has its nets loaded with the setup's weights;
the pruning head, which `noselect` never calls, and sklearn's `confusion_matrix`, which only feeds a
log line, are import stubs. Their `train_net_scaffold` leaves the net in eval mode (its
`compute_acc` calls `model.eval()` before training): VGG-11's dropout is then off, as in the library.

Controls. Their code starts every control variate as the same random network (`c_nets` loaded with
`c_global`'s encoder), so c_l = c_g in the first round: case `published`. Case `distinct_controls`
gives each client its own c_l (another random network's encoder, as a later round would), set by the
harness just before `local_update_scaffold`. There the update differs by design: their code subtracts
lr (c_g - c_l) / 100 from the weights after each optimizer step, the library adds c_g - c_l to the
gradient (eq. 9). With no momentum both are the same step once the library's controls are divided
by 100: the library's third run (`controls / 100`) checks that the weights then agree, and that their
c_l+ = c_l - c_g + (w_g - w) / (K lr) equals the library's plus 0.99 (c_l - c_g).
"""

from __future__ import annotations

import runpy
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A

NAME = "spatl"
REPOSITORY = "yusx-swapp/SPATL"
COMMIT = "fef44a60509624bca9dc6a3a6e5a11afc80fd726"
CHECKOUT = ""
MODEL = "their vgg11 (conv encoder 64-...-512, dense predictor 512-512-10) / the library's vgg11, 32x32x3"
SEED = 0
CLIENTS, EXAMPLES, BATCH, CLASSES, SIDE = 2, 16, 8, 10, 32
LR, WEIGHT_DECAY = 0.01, 1e-5
LIBRARY_OPTIONS = {"algorithm": "spatl", "model": "vgg11", "spatl_aggregation": "fedavg", "salient_policy": "fixed",
                   "gradient_control": True, "lr": LR, "momentum": 0.0, "weight_decay": WEIGHT_DECAY,
                   "local_epochs": 1, "batch_size": BATCH, "clients_per_round": "all"}
CASES = {
    "published": "their code as published (`--alg noselect`; its controls start equal, c_l = c_g)",
    "distinct_controls": "each client's c_l set to its own random encoder before the round",
}
RUNS = {"equal": "c_l = c_g", "distinct": "each client's own c_l", "scaled": "each client's own c_l, controls / 100"}
CORRECTION = ("their code subtracts lr (c_g - c_l) / 100 after each step; the library adds c_g - c_l to the "
              "gradient (eq. 9)")


def _args(logdir: str) -> list[str]:
    return ["spatl_federated_learning.py", "--alg", "noselect", "--model", "vgg", "--dataset", "cifar10",
            "--n_parties", str(CLIENTS), "--sample", "1", "--comm_round", "1", "--epochs", "1",
            "--batch-size", str(BATCH), "--lr", str(LR), "--rho", "0", "--reg", str(WEIGHT_DECAY), "--device", "cpu",
            "--init_seed", str(SEED), "--logdir", logdir, "--ckp_dir", logdir + "/"]


# ------------------------------------------------------------------ the PyTorch side

def _networks(checkout: Path):
    from benchmarks.parity import torch_side as T
    T.enter_checkout(checkout)
    from networks import vgg
    return vgg


def torch_setup(checkout: Path) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    vgg = _networks(checkout)
    T.deterministic(SEED)
    out = A.prefixed("init/global", T.state_arrays(vgg.vgg11().state_dict()))
    for c in range(CLIENTS):
        out.update(A.prefixed(f"init/client{c}", T.state_arrays(vgg.vgg11().state_dict())))
    out.update(A.prefixed("init/control", T.state_arrays(vgg.vgg11().encoder.state_dict())))
    for c in range(CLIENTS):
        out.update(A.prefixed(f"init/control{c}", T.state_arrays(vgg.vgg11().encoder.state_dict())))
    rng = np.random.default_rng(SEED)
    out.update({"data/x": rng.normal(size=(EXAMPLES * CLIENTS, 3, SIDE, SIDE)).astype(np.float32),
                "data/y": rng.integers(0, CLASSES, EXAMPLES * CLIENTS).astype(np.int64),
                "data/counts": np.full(CLIENTS, EXAMPLES),
                "keys": np.array(list(A.under(out, "init/global")))})
    return out


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    _networks(checkout)
    import pruning_head  # noqa: F401 - the real package; only its RL search module is stubbed
    import utils.data  # noqa: F401
    T.stub_module("pruning_head.gnnrl_network_pruning", gnnrl_pruning=T.refuse("gnnrl_pruning"))
    T.stub_module("sklearn")
    T.stub_module("sklearn.metrics", confusion_matrix=lambda *args, **kwargs: None)
    bounds = np.concatenate([[0], np.cumsum(setup["data/counts"])])
    index_map = {c: np.arange(bounds[c], bounds[c + 1]) for c in range(CLIENTS)}

    def partition_data(*args, **kwargs):
        return None, setup["data/y"], None, None, index_map, None

    def get_dataloader(dataset, datadir, train_bs, test_bs, dataidxs=None, *args, **kwargs):
        if dataidxs is None:  # the global loaders: `noselect` only measures len(test set)
            return None, None, None, []
        c = int(np.searchsorted(bounds, dataidxs[0], side="right") - 1)
        batches = T.Batches(*T.client_arrays(setup, c), train_bs, T.tensor_pair)
        return batches, batches, None, None

    T.stub_module("utils.data.prepare_data", partition_data=partition_data, get_dataloader=get_dataloader)
    import federated_learning.network_training as training
    import utils.load_neural_networks as loading
    T.deterministic(SEED)
    init_nets = loading.init_nets
    sources = iter([[f"init/client{c}" for c in range(CLIENTS)], ["init/global"], ["init/control"] * CLIENTS,
                    ["init/control"]])
    made = []

    def setup_nets(n_parties, model_name, args):  # their init_nets, its nets then holding the setup's weights
        nets, meta, layers = init_nets(n_parties, model_name, args)
        for net, source in zip(nets.values(), next(sources)):
            state = A.under(setup, source)
            if source == "init/control":
                T.load_state(net.module.encoder, state)
            else:
                T.load_state(net.module, state)
        made.append(nets)
        return nets, meta, layers

    loading.init_nets = setup_nets
    local_update_scaffold = training.local_update_scaffold

    def with_controls(nets, selected, global_model, c_nets, *args, **kwargs):
        if case == "distinct_controls":
            for c in range(CLIENTS):
                T.load_state(c_nets[c].module.encoder, A.under(setup, f"init/control{c}"))
        return local_update_scaffold(nets, selected, global_model, c_nets, *args, **kwargs)

    training.local_update_scaffold = with_controls
    with tempfile.TemporaryDirectory() as logdir:
        sys.argv = _args(logdir)
        runpy.run_path("spatl_federated_learning.py", run_name="__main__")
    nets, global_nets, c_nets, c_globals = made
    out = {}
    for c in range(CLIENTS):
        out.update(A.prefixed(f"client{c}", T.state_arrays(nets[c].module.state_dict())))
        out.update(A.prefixed(f"client{c}/control", T.state_arrays(c_nets[c].module.encoder.state_dict())))
    out.update(A.prefixed("global", T.state_arrays(global_nets[0].module.encoder.state_dict())))
    out.update(A.prefixed("global/control", T.state_arrays(c_globals[0].module.encoder.state_dict())))
    return out


# ------------------------------------------------------------------ the JAX side

def mapping(setup: dict) -> dict:
    """Their encoder.<i> convolutions are conv1..conv8 in order, classifier.1/4/6 fc1..fc3."""
    out, convs, denses = {}, {}, {}
    for key in map(str, setup["keys"]):
        module, param = key.rsplit(".", 1)
        ndim = setup[f"init/global/{key}"].ndim if param == "weight" else setup[f"init/global/{module}.weight"].ndim
        table = convs if ndim == 4 else denses
        name = table.setdefault(module, (f"conv{len(table) + 1}" if ndim == 4 else f"fc{len(table) + 1}"))
        kind = ("conv" if ndim == 4 else "dense") if param == "weight" else "vector"
        out[key] = ("params", (name, "kernel" if param == "weight" else "bias"), kind)
    return out


def library(setup: dict) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.structure.model_parts import part_labels, take_part
    from fedjax_sparse.core.round.step import round_info
    from fedjax_sparse.models import get_model

    model = get_model("vgg11", (SIDE, SIDE, 3), CLASSES)
    maps = mapping(setup)
    encoder_maps = {k: v for k, v in maps.items() if k.startswith("encoder.")}
    labels = part_labels(model)
    blank = model.init(jax.random.key(0))

    def full(source):
        return J.load_torch(blank, maps, A.under(setup, source))

    def control(source, scale):
        tree = {"params": blank["params"]}
        for key, (collection, path, kind) in encoder_maps.items():
            value = setup[f"{source}/{key.removeprefix('encoder.')}"]  # saved from the encoder itself
            tree = {"params": J.put(tree["params"], path, jnp.asarray(J.from_torch(kind, value)))}
        return jax.tree_util.tree_map(lambda x: x * scale, take_part(tree, labels, "encoder")["params"])

    split = J.federated_data(setup)
    local = LocalSGD(model, LR, 1, BATCH, 0.0, WEIGHT_DECAY)
    context = BuildContext(local=local, num_clients=CLIENTS, clients_per_round=CLIENTS, train=split,
                           num_classes=CLASSES, seed=0)
    options = {k: LIBRARY_OPTIONS[k] for k in ("spatl_aggregation", "salient_policy", "gradient_control")}
    algorithm = make_algorithm("spatl", context, make_options("spatl", options))
    client_update = jax.jit(algorithm.client_update)
    server_update = jax.jit(algorithm.server_update)
    info = round_info(0, 0, jnp.arange(CLIENTS))
    out = {}

    def torch_tree(tree):
        return J.in_torch_layout(tree, maps)

    for run in RUNS:
        scale = 0.01 if run == "scaled" else 1.0
        server_state, clients = algorithm.init(jax.random.key(1), full("init/global"), CLIENTS)
        server_state = {**server_state, "control": control("init/control", scale)}
        ups = []
        with J.fixed_data_order():
            for c in range(CLIENTS):
                state = jax.tree_util.tree_map(lambda leaf: leaf[c], clients)
                own = "init/control" if run == "equal" else f"init/control{c}"
                state = {**state, "variables": full(f"init/client{c}"), "control": control(own, scale)}
                up, new, _ = client_update(algorithm.broadcast(server_state, c, info), state, split.client(c),
                                           jax.random.key(100 + c), info)
                ups.append(up)
                out.update(A.prefixed(f"{run}/client{c}", torch_tree(new["variables"])))
                out.update(A.prefixed(f"{run}/client{c}/control", torch_tree({"params": new["control"]})))
        new_server = server_update(server_state, J.stack(ups), split.counts, info)
        out.update(A.prefixed(f"{run}/global", torch_tree(new_server["encoder"])))
        out.update(A.prefixed(f"{run}/global/control", torch_tree({"params": new_server["control"]})))
    return out


def _ulp_note(row: dict, official: dict, clients: list[int]) -> None:
    """A control variate is (w_g - w) / (K lr) plus controls: the difference of two float32 weights a
    small step apart, so its round-off is that of the weights (their ulp), over K lr, not its own
    scale's. The note says how many of those units the row's worst error is."""
    steps = -(-EXAMPLES // BATCH)
    units = []  # of the tensors above round-off at their own scale
    for d in row["details"]:
        if d["max_rel"] > A.ROUND_OFF:
            weight = max(float(np.max(np.abs(official[f"client{c}/encoder.{d['tensor']}"]))) for c in clients)
            units.append(d["max_abs"] / (float(np.spacing(np.float32(weight))) / (steps * LR)))
    if units and max(units) <= 4:
        row["note"] = (f"float32 round-off of w_g - w over K lr: at most {max(units):.2g} ulp of the weights / (K lr), "
                       f"K = {steps}")


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    runs = ("equal",) if case == "published" else ("distinct", "scaled")
    rows = []
    for run in runs:
        ours = A.under(library, run)
        label = f"library ({RUNS[run]})"
        group, controls = [], []
        global_start = A.under(setup, "init/global")
        for c in range(CLIENTS):
            theirs = A.under(official, f"client{c}")
            start = A.under(setup, f"init/client{c}")
            encoder = {k: v for k, v in theirs.items() if k.startswith("encoder.")}
            predictor = {k: v for k, v in theirs.items() if k.startswith("classifier.")}
            group.append(A.group(f"{label}: client {c} encoder after local training",
                                 [A.difference(k, ours[f"client{c}/{k}"], v, global_start[k])
                                  for k, v in encoder.items()]))
            group.append(A.group(f"{label}: client {c} private predictor",
                                 [A.difference(k, ours[f"client{c}/{k}"], v, start[k]) for k, v in predictor.items()]))
            control = A.under(official, f"client{c}/control")
            if run == "scaled":  # their c_l+ = the library's (controls / 100) + 0.99 (c_l - c_g)
                own, shared = A.under(setup, f"init/control{c}"), A.under(setup, "init/control")
                row = A.group(f"{label}: client {c} c_l+ (library's + 0.99 (c_l - c_g))",
                              [A.difference(k, ours[f"client{c}/control/encoder.{k}"] + 0.99 * (own[k] - shared[k]), v)
                               for k, v in control.items()])
            else:
                row = A.group(f"{label}: client {c} control variate c_l+",
                              [A.difference(k, ours[f"client{c}/control/encoder.{k}"], v) for k, v in control.items()])
            group.append(row)
            controls.append((row, [c]))
        theirs_global = {k: v for k, v in A.under(official, "global").items() if not k.startswith("control/")}
        group.append(A.group(f"{label}: server encoder (data-weighted mean)",
                             [A.difference(k, ours[f"global/encoder.{k}"], v, setup[f"init/global/encoder.{k}"])
                              for k, v in theirs_global.items()]))
        row = A.group(f"{label}: server control variate c_g",
                      [A.difference(k, ours[f"global/control/encoder.{k}"], v)
                       for k, v in A.under(official, "global/control").items()])
        group.append(row)
        controls.append((row, list(range(CLIENTS))))
        A.explain(group, CORRECTION if run == "distinct" else "UNEXPLAINED")
        if run != "distinct":
            for row, clients in controls:
                _ulp_note(row, official, clients)
        rows += group
    return rows
