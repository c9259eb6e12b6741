"""SPATL (Yu et al., CVPR 2023): the encoder update with its control variate, against its code:
`spatl_federated_learning.py` run as a script (`--alg noselect`: its SCAFFOLD-style round without the
RL pruning search), which calls `federated_learning/network_training.py`'s `local_update_scaffold`
and `train_net_scaffold` and aggregates the encoders; `networks/vgg.py`'s `vgg11`.

Three rounds, every client sampled (`--sample 1`), three clients of 70, 45 and 19 examples (32x32x3),
their README's VGG settings otherwise: five local epochs of batches of 64 (the last short), SGD lr 0.01
with momentum 0.9 (`--rho 0.9`), weight decay 1e-5 (their `--reg` default). The library runs `spatl`
on `vgg11` (the same network: the convolutions are the encoder, the three dense layers the private
predictor) with `--spatl-aggregation fedavg` (their data-weighted mean of whole encoders),
`--salient-policy fixed`, `--gradient-control`. The salient selection changes nothing either side
sends under fedavg; their `--alg scaffold` runs the RL pruning search on a copy it then discards (the
weights are those of `noselect`), and it needs their data pipeline and torch_geometric.

Their run is fed from the harness: `partition_data`/`get_dataloader` (their data module, an import
stub) give our examples; `init_nets` (called unchanged) has its nets loaded with the setup's weights;
the pruning head, which `noselect` never calls, and sklearn's `confusion_matrix`, which only feeds a
log line, are import stubs. Their `train_net_scaffold` leaves the net in eval mode (its
`compute_acc` calls `model.eval()` before training): VGG-11's dropout is then off, as in the library.

Controls. Their code starts every control variate as the same random network (`c_nets` loaded with
`c_global`'s encoder), so c_l = c_g in the first round (setting `equal`, the code as published);
from the second round each client's c_l is its own. Setting `distinct` gives each client its own c_l
from the start (another random network's encoder), set by the harness before the first
`local_update_scaffold`.

Cause `control`: their code subtracts lr (c_g - c_l) / 100 from the encoder after each optimizer step
(outside the momentum) and divides c_l+'s (w_g - w) by its plain count of steps, where the library
(eq. 9, 10) adds c_g - c_l to the gradient and divides by the momentum-aware count; aligned by the
library's `--spatl-control code`. The control variates are (w_g - w) / (K lr) plus controls: a
difference of two weights a few steps apart over K lr, whose round-off is the weights' over K lr, so
their rows compare them in those units: relative to the encoder weight's largest magnitude / (K lr),
K the fewest steps a client takes.
"""

from __future__ import annotations

import runpy
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A
from benchmarks.parity import decisions as D
from benchmarks.parity.verdicts import Case

NAME = "spatl"
REPOSITORY = "yusx-swapp/SPATL"
COMMIT = "fef44a60509624bca9dc6a3a6e5a11afc80fd726"
CHECKOUT = ""
MODEL = "their vgg11 (conv encoder 64-...-512, dense predictor 512-512-10) / the library's vgg11, 32x32x3"
SEED = 0
COUNTS, BATCH, EPOCHS, ROUNDS, CLASSES, SIDE = (70, 45, 19), 64, 5, 3, 10, 32
CLIENTS = len(COUNTS)
LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 1e-5
SETUP = (f"{ROUNDS} rounds, every client sampled, the global encoder, c_g and each client's model and c_l carried; "
         f"clients holding {', '.join(map(str, COUNTS))} examples; their README's VGG settings: {EPOCHS} local "
         f"epochs of batches of {BATCH} (the last short), SGD lr {LR}, momentum {MOMENTUM}, weight decay "
         f"{WEIGHT_DECAY} (`--reg`'s default).")
LIBRARY_OPTIONS = {"algorithm": "spatl", "model": "vgg11", "spatl_aggregation": "fedavg", "salient_policy": "fixed",
                   "gradient_control": True, "spatl_control": "paper (code where `control` is aligned)", "lr": LR,
                   "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY, "local_epochs": EPOCHS, "batch_size": BATCH,
                   "clients_per_round": "all"}
CAUSES = {"control": "their code subtracts lr (c_g - c_l) / 100 from the encoder after each optimizer step and divides "
                     "c_l+'s (w_g - w) by its plain count of steps; the library adds c_g - c_l to the gradient (eq. "
                     "9) and divides by the momentum-aware count; aligned by the library's `--spatl-control code`"}
CASES = {"published": Case("their code as published (`--alg noselect`; its controls start equal, c_l = c_g)",
                           floor="code_control"),
         "code_control": Case("the library with `--spatl-control code`", ("control",)),
         "distinct": Case("each client's c_l set to its own random encoder before the first round",
                          floor="distinct_code_control"),
         "distinct_code_control": Case("the same, the library with `--spatl-control code`", ("control",))}
RUNS = {"published": "equal/paper", "code_control": "equal/code", "distinct": "distinct/paper",
        "distinct_code_control": "distinct/code"}


