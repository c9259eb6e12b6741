"""The methods the harness runs, one file each. A method module defines (imports at its top: numpy and
the standard library only, since the PyTorch side imports it too; torch or JAX inside the functions):

  NAME, REPOSITORY ("owner/name" on GitHub), COMMIT (pinned), CHECKOUT (the folder of the checkout to
    run from, "" for its root), MODEL (what runs on both sides), LIBRARY_OPTIONS (the library's
    options used, as the table lists them);
  CASES: {case: description} - the official runs compared with the library's (the code as published
    first; then diagnostics that remove one known difference each, to show what remains);
  torch_setup(checkout) -> arrays: initial weights, batches ("data/x" NCHW float32, "data/y",
    "data/counts"), anything else both sides start from;
  library(setup) -> arrays: the library's updated tensors in torch layout (and random draws the
    official run must reuse);
  torch_official(checkout, setup, library, case) -> arrays: the official code's updated tensors;
  compare(setup, library, official, case) -> rows (`arrays.group`): one per compared group of
    tensors, each with a note explaining any difference above float32 round-off.
"""

from __future__ import annotations

import importlib
from types import ModuleType

METHODS = ("heterofl", "fedrolex", "fedpm", "spatl", "spafl", "fedp3")


def get(name: str) -> ModuleType:
    if name not in METHODS:
        raise ValueError(f"unknown parity method {name!r}; valid: {', '.join(METHODS)}")
    return importlib.import_module(f"benchmarks.parity.methods.{name}")
