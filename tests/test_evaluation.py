"""The evaluators against hand counts: correct predictions and mean loss, padding left out."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.core.evaluation.evaluators import global_evaluator, personalized_evaluator
from fedjax_sparse.data.federated import federated_split
from conftest import LINEAR_CLASSES as CLASSES, linear_model
from fedjax_sparse.models import get_model

FEATURES, MEAN, STD = 4, 0.5, 0.25




def params_of(w, b):
    return {"fc": {"kernel": jnp.asarray(w, jnp.float32), "bias": jnp.asarray(b, jnp.float32)}}


def hand_logits(x_uint8, w, b):
    features = ((x_uint8.astype(np.float64) / 255 - MEAN) / STD).reshape(len(x_uint8), -1)
    return features @ w + b


def hand_losses(logits, y):
    top = logits.max(1)
    return top + np.log(np.exp(logits - top[:, None]).sum(1)) - logits[np.arange(len(y)), y]


def random_problem(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 2, 2, 1), dtype=np.uint8)
    y = rng.integers(0, CLASSES, n).astype(np.int32)
    w = rng.normal(0, 1.0, (FEATURES, CLASSES))
    b = rng.normal(0, 0.5, CLASSES)
    return x, y, w, b


@pytest.mark.parametrize("batch_size", [4, 3, 10, 500])
def test_global_evaluator_counts_only_real_examples(batch_size):
    """10 test examples in batches of 4 or 3 leave padded slots; 10 and 500 leave none."""
    x, y, w, b = random_problem(10, seed=0)
    # The padding is a zero image labelled 0; make the model call it 0, so that a padded slot that
    # counted would add a correct prediction (and a loss) to the totals.
    pad_logits = hand_logits(np.zeros((1, 2, 2, 1), np.uint8), w, b)[0]
    b[0] += pad_logits[1:].max() + 1.0 - pad_logits[0]
    pad_logits = hand_logits(np.zeros((1, 2, 2, 1), np.uint8), w, b)
    assert pad_logits.argmax() == 0
    logits = hand_logits(x, w, b)
    correct = int((logits.argmax(1) == y).sum())
    assert 0 < correct < 10
    losses = hand_losses(logits, y)

    scores = global_evaluator(linear_model(), x, y, [MEAN], [STD], batch_size=batch_size)(
        {"params": params_of(w, b), "batch_stats": {}})
    assert float(scores["accuracy"]) == pytest.approx(correct / 10, abs=1e-7)
    assert float(scores["loss"]) == pytest.approx(losses.mean(), rel=1e-5)
    pads = -(-10 // min(batch_size, 10)) * min(batch_size, 10) - 10
    if pads:  # what counting the padding would have given is far from the result
        pad_loss = hand_losses(pad_logits, np.zeros(1, int))[0]
        assert abs((correct + pads) / 10 - correct / 10) >= 0.1
        assert abs((losses.sum() + pads * pad_loss) / 10 - losses.mean()) > 1e-2


def test_global_evaluator_on_the_digits_mlp_equals_one_unbatched_pass():
    """37 examples in batches of 8 against one forward pass over all 37: 4 full batches, then the 5 left
    in batches of 2, the last of which would run past the arrays and is moved back one example (that
    example, already counted, is left out: counting it twice would move the loss)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.round(digits.images[:37] * 255 / 16).astype(np.uint8)[..., None]
    y = digits.target[:37].astype(np.int32)
    model = get_model("mlp", (8, 8, 1), 10)
    variables = model.init(jax.random.key(3))
    mean, std = [0.3], [0.4]
    logits, _ = model.apply(variables, (jnp.asarray(x, jnp.float32) / 255 - 0.3) / 0.4, train=False)
    logits = np.asarray(logits, np.float64)
    scores = global_evaluator(model, x, y, mean, std, batch_size=8)(variables)
    assert float(scores["accuracy"]) == pytest.approx((logits.argmax(1) == y).sum() / 37, abs=1e-7)
    assert float(scores["loss"]) == pytest.approx(hand_losses(logits, y).mean(), rel=1e-5)


