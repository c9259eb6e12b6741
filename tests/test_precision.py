"""Precision as a recorded choice, and mixed precision (bfloat16) over the zoo and every algorithm (issue 52).

What reaches the compiled programs is read from the programs themselves (their StableHLO: each matrix product's
and convolution's operand dtypes and precision), so a model or algorithm that ignored an option would fail here
on a CPU, where the figures alone would not show it (a CPU computes float32 products in float32 at every
precision).

How close bfloat16 comes to float32 is measured against the function's own sensitivity at bfloat16's resolution:
the same float32 computation from its starting point rounded to bfloat16 (weights, or the server state). The
models' gradients at initialization are ill-conditioned (rounding spafl_cnn's weights alone moves its gradient by
15 %, vgg9's by 18 %), and a round of local steps more so, so a fixed tolerance would be either loose for the MLP
or failed by a ResNet. Measured on 2 CPU cores (jax 0.10.2): bfloat16's difference over rounding's was 0.4-2.3
for the zoo's gradients (char_lstm 6.5, at 1.2 % absolute: its 80 recurrent steps round every step's state),
1.2-2.9 for its logits, and 0.2-1.4 for a round of every algorithm (spafl, whose server state, thresholds at
zero, rounds to itself: 2.7 % absolute).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_split
from test_models import NATURAL, sample_input
from test_participation_algorithms import CASES, COUNTS, IDS, K, N, SEED, build, case_id
from fedjax_sparse.core.contract.algorithm import BuildContext
from fedjax_sparse.core.round.compilation import compiler_options
from fedjax_sparse.core.round.local_training import LocalSGD, masked_cross_entropy
from fedjax_sparse.core.round.numerics import GPU_DETERMINISM, Numerics, numerics
from fedjax_sparse.core.round.step import round_step
from fedjax_sparse.models import MODEL_NAMES, get_model
from fedjax_sparse.run.cli import main

tree_map = jax.tree_util.tree_map
BF16_OVER_ROUNDING = 4.0  # bfloat16's difference from float32 over rounding's (measured at most 2.9, module docstring)
FLOOR = 0.05  # ... or this relative difference: 13 bfloat16 units, for what rounds to itself or is tiny (char_lstm)


# ---------------------------------------------------------------- reading a program

_OP = re.compile(r"stablehlo\.(dot_general|convolution)\b.*?:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)")
_PRECISION = re.compile(r"precision = \[(\w+)|#stablehlo<precision (\w+)>")


def products(text: str) -> list[tuple[str, tuple[str, str], str]]:
    """(kind, (lhs element type, rhs element type), XLA precision) of every matrix product and convolution in a
    StableHLO module's text ('DEFAULT' where it names none)."""
    out = []
    for line in text.splitlines():
        op = _OP.search(line)
        if op is None:
            continue
        precision = _PRECISION.search(line)
        dtypes = tuple(t.rstrip(">").split("x")[-1] for t in op.group(2, 3))
        out.append((op.group(1), dtypes, (precision.group(1) or precision.group(2)) if precision else "DEFAULT"))
    return out


def test_products_reads_dtypes_and_precisions():
    with numerics(Numerics("tensorfloat32")):
        text = jax.jit(lambda a, b: (a @ b, jnp.dot(a, b, precision="highest"),
                                     jax.lax.conv(a[None, None], b[None, None], (1, 1), "VALID"))).lower(
            jnp.ones((4, 4), jnp.bfloat16), jnp.ones((4, 4), jnp.bfloat16)).as_text()
    assert products(text) == [("dot_general", ("bf16", "bf16"), "HIGH"), ("dot_general", ("bf16", "bf16"), "HIGHEST"),
                              ("convolution", ("bf16", "bf16"), "HIGH")]


def test_the_suite_computes_float32_products_in_float32():
    """By construction (conftest), not by tolerance: every test and every process a test starts."""
    assert os.environ["JAX_DEFAULT_MATMUL_PRECISION"] == "float32"
    assert jax.config.jax_default_matmul_precision == "float32"
    text = jax.jit(jnp.dot).lower(jnp.ones((2, 2)), jnp.ones((2, 2))).as_text()
    assert products(text) == [("dot_general", ("f32", "f32"), "HIGHEST")]


