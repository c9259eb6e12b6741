"""The methods the harness runs, one file each. A method module defines (imports at its top: numpy and
the standard library only, since the PyTorch side imports it too; torch or JAX inside the functions):

  NAME, REPOSITORY ("owner/name" on GitHub), COMMIT (pinned), CHECKOUT (the folder of the checkout to
    run from, "" for its root), MODEL (what runs on both sides), SETUP (the rounds, clients, data and
    hyper-parameters, in a sentence or two), LIBRARY_OPTIONS (the library's options used, as the table
    lists them), SEED (the first draw of the inputs);
  CAUSES: {cause: what differs between the library and the code, and how a case aligns it};
  CASES: {case: verdicts.Case(description, aligns)} - the official runs compared with the library's:
    the code as published first (aligning nothing); then cases aligning causes, the last all of them;
  torch_setup(checkout, seed) -> arrays: initial weights, batches ("data/x" NCHW float32, "data/y",
    "data/counts"), anything else both sides start from, drawn from `seed`;
  library(setup, cases) -> arrays: the library's updated tensors in torch layout, for every library
    variant the named cases compare with (and the random draws and ReLU/pool decisions the official
    run must reuse);
  torch_official(checkout, setup, library, case) -> arrays: the official code's updated tensors;
  compare(setup, library, official, case) -> rows (`arrays.group`, `identical`, `margin_row`,
    `decisions.aligned_row`): the same rows, by name, in every case; verdicts.py judges them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

METHODS = ("heterofl", "fedrolex", "fedpm", "spatl", "spafl", "fedp3")


def get(name: str) -> ModuleType:
    if name not in METHODS:
        raise ValueError(f"unknown parity method {name!r}; valid: {', '.join(METHODS)}")
    return importlib.import_module(f"benchmarks.parity.methods.{name}")
