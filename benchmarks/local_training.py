"""One CNN client's local training on this device: milliseconds per example-pass, and where they go.

    python -m benchmarks.local_training [--quick] [--out DIR]

For `spafl_cnn` under FedAvg and SpaFL, `resnet20` and `cnn4` (FedAvg), one
client's `client_update` exactly as a round runs it (CIFAR-10 shapes, random
crop and flip, batch 64, SGD with momentum 0.9, lr 0.001: the setting of
issue 19, where the official SpaFL code takes 3.4 ms per example-pass on 2
CPU cores with 2 threads). Two variants, interleaved in one process:

  library       compiled as the library compiles (`core.round.compilation.jit`);
  xla_defaults  plain `jax.jit`: XLA's default CPU options (YNNPACK convolutions);
  one_convolution_input_gradients
                the library's, with every input gradient one convolution of
                the zero-padded dy (no frames: `models.conv.uses_frame`).

The profile: every convolution of the model at the step's batch, timed alone
(forward, and forward plus the gradients the step takes through
`models.conv.conv2d`'s custom VJP: both, but only the kernel's for a first
layer) under both variants, with the whole step's time beside their sum, and
the library's two gradients each alone (where the input gradient is a frame
of convolutions that skip dy's zero padding, the same gradient as one
convolution of the padded dy beside it, with the GFLOP that one multiplies);
and every BatchNorm alone (forward and backward), the library's against
Flax's `nn.BatchNorm`.
Writes `local_training_<device>_<date>.{md,json}` in --out.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .common import (best, command_line, environment, environment_markdown, finish, fmt, interleaved,
                     markdown_table)
from .common import parser as benchmark_parser
from fedjax_sparse.algorithms import BuildContext, make_algorithm
from fedjax_sparse.core.round.compilation import jit
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.round.step import round_info
from fedjax_sparse.data.federated import federated_split
from fedjax_sparse.models import get_model
from fedjax_sparse.models import conv as conv_module
from fedjax_sparse.models.conv import (Conv2D, _input_gradient, _input_gradient_by_convolution, _kernel_gradient,
                                      conv2d, uses_frame)
from fedjax_sparse.models.layers import BN_EPSILON, BN_MOMENTUM, MaskedBatchNorm

REFERENCE_MS = {"spafl_cnn": 3.4}  # official SpaFL code (PyTorch, 2 threads) on the 2-core CPU, issue 19
CASES = (("spafl_cnn", "fedavg"), ("spafl_cnn", "spafl"), ("resnet20", "fedavg"), ("cnn4", "fedavg"))


@dataclasses.dataclass(frozen=True)
class Setting:
    examples: int = 512  # about a client of CIFAR-10's 50,000 over 100 clients
    epochs: int = 1
    batch_size: int = 64
    repeats: int = 3
    profile: bool = True


FULL = Setting()
QUICK = Setting(examples=64, repeats=1, profile=False)


def input_shape(model_name: str) -> tuple[int, int, int]:
    """The MLP's digits shape; CIFAR's for the CNNs."""
    return (8, 8, 1) if model_name == "mlp" else (32, 32, 3)


def synthetic_split(model_name: str, counts: Sequence[int], seed: int = 0):
    """Random uint8 images of the model's input shape for clients holding `counts` examples (CIFAR's
    crop and flip on 32x32x3; the cost of a pass does not depend on pixel values)."""
    shape = input_shape(model_name)
    rng = np.random.default_rng(seed)
    n = int(sum(counts))
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    y = rng.integers(0, 10, n).astype(np.int32)
    bounds = np.cumsum([0, *counts])
    return federated_split(x, y, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])], [0.5] * shape[-1],
                           [0.25] * shape[-1], augment=shape == (32, 32, 3))


def client_update_fn(model_name: str, algorithm_name: str, setting: Setting, seed: int = 0):
    """A function of (server, client, key) running one client's local training, its arguments, the model
    and its variables."""
    model = get_model(model_name, input_shape(model_name), 10)
    split = synthetic_split(model_name, [setting.examples], seed)
    local = LocalSGD(model, 0.001, setting.epochs, setting.batch_size, momentum=0.9)
    algorithm = make_algorithm(algorithm_name, BuildContext(local=local, num_clients=1, clients_per_round=1,
                                                            train=split, num_classes=10, seed=seed))
    variables = model.init(jax.random.key(seed))
    server, clients = algorithm.init(jax.random.key(seed + 1), variables, 1)
    client = jax.tree_util.tree_map(lambda a: a[0], clients)
    ids = jnp.zeros((1,), jnp.int32)

    def update(server, client, key):
        info = round_info(seed, 0, ids)
        up, state, metrics = algorithm.client_update(algorithm.broadcast(server, ids[0], info), client,
                                                     split.client(ids[0]), key, info)
        return up, state, metrics["loss"]

    return update, (server, client, jax.random.key(seed + 2)), model, variables


def module_calls(model, variables, batch_size: int, module_type: type) -> list[dict]:
    """Every call of a `module_type` module in a training forward pass: its path, module and input shape."""
    calls = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, module_type) and context.method_name == "__call__":
            calls.append({"name": "/".join(context.module.path), "module": context.module,
                          "input": tuple(args[0].shape)})
        return next_fun(*args, **kwargs)

    x = jnp.zeros((batch_size, *model.input_shape), jnp.float32)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda v: model.apply(v, x, train=True, mask=jnp.ones(batch_size, bool)), variables)
    return calls


def conv_calls(model, variables, batch_size: int) -> list[dict]:
    """Every Conv2D call of a training forward pass: input shape, kernel size, stride, padding."""
    return [{"name": c["name"], "input": c["input"], "features": c["module"].features,
             "kernel": c["module"].kernel_size, "stride": c["module"].stride, "padding": c["module"].padding}
            for c in module_calls(model, variables, batch_size, Conv2D)]


def profile_convolutions(model, variables, batch_size: int, repeats: int) -> list[dict]:
    """Each convolution alone at the step's batch: forward, and forward + the step's gradients, in both variants."""
    rows = []
    for call in conv_calls(model, variables, batch_size):
        k, s, p = call["kernel"], call["stride"], call["padding"]
        x = jax.random.normal(jax.random.key(0), call["input"])
        w = jax.random.normal(jax.random.key(1), (k, k, call["input"][-1], call["features"]))
        out = jax.eval_shape(lambda x, w: conv2d(x, w, s, p), x, w)
        g = jax.random.normal(jax.random.key(2), out.shape)

        def forward(x, w):
            return conv2d(x, w, s, p)

        # The step takes no gradient for the model's input: the first convolution's is left out.
        first = call["input"][1:] == tuple(model.input_shape)

        def backward(x, w):
            if first:
                y, vjp = jax.vjp(lambda w: conv2d(x, w, s, p), w)
            else:
                y, vjp = jax.vjp(lambda x, w: conv2d(x, w, s, p), x, w)
            return y, vjp(g)

        runs = {}
        for variant, make in (("library", jit), ("xla_defaults", jax.jit)):
            f, b = make(forward), make(backward)
            runs[f"{variant}_forward"] = lambda f=f: f(x, w)
            runs[f"{variant}_train"] = lambda b=b: b(x, w)
        if not first:
            dx = jit(lambda g, w: _input_gradient(g, w, s, p, call["input"][1:3]))
            runs["library_input_gradient"] = lambda: dx(g, w)
            if uses_frame((k, k), out.shape[1:3], s, p):
                one = jit(lambda g, w: _input_gradient_by_convolution(g, w, s, p, call["input"][1:3]))
                runs["input_gradient_as_one_convolution"] = lambda: one(g, w)
        dw = jit(lambda x, g: _kernel_gradient(x, g, s, p, (k, k)))
        runs["library_kernel_gradient"] = lambda: dw(x, g)
        times = {name: best(t)["wall"] * 1e3 for name, t in interleaved(runs, repeats).items()}
        macs = int(np.prod(out.shape)) * k * k * call["input"][-1]
        rows.append({**call, "output": tuple(out.shape), "forward_gflop": 2 * macs / 1e9, "ms": times,
                     "one_convolution_gflop_multiplied": (_one_convolution_work(call)
                                                          if "input_gradient_as_one_convolution" in times
                                                          else None)})
    return rows


def _one_convolution_work(call: dict) -> float:
    """GFLOP the input gradient multiplies as one stride-1 convolution of the zero-padded dy, zeros
    included: every input position takes all k x k taps, where the forward pass's output positions (and the
    frame form) take only real ones."""
    n, h, w, c_in = call["input"]
    k = call["kernel"]
    return 2 * n * h * w * k * k * c_in * call["features"] / 1e9


def profile_batch_norms(model, variables, batch_size: int, repeats: int) -> list[dict]:
    """Each BatchNorm alone at the step's batch (one padded example), forward and backward, both compiled as
    the library compiles: the library's (`models.batch_norm`) against Flax's `nn.BatchNorm` with the same mask."""
    rows = []
    mask = jnp.arange(batch_size) < batch_size - 1
    for call in module_calls(model, variables, batch_size, MaskedBatchNorm):
        x = jax.random.normal(jax.random.key(0), call["input"])
        g = jax.random.normal(jax.random.key(1), call["input"])
        runs = {}
        for variant, kind in (("library", MaskedBatchNorm), ("flax", nn.BatchNorm)):
            module = kind(momentum=BN_MOMENTUM, epsilon=BN_EPSILON)
            v = module.init(jax.random.key(2), x, use_running_average=True)

            def train(v, x, g, mask, module=module, shaped=variant == "flax"):
                def loss(params, x):
                    m = mask.reshape((-1,) + (1,) * (x.ndim - 1)) if shaped else mask
                    y, stats = module.apply({"params": params, "batch_stats": v["batch_stats"]}, x,
                                            use_running_average=False, mask=m, mutable=["batch_stats"])
                    return jnp.sum(y * g), stats
                return jax.grad(loss, argnums=(0, 1), has_aux=True)(v["params"], x)

            f = jit(train)
            runs[variant] = lambda f=f, v=v: f(v, x, g, mask)
        times = {name: best(t)["wall"] * 1e3 for name, t in interleaved(runs, repeats).items()}
        rows.append({"name": call["name"], "input": call["input"], "ms": times})
    return rows


def without_frames(jitted, args):
    """`jitted` lowered and compiled for `args` with every input gradient as one convolution of the
    zero-padded dy, as before `models.conv` computed some as frames: the variant the frames are timed against.
    The executable itself is returned, so that neither its timing nor its convolution count depends on JAX
    reusing the trace made while `uses_frame` was replaced."""
    original = conv_module.uses_frame
    conv_module.uses_frame = lambda *a, **k: False
    try:
        return jitted.lower(*args).compile()
    finally:
        conv_module.uses_frame = original


def run_case(model_name: str, algorithm_name: str, setting: Setting) -> dict:
    update, args, model, variables = client_update_fn(model_name, algorithm_name, setting)
    compiled = {"library": jit(update), "xla_defaults": jax.jit(update)}
    runs = {name: (lambda f=f: f(*args)) for name, f in compiled.items()}
    # A function of its own: JAX caches traces per function, and this one is traced without frames.
    plain_update, plain_args, _, _ = client_update_fn(model_name, algorithm_name, setting)
    plain = without_frames(jit(plain_update), plain_args)
    runs["one_convolution_input_gradients"] = lambda: plain(*plain_args)
    times = interleaved(runs, setting.repeats)
    passes = setting.examples * setting.epochs
    record = {"model": model_name, "algorithm": algorithm_name, "examples": setting.examples,
              "epochs": setting.epochs, "batch_size": setting.batch_size, "example_passes": passes,
              "steps": setting.epochs * -(-setting.examples // setting.batch_size), "times": times}
    for name, t in times.items():
        b = best(t)
        record[f"{name}_ms_per_example"] = 1e3 * b["wall"] / passes
        record[f"{name}_cpu_ms_per_example"] = 1e3 * b["cpu"] / passes
    record["library_over_xla_defaults"] = record["xla_defaults_ms_per_example"] / record["library_ms_per_example"]
    record["library_over_one_convolution_input_gradients"] = (
        record["one_convolution_input_gradients_ms_per_example"] / record["library_ms_per_example"])
    reference = REFERENCE_MS.get(model_name)
    record["reference_ms_per_example"] = reference
    if reference is not None:
        record["library_over_reference"] = reference / record["library_ms_per_example"]
    library_executable = compiled["library"].lower(*args).compile()
    stats = library_executable.memory_analysis()
    record["compiled_convolutions"] = {
        "library": library_executable.as_text().count(" convolution("),
        "one_convolution_input_gradients": plain.as_text().count(" convolution(")}
    record["xla_temp_bytes"] = None if stats is None else int(stats.temp_size_in_bytes)
    if setting.profile:
        convs = profile_convolutions(model, variables, setting.batch_size, setting.repeats)
        record["convolutions"] = convs
        step_ms = 1e3 * best(times["library"])["wall"] / record["steps"]
        record["library_step_ms"] = step_ms
        record["library_convolutions_ms"] = sum(c["ms"]["library_train"] for c in convs)
        norms = profile_batch_norms(model, variables, setting.batch_size, setting.repeats)
        record["batch_norms"] = norms
        record["library_batch_norms_ms"] = sum(b["ms"]["library"] for b in norms)
        record["flax_batch_norms_ms"] = sum(b["ms"]["flax"] for b in norms)
    return record


def markdown(env: dict, records: list[dict]) -> str:
    rows = []
    for r in records:
        rows.append([r["model"], r["algorithm"], r["example_passes"],
                     fmt(r["library_ms_per_example"]), fmt(r["xla_defaults_ms_per_example"]),
                     fmt(r["library_cpu_ms_per_example"]), f"{r['library_over_xla_defaults']:.2f}x",
                     f"{r['library_over_one_convolution_input_gradients']:.3f}x",
                     fmt(r["reference_ms_per_example"]),
                     f"{r['library_over_reference']:.2f}x" if r.get("library_over_reference") else "-",
                     fmt((r["xla_temp_bytes"] or 0) / 2**20)])
    parts = ["# One client's local training", "", environment_markdown(env), "",
             markdown_table(["model", "algorithm", "example-passes", "library ms/example", "xla_defaults ms/example",
                             "library CPU-ms/example", "library speed / xla_defaults",
                             "library speed / input gradients as one convolution", "reference ms/example",
                             "library speed / reference", "XLA temp MiB"], rows)]
    for r in records:
        if "convolutions" not in r:
            continue
        parts += ["", f"## Convolutions of {r['model']} at batch {r['batch_size']}, each alone (ms)", "",
                  f"One training step of the whole client: {r['library_step_ms']:.1f} ms; its convolutions alone "
                  f"(forward + the step's gradients, library): {r['library_convolutions_ms']:.1f} ms.", ""]
        rows = [[c["name"], "x".join(map(str, c["input"][1:])), "x".join(map(str, c["output"][1:])),
                 f"{c['kernel']}/{c['stride']}/{c['padding']}", f"{c['forward_gflop']:.2f}",
                 fmt(c["ms"]["library_forward"]), fmt(c["ms"]["xla_defaults_forward"]),
                 fmt(c["ms"]["library_train"]), fmt(c["ms"]["xla_defaults_train"]),
                 fmt(c["ms"].get("library_input_gradient")), fmt(c["ms"].get("input_gradient_as_one_convolution")),
                 fmt(c.get("one_convolution_gflop_multiplied")),
                 fmt(c["ms"]["library_kernel_gradient"])] for c in r["convolutions"]]
        parts.append(markdown_table(["conv", "input", "output", "k/s/p", "forward GFLOP", "library fwd",
                                     "xla_defaults fwd", "library fwd+grads", "xla_defaults fwd+grads",
                                     "library input grad", "as one convolution", "its GFLOP (zeros included)",
                                     "library kernel grad"], rows))
        parts += ["", "(Input gradient: none for a first layer. Where the library computes it as a frame of "
                      "convolutions that skip dy's zero padding (`models.conv.uses_frame`), the same gradient as one "
                      "convolution of the padded dy is timed beside it, with the GFLOP that one multiplies; the "
                      "gradient itself is the forward GFLOP.)"]
        if r["batch_norms"]:
            parts += ["", f"BatchNorms of {r['model']} at batch {r['batch_size']}, each alone, forward and backward "
                          f"(ms): library {r['library_batch_norms_ms']:.1f} in all, Flax's `nn.BatchNorm` "
                          f"{r['flax_batch_norms_ms']:.1f}.", ""]
            rows = [[b["name"], "x".join(map(str, b["input"][1:])), fmt(b["ms"]["library"]), fmt(b["ms"]["flax"]),
                     f"{b['ms']['flax'] / b['ms']['library']:.2f}x"] for b in r["batch_norms"]]
            parts.append(markdown_table(["BatchNorm", "input", "library", "flax", "library speed / flax"], rows))
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = benchmark_parser("benchmarks.local_training", __doc__, "64 examples a client, one repeat, no profile")
    parser.add_argument("--only", default=None, help="MODEL:ALGORITHM, e.g. spafl_cnn:fedavg")
    args = parser.parse_args(argv)
    env = environment(command_line("benchmarks.local_training", argv))
    setting = QUICK if args.quick else FULL
    cases = [c for c in CASES if args.only in (None, f"{c[0]}:{c[1]}")]
    if not cases:
        raise SystemExit(f"--only {args.only!r} matches none of: " + ", ".join(f"{m}:{a}" for m, a in CASES))
    records = []
    for model_name, algorithm_name in cases:
        print(f"{model_name} / {algorithm_name} ...", file=sys.stderr, flush=True)
        records.append(run_case(model_name, algorithm_name, setting))
    finish(args.out, "local_training", env, records, lambda env: markdown(env, records))
    return records


if __name__ == "__main__":
    main()
