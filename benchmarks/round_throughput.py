"""Round throughput: the engine's one-jit round against Python-loop federated code.

    python -m benchmarks.round_throughput [--quick] [--json FILE] [--only MODEL[:K]]

For FedAvg with the digits MLP and with the SpaFL CIFAR-10 CNN, at 10, 100 and
1000 clients per round (1000 for the MLP only), this measures in one process on
one device the examples per second of four ways to run the same round:

  engine       the library as `fedjax-sparse run` uses it: `build_round(fedavg(LocalSGD(...)))`
               with the platform's `default_client_chunk`, one jitted call per round, each
               client's steps a `lax.while_loop` (on an accelerator all clients are vmapped
               at once; on a CPU they go in cache-sized vmapped chunks, and with a CPU device
               per core, `core.round.cpu.CpuRound` shares them among the devices);
  engine_1cpu  (CPU only, where `engine` uses several CPU devices) the same round on one device:
               `core.round.cpu`'s layout against `build_round`'s one jit, on one core;
  engine_vmap  (CPU only, where it differs from `engine`) the same round with all K clients
               in one vmap, the accelerator layout;
  step_loop    the way most federated code is written: a Python loop over the
               clients and over their batches, one jitted SGD step per call;
  client_loop  a Python loop over the clients, one jitted `client_update`
               (the library's whole local training of one client) per call;
  centralized  one model trained on the same examples for the same number of
               steps with batch B x K (one jitted step per big batch): the same
               arithmetic without per-client weights, the ceiling a simulator
               can approach.

Fairness. All four use the same model, loss (`masked_cross_entropy`),
optimizer (`LocalSGD.optimizer`), batch gather (`client_batch`, by index from
the data that lies on the device once) and, for the three federated variants,
the same per-client keys and example orders, so `engine`, `step_loop` and
`client_loop` compute the same round (tests/test_benchmark.py checks it). All
clients hold the same number of examples and run exact epochs, so there are no
padded steps; `padded_step_fraction` is reported anyway. The loops set up each
client's data view (offset, count) inside their jitted calls and skip nothing
the engine does except its byte accounting, which is negligible.

Timing. Each variant runs one round to compile and warm up, then `repeats`
rounds, each ended by `jax.block_until_ready`; the steady round time is their
median and compile time is the first round's time minus it. Examples per
second = real training examples of a round (clients x examples x epochs) /
steady round time.

Memory. `peak_device_memory_bytes` comes from `jax.devices()[0].memory_stats()`,
which the CPU backend does not implement (it is None there); it is the
process-wide peak so far, read right after the engine's rounds (settings run
from small to large, so it is that setting's engine peak). On every backend the
engine's compiled round also reports XLA's own memory analysis
(`engine_xla_bytes`: arguments, outputs and temporaries).

Data. No data set has to be downloaded or prepared: the MLP trains on
scikit-learn's bundled 8x8 digits (resampled to fill the clients), the CNN on
synthetic uint8 32x32x3 images with random labels (throughput does not depend
on pixel values), with CIFAR's random crop and flip as a CIFAR run has.

CNN choice. `spafl_cnn` (SpaFL's CIFAR-10 network: four 5x5 convolutions with
masked BatchNorm and three dense layers, 806k parameters) is this project's CIFAR-10
CNN and the one whose vmapped convolutions (per-client filters, i.e. grouped
convolutions) and per-client BatchNorm the GPU target is about. On CPU it costs
about 0.5 GFLOP per training example, so its clients hold few examples there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
from typing import Any, Callable, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sparse.algorithms import fedavg
from fedjax_sparse.core.contract.algorithm import FederatedAlgorithm
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.round.cpu import CpuRound, keep_freed_memory, round_devices, use_cpu_cores
from fedjax_sparse.core.round.local_training import LocalSGD, masked_cross_entropy
from fedjax_sparse.core.round.numerics import Numerics, numerics
from fedjax_sparse.core.federation.participation import sample_clients
from fedjax_sparse.core.round.step import build_round, client_keys, default_client_chunk, round_info
from fedjax_sparse.data import load_dataset
from fedjax_sparse.data.federated import (Batch, ClientData, FederatedSplit, client_batch,
                                          epoch_permutations, federated_split, padded_step_fraction)
from fedjax_sparse.models import Model, get_model

VARIANTS = ("engine", "engine_1cpu", "engine_vmap", "step_loop", "client_loop", "centralized")
RECORD_KEYS = ("model", "clients_per_round", "engine", "step_loop", "client_loop", "centralized")

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the benchmark: a model, K clients per round and their local work."""

    model: str
    clients_per_round: int
    examples_per_client: int
    batch_size: int = 16
    epochs: int = 1
    learning_rate: float = 0.05
    momentum: float = 0.0
    repeats: int = 3
    seed: int = 0
    compute_dtype: str = "float32"  # the model's (`--compute-dtype`)
    matmul_precision: str = "float32"  # the run's (`--matmul-precision`)

    @property
    def steps_per_client(self) -> int:
        return self.epochs * math.ceil(self.examples_per_client / self.batch_size)

    @property
    def examples_per_round(self) -> int:
        return self.clients_per_round * self.examples_per_client * self.epochs