def _args(logdir: str) -> list[str]:
    return ["spatl_federated_learning.py", "--alg", "noselect", "--model", "vgg", "--dataset", "cifar10",
            "--n_parties", str(CLIENTS), "--sample", "1", "--comm_round", str(ROUNDS), "--epochs", str(EPOCHS),
            "--batch-size", str(BATCH), "--lr", str(LR), "--rho", str(MOMENTUM), "--reg", str(WEIGHT_DECAY),
            "--device", "cpu", "--init_seed", str(SEED), "--logdir", logdir, "--ckp_dir", logdir + "/"]


# ------------------------------------------------------------------ the PyTorch side

def _networks(checkout: Path):
    from benchmarks.parity import torch_side as T
    T.enter_checkout(checkout)
    from networks import vgg
    return vgg


def torch_setup(checkout: Path, seed: int) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    vgg = _networks(checkout)
    T.deterministic(seed)
    out = A.prefixed("init/global", T.state_arrays(vgg.vgg11().state_dict()))
    for c in range(CLIENTS):
        out.update(A.prefixed(f"init/client{c}", T.state_arrays(vgg.vgg11().state_dict())))
    out.update(A.prefixed("init/control", T.state_arrays(vgg.vgg11().encoder.state_dict())))
    for c in range(CLIENTS):
        out.update(A.prefixed(f"init/control{c}", T.state_arrays(vgg.vgg11().encoder.state_dict())))
    rng = np.random.default_rng(seed)
    out.update({"data/x": rng.normal(size=(sum(COUNTS), 3, SIDE, SIDE)).astype(np.float32),
                "data/y": rng.integers(0, CLASSES, sum(COUNTS)).astype(np.int64),
                "data/counts": np.array(COUNTS), "keys": np.array(list(A.under(out, "init/global")))})
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
        batches = T.Batches(*T.client_arrays(setup, c), train_bs, T.tensor_pair, owner=c)
        return batches, batches, None, None

    T.stub_module("utils.data.prepare_data", partition_data=partition_data, get_dataloader=get_dataloader)
    import federated_learning.network_training as training
    import utils.load_neural_networks as loading
    T.deterministic(SEED)
    decisions = D.OfficialDecisions(A.under(library, RUNS[case]))
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
    train_net_scaffold = training.train_net_scaffold
    out, rounds = {}, []

    def with_controls(nets, selected, global_model, c_nets, c_global, *args, **kwargs):
        rnd = len(rounds)
        if rnd == 0 and case.startswith("distinct"):
            for c in range(CLIENTS):
                T.load_state(c_nets[c].module.encoder, A.under(setup, f"init/control{c}"))
        if rnd > 0:  # what the last round left: the aggregated encoder and c_g
            record_global(rnd - 1, global_model, c_global)
        rounds.append(rnd)
        result = local_update_scaffold(nets, selected, global_model, c_nets, c_global, *args, **kwargs)
        for c in range(CLIENTS):
            out.update(A.prefixed(f"round{rnd}/client{c}", T.state_arrays(nets[c].module.state_dict())))
            out.update(A.prefixed(f"round{rnd}/client{c}/control", T.state_arrays(c_nets[c].module.encoder.state_dict())))
        return result

    def aligned_training(net_id, net, global_model, c_local, c_global, train_dataloader, *args, **kwargs):
        decisions.start(f"decisions/r{len(rounds) - 1}/c{train_dataloader.owner}")
        result = train_net_scaffold(net_id, net, global_model, c_local, c_global, train_dataloader, *args, **kwargs)
        decisions.finish()
        return result

    def record_global(rnd, global_model, c_global):
        out.update({f"round{rnd}/global/encoder.{k}": v
                    for k, v in T.state_arrays(global_model.module.encoder.state_dict()).items()})
        out.update(A.prefixed(f"round{rnd}/global/control", T.state_arrays(c_global.module.encoder.state_dict())))

    training.local_update_scaffold = with_controls
    training.train_net_scaffold = aligned_training
    with tempfile.TemporaryDirectory() as logdir:
        sys.argv = _args(logdir)
        runpy.run_path("spatl_federated_learning.py", run_name="__main__")
    _, global_nets, _, c_globals = made
    record_global(ROUNDS - 1, global_nets[0], c_globals[0])
    return {**out, **decisions.arrays()}


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


def library(setup: dict, cases) -> dict[str, np.ndarray]:
    """The library's rounds, for the runs `cases` compare with: controls starting equal or distinct, the
    control term as the paper reads it or as the code applies it."""
    out = {}
    for run in dict.fromkeys(RUNS[c] for c in cases):
        controls, variant = run.split("/")
        out.update(A.prefixed(run, library_rounds(setup, controls, variant)))
    return out


