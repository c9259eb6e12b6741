"""What a sub-model consists of, on every model of the zoo.

The structure description (`ModelStructure`) is the one statement of which weights a
sub-model holds (`core.structure.unit_masks.variable_masks`), what it costs to run
(`core.structure.flops.layer_forward_flops`) and what it uploads. These tests hold it against the
computation itself: the gradient of the masked model (zero exactly outside
`variable_masks`, non-zero inside), and what every convolution and dense call really
receives and delivers (`core.structure.flops.measure_layers`), for unit masks drawn as the methods draw
them: the group-tied sub-model selection over all hidden layers (HeteroFL, FedRolex,
Federated Dropout, FedGSE), ordered dropout's prefixes (Fjord, FedP3's downlink), SPATL's
encoder-only selection, and SpaFL's untied per-layer masks.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_models import NATURAL

from fedjax_sparse.algorithms.spatl_selection import encoder_layers
from fedjax_sparse.core.structure.flops import layer_forward_flops, measure_layers
from fedjax_sparse.core.structure.unit_masks import input_unit_masks, variable_masks
from fedjax_sparse.core.structure.unit_selection import keep_top_units, prefix_scores
from fedjax_sparse.models import MODEL_NAMES, get_model
from fedjax_sparse.models.conv import Conv2D, conv2d
from fedjax_sparse.models.recurrent import LSTM
from fedjax_sparse.models.structure import get_path

# The smallest input each model accepts (models refuse anything smaller), three channels; char_lstm reads
# sequences of 10 tokens, each of its 10 characters once (so that every row of its embedding is read).
SMALLEST = {"mlp": 1, "lenet5_caffe": 16, "spafl_cnn": 28, "vgg9": 32, "vgg11": 32, "resnet20": 1,
            "resnet32": 1, "preresnet18": 1, "cnn4": 8, "cnn2": 4, "char_lstm": 10}


def zoo_model(name: str):
    side = SMALLEST[name]
    return get_model(name, (side,) if name == "char_lstm" else (side, side, 3), 10)


def positive_inputs(model, rng: np.random.Generator, draws: int) -> np.ndarray:
    """[draws, 1, ...] inputs: each a permutation of the characters for a token model (every one read,
    and its embedding positive), else uniform in [0.5, 1.5)."""
    if model.input_kind == "tokens":
        return np.stack([rng.permutation(model.num_classes)[None] for _ in range(draws)]).astype(np.int32)
    return 0.5 + rng.random((draws, 1, *model.input_shape), np.float32)
FRACTIONS = (0.3, 0.75)
UNTIED_KEEP = (0.3, 0.7)


def positive_variables(model, seed: int) -> dict:
    """Variables under which every live channel is strictly positive everywhere.

    Kernels uniform in [0.5, 1.5] / fan-in, biases and BatchNorm shifts in [0.1, 0.5], scales in
    [0.5, 1.5], running statistics mean 0 and variance 1. With positive inputs no ReLU ever
    outputs an exact zero and no sum cancels, so an exact zero anywhere (a channel, a gradient)
    comes from a unit mask and nothing else, and a non-zero is what the structure must account
    for. Activations stay O(1) (each unit averages its inputs).
    """
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init, jax.random.key(0))

    def draw(path, leaf):
        u = rng.random(leaf.shape, np.float32)
        last = path[-1].key
        if last == "kernel":
            return (0.5 + u) / np.prod(leaf.shape[:-1])
        if last == "scale":
            return 0.5 + u
        return 0.1 + 0.4 * u  # biases of convolutions, dense layers and norms

    stats = {"mean": np.zeros, "var": np.ones}
    return {"params": jax.tree_util.tree_map_with_path(draw, shapes["params"]),
            "batch_stats": jax.tree_util.tree_map_with_path(
                lambda path, leaf: stats[path[-1].key](leaf.shape, np.float32), shapes["batch_stats"])}


def mask_draws(structure, seed: int) -> dict[str, dict]:
    """{label: unit masks} drawn as the methods draw them: random scores through the group-tied
    selection (`keep_top_units`) over all hidden layers (the sub-model family) or over the encoder
    (SPATL) at several keep fractions, ordered dropout's prefixes (HeteroFL, Fjord, FedP3's downlink),
    and untied per-layer masks (SpaFL), the output layer included."""
    rng = np.random.default_rng(seed)
    encoder = encoder_layers(structure)
    fractions = jnp.asarray(FRACTIONS, jnp.float32)
    draws = {}
    prefix = prefix_scores(structure)
    selections = (("submodel", None), ("spatl", encoder), ("ordered", None))
    scores = [{l.name: (np.broadcast_to(prefix[l.name], (len(FRACTIONS), l.num_units)) if label == "ordered" else
                        rng.standard_normal((len(FRACTIONS), l.num_units), np.float32)) for l in structure.layers}
              for label, _ in selections]

    @jax.jit  # every selection one program
    def select(scores, fractions):
        return [jax.vmap(lambda s, f: keep_top_units(structure, s, f, layers=layers))(score, fractions)
                for (_, layers), score in zip(selections, scores)]

    for (label, _), masks in zip(selections, jax.device_get(select(scores, fractions))):
        for i, fraction in enumerate(FRACTIONS):
            draws[f"{label}@{fraction}"] = {k: m[i] for k, m in masks.items()}
    for keep in UNTIED_KEEP:
        masks = {}
        for l in structure.layers:
            u = rng.random(l.num_units)
            masks[l.name] = ((u < keep) | (u == u.min())).astype(np.float32)  # a layer keeps at least one unit
        draws[f"untied@{keep}"] = masks
    return draws


def _pairs(layer, kernel: np.ndarray) -> np.ndarray:
    """A kernel reduced to [input unit, output unit]: any of its taps / repeated input positions."""
    k = np.abs(kernel).reshape(-1, kernel.shape[-2], kernel.shape[-1]).max(axis=0)
    return k.reshape(layer.input_repeat, -1, k.shape[-1]).max(axis=0) if layer.kind == "dense" else k


@pytest.fixture(scope="module", params=MODEL_NAMES)
def zoo_run(request):
    """One model at its smallest input: gradients and measurements of every mask draw, one jit."""
    model = zoo_model(request.param)
    variables = positive_variables(model, 1)
    draws = list(mask_draws(model.structure, 2).items())
    stacked = jax.tree_util.tree_map(lambda *m: np.stack(m), *[m for _, m in draws])
    rng = np.random.default_rng(3)  # each draw its own positive input and projection of the logits
    x = positive_inputs(model, rng, len(draws))
    projection = rng.standard_normal((len(draws), 1, 10), np.float32)

    def run(variables, masks, x, projection):
        def output(params):
            logits, _ = model.apply({**variables, "params": params, "unit_masks": masks}, x, train=False)
            return jnp.sum(logits * projection)

        structure = model.structure
        return {"grads": jax.grad(output)(variables["params"]),
                "measured": measure_layers(model, {**variables, "unit_masks": masks}, x),
                "variable_masks": variable_masks(structure, variables, masks)["params"],
                "input_units": input_unit_masks(structure, masks),
                "flops": {c: layer_forward_flops(structure, masks, count_inputs=c) for c in (True, False)}}

    out = jax.device_get(jax.jit(jax.vmap(run, in_axes=(None, 0, 0, 0)))(variables, stacked, x, projection))
    return model, [(label, masks, jax.tree_util.tree_map(lambda a: a[d], out))
                   for d, (label, masks) in enumerate(draws)]


def test_the_gradient_is_zero_exactly_outside_the_sub_model_and_nonzero_inside(zoo_run):
    """The weights a sub-model uses are the weights `variable_masks` names: exactly no gradient
    elsewhere, and a gradient on every kept entry (on every (input unit, output unit) pair of a
    kernel: at the smallest inputs some taps read only padding)."""
    model, runs = zoo_run
    kernels = {l.kernel: l for l in model.structure.layers}
    for label, _, out in runs:
        for path, grad in jax.tree_util.tree_flatten_with_path(out["grads"])[0]:
            keys = tuple(p.key for p in path)
            kept = get_path(out["variable_masks"], keys)
            where = f"{model.name} {label} {'/'.join(keys)}"
            assert not np.any(grad[~kept]), f"{where}: {np.sum(grad[~kept] != 0)} used entries outside the sub-model"
            if keys in kernels:
                grad, kept = _pairs(kernels[keys], grad), _pairs(kernels[keys], kept) != 0
            used = grad != 0
            assert np.array_equal(used, kept), f"{where}: {np.sum(kept & ~used)} kept entries unused"


def test_every_layer_receives_and_delivers_exactly_the_units_the_structure_says(zoo_run):
    """A dropped unit's consumers see exactly zero from it and a live one is seen; and the FLOPs the
    structure counts (with live inputs, SPATL's count, and the paper's) are the FLOPs of the
    convolution and dense calls of the masked forward pass (`measure_layers`)."""
    model, runs = zoo_run
    for label, masks, out in runs:
        for layer in model.structure.layers:
            got, live = out["measured"][layer.name], out["input_units"][layer.name]
            where = f"{model.name} {label} {layer.name}"
            expected = np.ones(got.live_inputs.shape, bool) if live is None else np.tile(live, layer.input_repeat)
            np.testing.assert_array_equal(got.live_inputs, expected, err_msg=f"{where}: live inputs")
            np.testing.assert_array_equal(got.live_outputs, masks[layer.name] > 0, err_msg=f"{where}: live outputs")
            for c in (True, False):
                np.testing.assert_allclose(out["flops"][c][layer.name], got.flops(count_inputs=c), rtol=1e-6,
                                           err_msg=f"{where}: FLOPs (count_inputs={c})")


@functools.cache
def _xla_macs(kernel: int | None, stride: int, padding: int, in_shape: tuple, features: int) -> float:
    """Multiply-accumulates XLA's cost analysis counts for one example through a convolution
    (`kernel` its size) or, with kernel None, a matrix product."""
    if kernel is None:
        fn, shapes = jnp.matmul, [(1, *in_shape), (in_shape[-1], features)]
    else:
        fn, shapes = (lambda x, w: conv2d(x, w, stride, padding)), [(1, *in_shape), (kernel, kernel, in_shape[-1], features)]
    cost = jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"] / 2


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_dense_flops_are_what_xla_counts_for_every_call(name):
    """The structure's dense count of each layer against XLA's cost analysis of the very convolution
    or matrix product the forward pass calls (shapes and settings read off the call, one example,
    at the model's natural input). XLA skips the taps of a convolution that read padding, the
    paper's count (ours) keeps them: equal on unpadded convolutions and dense layers, and on a padded
    one XLA's count is in x out x the (position, tap) pairs that read the image."""
    model = get_model(name, *NATURAL[name])
    calls = {}

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and isinstance(context.module, (Conv2D, nn.Dense, LSTM)):
            calls[".".join(context.module.path)] = (context.module, args[0].shape[1:])
        return next_fun(*args, **kwargs)

    dtype = jnp.int32 if model.input_kind == "tokens" else jnp.float32
    with nn.intercept_methods(interceptor):
        jax.eval_shape(lambda: model.apply(model.init(jax.random.key(0)), jnp.zeros((1, *model.input_shape), dtype),
                                           train=False))
    counted = layer_forward_flops(model.structure)
    assert set(calls) == set(counted)
    for layer, (module, shape) in calls.items():
        if isinstance(module, LSTM):  # its products: the inputs' at every step, and the previous output's
            steps = shape[0]
            xla = _xla_macs(None, 1, 0, shape, 4 * module.units) + steps * _xla_macs(None, 1, 0, (module.units,),
                                                                                       4 * module.units)
            assert xla == counted[layer] == model.structure[layer].fan_in * module.units * steps, layer
            continue
        if isinstance(module, nn.Dense):
            assert _xla_macs(None, 1, 0, shape, module.features) == counted[layer], layer
            continue
        k, s, p = module.kernel_size, module.stride, module.padding
        xla = _xla_macs(k, s, p, shape, module.features)
        reads_image = float(jnp.sum(conv2d(jnp.ones((1, *shape[:2], 1)), jnp.ones((k, k, 1, 1)), s, p)))
        assert xla == shape[-1] * module.features * reads_image, layer
        if p == 0:
            assert xla == counted[layer], layer
        else:
            assert xla < counted[layer] == shape[-1] * module.features * k * k * np.prod(
                [(n + 2 * p - k) // s + 1 for n in shape[:2]]), layer


def test_bad_descriptions_are_refused_in_one_line():
    from conftest import linear_model

    from fedjax_sparse.models import Layer, ModelStructure

    with pytest.raises(ValueError, match="linear: the forward pass calls fc, which its structure does not describe"):
        measure_layers(linear_model(), linear_model().init(jax.random.key(0)), jnp.ones((1, 2, 2, 1)))
    a = Layer("a", "dense", ("a", "kernel"), None, ("bn",), 4, 3, ("input",), norm_units_from=("a", "b"))
    b = Layer("b", "dense", ("b", "kernel"), None, None, 5, 4, ("a",))
    with pytest.raises(ValueError, match=r"layer 'a': norm_units_from \('a', 'b'\) must name layers of 4 units"):
        ModelStructure((a, b))


def test_all_ones_masks_leave_the_resnets_unchanged():
    """Masking the option-A shortcut changes nothing when every unit is kept."""
    from fedjax_sparse.core.structure.unit_masks import full_unit_masks

    model = get_model("resnet20", (4, 4, 3), 10)
    variables = positive_variables(model, 0)
    x = jax.random.normal(jax.random.key(0), (2, 4, 4, 3))
    apply = jax.jit(lambda v: model.apply(v, x, train=False)[0])
    np.testing.assert_array_equal(apply({**variables, "unit_masks": full_unit_masks(model.structure)}),
                                  apply(variables))
