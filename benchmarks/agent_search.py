"""SPATL's salient-selection search: all sampled clients at once (one jitted vmap) against client by client.

    python -m benchmarks.agent_search [--quick] [--json FILE]

The search is SPATL's `agent` policy exactly as a round runs it
(`algorithms.spatl_selection.agent_policy`): per client, `updates` PPO updates of 20
environment steps and 20 epochs each, every step scoring the client's ResNet-20
(CIFAR-10 shapes, 32x32x3) pruned to the proposed keep ratios on its validation
examples. The full run uses the paper's budget (section 4.6.2: about 40 PPO
updates, "45 minutes of a single GPU" per client in the official code) for 10
clients, SPATL's CIFAR-10 setting. Variants, in one process on one device:

  vmapped   `jax.vmap` of the search over the 10 clients, one jitted call;
  loop      the same jitted single-client search called once per client.

Both compute the same thing (tests/test_agent.py checks the vmapped search
against a per-client loop). Timing: each variant is compiled ahead of time
(its compile time measured on its own), then run `repeats` times; the steady
time is the median. Clients hold random weights and synthetic images (the cost
of a search does not depend on their values) and score candidates on 16
validation examples each (the paper does not say how many; the reward is one
ResNet-20 forward pass over them per environment step, the search's main cost
on a CPU). Results name the device, the versions and the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from typing import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.agent import AgentConfig
from fedjax_sparse.algorithms import make_options
from fedjax_sparse.algorithms.spatl_selection import agent_policy, encoder_layers
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.data.federated import federated_split
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class Setting:
    model: str = "resnet20"
    clients: int = 10
    updates: int = 40
    validation_examples: int = 16
    repeats: int = 1
    seed: int = 0


FULL = Setting()
QUICK = Setting(clients=2, updates=2)
SMALLEST = Setting(model="mlp", clients=2, updates=1, validation_examples=8)  # what the test runs

INPUT_SHAPES = {"resnet20": (32, 32, 3), "mlp": (8, 8, 1)}


def workload(setting: Setting):
    """(select, states, variables, data, keys): the clients' search inputs, stacked on a client axis."""
    model = get_model(setting.model, INPUT_SHAPES[setting.model], 10)
    layers = encoder_layers(model.structure)
    options = make_options("spatl", {"salient_policy": "agent", "agent_updates": setting.updates,
                                     "agent_validation_examples": setting.validation_examples})
    config = AgentConfig(updates=setting.updates, flops_target=options.flops_reduction)
    policy = agent_policy(model, layers, options, config)
    n = setting.clients
    keys = jax.random.split(jax.random.key(setting.seed), 3 * n).reshape(3, n)
    states = jax.vmap(policy.init)(keys[0])
    variables = jax.vmap(model.init)(keys[1])
    rng = np.random.default_rng(setting.seed)
    count = setting.validation_examples
    x = rng.integers(0, 256, (n * count, *model.input_shape), dtype=np.uint8)
    y = rng.integers(0, 10, n * count)
    split = federated_split(x, y, [np.arange(i * count, (i + 1) * count) for i in range(n)], [0.5] * x.shape[-1],
                            [0.25] * x.shape[-1])
    return policy, states, variables, split, keys[2]


def _timed(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _compiled(fn, *args):
    """(the compiled function, seconds to compile it)."""
    start = time.perf_counter()
    compiled = jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def run_setting(setting: Setting) -> dict:
    policy, states, variables, split, keys = workload(setting)
    ids = jnp.arange(setting.clients)

    def vmapped(states, variables, keys):
        return jax.vmap(lambda s, v, c, k: policy.select(s, v, split.client(c), k))(states, variables, ids, keys)

    def one(state, variables, client, key):
        return policy.select(state, variables, split.client(client), key)

    def client(i):
        return tree_map(lambda a: a[i], states), tree_map(lambda a: a[i], variables), jnp.asarray(i), keys[i]

    print(f"compiling the vmapped search of {setting.clients} clients x {setting.updates} PPO updates...",
          file=sys.stderr, flush=True)
    vmapped_fn, vmap_compile = _compiled(vmapped, states, variables, keys)
    print(f"running it ({vmap_compile:.0f} s to compile)...", file=sys.stderr, flush=True)
    vmap_seconds = _timed(lambda: vmapped_fn(states, variables, keys), setting.repeats)
    print(f"vmapped: {vmap_seconds:.1f} s; now client by client...", file=sys.stderr, flush=True)
    one_fn, loop_compile = _compiled(one, *client(0))
    loop_seconds = _timed(lambda: [one_fn(*client(i)) for i in range(setting.clients)], setting.repeats)
    print(f"loop: {loop_seconds:.1f} s", file=sys.stderr, flush=True)
    steps = setting.updates * 20
    return {**dataclasses.asdict(setting), "environment_steps_per_client": steps,
            "vmapped_seconds": vmap_seconds, "vmapped_compile_seconds": vmap_compile,
            "loop_seconds": loop_seconds, "loop_compile_seconds": loop_compile,
            "speedup": loop_seconds / vmap_seconds,
            "seconds_per_client_search_vmapped": vmap_seconds / setting.clients,
            "seconds_per_client_search_loop": loop_seconds / setting.clients}


def environment(command: str) -> dict:
    device = jax.devices()[0]
    return {"date": datetime.date.today().isoformat(), "command": command,
            "device": f"{jax.device_count()} x {getattr(device, 'device_kind', device.platform)} ({device.platform})",
            "machine": platform.machine(), "python": platform.python_version(), "jax": jax.__version__,
            "flax": flax.__version__, "cpu_count": __import__("os").cpu_count()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_search", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 clients, 2 updates: a minute on 2 CPU cores")
    parser.add_argument("--json", default=None, help="also write the record to this file")
    args = parser.parse_args(argv)
    setting = QUICK if args.quick else FULL
    record = {**environment(" ".join(["python -m benchmarks.agent_search", *argv])), **run_setting(setting)}
    print(json.dumps(record, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