# ---------------------------------------------------------------- the zoo

def relative(a, b) -> float:
    flat = [np.concatenate([np.zeros(0), *(np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(t))])
            for t in (a, b)]
    return float(np.linalg.norm(flat[0] - flat[1]) / max(np.linalg.norm(flat[1]), 1e-30))


def rounded_to_bfloat16(tree):
    return tree_map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                    tree)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_a_zoo_model_trains_in_bfloat16_with_float32_master_weights(name):
    """One training step's logits and gradients (a plain SGD update is -lr times them): under --compute-dtype
    bfloat16 every convolution and the model's matrix products are bfloat16 at the run's precision, BatchNorm's
    sums float32 at HIGHEST (their own), the gradients reach the float32 weights as float32,
    and both figures are within bfloat16's reach of float32's (module docstring)."""
    shape, classes = NATURAL[name]
    base = get_model(name, shape, classes)
    variables = jax.jit(base.init)(jax.random.key(0))
    x = sample_input(base, jax.random.key(1), 8)
    y = jax.random.randint(jax.random.key(2), (8,), 0, classes)
    valid = jnp.ones((8,), bool)

    def step(model):
        def loss(params):
            logits, _ = model.apply({**variables, "params": params}, x, train=True, mask=valid)
            return masked_cross_entropy(logits, y, valid), logits

        def logits_and_gradients(params):
            (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
            return grads, logits

        return jax.jit(logits_and_gradients)

    lowered = {}
    for dtype in ("float32", "bfloat16"):  # lowered at TF32: what a model would ignore shows on any backend
        with numerics(Numerics("tensorfloat32")):
            lowered[dtype] = step(dataclasses.replace(base, compute_dtype=dtype)).lower(variables["params"])
    ops32, ops16 = (products(lowered[d].as_text()) for d in ("float32", "bfloat16"))
    # a product that names no precision of its own (every layer's, forward and backward) is at the run's; the
    # ones that do are exact sums: BatchNorm's and a unit mask's (float32) and a convolution gradient's placement
    assert {dtypes for _, dtypes, _ in ops32} == {("f32", "f32")}
    assert {p for kind, _, p in ops32 + ops16 if kind == "convolution"} <= {"HIGH"}
    assert {dtypes for _, dtypes, p in ops16 if p == "HIGH"} == {("bf16", "bf16")}
    assert {p for _, dtypes, p in ops16 if dtypes == ("f32", "f32")} <= {"HIGHEST"}
    assert sum(p == "HIGH" for *_, p in ops16) == sum(p == "HIGH" for *_, p in ops32) >= len(base.structure.layers)
    assert len(ops16) == len(ops32)  # the same products, in another dtype

    f32, bf16 = lowered["float32"].compile(), lowered["bfloat16"].compile()
    grads32, logits32 = f32(variables["params"])
    grads16, logits16 = bf16(variables["params"])
    assert logits16.dtype == jnp.float32
    assert tree_map(lambda g: g.dtype, grads16) == tree_map(lambda p: p.dtype, variables["params"])
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads16))
    rounded_grads, rounded_logits = f32(rounded_to_bfloat16(variables["params"]))
    for what, ours, theirs, reach in (("logits", logits16, logits32, rounded_logits),
                                      ("gradients", grads16, grads32, rounded_grads)):
        difference, sensitivity = relative(ours, theirs), relative(reach, theirs)
        assert difference <= max(BF16_OVER_ROUNDING * sensitivity, FLOOR), (what, difference, sensitivity)


# ---------------------------------------------------------------- every algorithm

AGENT = ("spatl", {"salient_policy": "agent", "agent_updates": 1}, {})  # the GNN-PPO agent searching


@pytest.fixture(scope="module")
def split():
    return synthetic_split(COUNTS)


