"""A local objective that reads the batch and the model's features (MOON's contrastive term): the features are
what every zoo model's classifier reads, and a step with a feature loss is the step a hand-written loss takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_split
from fedjax_sparse.core.round.local_training import LocalObjective, LocalSGD
from fedjax_sparse.data.federated import normalize
from fedjax_sparse.models import MODEL_NAMES, get_model
from fedjax_sparse.models.check import check_model
from test_models import natural_passes


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_features_are_what_the_classifier_reads(name):
    """logits = features @ W + b, W and b the model's last layer: on every model of the zoo, which also meets the
    check an outside model's structure must pass (`models.check`)."""
    model, variables, x, passes = natural_passes(name)  # the passes the forward test reads, one program
    check_model(model)
    logits, _, features = passes["features"]
    layer = jax.device_get(variables["params"])
    for key in model.structure.layers[-1].kernel[:-1]:
        layer = layer[key]
    assert features.shape == (x.shape[0], layer["kernel"].shape[0])
    np.testing.assert_allclose(features @ layer["kernel"] + layer.get("bias", 0.0), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(passes["eval"][0], logits)


def test_a_step_with_a_feature_loss_is_the_hand_written_steps():
    """One full-batch SGD step of the MLP on cross-entropy + 0.1 mean ||h||^2, h its last hidden layer, written
    here with the model's weights by hand (flatten, two ReLU layers), equals LocalSGD's step with the same
    feature loss; and the loss changes the step (the weights differ from the plain step's)."""
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([8])
    data = split.client(0)
    variables = model.init(jax.random.key(0))
    local = LocalSGD(model, 0.5, 1, 8)

    def feature_loss(trainable, batch, features):
        del trainable
        return 0.1 * jnp.sum(jnp.where(batch.mask[:, None], features ** 2, 0.0)) / jnp.sum(batch.mask)

    @jax.jit  # both steps one program (eagerly each operation compiles on its own)
    def steps(variables, data):
        return (local.train(variables, data, jax.random.key(3), objective=LocalObjective(feature_loss=feature_loss))[0],
                local.train(variables, data, jax.random.key(3))[0])

    trained, plain = steps(variables, data)
    x = normalize(split.x, split.mean, split.std).reshape(8, -1)
    y = split.y

    def by_hand(params):
        h1 = jax.nn.relu(x @ params["fc1"]["kernel"] + params["fc1"]["bias"])
        h2 = jax.nn.relu(h1 @ params["fc2"]["kernel"] + params["fc2"]["bias"])
        logits = h2 @ params["fc3"]["kernel"] + params["fc3"]["bias"]
        task = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))
        return task + 0.1 * jnp.mean(jnp.sum(h2 ** 2, axis=1))

    grads = jax.jit(jax.grad(by_hand))(variables["params"])
    expected = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, variables["params"], grads)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), trained["params"],
                           expected)
    assert not np.allclose(trained["params"]["fc2"]["kernel"], plain["params"]["fc2"]["kernel"])


def test_a_feature_loss_beside_a_step_loss_is_refused():
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([8])
    objective = LocalObjective(feature_loss=lambda t, b, f: 0.0, step_loss=lambda t, s, b, k: (0.0, s))
    with pytest.raises(ValueError, match="feature_loss reads the one forward pass, which its step_loss replaces"):
        LocalSGD(model, 0.5, 1, 8).train(model.init(jax.random.key(0)), split.client(0), jax.random.key(1),
                                         objective=objective)