def library_rounds(setup: dict, controls: str, variant: str) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from benchmarks.parity import jax_side as J
    from fedjax_sparse.algorithms import make_algorithm, make_options
    from fedjax_sparse.core.contract.algorithm import BuildContext
    from fedjax_sparse.core.round.local_training import LocalSGD
    from fedjax_sparse.core.structure.model_parts import part_labels, take_part
    from fedjax_sparse.models import get_model

    model = get_model("vgg11", (SIDE, SIDE, 3), CLASSES)
    maps = mapping(setup)
    encoder_maps = {k: v for k, v in maps.items() if k.startswith("encoder.")}
    labels = part_labels(model)
    blank = model.init(jax.random.key(0))

    def full(source):
        return J.load_torch(blank, maps, A.under(setup, source))

    def control(source):
        tree = {"params": blank["params"]}
        for key, (collection, path, kind) in encoder_maps.items():
            value = setup[f"{source}/{key.removeprefix('encoder.')}"]  # saved from the encoder itself
            tree = {"params": J.put(tree["params"], path, jnp.asarray(J.from_torch(kind, value)))}
        return take_part(tree, labels, "encoder")["params"]

    split = J.federated_data(setup)
    local = LocalSGD(model, LR, EPOCHS, BATCH, MOMENTUM, WEIGHT_DECAY)
    context = BuildContext(local=local, num_clients=CLIENTS, clients_per_round=CLIENTS, train=split,
                           num_classes=CLASSES, seed=0)
    options = {**{k: LIBRARY_OPTIONS[k] for k in ("spatl_aggregation", "salient_policy", "gradient_control")},
               "spatl_control": variant}
    algorithm = make_algorithm("spatl", context, make_options("spatl", options))
    server_state, clients = algorithm.init(jax.random.key(1), full("init/global"), CLIENTS)
    server_state = {**server_state, "control": control("init/control")}
    states = []
    for c in range(CLIENTS):
        state = jax.tree_util.tree_map(lambda leaf: leaf[c], clients)
        own = "init/control" if controls == "equal" else f"init/control{c}"
        states.append({**state, "variables": full(f"init/client{c}"), "control": control(own)})
    def after(i, c, up, state, metrics):
        return {**A.prefixed(f"round{i}/client{c}", J.in_torch_layout(state["variables"], maps)),
                **A.prefixed(f"round{i}/client{c}/control", J.in_torch_layout({"params": state["control"]}, maps))}

    def after_round(i, state):
        return {**A.prefixed(f"round{i}/global", J.in_torch_layout(state["encoder"], maps)),
                **A.prefixed(f"round{i}/global/control", J.in_torch_layout({"params": state["control"]}, maps))}

    clients = list(range(CLIENTS))
    return J.run_rounds(algorithm, server_state, states, split, [(i, clients) for i in range(ROUNDS)], after=after,
                        after_round=after_round)


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    ours = A.under(library, RUNS[case])
    prefix = "" if not case.startswith("distinct") else "distinct c_l: "
    steps = min(EPOCHS * -(-n // BATCH) for n in COUNTS)
    rows = []
    for rnd in range(ROUNDS):
        head = f"{prefix}round {rnd + 1}: "
        global_start = A.under(setup, "init/global") if rnd == 0 else A.under(official, f"round{rnd - 1}/global")
        for c in range(CLIENTS):
            theirs = A.under(official, f"round{rnd}/client{c}")
            start = A.under(setup, f"init/client{c}") if rnd == 0 else A.under(official, f"round{rnd - 1}/client{c}")
            rows.append(A.group(f"{head}client {c} encoder after local training",
                                [A.difference(k, ours[f"round{rnd}/client{c}/{k}"], v, global_start[k],
                                              key=f"round{rnd}/client{c}/{k}")
                                 for k, v in theirs.items() if k.startswith("encoder.")]))
            rows.append(A.group(f"{head}client {c} private predictor",
                                [A.difference(k, ours[f"round{rnd}/client{c}/{k}"], v, start[k],
                                              key=f"round{rnd}/client{c}/{k}")
                                 for k, v in theirs.items() if k.startswith("classifier.")]))
            rows.append(control_row(f"{head}client {c} control variate c_l+", ours, official,
                                    f"round{rnd}/client{c}/control", f"round{rnd}/client{c}", steps))
        rows.append(A.group(f"{head}server encoder (data-weighted mean)",
                            [A.difference(k, ours[f"round{rnd}/global/{k}"], v, global_start[k],
                                          key=f"round{rnd}/global/{k}")
                             for k, v in A.under(official, f"round{rnd}/global").items() if k.startswith("encoder.")]))
        rows.append(control_row(f"{head}server control variate c_g", ours, official, f"round{rnd}/global/control",
                                f"round{rnd}/global", steps))
    return rows + [{**D.aligned_row(official), "compared": prefix + D.aligned_row(official)["compared"]}]


def control_row(what: str, ours: dict, official: dict, prefix: str, weights: str, steps: int) -> dict:
    """Control variates against theirs in the units of their round-off: relative to the largest magnitude
    of the encoder weight they stand beside over (K lr), K the fewest steps a client takes."""
    diffs = []
    for k, v in A.under(official, prefix).items():
        weight = float(np.max(np.abs(official[f"{weights}/encoder.{k}"])))
        diffs.append(A.difference(k, ours[f"{prefix}/encoder.{k}"], v, key=f"{prefix}/{k}",
                                  scale=weight / (steps * LR)))
    return A.group(what, diffs, "relative to the encoder weight's largest magnitude / (K lr)")
