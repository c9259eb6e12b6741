"""The PyTorch side's shared pieces: import stubs, deterministic settings, batches fed in place of the
official data loaders, state dicts as arrays. Runs in the torch environment (no JAX, no library).

Import stubs. The official repositories import packages their training loop never uses on the path
the harness runs (torchvision's `save_image`, tensorboard loggers, ray, their dataset modules, the
RL pruning head with torch_geometric) or modules that do not exist (FedPM's `pruned_layers`,
`drive`, `eden`). `stub_module` puts an empty module (or one holding the few names the harness
provides, such as the data loader it feeds) in `sys.modules` before their code is imported, so
their files run unchanged. Where a stub stands in for something the run does call, the method's
file says what and why.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np


def stub_module(name: str, **attributes: Any) -> types.ModuleType:
    """Registers an importable module `name` holding `attributes` (parents created as needed)."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__path__ = []  # a package, so that `name.sub` stubs import too
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # torch's lazy imports ask
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        owner = sys.modules.get(parent) or stub_module(parent)
        setattr(owner, child, module)
    return module


def refuse(what: str) -> Callable:
    """A stand-in for an official function the harness's path must never reach."""
    def called(*args, **kwargs):
        raise RuntimeError(f"the parity harness stubbed {what}; the official code reached it")
    return called


def enter_checkout(directory: Path) -> None:
    """Imports resolve in the official checkout and relative paths (their config.yml) read from it."""
    sys.path.insert(0, str(directory))
    os.chdir(directory)


def deterministic(seed: int) -> None:
    import torch
    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)


def state_arrays(state: dict) -> dict[str, np.ndarray]:
    """A state dict as float32/integer numpy arrays (detached copies)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def load_state(module, arrays: dict[str, np.ndarray], strict: bool = True) -> None:
    import torch
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}, strict=strict)


class Batches:
    """An iterable over a client's batches in a fixed order (examples [t B, (t + 1) B) in step t),
    built afresh by `make(x, y)` on every pass: their loops mutate what they are given (HeteroFL's
    `collate` stacks a dict in place). The last batch is short unless `drop_last` (as their
    DataLoader's). `owner`: the client the batches belong to, for the harness's bookkeeping."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, make: Callable[[np.ndarray, np.ndarray], Any],
                 drop_last: bool = False, owner: int | None = None):
        self.x, self.y, self.batch_size, self.make = x, y, batch_size, make
        self.drop_last, self.owner = drop_last, owner

    def __len__(self) -> int:
        return len(self.y) // self.batch_size if self.drop_last else -(-len(self.y) // self.batch_size)

    def __iter__(self) -> Iterator:
        for t in range(len(self)):
            start = t * self.batch_size
            yield self.make(self.x[start:start + self.batch_size], self.y[start:start + self.batch_size])


def tensor_pair(x: np.ndarray, y: np.ndarray):
    """(images, labels) as torch tensors: the (x, target) batches of SPATL's and FedPM's loops."""
    import torch
    return torch.from_numpy(np.array(x)), torch.from_numpy(np.array(y, np.int64))


def client_arrays(setup: dict[str, np.ndarray], client: int) -> tuple[np.ndarray, np.ndarray]:
    """Client `client`'s examples (NCHW float32) and labels, in the order every side trains on them."""
    counts = setup["data/counts"]
    start = int(np.sum(counts[:client]))
    stop = start + int(counts[client])
    return setup["data/x"][start:stop], setup["data/y"][start:stop]


def round_off_noise(seed: int) -> None:
    """From now on, after every optimizer step (any torch optimizer: a global post-hook), each parameter
    moves one ulp up or down at random: a float32 rounding difference in every weight at every step,
    what the library's different summation orders amount to at most, give or take a few ulps. The
    official run under this noise against the same run without it is the round-off floor of its
    comparisons (the driver's `floor` phase)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    generator = torch.Generator().manual_seed(seed)

    def nudge(optimizer, args, kwargs):
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    up = torch.rand(p.shape, generator=generator) < 0.5
                    p.copy_(torch.nextafter(p, torch.where(up, torch.tensor(float("inf")),
                                                           torch.tensor(float("-inf"))).to(p.dtype)))

    register_optimizer_step_post_hook(nudge)


class GradientNorms:
    """Wraps `torch.nn.utils.clip_grad_norm_` to record the total norm of every call (their code's
    clipping); `clip=False` measures without clipping (max_norm = inf: every gradient is multiplied
    by exactly 1). `exact=True` takes the total norm in float64 (`exact_clip_grad_norm_`): torch's CPU
    float32 norm accumulates in float32 and is off by up to ~1e-4 relative on tensors of millions of
    entries, which moves every clipped step by that much (FedRolex's cause `torch_norm`)."""

    def __init__(self, clip: bool, exact: bool = False):
        import torch
        self.original = torch.nn.utils.clip_grad_norm_
        self.clip = clip
        self.norms: list[float] = []
        clipper = exact_clip_grad_norm_ if exact else self.original

        def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
            norm = clipper(parameters, max_norm if self.clip else float("inf"), *args, **kwargs)
            self.norms.append(float(norm))
            return norm

        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


def exact_clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch's `clip_grad_norm_` (L2 only) with the total norm summed in float64 and rounded once to
    float32; the clip factor and the product are torch's own float32 operations."""
    import torch
    if float(norm_type) != 2.0:
        raise ValueError(f"exact_clip_grad_norm_ takes the L2 norm only, got norm_type={norm_type}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.sqrt(sum(torch.sum(g.detach().double() ** 2) for g in grads)).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of the gradients is {float(total)}")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coefficient.to(g.dtype))
    return total
