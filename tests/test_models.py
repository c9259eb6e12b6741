"""Tests of the model zoo: forward passes, structure descriptions, parameter counts, masked BN."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import initialized
from fedjax_sparse.models import MODEL_NAMES, Model, ModelStructure, get_model
from fedjax_sparse.models import layers as L
from fedjax_sparse.models.batch_norm import normalize
from fedjax_sparse.models.channel_sums import channel_sum, scale_channels
from fedjax_sparse.models.conv import Conv2D, conv2d
from fedjax_sparse.models.structure import get_path

# The input each model is meant for (digits are 8x8x1, (E/F)MNIST 28x28x1, CIFAR 32x32x3).
NATURAL = {
    "mlp": ((8, 8, 1), 10),
    "lenet5_caffe": ((28, 28, 1), 10),
    "spafl_cnn": ((32, 32, 3), 10),
    "vgg9": ((32, 32, 3), 10),
    "vgg11": ((32, 32, 3), 10),
    "resnet20": ((32, 32, 3), 10),
    "resnet32": ((32, 32, 3), 10),
    "preresnet18": ((32, 32, 3), 10),
    "cnn4": ((8, 8, 1), 10),
    "cnn2": ((28, 28, 1), 62),
    "char_lstm": ((80,), 80),  # LEAF's Shakespeare: 80-character windows, 80 characters
}


def sample_input(model: Model, key, batch: int) -> jax.Array:
    """A batch the model reads: random token sequences for a token model, standard normals otherwise."""
    if model.input_kind == "tokens":
        return jax.random.randint(key, (batch, *model.input_shape), 0, model.num_classes)
    return jax.random.normal(key, (batch, *model.input_shape), jnp.float32)


def _model(name: str) -> Model:
    shape, classes = NATURAL[name]
    return get_model(name, shape, classes)


def _abstract_variables(model: Model):
    return jax.eval_shape(model.init, jax.random.key(0))


def _leaf_paths(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def _size(tree) -> int:
    return sum(math.prod(a.shape) for a in jax.tree_util.tree_leaves(tree))


def test_registry_names():
    assert MODEL_NAMES == ("mlp", "lenet5_caffe", "spafl_cnn", "vgg9", "vgg11", "resnet20",
                           "resnet32", "preresnet18", "cnn4", "cnn2", "char_lstm")
    assert set(NATURAL) == set(MODEL_NAMES)
    for name in MODEL_NAMES:
        model = _model(name)
        assert model.name == name
        assert isinstance(model.structure, ModelStructure)
        assert model.description.strip()


# ---------------------------------------------------------------- forward passes

@functools.cache
def natural_passes(name: str):
    """(model, variables, x, passes): a zoo model at its natural input, its variables and a batch x of 2, and
    what one compiled program computes (eagerly, Flax compiles every operation on its own: seconds on the larger
    models), for the forward test here and tests/test_feature_loss.py: 'train' (logits, statistics) with the
    second row padding, 'eval' (logits, statistics), 'features' (logits, statistics, features), and
    'eval_returns_its_statistics': whether the evaluation pass handed back the very statistics it was given."""
    shape, classes = NATURAL[name]
    model, variables = initialized(name, shape, classes)
    x = sample_input(model, jax.random.key(1), 2)
    returned = []

    @jax.jit
    def forward(variables, x, mask):
        evaluation = model.apply(variables, x, train=False)
        returned.append(evaluation[1] is variables["batch_stats"])  # as traced: the same object
        return {"train": model.apply(variables, x, train=True, mask=mask), "eval": evaluation,
                "features": model.apply(variables, x, train=False, features=True)}

    passes = jax.device_get(forward(variables, x, jnp.array([True, False])))
    return model, variables, x, {**passes, "eval_returns_its_statistics": returned == [True]}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_train_and_eval(name):
    _, classes = NATURAL[name]
    _, variables, _, passes = natural_passes(name)
    logits, stats = passes["train"]
    assert logits.shape == (2, classes) and logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))
    assert (jax.tree_util.tree_structure(stats)
            == jax.tree_util.tree_structure(variables["batch_stats"]))
    assert all(np.all(np.isfinite(a)) for a in jax.tree_util.tree_leaves(stats))
    if jax.tree_util.tree_leaves(stats):
        # Training moved the running statistics.
        changed = jax.tree_util.tree_map(lambda a, b: bool(np.any(a != b)), stats,
                                         jax.device_get(variables["batch_stats"]))
        assert any(jax.tree_util.tree_leaves(changed))

    eval_logits, _ = passes["eval"]
    assert eval_logits.shape == (2, classes)
    assert np.all(np.isfinite(eval_logits))
    assert passes["eval_returns_its_statistics"]


# ---------------------------------------------------------------- structure

@pytest.mark.parametrize("name", MODEL_NAMES)
def test_structure_matches_params(name):
    model = _model(name)
    shape, _ = NATURAL[name]
    variables = _abstract_variables(model)
    params = variables["params"]
    leaves = _leaf_paths(params)
    st = model.structure

    kernels = {p for p in leaves if p[-1] == "kernel"}
    biases = {p for p in leaves if p[-1] == "bias" and p[:-1] + ("scale",) not in leaves}
    norms = {p[:-1] for p in leaves if p[-1] == "scale"}
    # The structure covers every conv/dense kernel (and bias, and norm) exactly once.
    assert sorted(l.kernel for l in st.layers) == sorted(kernels)
    assert sorted(l.bias for l in st.layers if l.bias) == sorted(biases)
    assert sorted(l.norm for l in st.layers if l.norm) == sorted(norms)
    stats = _leaf_paths(variables["batch_stats"])
    assert {p[:-1] for p in stats} == norms

    for layer in st.layers:
        k = get_path(params, layer.kernel).shape
        assert layer.kind == {4: "conv", 3: "lstm", 2: "dense"}[len(k)], layer.name
        assert layer.num_units == k[-1], layer.name
        assert layer.fan_in == math.prod(k[:-1]), layer.name
        assert layer.num_weights == math.prod(k)
        if layer.bias is not None:  # an LSTM's: one per gate and unit
            assert get_path(params, layer.bias).shape == ((4,) if layer.kind == "lstm" else ()) + (layer.num_units,)
        if layer.norm is not None:
            # The BN assigned to a layer normalizes that layer's output units.
            assert get_path(params, layer.norm + ("scale",)).shape == (layer.num_units,)
            assert get_path(params, layer.norm + ("bias",)).shape == (layer.num_units,)
            assert stats[layer.norm + ("mean",)] == (layer.num_units,)
        assert layer.part in ("encoder", "predictor", "private", "shared")

        # The input axis is the producers' units, each input_repeat times.
        producers = layer.inputs_from
        assert producers, layer.name
        if producers == ("input",):
            units = model.num_classes if model.input_kind == "tokens" else shape[-1]  # tokens: one-hot
        else:
            assert "input" not in producers
            counts = {st[p].num_units for p in producers}
            assert len(counts) == 1, (layer.name, producers)  # residual sums share units
            units = counts.pop()
        if layer.kind in ("conv", "lstm"):
            assert layer.input_repeat == 1
        own = layer.num_units if layer.kind == "lstm" else 0  # an LSTM reads its own units back
        assert k[-2] == units * layer.input_repeat + own, layer.name
        if len(producers) > 1:
            groups = {st[p].unit_group for p in producers}
            assert len(groups) == 1 and None not in groups, (layer.name, groups)

    # Unit groups hold equal unit counts.
    groups: dict[str, set[int]] = {}
    for layer in st.layers:
        if layer.unit_group is not None:
            groups.setdefault(layer.unit_group, set()).add(layer.num_units)
    assert all(len(v) == 1 for v in groups.values()), groups

    # Forward order: every producer comes before its consumer.
    seen = {"input"}
    for layer in st.layers:
        assert set(layer.inputs_from) <= seen, layer.name
        seen.add(layer.name)

    # output_hw is the real output map of each conv (dense layers: 1).
    x = jax.ShapeDtypeStruct((1, *shape), jnp.int32 if model.input_kind == "tokens" else jnp.float32)
    _, inter = jax.eval_shape(
        lambda v, x: model.module.apply(v, x, train=False, capture_intermediates=True,
                                        mutable=["intermediates"]), variables, x)
    for layer in st.layers:
        out = get_path(inter["intermediates"], layer.kernel[:-1])["__call__"][0].shape
        if layer.kind == "conv":
            assert layer.output_hw == out[1] * out[2], layer.name
        elif layer.kind == "lstm":  # [B, T, units]: its kernel runs once a step
            assert layer.output_hw == out[1] == shape[0], layer.name
        else:  # a dense layer runs at every position of its input (1, or a sequence's steps)
            assert layer.output_hw == math.prod(out[1:-1]), layer.name


def test_parts_follow_the_papers():
    def parts(name):
        return {l.name: l.part for l in _model(name).structure.layers}

    vgg11 = _model("vgg11").structure
    assert [l.part for l in vgg11.layers if l.kind == "conv"] == ["encoder"] * 8
    assert [l.part for l in vgg11.layers if l.kind == "dense"] == ["predictor"] * 3
    for name in ("resnet20", "resnet32"):
        p = parts(name)
        assert p.pop("conv1") == "private" and p.pop("fc") == "predictor"
        assert set(p.values()) == {"encoder"}
    assert parts("cnn2") == {"conv1": "encoder", "conv2": "encoder", "fc1": "predictor",
                             "fc2": "predictor"}
    for name in ("mlp", "lenet5_caffe", "spafl_cnn", "vgg9", "preresnet18", "cnn4"):
        # no paper splits these: the hidden layers are the encoder, the output layer the predictor
        structure = _model(name).structure
        assert [l.part for l in structure.layers] == ["encoder"] * (len(structure.layers) - 1) + ["predictor"]


def test_resnet_unit_groups():
    st = _model("resnet20").structure
    groups = {}
    for l in st.layers:
        groups.setdefault(l.unit_group, []).append(l.name)
    assert groups["stage1"] == ["conv1"] + [f"stage1_block{b}.conv2" for b in (1, 2, 3)]
    assert groups["stage2"] == [f"stage2_block{b}.conv2" for b in (1, 2, 3)]
    assert groups["stage3"] == [f"stage3_block{b}.conv2" for b in (1, 2, 3)]
    assert st["stage1_block3.conv1"].inputs_from == ("conv1", "stage1_block1.conv2",
                                                     "stage1_block2.conv2")
    # Downsampling blocks read the whole previous stage; option A adds no parameters.
    assert st["stage2_block1.conv1"].inputs_from == ("conv1", "stage1_block1.conv2",
                                                     "stage1_block2.conv2", "stage1_block3.conv2")
    assert st["fc"].inputs_from == tuple(groups["stage3"])

    pre = _model("preresnet18").structure
    assert pre["conv1"].norm == ("stage1_block1", "bn1")
    assert pre["stage1_block1.conv1"].norm == ("stage1_block1", "bn2")
    assert pre["stage1_block2.conv2"].norm == ("stage2_block1", "bn1")
    assert pre["stage4_block2.conv2"].norm == ("bn_final",)
    assert pre["stage2_block1.shortcut"].unit_group == "stage2"
    assert pre["stage2_block2.conv1"].inputs_from == ("stage2_block1.shortcut",
                                                      "stage2_block1.conv2")


def test_option_a_shortcut_places_channels_in_the_middle():
    """With zeroed residual branches a downsampling block passes x[::2, ::2] into channels 8..23."""
    from fedjax_sparse.models.resnet import BasicBlock

    block = BasicBlock(planes=32, stride=2)
    x = jax.nn.relu(jax.random.normal(jax.random.key(0), (1, 4, 4, 16)))
    v = jax.jit(lambda key, x: block.init(key, x, False))(jax.random.key(1, impl="rbg"), x)  # not op by op
    v = {"params": jax.tree_util.tree_map(jnp.zeros_like, v["params"]),
         "batch_stats": v["batch_stats"]}
    y = jax.jit(lambda v, x: block.apply(v, x, False))(v, x)
    assert y.shape == (1, 2, 2, 32)
    np.testing.assert_allclose(y[..., 8:24], x[:, ::2, ::2, :])
    assert float(jnp.abs(y[..., :8]).sum() + jnp.abs(y[..., 24:]).sum()) == 0.0


# ---------------------------------------------------------------- parameter counts

def _counts(name, shape=None, classes=None):
    model = get_model(name, *(NATURAL[name] if shape is None else (shape, classes)))
    v = _abstract_variables(model)
    return model, model.num_params(v), _size(v["batch_stats"])


def test_mlp_count():
    # 64*256+256 + 256*256+256 + 256*10+10 = 16,640 + 65,792 + 2,570
    _, n, _ = _counts("mlp")
    assert n == 85_002


def test_lenet5_caffe_count():
    # 28 -> 24 -> 12 -> 8 -> 4, fc1 reads 4*4*50 = 800.
    # conv1 5*5*1*20 = 500; conv2 5*5*20*50 = 25,000; fc1 800*500 = 400,000; fc2 500*10 = 5,000.
    model, n, stats = _counts("lenet5_caffe")
    assert n == 500 + 25_000 + 400_000 + 5_000 == 430_500  # SpaFL: 430,500 parameters
    assert stats == 0
    assert model.structure.num_units == 20 + 50 + 500 + 10 == 580  # SpaFL: 580 thresholds


def test_spafl_cnn_count():
    # 32 -> 28 -> 24 -> 12 -> 8 -> 4 -> 2, fc1 reads 2*2*128 = 512.
    # kernels: 5*5*3*64 = 4,800; 5*5*64*64 = 102,400; 5*5*64*128 = 204,800;
    #          5*5*128*128 = 409,600; 512*128 = 65,536; 128*128 = 16,384; 128*10 = 1,280.
    model, n, stats = _counts("spafl_cnn")
    kernels = 4_800 + 102_400 + 204_800 + 409_600 + 65_536 + 16_384 + 1_280
    assert kernels == 804_800 == model.structure.num_prunable_weights
    bn_channels = 64 + 64 + 128 + 128 + 128 + 128
    assert n == kernels + 2 * bn_channels == 804_800 + 1_280  # + BN scale and bias
    assert stats == 2 * bn_channels == 1_280  # BN running mean and var
    # SpaFL's "807,366 model parameters" = PyTorch state dict: kernels, BN affine,
    # BN running stats, and one num_batches_tracked counter for each of the 6 BNs.
    assert n + stats + 6 == 807_366
    # SpaFL states 1,418 thresholds; the model has 650 units (see cnn.py's docstring).
    assert model.structure.num_units == 64 + 64 + 128 + 128 + 128 + 128 + 10 == 650


def test_vgg_counts():
    # conv weights + biases: 3*3*3*64+64 = 1,792; 3*3*64*128+128 = 73,856;
    # 3*3*128*256+256 = 295,168; 3*3*256*256+256 = 590,080; 3*3*256*512+512 = 1,180,160;
    # 3 x (3*3*512*512+512) = 3 x 2,359,808.
    convs = 1_792 + 73_856 + 295_168 + 590_080 + 1_180_160 + 3 * 2_359_808
    assert convs == 9_220_480
    # vgg9: + BN scale/bias 2*(64+128+256+256+4*512) = 5,504 + dense 512*10+10 = 5,130.
    _, n, stats = _counts("vgg9")
    assert n == convs + 5_504 + 5_130 == 9_231_114
    assert stats == 5_504
    # vgg11 (no BN): + 2 x (512*512+512) + 5,130.
    _, n, stats = _counts("vgg11")
    assert n == convs + 2 * 262_656 + 5_130 == 9_750_922
    assert stats == 0


def test_resnet_counts():
    # ResNet-20: stem 3*3*3*16 = 432 + BN 32; stage 1: 6 x 3*3*16*16 = 13,824 + BN 6*32;
    # stage 2: 3*3*16*32 + 5 x 3*3*32*32 = 50,688 + BN 6*64; stage 3: 3*3*32*64 +
    # 5 x 3*3*64*64 = 202,752 + BN 6*128; dense 64*10+10 = 650.
    _, n, _ = _counts("resnet20")
    assert n == 432 + 32 + 13_824 + 192 + 50_688 + 384 + 202_752 + 768 + 650 == 269_722
    # ResNet-32: n = 5 blocks per stage.
    _, n, _ = _counts("resnet32")
    s1 = 10 * 2_304 + 10 * 32
    s2 = 4_608 + 9 * 9_216 + 10 * 64
    s3 = 18_432 + 9 * 36_864 + 10 * 128
    assert n == 464 + s1 + s2 + s3 + 650 == 464_154


def test_preresnet18_count():
    # stem 3*3*3*64 = 1,728
    # stage 1: 4 x 3*3*64*64 = 147,456; BN 4*64 channels
    # stage 2: 3*3*64*128 + 3 x 3*3*128*128 + 1x1 64*128 = 524,288; BN (64+3*128) channels
    # stage 3: 3*3*128*256 + 3 x 3*3*256*256 + 128*256 = 2,097,152; BN (128+3*256)
    # stage 4: 3*3*256*512 + 3 x 3*3*512*512 + 256*512 = 8,388,608; BN (256+3*512)
    # final BN 512; dense 512*10+10 = 5,130.
    _, n, _ = _counts("preresnet18")
    bn_channels = 4 * 64 + (64 + 3 * 128) + (128 + 3 * 256) + (256 + 3 * 512) + 512
    expected = 1_728 + 147_456 + 524_288 + 2_097_152 + 8_388_608 + 2 * bn_channels + 5_130
    assert n == expected == 11_172_170
    assert round(n / 1e6, 1) == 11.2  # HeteroFL: "11.2 M" for CIFAR-10


def test_cnn_counts():
    # cnn4 on 8x8x1 digits: 3*3*1*64+64 = 640; 3*3*64*128+128 = 73,856;
    # 3*3*128*256+256 = 295,168; 3*3*256*512+512 = 1,180,160; BN 2*(64+128+256+512) = 1,920;
    # dense 512*10+10 = 5,130.
    _, n, _ = _counts("cnn4")
    assert n == 640 + 73_856 + 295_168 + 1_180_160 + 1_920 + 5_130 == 1_556_874
    # cnn2 on 28x28x1, 62 classes: 5*5*1*32+32 = 832; 5*5*32*64+64 = 51,264;
    # 7*7*64*512+512 = 1,606,144; 512*62+62 = 31,806.
    _, n, _ = _counts("cnn2")
    assert n == 832 + 51_264 + 1_606_144 + 31_806 == 1_690_046


# ---------------------------------------------------------------- masked BatchNorm

class _TinyBN(nn.Module):
    @nn.compact
    def __call__(self, x, train, mask=None):
        return L.batch_norm(train, "bn")(x, mask=mask)


@pytest.mark.parametrize("shape", [(6, 3, 3, 4), (6, 4)])
def test_masked_batchnorm_uses_only_valid_examples(shape):
    x = 3 * np.random.default_rng(0).standard_normal(shape, np.float32) + 1
    mask = np.array([True, False, True, True, False, False])
    bn = _TinyBN()
    v = bn.init(jax.random.key(1), x, False)
    valid = x[mask]

    @jax.jit  # one program for every pass (eagerly each operation compiles on its own)
    def passes(x, mask, valid):
        return {"masked": bn.apply(v, x, True, mask, mutable=["batch_stats"]),
                "valid": bn.apply(v, valid, True, mutable=["batch_stats"]),
                "plain": bn.apply(v, x, True, mutable=["batch_stats"])[1],
                "ones": bn.apply(v, x, True, jnp.ones(6, bool), mutable=["batch_stats"])[1],
                "eval_masked": bn.apply(v, x, False, mask), "eval": bn.apply(v, x, False)}

    out = passes(x, mask, valid)
    y, upd = out["masked"]
    axes = tuple(range(x.ndim - 1))
    mean, var = valid.mean(axes), valid.var(axes)
    np.testing.assert_allclose(upd["batch_stats"]["bn"]["mean"], 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(upd["batch_stats"]["bn"]["var"], 0.9 + 0.1 * var, rtol=1e-5)
    # Valid rows are normalized exactly as if the batch held only them.
    y_valid, upd_valid = out["valid"]
    np.testing.assert_allclose(y[mask], y_valid, rtol=1e-4, atol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           upd, upd_valid)
    # mask=None and an all-True mask are plain BatchNorm over the batch.
    plain, ones = out["plain"], out["ones"]
    np.testing.assert_allclose(plain["batch_stats"]["bn"]["mean"], 0.1 * x.mean(axes),
                               rtol=1e-5, atol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), plain, ones)
    # Eval mode ignores the mask and uses the running averages.
    np.testing.assert_allclose(out["eval_masked"], out["eval"], rtol=1e-6)


@pytest.mark.parametrize("shape", [(5, 3, 4, 6), (5, 6)])
def test_channel_sum_and_scale_channels_match_plain_jax(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, np.float32)
    weights = np.array([1.0, 0.0, 2.0, 1.0, 0.5], np.float32)
    axes = tuple(range(x.ndim - 1))
    wide = weights.reshape((-1,) + (1,) * (x.ndim - 1))
    v = rng.standard_normal(shape[-1:], np.float32)
    g = rng.standard_normal(shape, np.float32)
    def loss(fn):
        return lambda x, v: jnp.sum(jnp.sin(fn(x, v)) * g)

    plain = lambda x, v: x * v  # noqa: E731

    @jax.jit  # one program for every comparison (eagerly each operation compiles on its own)
    def compare(x, v, weights):
        # under vmap too (clients side by side), as an accelerator's round runs them
        xs, vs = jnp.stack([x, 2 * x]), jnp.stack([v, -v])
        return {"sums": (channel_sum(x, weights), jnp.sum(x * wide, axes), channel_sum(x), jnp.sum(x, axes)),
                "scaled": (scale_channels(x, v), plain(x, v)),
                "grads": [jax.grad(loss(fn), argnums=(0, 1))(x, v) for fn in (scale_channels, plain)],
                "vmapped": [jax.vmap(jax.grad(loss(fn), argnums=(0, 1)))(xs, vs) for fn in (scale_channels, plain)]}

    out = compare(x, v, weights)
    weighted, weighted_by_hand, summed, summed_by_hand = out["sums"]
    np.testing.assert_allclose(weighted, weighted_by_hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(summed, summed_by_hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(*out["scaled"], rtol=1e-6)
    for got, want in (out["grads"], out["vmapped"]):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"one value per channel.*shape \(3,\)"):
        scale_channels(x, jnp.ones(3))


@pytest.mark.parametrize("shape", [(6, 3, 5, 4), (6, 4)])
@pytest.mark.parametrize("valid", [6, 2])
def test_batch_norm_normalize_and_its_gradient_match_autodiff_of_the_textbook_formula(shape, valid):
    """`batch_norm.normalize` (sums as products, hand-written gradient) against jnp reductions under autodiff,
    with a loss that reads the normalized output and the statistics, and against Flax's BatchNorm."""
    rng = np.random.default_rng(0)
    x = 3 * rng.standard_normal(shape, np.float32) + 1
    scale = np.linspace(0.5, 1.5, shape[-1], dtype=np.float32)
    bias = np.linspace(-1.0, 1.0, shape[-1], dtype=np.float32)
    g = rng.standard_normal(shape, np.float32)
    a, b = np.linspace(-2.0, 2.0, shape[-1], dtype=np.float32), np.linspace(1.0, 3.0, shape[-1], dtype=np.float32)
    axes = tuple(range(x.ndim - 1))

    @jax.jit  # one program for every comparison (eagerly each operation compiles on its own)
    def compare(x, scale, bias, weights):
        def textbook(x, scale, bias):
            m = weights.reshape((-1,) + (1,) * (x.ndim - 1)) > 0
            mean = jnp.mean(x, axes, where=m)
            var = jnp.maximum(0.0, jnp.mean(x * x, axes, where=m) - mean * mean)
            return (x - mean) * jax.lax.rsqrt(var + L.BN_EPSILON) * scale + bias, mean, var

        def loss(fn):
            def f(x, scale, bias):
                y, mean, var = fn(x, scale, bias)
                return jnp.sum(jnp.tanh(y) * g) + jnp.sum(a * mean) + jnp.sum(b * var)
            return f

        library = lambda x, scale, bias: normalize(x, scale, bias, weights, L.BN_EPSILON)  # noqa: E731
        flax_bn = nn.BatchNorm(use_running_average=False, epsilon=L.BN_EPSILON)
        variables = {"params": {"scale": scale, "bias": bias},
                     "batch_stats": {"mean": jnp.zeros(shape[-1]), "var": jnp.ones(shape[-1])}}
        flax_y, _ = flax_bn.apply(variables, x, mask=weights.reshape((-1,) + (1,) * (x.ndim - 1)) > 0,
                                  mutable=["batch_stats"])
        return (library(x, scale, bias), textbook(x, scale, bias), jax.grad(loss(library), argnums=(0, 1, 2))(
            x, scale, bias), jax.grad(loss(textbook), argnums=(0, 1, 2))(x, scale, bias), flax_y)

    weights = (np.arange(shape[0]) < valid).astype(np.float32)
    library, textbook, got, want, flax_y = compare(x, scale, bias, weights)
    for got_value, want_value in zip(library, textbook):
        np.testing.assert_allclose(got_value, want_value, rtol=1e-5, atol=1e-5)
    for gd, wt in zip(got, want):
        np.testing.assert_allclose(gd, wt, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(wt))))
    np.testing.assert_allclose(library[0], flax_y, rtol=1e-5, atol=1e-5)