# Input shape, classes, data source and CIFAR augmentation of each benchmarked model.
MODELS = {
    "mlp": dict(input_shape=(8, 8, 1), num_classes=10, data="digits", augment=False),
    "spafl_cnn": dict(input_shape=(32, 32, 3), num_classes=10, data="synthetic", augment=True),
    "resnet20": dict(input_shape=(32, 32, 3), num_classes=10, data="synthetic", augment=True),
}


def full_settings(platform_name: str) -> list[Setting]:
    """The settings of a full run, small to large.

    The MLP: 64 examples per client, batch 16 (the library's default), one epoch:
    4 steps. The CNN costs ~0.5 GFLOP per training example, and on XLA:CPU the
    library's loop-based variants run its convolution gradients ~20x slower than
    a lone step does (see benchmarks/results), so on CPU its clients take one
    step of 8 examples; elsewhere 64 examples in batches of 16.
    """
    if platform_name == "cpu":
        cnn = dict(examples_per_client=8, batch_size=8, repeats=1)
    else:
        cnn = dict(examples_per_client=64, batch_size=16, repeats=3)
    return [
        Setting("mlp", 10, 64),
        Setting("mlp", 100, 64),
        Setting("mlp", 1000, 64),
        Setting("spafl_cnn", 10, **cnn),
        Setting("spafl_cnn", 100, **cnn),
    ]


def quick_settings(platform_name: str) -> list[Setting]:
    """A run that finishes in under a minute on 2 CPU cores: the MLP at 10 and 100 clients.

    On CPU the CNN is left out: one round of even 10 small clients takes minutes
    there (see `full_settings`); on an accelerator it runs at 10 clients.
    """
    settings = [Setting("mlp", 10, 64, repeats=5), Setting("mlp", 100, 64, repeats=5)]
    if platform_name != "cpu":
        settings.append(Setting("spafl_cnn", 10, 16, repeats=2))
    return settings


# The smallest configuration: what the test runs.
SMALLEST = Setting("mlp", 2, 16, batch_size=8, repeats=1)


# ---------------------------------------------------------------- workload


@dataclasses.dataclass(frozen=True)
class Workload:
    setting: Setting
    model: Model
    local: LocalSGD
    algorithm: FederatedAlgorithm
    split: FederatedSplit
    variables: dict
    data: str

    @property
    def num_clients(self) -> int:
        return self.split.num_clients


def _examples(spec: dict, total: int, rng: np.random.Generator):
    if spec["data"] == "digits":
        digits = load_dataset("digits")
        index = rng.permutation(len(digits.y_train))
        if total > len(index):  # more client examples than digits: resample
            index = np.concatenate([index, rng.integers(0, len(index), total - len(index))])
        return (digits.x_train[index[:total]], digits.y_train[index[:total]], digits.mean, digits.std,
                f"scikit-learn digits, {len(digits.y_train)} train images resampled to {total}")
    h, w, c = spec["input_shape"]
    x = rng.integers(0, 256, size=(total, h, w, c), dtype=np.uint8)
    y = rng.integers(0, spec["num_classes"], size=total).astype(np.int32)
    return x, y, (0.5,) * c, (0.25,) * c, f"synthetic uint8 {h}x{w}x{c}, random labels"


