"""The structure description every model carries.

Sparse federated methods talk about *units*: the filters of a convolution, the
neurons of a dense layer. SpaFL puts a threshold on each, FedGSE/HeteroFL keep a
subset of them, SPATL uploads the salient ones, FedLDF moves whole layers. All
of them are written against this one description instead of against a model.

Conventions (Flax): a kernel's output units are its last axis (`Dense`:
`[in, out]`, `Conv`: `[kh, kw, in, out]`) and its input units the one before.
Paths are tuples of keys into the `params` collection; a normalization path
names a module whose `scale`/`bias` live in `params` and whose `mean`/`var`
live in `batch_stats`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

Params = Any
Variables = dict  # {'params': ..., 'batch_stats': ...}; batch_stats may be {}
Path = tuple[str, ...]

Part = Literal["encoder", "predictor", "private", "shared"]


@dataclasses.dataclass(frozen=True)
class Layer:
    """One prunable layer: a convolution, dense or LSTM kernel and what belongs to its units.

    Attributes:
      name: unique name, also the FedLDF layer name.
      kind: 'conv', 'dense' or 'lstm' (a recurrent layer, `models.recurrent`: kernel
        [4 gates, consumed units + its own units, units], its input axis holding the units it
        consumes and then its own, fed back from the previous step).
      kernel: path of the kernel in `params`.
      bias: path of the bias, or None.
      norm: path of the normalization applied to this layer's outputs, or None.
      num_units: output units (filters or neurons) = kernel.shape[-1].
      fan_in: weights feeding one unit = prod(kernel.shape[:-1]) (SpaFL's n_i).
      inputs_from: names of the layers whose units this layer consumes ('input'
        for the data). Several names mean their outputs were added (residual).
      input_repeat: how many input positions each consumed unit occupies in
        this layer's input axis (a dense layer after flattening an HxWxC map
        sees each channel H*W times, channel-fastest as Flax flattens NHWC).
      unit_group: layers whose outputs are summed by a residual connection
        share a group name and must keep the same units; None if untied.
      part: 'encoder' / 'predictor' where a paper splits the model (SPATL),
        'private' for layers a paper keeps on the client, else 'shared'.
      output_hw: spatial size (H*W) of the output map for a conv, 1 for dense (the steps
        of a sequence it runs at), the sequence's steps for an LSTM (its kernel runs once a
        step); used for FLOP counts.
      norm_units_from: where `norm` normalizes a residual sum rather than this
        layer's output alone (pre-activation ResNets), the layers summed into it
        (this one included): a normalization channel is then used while any of
        them keeps the unit. Empty: it follows this layer's units.
    """

    name: str
    kind: Literal["conv", "dense", "lstm"]
    kernel: Path
    bias: Path | None
    norm: Path | None
    num_units: int
    fan_in: int
    inputs_from: tuple[str, ...]
    input_repeat: int = 1
    unit_group: str | None = None
    part: Part = "shared"
    output_hw: int = 1
    norm_units_from: tuple[str, ...] = ()

    @property
    def num_weights(self) -> int:
        return self.num_units * self.fan_in

    @property
    def consumed_width(self) -> int:
        """Width of the consumed part of the kernel's input axis: what an LSTM reads besides its own units."""
        return self.fan_in // 4 - self.num_units