@pytest.mark.parametrize("case", [*CASES, AGENT], ids=case_id)
def test_every_algorithm_runs_a_round_in_bfloat16(split, case):
    """A round of every algorithm and wrapper (thresholds, masks, sub-models, the agent) on the MLP in bfloat16:
    every server and client state keeps its dtype (float32 master weights, optimizer states, masks), stays
    finite, and moves within bfloat16's reach of the float32 round's move. The float32 round is the one
    tests/test_participation_algorithms.py compiles (K - 1 slots), so it is usually the session cache's. The
    agent's search runs in bfloat16 and is checked for its dtypes and finiteness only (its float32 round is the
    fixed policy's figures plus a minute of compiling; SPATL's fixed-policy cases compare the figures)."""
    ids = IDS[:K - 1]
    rounds, states = {}, {}
    for dtype in ("bfloat16",) if case is AGENT else ("float32", "bfloat16"):
        model = dataclasses.replace(get_model("mlp", (8, 8, 1), 10), compute_dtype=dtype)
        context = BuildContext(local=LocalSGD(model, 0.1, 1, 8), num_clients=N, clients_per_round=K, train=split,
                               num_classes=10, seed=SEED, labels_per_client=2)
        algorithm = build(context, *case)
        server, clients = jax.jit(algorithm.init, static_argnums=2)(jax.random.key(1), model.init(jax.random.key(0)),
                                                                    N)
        rounds[dtype] = jax.jit(lambda s, c, i, r, algorithm=algorithm: round_step(algorithm, K - 1, seed=SEED)(
            s, c, split, i, i, r))
        states[dtype] = server, tree_map(lambda a: a[ids], clients)
    server, clients = states["bfloat16" if case is AGENT else "float32"]
    assert tree_map(lambda a: a.dtype, states["bfloat16"]) == tree_map(lambda a: a.dtype, (server, clients))
    new16, clients16, _ = rounds["bfloat16"](server, clients, ids, 0)
    assert tree_map(lambda a: a.dtype, (new16, clients16)) == tree_map(lambda a: a.dtype, (server, clients))
    floating = [a for a in jax.tree_util.tree_leaves((new16, clients16)) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert all(np.isfinite(np.asarray(a)).all() for a in floating)
    if case is AGENT:
        return
    new32, _, _ = rounds["float32"](server, clients, ids, 0)
    rounded = rounded_to_bfloat16(server)
    new_rounded, _, _ = rounds["float32"](rounded, clients, ids, 0)

    def move(new, old):
        return [np.asarray(a, np.float64) - np.asarray(b, np.float64)
                for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old))
                if jnp.issubdtype(a.dtype, jnp.floating)]

    difference = relative(move(new16, server), move(new32, server))
    sensitivity = relative(move(new_rounded, rounded), move(new32, server))
    assert difference <= max(BF16_OVER_ROUNDING * sensitivity, FLOOR), (difference, sensitivity)


# ---------------------------------------------------------------- a run

RUN = ["run", "--rounds", "1", "--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1",
       "--max-train-examples", "300", "--max-test-examples", "100", "--no-progress", "--no-tensorboard"]


def run_programs(tmp_path, name, *flags):
    """Runs one round with `flags`, returning (config.json, summary.json, {program name: its products})."""
    dump, out = tmp_path / f"{name}_ir", tmp_path / name
    jax.config.update("jax_dump_ir_to", str(dump))
    try:
        assert main([*RUN, *flags, "--out", str(out)]) == 0
    finally:
        jax.config.update("jax_dump_ir_to", "")
    programs = {}
    for path in sorted(dump.glob("*.mlir")):
        ops = products(path.read_text())
        if ops:
            programs[path.name] = ops
    return json.loads((out / "config.json").read_text()), json.loads((out / "summary.json").read_text()), programs