def clients_test_split(counts, seed, shape=(2, 2, 1), classes=CLASSES):
    """Random test images of clients holding `counts` examples: (x, y, client bounds, FederatedSplit)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (sum(counts), *shape), dtype=np.uint8)
    y = rng.integers(0, classes, sum(counts)).astype(np.int32)
    bounds = np.cumsum([0] + counts)
    test = federated_split(x, y, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])], [MEAN] * shape[-1],
                           [STD] * shape[-1])
    return x, y, bounds, test, rng


@pytest.mark.parametrize("client_chunk", [1, 2, None, "auto"])
def test_personalized_evaluator_scores_each_client_on_its_own_test_split(client_chunk):
    """Clients of 5, 1, 9, 3 and 6 test examples, each with its own model (server + client part),
    in batches of 4, one client at a time, in chunks of 2 clients (a remainder of 1) or all at once."""
    counts = [5, 1, 9, 3, 6]
    x, y, bounds, test, rng = clients_test_split(counts, seed=1)
    server_w, server_b = rng.normal(0, 1.0, (FEATURES, CLASSES)), rng.normal(0, 0.5, CLASSES)
    client_w = rng.normal(0, 1.0, (len(counts), FEATURES, CLASSES))
    client_b = rng.normal(0, 0.5, (len(counts), CLASSES))

    def client_variables(server_state, client_state):
        params = jax.tree_util.tree_map(jnp.add, server_state, client_state)
        return {"params": params, "batch_stats": {}}

    evaluate = personalized_evaluator(linear_model(), client_variables, test, batch_size=4,
                                      client_chunk=client_chunk)
    accuracies = np.asarray(evaluate(params_of(server_w, server_b), params_of(client_w, client_b)))

    expected, with_padding = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        right = hand_logits(x[a:b], server_w + client_w[i], server_b + client_b[i]).argmax(1) == y[a:b]
        expected.append(right.sum() / counts[i])
        # padded slots repeat the client's last example; counted up to the largest client, they would give
        with_padding.append((right.sum() + (12 - counts[i]) * right[-1]) / 12)
    assert accuracies.shape == (5,)
    np.testing.assert_allclose(accuracies, expected, atol=1e-7)
    assert len(set(np.round(expected, 6))) > 2  # clients really differ
    assert np.abs(np.asarray(with_padding) - expected).max() > 0.1


class _CountingLinear(nn.Module):
    """The linear model, reporting each batch it scores to the host (how many batches an evaluation runs)."""

    @nn.compact
    def __call__(self, x, train, mask=None, unit_masks=None):
        del train, mask, unit_masks
        jax.debug.callback(lambda: BATCHES.append(1))
        return nn.Dense(CLASSES, name="fc")(x.reshape(x.shape[0], -1))


BATCHES = []


@pytest.mark.parametrize("client_chunk,expected_batches", [(1, 4 + 8), (None, 2 + 3), ("auto", 4 + 8)])
def test_personalized_evaluator_stops_each_client_at_its_own_size(client_chunk, expected_batches):
    """Batches of 4, the rest in batches of 1: one client at a time, clients of 5, 1, 9, 3, 6 examples
    run 1 + 0 + 2 + 0 + 1 = 4 full batches and 1 + 1 + 1 + 3 + 2 = 8 of the rest, 12 batches, none
    padded (one padded batch per client would run 2 + 1 + 3 + 1 + 2 = 9 of 4 with 16 padded slots;
    padding every client to the largest, 5 x 3 = 15); vmapped together, each loop runs as long as its
    longest client needs: 2 full batches and 3 of the rest.
    On a CPU (the suite's platform) the default takes one client at a time even for this tiny model,
    for which training's rule would vmap all five."""
    assert jax.default_backend() == "cpu"
    from fedjax_sparse.models import Model, ModelStructure

    counts = [5, 1, 9, 3, 6]
    x, y, bounds, test, rng = clients_test_split(counts, seed=2)
    model = Model(name="counting", module=_CountingLinear(), input_shape=(2, 2, 1), num_classes=CLASSES,
                  structure=ModelStructure(()))
    w = rng.normal(0, 1.0, (len(counts), FEATURES, CLASSES))
    evaluate = personalized_evaluator(model, lambda server, client: {"params": client, "batch_stats": {}}, test,
                                      batch_size=4, client_chunk=client_chunk)
    BATCHES.clear()
    accuracies = np.asarray(evaluate({}, params_of(w, np.zeros((len(counts), CLASSES)))))
    jax.effects_barrier()
    assert len(BATCHES) == expected_batches
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        right = hand_logits(x[a:b], w[i], np.zeros(CLASSES)).argmax(1) == y[a:b]
        assert accuracies[i] == pytest.approx(right.mean(), abs=1e-7)


def test_personalized_evaluator_on_a_cnn_gives_the_same_accuracies_in_every_layout():
    """cnn2 on 8x8 images, 4 clients with their own convolution kernels: one at a time (the CPU layout)
    and all vmapped (the accelerator layout, a grouped convolution) score alike."""
    counts = [7, 2, 12, 5]
    x, y, bounds, test, _ = clients_test_split(counts, seed=3, shape=(8, 8, 1), classes=10)
    model = get_model("cnn2", (8, 8, 1), 10)
    clients = jax.jit(jax.vmap(model.init))(jax.random.split(jax.random.key(4), len(counts)))
    results = [np.asarray(personalized_evaluator(model, lambda s, c: c, test, batch_size=4, client_chunk=chunk)(
        {}, clients)) for chunk in (1, None)]
    owner = np.repeat(np.arange(len(counts)), counts)
    logits = jax.jit(jax.vmap(lambda v, x: model.apply(v, x[None], train=False)[0][0]))(
        jax.tree_util.tree_map(lambda a: a[owner], clients), (x.astype(np.float32) / 255 - MEAN) / STD)
    right = np.asarray(logits).argmax(1) == y
    expected = [right[a:b].mean() for a, b in zip(bounds, bounds[1:])]
    for got in results:
        np.testing.assert_allclose(got, expected, atol=1e-7)


def test_the_global_batch_holds_about_1e8_multiply_adds_between_125_and_1000_examples():
    """The digits MLP: 64*256 + 256*256 + 256*10 = 84,480 multiply-adds an example, so 1,000 examples
    (84 M) fit; CIFAR's CNNs (tens of millions an example) get the floor of 125; a test set smaller
    than the batch is one batch; the rule's bound moves the choice."""
    from fedjax_sparse.core.evaluation.evaluators import default_global_batch

    mlp = get_model("mlp", (8, 8, 1), 10)
    assert default_global_batch(mlp, 10_000) == 1000
    assert default_global_batch(mlp, 360) == 360
    assert default_global_batch(mlp, 10_000, max_batch_flops=84_480 * 999) == 500
    assert default_global_batch(mlp, 10_000, max_batch_flops=84_480 * 250) == 250
    for name in ("spafl_cnn", "resnet20", "cnn4"):
        assert default_global_batch(get_model(name, (32, 32, 3), 10), 10_000) == 125