@dataclasses.dataclass(frozen=True)
class ModelStructure:
    """Ordered prunable layers of a model, input to output."""

    layers: tuple[Layer, ...]

    def __post_init__(self):
        names = [l.name for l in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        known = set(names) | {"input"}
        widths = {l.name: l.num_units for l in self.layers}
        for layer in self.layers:
            missing = [n for n in layer.inputs_from if n not in known]
            if missing:
                raise ValueError(f"layer {layer.name!r} consumes unknown layers {missing}")
            followed = layer.norm_units_from
            if followed and (layer.norm is None or layer.name not in followed
                             or any(widths.get(n) != layer.num_units for n in followed)):
                raise ValueError(f"layer {layer.name!r}: norm_units_from {followed} must name layers of "
                                 f"{layer.num_units} units, itself included, and the layer needs a norm")

    def __getitem__(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer {name!r}; layers are {[l.name for l in self.layers]}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(l.name for l in self.layers)

    @property
    def num_units(self) -> int:
        return sum(l.num_units for l in self.layers)

    @property
    def num_prunable_weights(self) -> int:
        return sum(l.num_weights for l in self.layers)

    def consumers(self, name: str) -> tuple[Layer, ...]:
        return tuple(l for l in self.layers if name in l.inputs_from)

    def part(self, part: Part) -> tuple[Layer, ...]:
        return tuple(l for l in self.layers if l.part == part)


def get_path(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: Path, value: Any) -> dict:
    """Returns a copy of nested dict `tree` with `path` replaced (no mutation)."""
    if not path:
        return value
    head, *rest = path
    new = dict(tree)
    new[head] = set_path(tree[head], tuple(rest), value)
    return new


@dataclasses.dataclass(frozen=True)
class Model:
    """A Flax module used as pure functions, with its structure description.

    `init(key) -> variables` and `apply(variables, x, train, mask) -> (logits,
    batch_stats)`; `x` is float32 NHWC images or [B, features] vectors, or, for a model whose
    `input_kind` is 'tokens', int32 [B, T] token sequences. BatchNorm statistics are explicit state
    in `variables['batch_stats']` (an empty dict for models without them) and
    `mask` ([B] bool) keeps padded examples out of the batch statistics.
    `variables` may also hold `'unit_masks'` ({layer: [units]}): the sub-model
    the forward pass runs, each mask multiplying its layer's unit outputs
    (`layers.unit_output`, `core.structure.unit_masks`).

    `compute_dtype` is the dtype the forward and backward passes compute in ('float32' or
    'bfloat16', `--compute-dtype`): mixed precision, as Micikevicius et al. (2018) and JAX's own
    `jmp` define it. `apply` casts the floating parameters, unit masks, perturbations and inputs
    to it, so every convolution and matrix product runs in it, and returns float32 logits and
    features; the caller's variables stay float32 (the master weights the optimizer steps, whose
    gradients arrive in float32 through the cast), and BatchNorm computes its statistics and keeps
    its running averages in float32 (`layers.MaskedBatchNorm`). Everything outside `apply` -- the
    loss, optimizer states, thresholds, masks, messages, aggregation, server state -- never sees
    the compute dtype.
    """

    name: str
    module: Any
    input_shape: tuple[int, ...]
    num_classes: int
    structure: ModelStructure
    description: str = ""
    input_kind: Literal["numbers", "tokens"] = "numbers"
    compute_dtype: str = "float32"

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"--compute-dtype {self.compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")

    def init(self, key: jax.Array) -> Variables:
        x = jnp.zeros((1, *self.input_shape), jnp.int32 if self.input_kind == "tokens" else jnp.float32)
        variables = self.module.init(key, x, train=False)
        return {"params": variables["params"], "batch_stats": variables.get("batch_stats", {})}

    def apply(self, variables: Variables, x: jax.Array, *, train: bool, mask: jax.Array | None = None,
              perturbations: Any = None, features: bool = False) -> tuple[jax.Array, ...]:
        """(logits, batch_stats), and with `features` the representation the predictor reads, [B, d]: the
        input of the model's last layer (its classifier), flattened per example (MOON's contrastive loss,
        `LocalObjective.feature_loss`)."""
        if features:
            return self._with_features(variables, x, train=train, mask=mask, perturbations=perturbations)
        compute = in_compute_dtype(self.compute_dtype)
        inputs = {"params": compute(variables["params"])}
        has_stats = bool(jax.tree_util.tree_leaves(variables["batch_stats"]))
        if has_stats:
            inputs["batch_stats"] = variables["batch_stats"]  # float32: BatchNorm's statistics
        if perturbations is not None:
            inputs["perturbations"] = compute(perturbations)
        unit_masks = variables.get("unit_masks")
        kwargs = {"mask": mask, "unit_masks": None if unit_masks is None else compute(unit_masks)}
        x = compute(x)
        if train and has_stats:
            logits, updates = self.module.apply(inputs, x, train=True, mutable=["batch_stats"], **kwargs)
            return logits.astype(jnp.float32), updates["batch_stats"]
        logits = self.module.apply(inputs, x, train=train, **kwargs)
        return logits.astype(jnp.float32), variables["batch_stats"]

    def _with_features(self, variables, x, **kwargs):
        # the classifier is every model's last layer; its input, read as the module is called
        classifier = self.structure.layers[-1].kernel[:-1]
        seen = []

        def read_input(call, args, call_kwargs, context):
            if context.method_name == "__call__" and tuple(context.module.path) == classifier:
                seen.append(args[0])
            return call(*args, **call_kwargs)

        with nn.intercept_methods(read_input):
            logits, stats = self.apply(variables, x, **kwargs)
        if len(seen) != 1:
            raise ValueError(f"{self.name}: its classifier {'/'.join(classifier)} was called {len(seen)} times in a "
                             f"forward pass; features=True reads the input of one call")
        return logits, stats, seen[0].reshape(seen[0].shape[0], -1).astype(jnp.float32)

    def unit_output_gradients(self, variables: Variables, x: jax.Array, loss: Callable[[jax.Array], jax.Array],
                              *, train: bool, mask: jax.Array | None = None) -> dict[str, jax.Array]:
        """{layer: dL/dh}: the gradient of `loss(logits)` at every layer's unit outputs h
        (the points `layers.unit_output` marks), each shaped like h ([B, ..., units])."""
        shapes = jax.eval_shape(lambda: self.module.init(jax.random.key(0), x, train=False))["perturbations"]
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        grads = jax.grad(lambda p: loss(self.apply(variables, x, train=train, mask=mask, perturbations=p)[0]))(zeros)
        return {l.name: get_path(grads, l.kernel[:-2] + (l.kernel[-2] + "_out",)) for l in self.structure.layers}

    def num_params(self, variables: Variables) -> int:
        return sum(math.prod(a.shape) for a in jax.tree_util.tree_leaves(variables["params"]))


ModelFactory = Callable[[tuple[int, ...], int], Model]

COMPUTE_DTYPES = ("float32", "bfloat16")


def in_compute_dtype(dtype: str) -> Callable[[Any], Any]:
    """tree -> the tree with its floating leaves cast to `dtype` (integer and boolean leaves as they are)."""
    target = jnp.dtype(dtype)

    def cast(tree):
        return jax.tree_util.tree_map(
            lambda a: jnp.asarray(a).astype(target) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a,
            tree)

    return cast