def test_the_run_options_reach_every_program_and_the_records(tmp_path):
    """Every matrix product a run compiles is at the precision it names, the model's in its compute dtype, and
    config.json and summary.json say both (the default: float32 at HIGHEST, float32 products)."""
    config, summary, programs = run_programs(tmp_path, "default")
    assert (config["matmul_precision"], config["compute_dtype"], config["deterministic"]) == ("float32", "float32",
                                                                                            False)
    assert {k: summary[k] for k in ("matmul_precision", "xla_precision", "compute_dtype", "deterministic")} == {
        "matmul_precision": "float32", "xla_precision": "HIGHEST", "compute_dtype": "float32", "deterministic": False}
    assert {(dtypes, p) for ops in programs.values() for _, dtypes, p in ops} == {(("f32", "f32"), "HIGHEST")}

    config, summary, programs = run_programs(tmp_path, "mixed", "--matmul-precision", "high", "--compute-dtype",
                                             "bfloat16", "--deterministic")
    assert (config["matmul_precision"], config["compute_dtype"], config["deterministic"]) == ("high", "bfloat16", True)
    assert {k: summary[k] for k in ("matmul_precision", "xla_precision", "compute_dtype", "deterministic")} == {
        "matmul_precision": "tensorfloat32", "xla_precision": "HIGH", "compute_dtype": "bfloat16",
        "deterministic": True}
    assert {p for ops in programs.values() for _, _, p in ops} == {"HIGH"}
    trained = [ops for name, ops in programs.items() if "round" in name]
    evaluated = [ops for name, ops in programs.items() if "evaluate" in name]
    assert trained and evaluated
    for ops in trained + evaluated:  # the MLP's products in bfloat16 (the server's sums stay float32)
        assert sum(dtypes == ("bf16", "bf16") for _, dtypes, _ in ops) >= 3


def test_bad_precision_and_dtype_values_are_refused_in_one_line(tmp_path, capsys):
    for flag, value in (("--matmul-precision", "fp16"), ("--compute-dtype", "float16")):
        with pytest.raises(SystemExit) as exit:
            main([*RUN, flag, value, "--out", str(tmp_path / "bad")])
        assert exit.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and value in err[0] and ("tensorfloat32" in err[0] or "bfloat16" in err[0]), err
    with pytest.raises(ValueError, match="'fp16' is not one of float32, tensorfloat32, bfloat16, default"):
        Numerics("fp16")
    with pytest.raises(ValueError, match="'float16' is not one of float32, bfloat16"):
        dataclasses.replace(get_model("mlp", (8, 8, 1), 10), compute_dtype="float16")


def test_numerics_sets_jax_and_restores_it():
    assert Numerics("highest").matmul_precision == "float32"
    with numerics(Numerics("bfloat16")):
        assert jax.config.jax_default_matmul_precision == "bfloat16"
        assert Numerics("bfloat16").describe()["xla_precision"] == "DEFAULT"
    assert jax.config.jax_default_matmul_precision == "float32"
    with numerics(Numerics("default")):  # JAX's own setting: the suite's float32
        assert jax.config.jax_default_matmul_precision == "float32"
        assert Numerics("default").describe()["xla_precision"] == "HIGHEST"


def test_deterministic_compiles_gpu_programs_with_deterministic_ops():
    """On a GPU the library's programs compile with XLA's deterministic ops under --deterministic; a CPU's options
    are what they were (it is deterministic already)."""
    assert compiler_options("gpu") is None
    cpu = compiler_options("cpu")
    with numerics(Numerics(deterministic=True)):
        assert compiler_options("gpu") == GPU_DETERMINISM
        assert compiler_options("cpu") == cpu
    assert compiler_options("gpu") is None


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedavg", "spafl"])
def test_a_digits_run_in_bfloat16_ends_within_one_point_of_float32(tmp_path, algorithm):
    """The CLI's default digits run (30 rounds; SpaFL at its defaults), seed 0, in both dtypes: the personalized
    accuracy of the last five evaluations within one point (experiments/results/precision_digits.md has the
    same over five seeds; one round's accuracy jitters by more between seeds than the dtype moves it)."""
    from fedjax_sparse.run import RunConfig, run_experiment

    last5 = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        run_experiment(RunConfig.create(algorithm=algorithm, compute_dtype=dtype, tensorboard=False, out=str(out)),
                       progress=False)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == 30
        last5[dtype] = np.mean([r["personalized_accuracy"] for r in records[-5:]])
    assert last5["float32"] > 0.85
    assert abs(last5["bfloat16"] - last5["float32"]) <= 0.01, last5
