"""HeteroFL (Diao et al., ICLR 2021) against its code: `src/fed.py`'s `Federation` (split, distribute,
combine), `src/train_classifier_fed.py`'s `train` and `Local.train`, `src/models/conv.py`'s `Conv`.

Three rounds of their `train`, the global model carried: three users of rates 1, 1/2, 1/4
(`model_split_mode` fix, `model_mode` a1-b1-c1) holding 23, 14 and 7 examples (batches of 10: 10+10+3,
10+4, 7) and a few labels each (their non-iid label split: masked cross-entropy, output rows averaged
over the users holding the label), their CIFAR-10 settings: SGD lr 0.1, momentum 0.9, weight decay
5e-4, 5 local epochs of batches of 10, gradients clipped to norm 1; their `Conv` (64-128-256-512,
BatchNorm without running statistics) at 16x16x3. The library runs `heterofl` on `cnn4` with the
options that mirror their code: `--submodel-aggregation heterofl` (plain mean over holders, label
rows), `--label-mask --label-mask-fill zero` (their `masked_fill(mask == 0, 0)`), `--scaler`,
`--static-bn`, `--grad-clip-norm 1` (their `clip_grad_norm_(..., 1)`).

Their run is fed from the harness: `make_data_loader`/`SplitDataset` (train_classifier_fed's names)
return our batches (in order, the last one short, as their loader without drop_last); the data
module, torchvision and the tensorboard logger are import stubs.

Cause `scaler`: their Scaler divides a conv's output by the rate before its BatchNorm; on batch
statistics that only changes BatchNorm's epsilon, eps -> eps rate^2; the library leaves BatchNorm
layers unscaled (`algorithms/submodels.py`). Case `no_scaler` runs their code with its `scale` control
at 0. At rate 1 the Scaler is the identity.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A
from benchmarks.parity import decisions as D
from benchmarks.parity.methods import _submodels as S
from benchmarks.parity.verdicts import Case

NAME = "heterofl"
REPOSITORY = "diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients"
COMMIT = "cc40f3e46b0fab5364d62a1bb623d3764daf179d"
CHECKOUT = "src"
MODEL = "their Conv (64-128-256-512, BN) / the library's cnn4, 16x16x3, 10 classes"
SEED = 0
RATES = (1.0, 0.5, 0.25)
LABELS = ((0, 1, 2, 3), (2, 3, 4, 5, 6), (0, 7, 8))  # class 9: no client holds it, its row keeps its value
COUNTS, BATCH, EPOCHS, ROUNDS, SIDE, CLASSES = (23, 14, 7), 10, 5, 3, 16, 10
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
SETUP = (f"{ROUNDS} rounds, the global model carried; clients of rates {', '.join(map(str, RATES))} holding "
         f"{', '.join(map(str, COUNTS))} examples of labels {'; '.join(','.join(map(str, l)) for l in LABELS)}; "
         f"their CIFAR-10 settings: {EPOCHS} local epochs of batches of {BATCH} (the last short), SGD lr {LR}, "
         f"momentum {MOMENTUM}, weight decay {WEIGHT_DECAY}, gradients clipped to norm 1.")
LIBRARY_OPTIONS = {"algorithm": "heterofl", "model": "cnn4", "capacities": "the client's rate", "rounds": "0, 1, 2",
                   "submodel_aggregation": "heterofl", "label_mask": True, "label_mask_fill": "zero",
                   "scaler": True, "static_bn": True, "lr": LR, "momentum": MOMENTUM,
                   "weight_decay": WEIGHT_DECAY, "local_epochs": EPOCHS, "batch_size": BATCH,
                   "grad_clip_norm": S.CLIP}
CAUSES = {"scaler": "their Scaler divides a conv's output by the rate before its BatchNorm, which changes only "
                    "BatchNorm's epsilon (1e-5 rate^2 for their 1e-5); the library leaves BatchNorm layers "
                    "unscaled; aligned by their `scale` control at 0"}
CASES = {"published": Case("their code as published (Scaler on, gradients clipped to norm 1)"),
         "no_scaler": Case("their `scale` control at 0", ("scaler",))}


# ------------------------------------------------------------------ the PyTorch side

class _Logger:
    """What their `train` logs to: nothing is kept."""

    def append(self, *args, **kwargs):
        pass

    def write(self, *args, **kwargs):
        pass


def _official(checkout: Path, scale: bool):
    """Their modules, imported unchanged, with cfg set as their `process_control` sets it for these users."""
    from benchmarks.parity import torch_side as T
    T.enter_checkout(checkout)
    T.stub_module("torchvision")
    T.stub_module("torchvision.utils", save_image=T.refuse("torchvision.utils.save_image"))
    T.stub_module("data", fetch_dataset=T.refuse("data.fetch_dataset"), split_dataset=T.refuse("data.split_dataset"),
                  make_data_loader=T.refuse("data.make_data_loader"), SplitDataset=T.refuse("data.SplitDataset"))
    T.stub_module("logger", Logger=T.refuse("logger.Logger"))
    sys.argv = ["train_classifier_fed.py"]  # their module parses its command line when imported
    import fed
    import models
    import train_classifier_fed
    import utils
    from config import cfg
    cfg["control"] = {"fed": "1", "num_users": str(len(RATES)), "frac": "1", "data_split_mode": "non-iid-2",
                      "model_split_mode": "fix", "model_mode": "a1-b1-c1", "norm": "bn", "scale": "1" if scale else "0",
                      "mask": "1"}
    cfg["data_name"], cfg["model_name"] = "CIFAR10", "conv"
    utils.process_control()
    assert (cfg["batch_size"]["train"], cfg["num_epochs"]["local"]) == (BATCH, EPOCHS), cfg
    cfg.update({"data_shape": [3, SIDE, SIDE], "classes_size": CLASSES, "device": "cpu", "model_tag": "parity"})
    assert list(cfg["model_rate"]) == list(RATES) and cfg["lr"] == LR and cfg["momentum"] == MOMENTUM \
        and cfg["weight_decay"] == WEIGHT_DECAY and cfg["optimizer_name"] == "SGD", cfg
    return fed, models, train_classifier_fed, utils, cfg


def torch_setup(checkout: Path, seed: int) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    _, models, _, _, cfg = _official(checkout, scale=True)
    T.deterministic(seed)
    model = models.conv(model_rate=cfg["global_model_rate"])
    state = T.state_arrays(model.state_dict())
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(sum(COUNTS), 3, SIDE, SIDE)).astype(np.float32)
    y = np.concatenate([rng.choice(labels, n) for labels, n in zip(LABELS, COUNTS)]).astype(np.int64)
    return {**A.prefixed("init", state), "keys": np.array(list(state)), "data/x": x, "data/y": y,
            "data/counts": np.array(COUNTS)}


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    fed, models, train_classifier_fed, utils, cfg = _official(checkout, scale=case == "published")
    T.deterministic(SEED)
    norms = T.GradientNorms(clip=True)
    decisions = D.OfficialDecisions(library)
    model = models.conv(model_rate=cfg["global_model_rate"])
    T.load_state(model, A.under(setup, "init"))
    label_split = {c: sorted(set(T.client_arrays(setup, c)[1].tolist())) for c in range(len(RATES))}

    def batch(x, y):  # what their dataset's collate receives: lists of examples
        return {"img": [torch.from_numpy(np.array(e)) for e in x], "label": [torch.tensor(int(l)) for l in y]}

    loaders = {c: T.Batches(*T.client_arrays(setup, c), BATCH, batch, owner=c) for c in range(len(RATES))}
    train_classifier_fed.SplitDataset = lambda dataset, user: user
    train_classifier_fed.make_data_loader = lambda split: {k: loaders[user] for k, user in split.items()}
    federation = fed.Federation(model.state_dict(), cfg["model_rate"], label_split)
    out, rnd = {}, 0
    combine = federation.combine

    def recording_combine(local_parameters, param_idx, user_idx):
        for m, user in enumerate(user_idx):
            out.update(A.prefixed(f"round{rnd}/client{user}/value", T.state_arrays(local_parameters[m])))
            out.update(A.prefixed(f"round{rnd}/client{user}", S.record_indices(param_idx[m])))
        return combine(local_parameters, param_idx, user_idx)

    local_train = train_classifier_fed.Local.train

    def aligned_train(self, local_parameters, lr, logger):
        decisions.start(f"decisions/r{rnd}/c{self.data_loader.owner}", S.prefix_channels)
        trained = local_train(self, local_parameters, lr, logger)
        decisions.finish()
        return trained

    federation.combine = recording_combine
    train_classifier_fed.Local.train = aligned_train
    optimizer = utils.make_optimizer(model, cfg["lr"])
    for rnd in range(ROUNDS):
        train_classifier_fed.train(None, {c: c for c in range(len(RATES))}, label_split, federation, model, optimizer,
                                   _Logger(), rnd + 1)
        out.update(A.prefixed(f"round{rnd}/global", T.state_arrays(federation.global_parameters)))
    out["norms"] = np.array(norms.norms)
    return {**out, **decisions.arrays()}


# ------------------------------------------------------------------ the JAX side

def mapping(setup: dict):
    """Their `blocks.<i>` Sequential onto cnn4: the k-th Conv2d (4-D weight) is conv<k>, the k-th
    BatchNorm (1-D weight) bn<k>, the Linear (2-D weight) fc."""
    out, convs, norms = {}, 0, 0
    for key in setup["keys"]:
        module, param = str(key).rsplit(".", 1)
        ndim = setup[f"init/{module}.weight"].ndim
        if param == "weight":
            if ndim == 4:
                convs += 1
            elif ndim == 1:
                norms += 1
        name = {4: f"conv{convs}", 1: f"bn{norms}", 2: "fc"}[ndim]
        kind = {4: "conv", 1: "vector", 2: "dense"}[ndim]
        leaf = {"weight": "scale" if ndim == 1 else "kernel", "bias": "bias"}[param]
        out[str(key)] = ("params", (name, leaf), kind if param == "weight" else "vector")
    return out


def library(setup: dict, cases) -> dict[str, np.ndarray]:
    del cases  # every case compares with the same run
    options = {k: LIBRARY_OPTIONS[k] for k in ("submodel_aggregation", "label_mask", "label_mask_fill", "scaler",
                                               "static_bn")}
    return S.library_rounds("heterofl", "cnn4", setup, mapping(setup), RATES, tuple(range(ROUNDS)), options, lr=LR,
                            momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, epochs=EPOCHS, batch_size=BATCH,
                            num_classes=CLASSES, grad_clip_norm=S.CLIP)


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    return S.compare_rounds(setup, library, official, ROUNDS, RATES)