def build_workload(setting: Setting) -> Workload:
    """K equal clients (every client takes part in every round) and FedAvg with LocalSGD."""
    spec = MODELS[setting.model]
    rng = np.random.default_rng(setting.seed)
    k, n = setting.clients_per_round, setting.examples_per_client
    x, y, mean, std, data = _examples(spec, k * n, rng)
    clients = [np.arange(i * n, (i + 1) * n) for i in range(k)]
    split = federated_split(x, y, clients, mean, std, augment=spec["augment"])
    model = dataclasses.replace(get_model(setting.model, spec["input_shape"], spec["num_classes"]),
                                compute_dtype=setting.compute_dtype)
    local = LocalSGD(model, learning_rate=setting.learning_rate, epochs=setting.epochs,
                     batch_size=setting.batch_size, momentum=setting.momentum)
    variables = model.init(jax.random.key(setting.seed + 1))
    return Workload(setting, model, local, fedavg(local), split, variables, data)


# ---------------------------------------------------------------- the four variants
# Each `*_runner(workload)` returns `run(round_index) -> server variables after the round`.


def sgd_step(model: Model, tx: optax.GradientTransformation, carry, batch: Batch):
    """One local SGD step, the arithmetic of the step inside `LocalSGD.train`."""
    variables, opt_state = carry

    def loss_fn(params):
        logits, batch_stats = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                                          batch.x, train=True, mask=batch.mask)
        return masked_cross_entropy(logits, batch.y, batch.mask), batch_stats

    grads, batch_stats = jax.grad(loss_fn, has_aux=True)(variables["params"])
    updates, opt_state = tx.update(grads, opt_state, variables["params"])
    params = optax.apply_updates(variables["params"], updates)
    return {"params": params, "batch_stats": batch_stats}, opt_state


def _sampler(w: Workload) -> Callable[[int], np.ndarray]:
    k, seed, num = w.setting.clients_per_round, w.setting.seed, w.num_clients
    sample = jit(lambda r: sample_clients(seed, r, num, k))
    return lambda r: np.asarray(sample(r), np.int32)


def _aggregator(w: Workload):
    """server_update on the stacked messages of a Python list of clients (one jitted call)."""

    @jit
    def aggregate(server, ups, weights, round_index, ids):
        info = round_info(w.setting.seed, round_index, ids)
        return w.algorithm.server_update(server, tree_map(lambda *a: jnp.stack(a), *ups), weights, info)

    return aggregate


class EngineRunner:
    """The library's round: `client_chunk` as `build_round` takes it; several CPU `devices` (as
    `round_devices` chooses them) make it `CpuRound`'s calls, one device `build_round`'s one jit."""

    def __init__(self, w: Workload, client_chunk: int | None, devices: Sequence[Any] = ()):
        s = w.setting
        self.client_chunk = client_chunk
        if len(devices) > 1:
            self.round_fn = CpuRound(w.algorithm, w.split, s.clients_per_round, seed=s.seed,
                                     client_chunk=client_chunk, devices=devices)
        else:
            self.round_fn = build_round(w.algorithm, w.split, s.clients_per_round, seed=s.seed,
                                        client_chunk=client_chunk)
        self.server, self.clients = w.algorithm.init(jax.random.key(s.seed), w.variables, w.num_clients)

    def __call__(self, r: int):
        self.server, self.clients, out = self.round_fn(self.server, self.clients, r)
        return self.server, out

    def xla_memory(self) -> dict | None:
        """XLA's memory analysis of the compiled round (the compilation is cached: no recompile)."""
        if isinstance(self.round_fn, CpuRound):
            return None
        try:
            stats = self.round_fn.lower(self.server, self.clients, 0).compile().memory_analysis()
        except Exception:  # noqa: BLE001 - a backend without memory analysis
            return None
        if stats is None:
            return None
        return {"argument": int(stats.argument_size_in_bytes), "output": int(stats.output_size_in_bytes),
                "temp": int(stats.temp_size_in_bytes), "alias": int(stats.alias_size_in_bytes)}


