"""Step-for-step parity with the authors' code: one client update and one server aggregation run in
the official PyTorch code and in this library, from the same initial weights and the same batches,
every updated tensor compared.

    python -m benchmarks.parity --official-root DIR [--method heterofl fedrolex ...]
                                [--torch-python PATH] [--out benchmarks/results]

Two processes, two environments. The PyTorch side (`worker`, run by `--torch-python`, a virtual
environment holding torch; see README.md) imports the official code unchanged from its checkout
and calls its own functions and classes; the harness only feeds it our batches in place of its
data loaders, and the random draws the library made in place of its own (FedPM's Bernoulli
samples), by monkeypatching and import stubs written here (no file of theirs is changed). The
JAX side (this process) loads the same initial weights (torch OIHW conv / [out, in] dense <->
Flax HWIO / [in, out], `layouts`), runs the library's registered algorithm (`client_update`,
`server_update`) with the options that mirror the code, and compares tensor by tensor.

Neither torch nor the official code is a dependency of the library or of its test suite.

A method is one file in `methods/` (see `methods/__init__.py` for what it defines); the phases:
  1. torch `setup`: the official model's initial weights, the batches, anything else both sides
     start from -> setup.npz;
  2. JAX `library`: the library's client updates and server update -> library.npz (its results in
     torch layout, and the random draws it made that the official code must reuse);
  3. torch `official`, once per case: the official code's client updates and aggregation ->
     official_<case>.npz;
  4. JAX `compare`: one table row per compared group of tensors.
"""
