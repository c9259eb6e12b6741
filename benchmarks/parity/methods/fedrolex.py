"""FedRolex (Alam et al., NeurIPS 2022) against its code: `resnet_server.py`'s `ResnetServerRoll`
(split_model's rolling window, distribute, combine), `resnet_client.py`'s `ResnetClient` (update,
step), `models/resnet.py`'s pre-activation `resnet18`.

One round at round index 5 (the window rolls by 5 units: {(j - 5) mod N : j < ceil(rate N)}, so it
wraps around), three clients of rates 1, 1/2, 1/4 each holding a few labels, SGD momentum 0.9 and
weight decay 1e-3 (their CIFAR-10 settings) at lr 0.01 (their README's 2e-4 would move the weights by
~1e-4 in three steps and hide any difference), one local epoch of 3 batches of 8, their `resnet18`
(64-128-256-512) at 8x8x3. The library runs `fedrolex` on `preresnet18` with `--label-mask
--label-mask-fill zero --scaler --static-bn --grad-clip-norm 1` (their `clip_grad_norm_(..., 1)`;
unclipped in the diagnostics no_clip and no_clip_no_scaler), aggregated twice:
`--submodel-aggregation heterofl` (the paper's plain mean over holders, the library's reading) and
`fedrolex_counts` (their code's weighting), where the library has it.

Their run is fed from the harness: ray is an import stub whose `remote` leaves classes as they are
and whose `get`/`put` return their argument (the harness calls `distribute`, each client's `update`
and `step` and the server's `step` in the order their `main_resnet.py` does, in one process);
`make_data_loader`/`SplitDataset` (resnet_client's names) return our batches; their hard-coded
'cuda' device reads as the CPU; data, torchvision and the logger are import stubs.

Known differences: the Scaler's BatchNorm epsilon as in HeteroFL (see heterofl.py; the same
diagnostic cases), and in `combine` `self.tmp_counts = tmp_counts_cpy` sits
inside the loop over keys, so from the second key on the k-th client holding a bias, normalization
parameter or output row weighs its count + (k - 1) instead of the same count: the paper's plain mean
(the library's `heterofl` aggregation) differs there, their weighting (`fedrolex_counts`) does not.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.parity import arrays as A
from benchmarks.parity.methods import _submodels as S
from benchmarks.parity.methods.heterofl import _Logger

NAME = "fedrolex"
REPOSITORY = "AIoT-MLSys-Lab/FedRolex"
COMMIT = "813510997e1802eb756d53baa4229c90ce5ac008"
CHECKOUT = ""
MODEL = "their pre-activation resnet18 (64-128-256-512) / the library's preresnet18, 8x8x3, 10 classes"
SEED = 0
ROUND = 5
RATES = (1.0, 0.5, 0.25)
LABELS = ((0, 1, 2, 3), (2, 3, 4, 5, 6), (0, 7, 8))
EXAMPLES, BATCH, SIDE, CLASSES = 24, 8, 8, 10
LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 1e-3
LIBRARY_OPTIONS = {"algorithm": "fedrolex", "model": "preresnet18", "capacities": "the client's rate", "round": ROUND,
                   "submodel_aggregation": "heterofl and fedrolex_counts", "label_mask": True,
                   "label_mask_fill": "zero", "scaler": True, "static_bn": True, "lr": LR, "momentum": MOMENTUM,
                   "weight_decay": WEIGHT_DECAY, "local_epochs": 1, "batch_size": BATCH,
                   "grad_clip_norm": f"{S.CLIP:g} (none in no_clip and no_clip_no_scaler)"}
CASES = {
    "published": "their code as published (`--algo roll --weighting avg`, gradients clipped to norm 1, Scaler on); "
                 "the library clips at 1 too",
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
PLAIN_MEAN = ("their combine's tmp_counts aliasing: the k-th client holding a bias, norm parameter or output row "
              "weighs 1 + (k - 1); the library's `heterofl` is the paper's plain mean")


def _aggregations() -> tuple[str, ...]:
    from fedjax_sparse.algorithms.submodels import SubmodelOptions
    from fedjax_sparse.core.contract.options import option_fields
    choices = next(f.metadata["option"].choices for f in option_fields(SubmodelOptions)
                   if f.name == "submodel_aggregation")
    return ("heterofl",) + (("fedrolex_counts",) if "fedrolex_counts" in choices else ())


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
    # what main_resnet.py sets from its command line (--algo roll --weighting avg, no --overlap)
    cfg.update({"overlap": None, "weighting": "avg", "lr": LR, "data_shape": [3, SIDE, SIDE], "classes_size": CLASSES,
                "device": "cpu", "model_tag": "parity", "active_user": len(RATES),
                "num_epochs": {"global": 1, "local": 1}, "batch_size": {"train": BATCH, "test": BATCH},
                "metric_name": {"train": {"Local": ["Local-Loss", "Local-Accuracy"]}}})
    assert list(cfg["model_rate"]) == list(RATES) and cfg["momentum"] == MOMENTUM \
        and cfg["weight_decay"] == WEIGHT_DECAY and cfg["optimizer_name"] == "SGD", cfg
    return resnet_client, resnet_server, resnet, cfg


def torch_setup(checkout: Path) -> dict[str, np.ndarray]:
    from benchmarks.parity import torch_side as T
    _, _, resnet, cfg = _official(checkout, scale=True)
    T.deterministic(SEED)
    state = T.state_arrays(resnet.resnet18(model_rate=cfg["global_model_rate"], cfg=cfg).state_dict())
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(EXAMPLES * len(RATES), 3, SIDE, SIDE)).astype(np.float32)
    y = np.concatenate([rng.choice(labels, EXAMPLES) for labels in LABELS]).astype(np.int64)
    return {**A.prefixed("init", state), "keys": np.array(list(state)), "data/x": x, "data/y": y,
            "data/counts": np.full(len(RATES), EXAMPLES)}


def torch_official(checkout: Path, setup: dict, library: dict, case: str) -> dict[str, np.ndarray]:
    import torch

    from benchmarks.parity import torch_side as T
    resnet_client, resnet_server, resnet, cfg = _official(checkout, scale=case in ("published", "no_clip"))
    T.deterministic(SEED)
    norms = T.GradientNorms(clip=case in ("published", "no_scaler"))
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
    server.rounds = ROUND
    # main_resnet.py's round: broadcast (distribute, client.update), client.step, server.step
    local_parameters, param_idx = server.distribute(users)
    out = {}
    for m, user in enumerate(users):
        out.update(A.prefixed(f"client{user}", S.record_indices(param_idx[m])))
    start = time.time()
    trained = []
    for m, user in enumerate(users):
        client = resnet_client.ResnetClient("parity", [cfg])
        client.update(user, dataset_ref, {"lr": LR, "model_rate": server.model_rate[user],
                                          "local_params": local_parameters[m]})
        trained.append(client.step(m, len(users), start))
        out.update(A.prefixed(f"client{user}/value", T.state_arrays(trained[-1])))
    server.step(trained, param_idx, users)
    out.update(A.prefixed("global", T.state_arrays(server.global_parameters)))
    out["norms"] = np.array(norms.norms)
    return out


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


def library(setup: dict) -> dict[str, np.ndarray]:
    options = {k: LIBRARY_OPTIONS[k] for k in ("label_mask", "label_mask_fill", "scaler", "static_bn")}
    return S.library_runs(functools.partial(S.library_round, "fedrolex", "preresnet18", setup, mapping(setup), RATES,
                                            ROUND, options, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                                            batch_size=BATCH, num_classes=CLASSES, aggregations=_aggregations()))


def compare(setup: dict, library: dict, official: dict, case: str) -> list[dict]:
    library = S.run_arrays(library, clipped=case in ("published", "no_scaler"))
    rows = S.client_rows(setup, library, official, len(RATES), RATES, "")
    A.explain(rows, EXPLANATIONS[case])
    code = [S.global_row(setup, library, official, "fedrolex_counts",
                         "server: combine vs the library's fedrolex_counts", "")
            ] if "global_fedrolex_counts/linear.weight" in library else []
    A.explain(code, EXPLANATIONS[case])
    plain = S.global_row(setup, library, official, "heterofl",
                         "server: combine vs the library's heterofl (plain mean)", "")
    A.explain([plain], PLAIN_MEAN)
    for row in code + [plain]:
        row["note"] += "; " + S.norms_note(official)
    return S.selection_rows(library, official, len(RATES), RATES) + rows + code + [plain]