def step_loop_runner(w: Workload) -> Callable[[int], Any]:
    """Python loops over clients and batches; one jitted SGD step (gather included) per call."""
    s, alg, split = w.setting, w.algorithm, w.split
    tx = w.local.optimizer()
    batch_size, epochs = s.batch_size, s.epochs
    counts = np.asarray(split.counts)

    @jit
    def start_client(server, split, round_index, cid):
        key = client_keys(s.seed, round_index, cid[None])[0]
        order_key, step_key = jax.random.split(key)  # as run_local_steps splits it
        data = split.client(cid)
        orders = epoch_permutations(order_key, data.count, data.max_count, epochs)
        variables = alg.broadcast(server, cid, round_info(s.seed, round_index, cid[None]))
        return (variables, tx.init(variables["params"])), orders, step_key

    @jit
    def train_step(carry, split, cid, orders, epoch, step_in_epoch, t, step_key):
        batch_key, _ = jax.random.split(jax.random.fold_in(step_key, t))
        batch = client_batch(split.client(cid), orders[epoch], step_in_epoch, batch_size, batch_key,
                             train=True)
        return sgd_step(w.model, tx, carry, batch)

    aggregate, sample = _aggregator(w), _sampler(w)
    state = {"server": alg.init(jax.random.key(s.seed), w.variables, w.num_clients)[0]}

    def run(r: int):
        ids = sample(r)
        ups = []
        for cid in ids:
            carry, orders, step_key = start_client(state["server"], split, r, cid)
            per_epoch = -(-int(counts[cid]) // batch_size)
            for t in range(epochs * per_epoch):
                carry = train_step(carry, split, cid, orders, t // per_epoch, t % per_epoch, t, step_key)
            ups.append(carry[0])
        state["server"] = aggregate(state["server"], ups, counts[ids].astype(np.float32), r, ids)
        return state["server"]

    return run


def client_loop_runner(w: Workload) -> Callable[[int], Any]:
    """A Python loop over clients; each call is the library's jitted local training of one client."""
    s, alg, split = w.setting, w.algorithm, w.split
    counts = np.asarray(split.counts)
    server, client_states = alg.init(jax.random.key(s.seed), w.variables, w.num_clients)

    @jit
    def train_client(server, split, client_states, round_index, cid, ids):
        key = client_keys(s.seed, round_index, cid[None])[0]
        info = round_info(s.seed, round_index, ids)
        state = tree_map(lambda a: a[cid], client_states)
        up, _, _ = alg.client_update(alg.broadcast(server, cid, info), state, split.client(cid), key, info)
        return up

    aggregate, sample = _aggregator(w), _sampler(w)
    state = {"server": server}

    def run(r: int):
        ids = sample(r)
        ups = [train_client(state["server"], split, client_states, r, cid, ids) for cid in ids]
        state["server"] = aggregate(state["server"], ups, counts[ids].astype(np.float32), r, ids)
        return state["server"]

    return run


def centralized_runner(w: Workload) -> Callable[[int], Any]:
    """One model, batch B x K, as many steps as each client takes, on the same examples.

    Each step is one jitted call of the same `sgd_step` and `client_batch` gather,
    over one permutation of all the round's examples. The steps are few (the
    clients' step count) and each carries B x K examples, so the Python loop costs
    nothing measurable, and keeping each step a separate computation keeps the
    ceiling free of how XLA compiles loop bodies (see benchmarks/results).
    """
    s, split = w.setting, w.split
    tx = w.local.optimizer()
    big_batch = s.batch_size * s.clients_per_round
    total = int(np.asarray(split.counts).sum())
    per_epoch = -(-total // big_batch)
    everything = ClientData(x=split.x, y=split.y, offset=jnp.int32(0), count=jnp.int32(total),
                            mean=split.mean, std=split.std, max_count=total, augment=split.augment)

    @jit
    def start(variables, data, round_index):
        key = jax.random.fold_in(jax.random.key(s.seed), round_index)
        order_key, step_key = jax.random.split(key)
        orders = epoch_permutations(order_key, data.count, data.max_count, s.epochs)
        return (variables, tx.init(variables["params"])), orders, step_key

    @jit
    def train_step(carry, data, orders, epoch, step_in_epoch, t, step_key):
        batch_key, _ = jax.random.split(jax.random.fold_in(step_key, t))
        batch = client_batch(data, orders[epoch], step_in_epoch, big_batch, batch_key, train=True)
        return sgd_step(w.model, tx, carry, batch)

    state = {"variables": w.variables}

    def run(r: int):
        carry, orders, step_key = start(state["variables"], everything, r)
        for t in range(s.epochs * per_epoch):
            carry = train_step(carry, everything, orders, t // per_epoch, t % per_epoch, t, step_key)
        state["variables"] = carry[0]
        return state["variables"]

    return run


# ---------------------------------------------------------------- measurement


def time_rounds(run: Callable[[int], Any], repeats: int) -> dict:
    """First round (compile + run), then `repeats` steady rounds; times in seconds."""
    start = time.perf_counter()
    jax.block_until_ready(run(0))
    first = time.perf_counter() - start
    times = []
    for r in range(1, repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(run(r))
        times.append(time.perf_counter() - start)
    steady = float(np.median(times))
    return {"first": first, "steady": steady, "compile": max(first - steady, 0.0), "rounds": times}


def peak_device_memory() -> int | None:
    stats = jax.devices()[0].memory_stats()  # None on CPU
    if not stats:
        return None
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else int(peak)


def run_setting(setting: Setting, variants: Sequence[str] = VARIANTS, *, devices_chosen: bool = False) -> dict:
    """Measures one setting, at its matrix-product precision; returns its record (examples per second under each
    variant's name)."""
    with numerics(Numerics(setting.matmul_precision)):
        return _run_setting(setting, variants, devices_chosen)


def _run_setting(setting: Setting, variants: Sequence[str], devices_chosen: bool) -> dict:
    w = build_workload(setting)
    examples = int(np.asarray(w.split.counts).sum()) * setting.epochs
    chunk = default_client_chunk(w.variables, setting.clients_per_round)
    devices = (round_devices(setting.clients_per_round, chunk, jax.local_devices(), chosen=devices_chosen)
               if platform_is_cpu() else [])
    timings, xla_bytes, peak = {}, None, None
    for name in variants:
        if name == "engine_vmap" and chunk is None:
            continue  # the engine already vmaps all clients on this platform
        if name == "engine_1cpu" and len(devices) < 2:
            continue  # the engine already runs on one device
        if name in ("engine", "engine_1cpu", "engine_vmap"):
            runner = EngineRunner(w, None if name == "engine_vmap" else chunk, devices if name == "engine" else ())
            timings[name] = time_rounds(runner, setting.repeats)
            if name == "engine":
                peak = peak_device_memory()
                xla_bytes = runner.xla_memory()
        else:
            runner = {"step_loop": step_loop_runner, "client_loop": client_loop_runner,
                      "centralized": centralized_runner}[name](w)
            timings[name] = time_rounds(runner, setting.repeats)
        del runner
        gc.collect()
    rate = {name: examples / t["steady"] for name, t in timings.items()}
    record = {
        "model": setting.model,
        "clients_per_round": setting.clients_per_round,
        **rate,
        "examples_per_client": setting.examples_per_client,
        "batch_size": setting.batch_size,
        "epochs": setting.epochs,
        "local_steps": setting.steps_per_client,
        "examples_per_round": examples,
        "num_params": w.model.num_params(w.variables),
        "engine_client_chunk": chunk,
        "engine_cpu_devices": max(len(devices), 1) if platform_is_cpu() else None,
        "padded_step_fraction": padded_step_fraction(np.asarray(w.split.counts), setting.batch_size),
        "round_seconds": {k: t["steady"] for k, t in timings.items()},
        "compile_seconds": {k: t["compile"] for k, t in timings.items()},
        "timed_rounds_seconds": {k: t["rounds"] for k, t in timings.items()},
        "peak_device_memory_bytes": peak,
        "engine_xla_bytes": xla_bytes,
        "data": w.data,
        "learning_rate": setting.learning_rate,
        "momentum": setting.momentum,
        "compute_dtype": setting.compute_dtype,
        "matmul_precision": setting.matmul_precision,
        "device": device_name(),
    }
    if "engine" in rate and "step_loop" in rate:
        record["engine_over_step_loop"] = rate["engine"] / rate["step_loop"]
    if "engine" in rate and "centralized" in rate:
        record["engine_over_centralized"] = rate["engine"] / rate["centralized"]
    if "engine" in rate and "engine_1cpu" in rate:
        record["engine_over_engine_1cpu"] = rate["engine"] / rate["engine_1cpu"]
    return record


# ---------------------------------------------------------------- reporting


def platform_is_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def device_name() -> str:
    d = jax.devices()[0]
    return f"{jax.device_count()} x {getattr(d, 'device_kind', d.platform)} ({d.platform})"


def environment(argv: Sequence[str], program: str = "benchmarks.round_throughput") -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "device": device_name(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "command": f"python -m {program} " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


HEADER = ("| model | K | examples/client | steps | chunk | CPU devices | engine | engine_1cpu | engine_vmap "
          "| step_loop | client_loop | centralized | engine/step_loop | engine/centralized | engine/engine_1cpu "
          "| compile s (engine/1cpu/vmap/step/client/central) "
          "| padded | peak device MiB | engine XLA temp MiB |")


def table_row(r: dict) -> str:
    comp = r["compile_seconds"]
    compile_s = "/".join(f"{comp[v]:.1f}" if v in comp else "-" for v in VARIANTS)
    peak = r["peak_device_memory_bytes"]
    temp = (r["engine_xla_bytes"] or {}).get("temp")
    chunk = r["engine_client_chunk"]
    return (f"| {r['model']} | {r['clients_per_round']} | {r['examples_per_client']} | {r['local_steps']} "
            f"| {'all' if chunk is None else chunk} | {r.get('engine_cpu_devices') or '-'} | {_num(r.get('engine'))} "
            f"| {_num(r.get('engine_1cpu'))} | {_num(r.get('engine_vmap'))} "
            f"| {_num(r.get('step_loop'))} | {_num(r.get('client_loop'))} "
            f"| {_num(r.get('centralized'))} | {_num(r.get('engine_over_step_loop'))}x "
            f"| {_num(r.get('engine_over_centralized'))}x | {_num(r.get('engine_over_engine_1cpu'))}x | {compile_s} "
            f"| {r['padded_step_fraction']:.2f} "
            f"| {'n/a' if peak is None else f'{peak / 2**20:.0f}'} "
            f"| {'n/a' if temp is None else f'{temp / 2**20:.0f}'} |")


def _select(settings: list[Setting], only: str | None) -> list[Setting]:
    if not only:
        return settings
    model, _, k = only.partition(":")
    chosen = [s for s in settings if s.model == model and (not k or s.clients_per_round == int(k))]
    if not chosen:
        raise SystemExit(f"--only {only!r} matches none of: "
                         + ", ".join(f"{s.model}:{s.clients_per_round}" for s in settings))
    return chosen


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.round_throughput",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a subset that takes under a minute on 2 CPU cores")
    parser.add_argument("--json", metavar="FILE", help="write the list of records as JSON")
    parser.add_argument("--only", metavar="MODEL[:K]", help="run only these settings, e.g. mlp:100")
    parser.add_argument("--cpu-devices", type=int, metavar="N",
                        help="JAX CPU devices, all of them used where a round has the chunks (default: one per "
                             "usable core, used where they pay, as the command line does)")
    parser.add_argument("--release-freed-memory", action="store_true",
                        help="leave glibc's allocator as it is (measures what core.round.cpu.keep_freed_memory brings)")
    args = parser.parse_args(argv)

    use_cpu_cores(args.cpu_devices)  # as the command line does: on a CPU, a device per core (before JAX starts)
    if platform_is_cpu() and not args.release_freed_memory:
        keep_freed_memory()
    env = environment(argv)
    platform_name = jax.devices()[0].platform
    settings = quick_settings(platform_name) if args.quick else full_settings(platform_name)
    settings = _select(settings, args.only)
    print(f"# round throughput, FedAvg: {env['device']}, {env['cpu_count']} CPUs; jax {env['jax']}, "
          f"flax {env['flax']}, optax {env['optax']}, python {env['python']}")
    print("# examples per second, steady state; compile time apart. No data set is needed: the MLP uses "
          "scikit-learn's bundled digits, the CNN synthetic 32x32x3 images.")
    print("# peak device memory: " + ("n/a (this backend's memory_stats() is None)"
                                      if peak_device_memory() is None and jax.devices()[0].platform == "cpu"
                                      else "process peak after the engine's rounds"))
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    records = []
    for setting in settings:
        record = run_setting(setting, devices_chosen=args.cpu_devices is not None)
        record["environment"] = env
        records.append(record)
        print(table_row(record), flush=True)
    try:
        env["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
