"""A model's structure checked against the model itself, before a run trusts it (the zoo's and outside ones).

Everything structural the library computes (sub-models, unit masks, FLOPs, bytes, SpaFL's thresholds, FedLDF's
layers, the representation MOON reads) reads `Model.structure`; a structure that misnames a kernel or miscounts
its units would be wrong silently. `check_model` builds the model on shapes and refuses, in one line naming the
model, the layer and what it found (a layer consuming one the structure lacks is refused by `ModelStructure`
itself):
  * a layer whose kernel, bias or normalization is not where the structure says, or whose kernel's last axis
    is not its `num_units`;
  * logits not shaped [batch, num_classes];
  * a last layer that is not the classifier (the logits must be its output: `Model.apply(features=True)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.models.structure import Model


def _at(tree, path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def check_model(model: Model) -> None:
    """Raises ValueError at the model's first inconsistency (the module docstring)."""
    name = model.name
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    params = shapes["params"]
    for layer in model.structure.layers:
        kernel = _at(params, layer.kernel)
        where = f"model {name!r}, layer {layer.name!r}"
        if kernel is None:
            raise ValueError(f"{where}: no kernel at params/{'/'.join(layer.kernel)}; the structure must name "
                             f"where each layer's kernel is")
        if kernel.shape[-1] != layer.num_units:
            raise ValueError(f"{where}: its kernel {list(kernel.shape)} has {kernel.shape[-1]} units on its last "
                             f"axis, the structure says {layer.num_units}")
        if layer.bias is not None and _at(params, layer.bias) is None:
            raise ValueError(f"{where}: no bias at params/{'/'.join(layer.bias)}")
        if layer.norm is not None and _at(params, layer.norm) is None and _at(shapes["batch_stats"], layer.norm) is None:
            raise ValueError(f"{where}: no normalization at {'/'.join(layer.norm)}")
    x = (jnp.zeros((2, *model.input_shape), jnp.int32) if model.input_kind == "tokens"
         else jnp.zeros((2, *model.input_shape), jnp.float32))
    # compiled: eagerly, Flax compiles every operation of the initialization and the pass on its own (seconds
    # for a large model, at every build of an outside model)
    variables = jax.jit(model.init)(jax.random.key(0))
    logits, _, features = jax.jit(lambda v, x: model.apply(v, x, train=False, features=True))(
        variables, x + 1 if model.input_kind == "tokens" else x + 0.5)
    if logits.shape != (2, model.num_classes):
        raise ValueError(f"model {name!r}: its logits are {list(logits.shape)} for a batch of 2, not "
                         f"[2, {model.num_classes}]")
    last = model.structure.layers[-1]
    classifier = _at(variables["params"], last.kernel[:-1])
    expected = features @ classifier[last.kernel[-1]] + (classifier.get("bias", 0.0) if isinstance(classifier, dict)
                                                         else 0.0)
    if expected.shape != logits.shape or not np.allclose(expected, logits, rtol=1e-4, atol=1e-4):
        raise ValueError(f"model {name!r}: its logits are not the output of its last layer {last.name!r}; the "
                         f"structure must end with the classifier")
