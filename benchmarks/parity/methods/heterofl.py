"""HeteroFL (Diao et al., ICLR 2021) against its code: `src/fed.py`'s `Federation` (split, distribute,
combine), `src/train_classifier_fed.py`'s `train` and `Local.train`, `src/models/conv.py`'s `Conv`.

One round of their `train`: three users of rates 1, 1/2, 1/4 (`model_split_mode` fix, `model_mode`
a1-b1-c1), each holding a few labels (their non-iid label split: masked cross-entropy, output rows
averaged over the users holding the label), SGD lr 0.1, momentum 0.9, weight decay 5e-4 (their
CIFAR-10 settings), one local epoch of 3 batches of 8, on their `Conv` (64-128-256-512, BatchNorm
without running statistics) at 16x16x3. The library runs `heterofl` on `cnn4` with the options that
mirror their code: `--submodel-aggregation heterofl` (plain mean over holders, label rows),
`--label-mask --label-mask-fill zero` (their `masked_fill(mask == 0, 0)`), `--scaler`,
`--static-bn`, and `--grad-clip-norm 1` (their `clip_grad_norm_(..., 1)`: `LocalSGD.grad_clip_norm`,
PyTorch's semantics).

Their run is fed from the harness: `make_data_loader`/`SplitDataset` (train_classifier_fed's names)
return our batches; the data module, torchvision and the tensorboard logger are import stubs.

Known difference: their Scaler divides a conv's output by the rate before its BatchNorm; on batch
statistics that only changes BatchNorm's epsilon, eps -> eps rate^2; the library leaves BatchNorm
layers unscaled (`algorithms/submodels.py`). At rate 1 the Scaler is the identity, so client 0's row
of the case as published checks the clipping alone. The diagnostics: `no_clip`, both sides unclipped
(their clip_grad_norm_ measuring only, max_norm = inf; the library without the option), the Scaler's
epsilon alone; `no_scaler`, both sides clipped at 1 (the clip's global norm is the sub-model's, on both
sides) and their `scale` control at 0; `no_clip_no_scaler`, neither.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A
from benchmarks.parity.methods import _submodels as S

NAME = "heterofl"
REPOSITORY = "diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients"
COMMIT = "cc40f3e46b0fab5364d62a1bb623d3764daf179d"
CHECKOUT = "src"
MODEL = "their Conv (64-128-256-512, BN) / the library's cnn4, 16x16x3, 10 classes"
SEED = 0
RATES = (1.0, 0.5, 0.25)
LABELS = ((0, 1, 2, 3), (2, 3, 4, 5, 6), (0, 7, 8))  # class 9: no client holds it, its row keeps its value
EXAMPLES, BATCH, SIDE, CLASSES = 24, 8, 16, 10
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
LIBRARY_OPTIONS = {"algorithm": "heterofl", "model": "cnn4", "capacities": "the client's rate", "round": 0,
                   "submodel_aggregation": "heterofl", "label_mask": True, "label_mask_fill": "zero",
                   "scaler": True, "static_bn": True, "lr": LR, "momentum": MOMENTUM,
                   "weight_decay": WEIGHT_DECAY, "local_epochs": 1, "batch_size": BATCH,
                   "grad_clip_norm": f"{S.CLIP:g} (none in no_clip and no_clip_no_scaler)"}
CASES = {
    "published": "their code as published (gradients clipped to norm 1, Scaler on); the library clips at 1 too",
    "no_clip": "diagnostic: both sides unclipped (their clip_grad_norm_ measuring only, max_norm = inf)",
    "no_scaler": "diagnostic: both sides clipped at 1, their `scale` control at 0",
    "no_clip_no_scaler": "diagnostic: both sides unclipped (their clip_grad_norm_ measuring only, max_norm = inf), "
                         "their `scale` control at 0",
}
EXPLANATIONS = {
    "published": "the Scaler: their BN(x / rate) has epsilon 1e-5 rate^2, the library's unscaled BN 1e-5",
    "no_clip": "the Scaler: their BN(x / rate) has epsilon 1e-5 rate^2, the library's unscaled BN 1e-5",
    "no_scaler": "UNEXPLAINED",
    "no_clip_no_scaler": "UNEXPLAINED",
}


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
    cfg.update({"data_shape": [3, SIDE, SIDE], "classes_size": CLASSES, "device": "cpu", "model_tag": "parity",
                "batch_size": {"train": BATCH, "test": BATCH}, "num_epochs": {"global": 1, "local": 1}})
    assert list(cfg["model_rate"]) == list(RATES) and cfg["lr"] == LR and cfg["momentum"] == MOMENTUM \
        and cfg["weight_decay"] == WEIGHT_DECAY and cfg["optimizer_name"] == "SGD", cfg
    return fed, models, train_classifier_fed, utils, cfg


def torch_setup(checkout: Path) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    _, models, _, _, cfg = _official(checkout, scale=True)
    T.deterministic(SEED)
    model = models.conv(model_rate=cfg["global_model_rate"])
    state = T.state_arrays(model.state_dict())
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(EXAMPLES * len(RATES), 3, SIDE, SIDE)).astype(np.float32)
    y = np.concatenate([rng.choice(labels, EXAMPLES) for labels in LABELS]).astype(np.int64)
    return {**A.prefixed("init", state), "keys": np.array(list(state)), "data/x": x, "data/y": y,
            "data/counts": np.full(len(RATES), EXAMPLES)}


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    fed, models, train_classifier_fed, utils, cfg = _official(checkout, scale=case in ("published", "no_clip"))
    T.deterministic(SEED)
    norms = T.GradientNorms(clip=case in ("published", "no_scaler"))
    model = models.conv(model_rate=cfg["global_model_rate"])
    T.load_state(model, A.under(setup, "init"))
    label_split = {c: sorted(set(T.client_arrays(setup, c)[1].tolist())) for c in range(len(RATES))}

    def batch(x, y):  # what their dataset's collate receives: lists of examples
        return {"img": [torch.from_numpy(np.array(e)) for e in x], "label": [torch.tensor(int(l)) for l in y]}

    loaders = {c: T.Batches(*T.client_arrays(setup, c), BATCH, batch) for c in range(len(RATES))}
    train_classifier_fed.SplitDataset = lambda dataset, user: user
    train_classifier_fed.make_data_loader = lambda split: {k: loaders[user] for k, user in split.items()}
    federation = fed.Federation(model.state_dict(), cfg["model_rate"], label_split)
    out = {}
    combine = federation.combine

    def recording_combine(local_parameters, param_idx, user_idx):
        for m, user in enumerate(user_idx):
            out.update(A.prefixed(f"client{user}/value", T.state_arrays(local_parameters[m])))
            out.update(A.prefixed(f"client{user}", S.record_indices(param_idx[m])))
        return combine(local_parameters, param_idx, user_idx)

    federation.combine = recording_combine
    optimizer = utils.make_optimizer(model, cfg["lr"])
    train_classifier_fed.train(None, {c: c for c in range(len(RATES))}, label_split, federation, model, optimizer,
                               _Logger(), 1)
    out.update(A.prefixed("global", T.state_arrays(federation.global_parameters)))
    out["norms"] = np.array(norms.norms)
    return out


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


def library(setup: dict) -> dict[str, np.ndarray]:
    options = {k: LIBRARY_OPTIONS[k] for k in ("label_mask", "label_mask_fill", "scaler", "static_bn")}
    return S.library_runs(functools.partial(S.library_round, "heterofl", "cnn4", setup, mapping(setup), RATES, 0,
                                            options, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                                            batch_size=BATCH, num_classes=CLASSES, aggregations=("heterofl",)))


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    library = S.run_arrays(library, clipped=case in ("published", "no_scaler"))
    rows = S.client_rows(setup, library, official, len(RATES), RATES, "")
    rows.append(S.global_row(setup, library, official, "heterofl", "server: global model after combine", ""))
    A.explain(rows, EXPLANATIONS[case])
    rows[-1]["note"] += "; " + S.norms_note(official)
    return S.selection_rows(library, official, len(RATES), RATES) + rows