def test_masked_batchnorm_all_padded_batch_is_a_finite_no_op():
    x = jax.random.normal(jax.random.key(0), (4, 2, 2, 3))
    bn = _TinyBN()
    v = bn.init(jax.random.key(1), x, False)
    y, upd = bn.apply(v, x, True, jnp.zeros(4, bool), mutable=["batch_stats"])
    assert bool(jnp.all(jnp.isfinite(y)))
    jax.tree_util.tree_map(np.testing.assert_array_equal, upd["batch_stats"], v["batch_stats"])
    # Also under jit and vmap (the engine's setting).
    f = jax.jit(jax.vmap(lambda x, m: bn.apply(v, x, True, m, mutable=["batch_stats"])))
    masks = jnp.array([[False] * 4, [True, True, False, False]])
    ys, upds = f(jnp.stack([x, x]), masks)
    assert bool(jnp.all(jnp.isfinite(ys)))
    np.testing.assert_array_equal(upds["batch_stats"]["bn"]["mean"][0], 0.0)
    np.testing.assert_allclose(upds["batch_stats"]["bn"]["mean"][1],
                               0.1 * x[:2].mean((0, 1, 2)), rtol=1e-5, atol=1e-6)


def test_model_mask_excludes_padded_examples():
    """A whole model with BN: padded rows change neither the valid logits nor the statistics."""
    model, variables = initialized("cnn4", (8, 8, 1), 10)
    x = jax.random.normal(jax.random.key(1), (8, 8, 8, 1))
    mask = jnp.array([True, False, True, True, False, True, False, False])
    valid = np.asarray(mask)

    @jax.jit  # one program (eager Flax compiles its operations one at a time)
    def forward(variables, x, mask):
        junk = jnp.where(mask[:, None, None, None], x, 100.0)
        return (model.apply(variables, x, train=True, mask=mask), model.apply(variables, junk, train=True, mask=mask),
                model.apply(variables, x[valid], train=True))

    (logits, stats), (logits_junk, stats_junk), (logits_valid, stats_valid) = forward(variables, x, mask)
    np.testing.assert_allclose(logits[valid], logits_valid, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(logits_junk[valid], logits_valid, rtol=1e-3, atol=1e-4)
    for a, b, c in zip(*(jax.tree_util.tree_leaves(s) for s in (stats, stats_junk, stats_valid))):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(b, c, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- get_model errors

def test_unknown_model_name():
    with pytest.raises(ValueError, match="'resnet18'") as err:
        get_model("resnet18", (32, 32, 3), 10)
    for name in MODEL_NAMES:
        assert name in str(err.value)


@pytest.mark.parametrize("name, shape, needed", [
    ("lenet5_caffe", (8, 8, 1), "16x16"),
    ("lenet5_caffe", (15, 28, 1), "16x16"),
    ("spafl_cnn", (27, 27, 3), "28x28"),
    ("vgg9", (28, 28, 1), "32x32"),
    ("vgg11", (8, 8, 1), "32x32"),
    ("cnn4", (7, 7, 1), "8x8"),
    ("cnn2", (3, 3, 1), "4x4"),
])
def test_too_small_inputs(name, shape, needed):
    with pytest.raises(ValueError) as err:
        get_model(name, shape, 10)
    msg = str(err.value)
    assert "\n" not in msg
    assert name in msg and needed in msg and "x".join(map(str, shape)) in msg


@pytest.mark.parametrize("name, shape", [
    ("lenet5_caffe", (16, 16, 1)), ("spafl_cnn", (28, 28, 3)), ("vgg9", (32, 32, 1)),
    ("cnn4", (8, 8, 3)), ("cnn2", (4, 4, 1)), ("mlp", (28, 28, 1)), ("resnet20", (8, 8, 1)),
    ("preresnet18", (8, 8, 1)), ("lenet5_caffe", (32, 20, 3)),
])
def test_smallest_and_other_inputs_build(name, shape):
    """Smallest accepted sizes and non-natural shapes: structure still matches the params."""
    model = get_model(name, shape, 7)
    params = _abstract_variables(model)["params"]
    for layer in model.structure.layers:
        k = get_path(params, layer.kernel).shape
        assert (layer.num_units, layer.fan_in) == (k[-1], math.prod(k[:-1]))
    out = jax.eval_shape(lambda v, x: model.apply(v, x, train=False)[0],
                         _abstract_variables(model),
                         jax.ShapeDtypeStruct((3, *shape), jnp.float32))
    assert out.shape == (3, 7)


def test_bad_shapes_and_classes():
    with pytest.raises(ValueError, match="mlp"):
        get_model("mlp", (8, 8), 10)
    with pytest.raises(ValueError, match="num_classes"):
        get_model("cnn2", (28, 28, 1), 0)


@pytest.mark.parametrize("size,kernel,stride,padding", [
    (8, 3, 1, 1), (9, 3, 2, 1), (8, 1, 2, 0), (10, 5, 1, 2), (11, 3, 3, 0),
    (8, 5, 1, 0), (6, 5, 2, 1), ((12, 9), 5, 1, 0), (7, 3, 1, 0), (10, 5, 1, 1)])
def test_conv2d_gradients_equal_jax_differentiating_lax_conv(size, kernel, stride, padding):
    """The hand-written canonical gradients are JAX's own, also vmapped over per-client kernels: one
    convolution, tap products (output smaller than the kernel), and the frame of stride-1 gradients
    padded by 2 or more (spafl_cnn's conv3 shape, a non-square input, 3x3 and cropped 5x5 kernels)."""
    height, width = size if isinstance(size, tuple) else (size, size)
    rng = np.random.default_rng(height * kernel + stride)
    x = rng.standard_normal((3, 2, height, width, 3), np.float32)
    w = rng.standard_normal((3, kernel, kernel, 3, 4), np.float32)

    def reference(x, w):
        return jax.lax.conv_general_dilated(x, w, (stride, stride), [(padding, padding)] * 2,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def ours(x, w):
        return conv2d(x, w, stride, padding)

    g = rng.standard_normal(jax.eval_shape(jax.vmap(reference), x, w).shape, np.float32)

    def grads(fn, x, w, g):
        loss = lambda x, w: jnp.sum(fn(x, w) * g)  # noqa: E731
        return jax.vmap(fn)(x, w), jax.vmap(jax.grad(loss, argnums=(0, 1)))(x, w)

    # one program for both (eagerly each operation compiles on its own)
    (y_ref, (dx_ref, dw_ref)), (y, (dx, dw)) = jax.jit(lambda *args: (grads(reference, *args), grads(ours, *args)))(
        x, w, g)
    for a, b in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_hw,kernel,padding", [((12, 9), 5, 0), ((7, 7), 3, 0), ((10, 10), 5, 1),
                                                   ((28, 28), 5, 0)])
def test_input_gradient_frame_equals_the_one_convolution_on_every_platform(in_hw, kernel, padding):
    """The frame form is the padded convolution's sum without its zero taps (on a CPU the library uses it
    for these shapes, spafl_cnn's conv2 among them; elsewhere only this test runs it)."""
    from fedjax_sparse.models.conv import _input_gradient_by_convolution, _input_gradient_by_frame, uses_frame

    out_hw = tuple(h + 2 * padding - kernel + 1 for h in in_hw)
    k = (kernel, kernel)
    assert uses_frame(k, out_hw, 1, padding, "cpu") and not uses_frame(k, out_hw, 1, padding, "gpu")
    assert not uses_frame((3, 3), (8, 8), 1, 1, "cpu") and not uses_frame((5, 5), (8, 8), 2, 0, "cpu")
    assert not uses_frame((5, 5), (4, 4), 1, 0, "cpu")  # smaller than the kernel: tap products
    rng = np.random.default_rng(kernel + padding)
    dy = rng.standard_normal((2, *out_hw, 4), np.float32)
    w = rng.standard_normal((kernel, kernel, 3, 4), np.float32)
    frame, convolution = jax.jit(lambda dy, w: (_input_gradient_by_frame(dy, w, padding),  # one program
                                                _input_gradient_by_convolution(dy, w, 1, padding, in_hw)))(dy, w)
    assert frame.shape == (2, *in_hw, 3)
    np.testing.assert_allclose(frame, convolution, rtol=1e-5, atol=1e-5)


def test_conv2d_refuses_what_it_does_not_implement():
    x = jnp.zeros((1, 8, 8, 3))
    with pytest.raises(ValueError, match="padding must be in \\[0, 2\\] for a 3x3 kernel, got 3"):
        Conv2D(4, 3, padding=3).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="NHWC inputs of rank 4, got shape \\(8, 8, 3\\)"):
        Conv2D(4, 3).init(jax.random.key(0), x[0])


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (2, 7, 9, 2)])
def test_max_pool2_equals_flax_max_pool_in_values_and_gradients(shape):
    """The library max pool is nn.max_pool(2, stride 2, floor), odd sizes included, gradients too (ties: one
    element of the window gets the gradient, the first maximum)."""
    from fedjax_sparse.models.layers import max_pool2

    g = jax.random.normal(jax.random.key(1), (shape[0], shape[1] // 2, shape[2] // 2, shape[3]))

    def reference(x):
        return nn.max_pool(x, (2, 2), strides=(2, 2), padding="VALID")

    x = jax.random.normal(jax.random.key(0), shape)
    for x in (x, jnp.round(x), jax.nn.relu(x)):  # the last two full of tied maxima (zeros after a ReLU)
        for fn in (max_pool2, reference):
            assert fn(x).shape == g.shape
        np.testing.assert_array_equal(max_pool2(x), reference(x))
        for fn in (lambda f: f, jax.jit):
            grad = lambda pool: fn(jax.grad(lambda x: jnp.sum(pool(x) * g)))(x)  # noqa: E731
            np.testing.assert_array_equal(grad(max_pool2), grad(reference))


def test_library_jit_keeps_cpu_convolutions_out_of_ynnpack():
    """On a CPU, `core.round.compilation.jit` compiles a convolution with XLA's own kernels (YNNPACK's run
    the zoo's shapes 2-4x slower, benchmarks/results/cnn_client_cpu.md) and keeps YNNPACK's dots."""
    from jax import lax

    from fedjax_sparse.core.round.compilation import compiler_options, jit

    if jax.default_backend() != "cpu":
        assert compiler_options() is None
        return

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    args = (jax.ShapeDtypeStruct((64, 28, 28, 64), jnp.float32), jax.ShapeDtypeStruct((5, 5, 64, 64), jnp.float32))
    assert "ynn_fusion" not in jit(conv).lower(*args).compile().as_text()
    dense = (jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((256, 256), jnp.float32))
    assert "ynn_fusion" in jit(lambda a, b: jnp.tanh(a @ b)).lower(*dense).compile().as_text()


def test_char_lstm_is_tensorflows_basic_lstm_cell_written_out_in_numpy():
    """A sequence through char_lstm against its layers by hand: the embedding a row lookup, each LSTM step
    TF's BasicLSTMCell (gates i, g, f, o of one kernel over [x_t, h_(t-1)], forget bias 1, h_0 = c_0 = 0),
    the output the last step's; with a unit mask, the masked unit's h is 0 at every step, fed back too."""
    model = get_model("char_lstm", (3,), 5)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda a: rng.normal(0, 0.3, a.shape).astype(np.float32),
                                    jax.eval_shape(model.init, jax.random.key(0))["params"])
    tokens = np.array([[4, 0, 2]], np.int32)

    def sigmoid(z):
        return 1 / (1 + np.exp(-z))

    def by_hand(keep):
        h_seq = params["embed"]["kernel"][tokens[0]]  # [3, 8]
        for name in ("lstm1", "lstm2"):
            kernel, bias = params[name]["kernel"].astype(np.float64), params[name]["bias"]
            h, c, out = np.zeros(256), np.zeros(256), []
            for x_t in h_seq:
                z = [np.concatenate([x_t, h]) @ kernel[gate] + bias[gate] for gate in range(4)]
                c = sigmoid(z[2] + 1.0) * c + sigmoid(z[0]) * np.tanh(z[1])
                h = sigmoid(z[3]) * np.tanh(c) * keep[name]
                out.append(h)
            h_seq = np.stack(out)
        return h_seq[-1] @ params["fc"]["kernel"] + params["fc"]["bias"]

    full = {l.name: np.ones(l.num_units, np.float32) for l in model.structure.layers}
    masks = {**full, "lstm1": np.where(np.arange(256) == 3, 0.0, 1.0).astype(np.float32)}
    # the dropped unit's weights (its gate columns, its row read back) take no part
    changed = {**params, "lstm1": {"kernel": params["lstm1"]["kernel"].copy(), "bias": params["lstm1"]["bias"]}}
    changed["lstm1"]["kernel"][:, :, 3] += 5.0
    changed["lstm1"]["kernel"][:, 8 + 3, :] += 5.0

    @jax.jit  # one program (eagerly each operation compiles on its own)
    def forward(params, changed, masks, tokens):
        return (model.apply({"params": params, "batch_stats": {}}, tokens, train=False)[0],
                model.apply({"params": params, "batch_stats": {}, "unit_masks": masks}, tokens, train=False)[0],
                model.apply({"params": changed, "batch_stats": {}, "unit_masks": masks}, tokens, train=False)[0])

    logits, masked, again = forward(params, changed, masks, tokens)
    np.testing.assert_allclose(logits[0], by_hand(full), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(masked[0], by_hand(masks), rtol=2e-4, atol=2e-5)
    assert not np.allclose(masked, logits)
    np.testing.assert_array_equal(again, masked)
