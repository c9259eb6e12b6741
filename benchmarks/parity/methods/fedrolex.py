"""FedRolex (Alam et al., NeurIPS 2022) against its code: `resnet_server.py`'s `ResnetServerRoll`
(split_model's rolling window, distribute, combine), `resnet_client.py`'s `ResnetClient` (update,
step), `models/resnet.py`'s pre-activation `resnet18`.

Three rounds at round indices 5, 6, 7 (the window rolls by the round index: {(j - r) mod N : j <
ceil(rate N)}, so it wraps around), the global model and their update counts carried; three clients
of rates 1, 1/2, 1/4 holding 27, 16 and 8 examples (batches of 10: 10+10+7, 10+6, 8) and a few labels
each; their CIFAR-10 settings (batch 10, one local epoch, SGD momentum 0.9, weight decay 1e-3,
gradients clipped to norm 1) but lr 0.01: their README's 2e-4 moves the weights by ~1e-5 of their size
in these steps, below what the comparison resolves. Their `resnet18` (64-128-256-512) at 16x16x3 (its
last stage's maps 2x2: at 8x8 they are 1x1, and a short batch leaves BatchNorm a handful of values
per channel, where the full-width client's BatchNorm shifts parted from theirs by up to 45 times their
round-off floor). The
library runs `fedrolex` on `preresnet18` with `--label-mask --label-mask-fill zero --scaler --static-bn
--grad-clip-norm 1`, twice: `--submodel-aggregation heterofl` (the paper's plain mean over holders, the
library's reading) and `fedrolex_counts` (the option reproducing their code's weighting).

Their run is fed from the harness: ray is an import stub whose `remote` leaves classes as they are
and whose `get`/`put` return their argument (the harness calls `distribute`, each client's `update`
and `step` and the server's `step` in the order their `main_resnet.py` does, in one process);
`make_data_loader`/`SplitDataset` (resnet_client's names) return our batches; their hard-coded
'cuda' device reads as the CPU; data, torchvision and the logger are import stubs.

Causes: `scaler`, the Scaler's BatchNorm epsilon as in HeteroFL (heterofl.py), aligned by their
`scale` control at 0; `counts`, their `combine`'s weighting: `self.tmp_counts = tmp_counts_cpy` sits
inside the loop over keys, so from the second key on the k-th client holding a bias, normalization
parameter or output row weighs its count + (k - 1) instead of the same count; aligned by the
library's `--submodel-aggregation fedrolex_counts`; `torch_norm`, their clipping's total norm: torch's
CPU float32 norm accumulates in float32 and, on this harness's first step, is 8.4e-5 below the float64
norm on each 2,359,296-entry kernel of layer4 and 1.2e-5 below it in total (17.966825 against
17.967043; the library's, XLA's reduction, gives 17.967043), so every clipped step of theirs is 1.2e-5
longer, which shows where a tensor's whole value is its updates (the BatchNorm shifts and the output
bias start at zero); aligned by the harness's wrap of clip_grad_norm_ summing the norm in float64
(`torch_side.exact_clip_grad_norm_`). How far torch's norm is off depends on the host's vector width.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A
from benchmarks.parity import decisions as D
from benchmarks.parity.methods import _submodels as S
from benchmarks.parity.methods.heterofl import _Logger
from benchmarks.parity.verdicts import Case

NAME = "fedrolex"
REPOSITORY = "AIoT-MLSys-Lab/FedRolex"
COMMIT = "813510997e1802eb756d53baa4229c90ce5ac008"
CHECKOUT = ""
MODEL = "their pre-activation resnet18 (64-128-256-512) / the library's preresnet18, 16x16x3, 10 classes"
SEED = 0
FIRST_ROUND, ROUNDS = 5, 3
RATES = (1.0, 0.5, 0.25)
LABELS = ((0, 1, 2, 3), (2, 3, 4, 5, 6), (0, 7, 8))
COUNTS, BATCH, EPOCHS, SIDE, CLASSES = (27, 16, 8), 10, 1, 16, 10
LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 1e-3
SETUP = (f"{ROUNDS} rounds at round indices {FIRST_ROUND}-{FIRST_ROUND + ROUNDS - 1}, the global model and update "
         f"counts carried; clients of rates {', '.join(map(str, RATES))} holding {', '.join(map(str, COUNTS))} "
         f"examples of labels {'; '.join(','.join(map(str, l)) for l in LABELS)}; {EPOCHS} local epoch of batches "
         f"of {BATCH} (the last short), SGD lr {LR} (their README's 2e-4 would move the weights below what the "
         f"comparison resolves), momentum {MOMENTUM}, weight decay {WEIGHT_DECAY}, gradients clipped to norm 1.")
LIBRARY_OPTIONS = {"algorithm": "fedrolex", "model": "preresnet18", "capacities": "the client's rate",
                   "rounds": ", ".join(str(FIRST_ROUND + i) for i in range(ROUNDS)),
                   "submodel_aggregation": "heterofl (fedrolex_counts where `counts` is aligned)", "label_mask": True,
                   "label_mask_fill": "zero", "scaler": True, "static_bn": True, "lr": LR, "momentum": MOMENTUM,
                   "weight_decay": WEIGHT_DECAY, "local_epochs": EPOCHS, "batch_size": BATCH,
                   "grad_clip_norm": S.CLIP}
CAUSES = {"scaler": "their Scaler divides a layer's input by the rate before its BatchNorm, which changes only "
                    "BatchNorm's epsilon (1e-5 rate^2 for their 1e-5); the library leaves BatchNorm layers "
                    "unscaled; aligned by their `scale` control at 0",
          "counts": "their combine weighs the k-th client holding a bias, norm parameter or output row by its "
                    "update count + (k - 1) (`self.tmp_counts = tmp_counts_cpy` inside the loop over keys); the "
                    "library's default `heterofl` aggregation is the paper's plain mean; aligned by the library's "
                    "`--submodel-aggregation fedrolex_counts`",
          "torch_norm": "their clipping takes the total gradient norm from torch's CPU float32 norm, which sums in "
                        "float32: 1.2e-5 below the float64 norm on the first step (8.4e-5 on each of layer4's "
                        "2,359,296-entry kernels), so their clipped steps are that much longer; the library's "
                        "norm is within 1e-7; aligned by the harness's wrap of clip_grad_norm_ summing it in "
                        "float64"}
CASES = {"published": Case("their code as published (`--algo roll --weighting avg`, Scaler on, gradients clipped "
                           "to norm 1) against the library's plain mean"),
         "no_scaler": Case("their `scale` control at 0", ("scaler",)),
         "counts": Case("the library with `--submodel-aggregation fedrolex_counts`", ("counts",)),
         "no_scaler_counts": Case("both", ("scaler", "counts")),
         "aligned": Case("both, and their clipping's norm summed in float64", ("scaler", "counts", "torch_norm"))}
AGGREGATION = {"published": "heterofl", "no_scaler": "heterofl", "counts": "fedrolex_counts",
               "no_scaler_counts": "fedrolex_counts", "aligned": "fedrolex_counts"}


def rolled_channels(round_index: int):
    """FedRolex's sub-model of a layer in round `round_index` (`decisions.ChannelMap`): their
    torch.roll(arange(N), r)[:k], official channel j being global unit (j - r) mod N."""
    return lambda units, kept: (np.arange(kept) - round_index) % units


# ------------------------------------------------------------------ the PyTorch side

def _cpu_for_cuda():
    """Their code moves models and batches to 'cuda' by name; on this CPU-only torch it reads as 'cpu'."""
    import torch

    def redirect(method):
        def to(self, *args, **kwargs):
            args = tuple("cpu" if a == "cuda" else a for a in args)
            kwargs = {k: "cpu" if v == "cuda" else v for k, v in kwargs.items()}
            return method(self, *args, **kwargs)
        return to

    torch.nn.Module.to = redirect(torch.nn.Module.to)
    torch.Tensor.to = redirect(torch.Tensor.to)


def _official(checkout: Path, scale: bool):
    from benchmarks.parity import torch_side as T
    T.enter_checkout(checkout)
    T.stub_module("ray", remote=lambda *args, **kwargs: (lambda cls: cls), get=lambda ref: ref, put=lambda value: value)
    T.stub_module("torchvision")
    T.stub_module("torchvision.utils", save_image=T.refuse("torchvision.utils.save_image"))
    T.stub_module("data", fetch_dataset=T.refuse("data.fetch_dataset"), split_dataset=T.refuse("data.split_dataset"),
                  make_data_loader=T.refuse("data.make_data_loader"), SplitDataset=T.refuse("data.SplitDataset"))
    T.stub_module("logger", Logger=lambda path: _Logger())
    sys.argv = ["main_resnet.py"]
    import resnet_client
    import resnet_server
    import utils
    from config import cfg
    from models import resnet
    _cpu_for_cuda()
    cfg["control"] = {"fed": "1", "num_users": str(len(RATES)), "frac": "1", "data_split_mode": "non-iid-2",
                      "model_split_mode": "fix", "model_mode": "a1-b1-c1", "norm": "bn", "scale": "1" if scale else "0",
                      "mask": "1"}
    cfg["data_name"] = "CIFAR10"
    utils.process_control()
    assert cfg["batch_size"]["train"] == BATCH, cfg
    # what main_resnet.py sets from its command line (--algo roll --weighting avg --l_epoch 1, no --overlap)
    cfg.update({"overlap": None, "weighting": "avg", "lr": LR, "data_shape": [3, SIDE, SIDE], "classes_size": CLASSES,
                "device": "cpu", "model_tag": "parity", "active_user": len(RATES),
                "num_epochs": {"global": ROUNDS, "local": EPOCHS},
                "metric_name": {"train": {"Local": ["Local-Loss", "Local-Accuracy"]}}})
    assert list(cfg["model_rate"]) == list(RATES) and cfg["momentum"] == MOMENTUM \
        and cfg["weight_decay"] == WEIGHT_DECAY and cfg["optimizer_name"] == "SGD", cfg
    return resnet_client, resnet_server, resnet, cfg


def torch_setup(checkout: Path, seed: int) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    _, _, resnet, cfg = _official(checkout, scale=True)
    T.deterministic(seed)
    state = T.state_arrays(resnet.resnet18(model_rate=cfg["global_model_rate"], cfg=cfg).state_dict())
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(sum(COUNTS), 3, SIDE, SIDE)).astype(np.float32)
    y = np.concatenate([rng.choice(labels, n) for labels, n in zip(LABELS, COUNTS)]).astype(np.int64)
    return {**A.prefixed("init", state), "keys": np.array(list(state)), "data/x": x, "data/y": y,
            "data/counts": np.array(COUNTS)}


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    resnet_client, resnet_server, resnet, cfg = _official(checkout, scale="scaler" not in CASES[case].aligns)
    T.deterministic(SEED)
    norms = T.GradientNorms(clip=True, exact="torch_norm" in CASES[case].aligns)
    decisions = D.OfficialDecisions(A.under(library, AGGREGATION[case]))
    model = resnet.resnet18(model_rate=cfg["global_model_rate"], cfg=cfg)
    T.load_state(model, A.under(setup, "init"))
    users = list(range(len(RATES)))
    label_split = {c: sorted(set(T.client_arrays(setup, c)[1].tolist())) for c in users}

    def batch(x, y):  # what their collate receives: lists of images and of labels
        return {"img": [torch.from_numpy(np.array(e)) for e in x], "label": [int(l) for l in y]}

    loaders = {c: T.Batches(*T.client_arrays(setup, c), BATCH, batch) for c in users}
    resnet_client.SplitDataset = lambda dataset, user: user
    resnet_client.make_data_loader = lambda split: {k: loaders[user] for k, user in split.items()}
    dataset_ref = {"dataset": None, "split": {c: c for c in users}, "label_split": label_split}
    server = resnet_server.ResnetServerRoll(model, cfg["model_rate"], dataset_ref, cfg)
    server.rounds = FIRST_ROUND
    out = {}
    for rnd in range(ROUNDS):
        # main_resnet.py's round: broadcast (distribute, client.update), client.step, server.step
        assert server.rounds == FIRST_ROUND + rnd
        local_parameters, param_idx = server.distribute(users)
        for m, user in enumerate(users):
            out.update(A.prefixed(f"round{rnd}/client{user}", S.record_indices(param_idx[m])))
        start = time.time()
        trained = []
        for m, user in enumerate(users):
            client = resnet_client.ResnetClient("parity", [cfg])
            client.update(user, dataset_ref, {"lr": LR, "model_rate": server.model_rate[user],
                                              "local_params": local_parameters[m]})
            decisions.start(f"decisions/r{rnd}/c{user}", rolled_channels(server.rounds))
            trained.append(client.step(m, len(users), start))
            decisions.finish()
            out.update(A.prefixed(f"round{rnd}/client{user}/value", T.state_arrays(trained[-1])))
        server.step(trained, param_idx, users)
        out.update(A.prefixed(f"round{rnd}/global", T.state_arrays(server.global_parameters)))
    out["norms"] = np.array(norms.norms)
    return {**out, **decisions.arrays()}


# ------------------------------------------------------------------ the JAX side

def mapping(setup: dict):
    """Their names onto preresnet18's: layer<s>.<b> -> stage<s>_block<b + 1>, n1/n2 -> bn1/bn2, n4 -> bn_final,
    linear -> fc."""
    out = {}
    for key in map(str, setup["keys"]):
        parts = key.split(".")
        param = parts[-1]
        ndim = setup[f"init/{key}"].ndim
        if parts[0].startswith("layer"):
            block = (f"stage{parts[0][5:]}_block{int(parts[1]) + 1}",)
            module = parts[2]
        else:
            block, module = (), parts[0]
        module = {"n1": "bn1", "n2": "bn2", "n4": "bn_final", "linear": "fc"}.get(module, module)
        if ndim == 1:
            leaf = {"weight": "scale", "bias": "bias"}[param] if module.startswith("bn") else param
            out[key] = ("params", block + (module, leaf), "vector")
        else:
            out[key] = ("params", block + (module, "kernel"), "conv" if ndim == 4 else "dense")
    return out


def library(setup: dict, cases) -> dict[str, np.ndarray]:
    options = {k: LIBRARY_OPTIONS[k] for k in ("label_mask", "label_mask_fill", "scaler", "static_bn")}
    rounds = tuple(range(FIRST_ROUND, FIRST_ROUND + ROUNDS))
    out = {}
    for aggregation in dict.fromkeys(AGGREGATION[c] for c in cases):
        out.update(A.prefixed(aggregation, S.library_rounds(
            "fedrolex", "preresnet18", setup, mapping(setup), RATES, rounds,
            {**options, "submodel_aggregation": aggregation}, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
            epochs=EPOCHS, batch_size=BATCH, num_classes=CLASSES, grad_clip_norm=S.CLIP)))
    return out


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    return S.compare_rounds(setup, A.under(library, AGGREGATION[case]), official, ROUNDS, RATES)
