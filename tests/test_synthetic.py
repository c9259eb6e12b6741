"""FedProx's Synthetic(alpha, beta), generated client by client: its statistics against the generative
process, determinism, each process generating only its own clients, and the device store's materialized
population training exactly as the host store's generated one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedjax_sparse import data
from fedjax_sparse.data.process_layout import ProcessLayout
from fedjax_sparse.data.synthetic import FEATURES, Synthetic


def test_client_sizes_follow_the_power_law_capped_and_split_as_leaf_splits():
    sizes = Synthetic(1.0, 1.0, 0, 20_000).sizes
    assert sizes.min() >= 50 and sizes.max() == 1000
    # floor(lognormal(4, 2)) + 50: median floor(e^4) + 50 = 104; P(capped) = P(Z > (ln 950 - 4) / 2) = 0.0766
    assert 101 <= np.median(sizes) <= 108
    assert abs(np.mean(sizes == 1000) - 0.0766) < 0.01
    population = Synthetic(1.0, 1.0, 0, 300)
    train, test = population.counts["train"], population.counts["test"]
    np.testing.assert_array_equal(train, np.floor(0.9 * population.sizes).astype(int))  # n >= 50: int(0.9 n)
    np.testing.assert_array_equal(train + test, population.sizes)
    x, y = population.examples(7, "test")
    assert x.shape == (test[7], FEATURES) and x.dtype == np.float32 and y.dtype == np.int32


def test_features_have_the_stated_covariance_and_beta_spreads_the_clients():
    # within a client, feature j varies around v_j with variance j^-1.2
    population = Synthetic(0.0, 0.0, 1, 400)
    big = int(np.argmax(population.sizes))
    x = np.concatenate([population.examples(big, split)[0] for split in ("train", "test")])
    assert len(x) == 1000
    np.testing.assert_allclose(x.var(axis=0), np.arange(1, FEATURES + 1) ** -1.2, rtol=0.25)
    # across clients the mean feature is B_k + N(0, 1/60) noise: its spread is beta (plus 0.13)
    for beta, low, high in ((0.0, 0.08, 0.2), (1.0, 0.8, 1.25)):
        pop = Synthetic(0.0, beta, 2, 300)
        means = [pop.client_model(k)[2].mean() for k in range(300)]
        assert low < np.std(means) < high, (beta, np.std(means))


def test_alpha_shifts_every_class_alike_so_labels_do_not_depend_on_it():
    """W_k and b_k ~ N(u_k, 1) move every class's score by u_k (x.1 + 1): the argmax, the label, is the
    same for every alpha, in FedProx's code as here (module docstring). The scores themselves do move."""
    a, b = Synthetic(0.0, 1.0, 3, 20), Synthetic(5.0, 1.0, 3, 20)
    for k in range(20):
        np.testing.assert_array_equal(a.examples(k, "train")[1], b.examples(k, "train")[1])
        assert not np.allclose(a.client_model(k)[0], b.client_model(k)[0])
    labels = np.concatenate([a.examples(k, "train")[1] for k in range(20)])
    per_client = [len(np.unique(a.examples(k, "train")[1])) for k in range(20)]
    assert len(np.unique(labels)) >= 8 and min(per_client) < 10  # heterogeneous clients, all classes overall


def test_a_population_is_a_pure_function_of_the_seed_and_each_process_makes_its_own_clients():
    population = Synthetic(0.5, 0.5, [7, 11], 1_000_000)
    assert math.isclose(population.sizes.mean(), 237, rel_tol=0.05)  # every size, without any example
    ids = np.array([999_999, 4, 17, 123_456, 4])
    whole = population.windows("train").windows(ids)
    again = Synthetic(0.5, 0.5, [7, 11], 1_000_000).windows("train").windows(ids)
    np.testing.assert_array_equal(whole.x, again.x)
    generated = []
    parts = []
    for p in range(2):
        windows = population.windows("train", ProcessLayout(p, 2))
        original = population.examples
        population_calls = []

        def counted(client, split, original=original, calls=population_calls):
            calls.append(client)
            return original(client, split)

        object.__setattr__(windows, "population", _Spy(population, counted))
        parts.append(windows.windows(ids))
        generated.append(sorted(population_calls))
    assert generated == [[4, 4, 123_456], [17, 999_999]]  # id % 2 == p, and nothing else
    m = population.counts["train"].max()
    for k, client in enumerate(ids):
        own, other = parts[client % 2], parts[1 - client % 2]
        np.testing.assert_array_equal(own.x[k * m:(k + 1) * m], whole.x[k * m:(k + 1) * m])
        assert not other.x[k * m:(k + 1) * m].any() and other.counts[k] == 0
    np.testing.assert_array_equal(np.maximum(parts[0].counts, parts[1].counts), whole.counts)
    assert Synthetic(0.5, 0.5, [7, 12], 10).examples(0, "train")[0].tolist() != \
        Synthetic(0.5, 0.5, [7, 11], 10).examples(0, "train")[0].tolist()


class _Spy:
    """A population whose `examples` is replaced (to count which clients a process generates)."""

    def __init__(self, population, examples):
        self._population, self.examples = population, examples

    def __getattr__(self, name):
        return getattr(self._population, name)


def test_bad_specs_are_one_line():
    for spec, fragment in (("synthetic:1", "synthetic:ALPHA,BETA with two numbers"),
                           ("synthetic:-1,1", "must be finite and >= 0")):
        with pytest.raises(data.DataError, match=fragment):
            data.load_dataset(spec, num_clients=3)


def test_the_device_store_trains_the_generated_clients_exactly_as_the_host_store(tmp_path):
    """Materialized on the device or generated per sampled client on the host: the same rounds and the
    same evaluation (global test: every client's test examples, 30 clients <= 1,000)."""
    import jax

    from fedjax_sparse.run import RunConfig, build_experiment, evaluate

    config = RunConfig.create(dataset="synthetic:1,1", algorithm="scaffold", num_clients=30, clients_per_round=4,
                              local_epochs=1, seed=5, out=str(tmp_path / "run"))
    results = []
    for store in ("device", "host"):
        exp = build_experiment(config.replace(client_store=store), progress=False)
        try:
            server, out = exp.round_fn(exp.server_state, 0, prefetch_next=False)
            results.append((np.asarray(out.metrics["loss"]), jax.device_get(server), evaluate(exp, server)[0]))
        finally:
            exp.close()
    (loss_d, server_d, figures_d), (loss_h, server_h, figures_h) = results
    np.testing.assert_array_equal(loss_d, loss_h)
    for a, b in zip(jax.tree_util.tree_leaves(server_d), jax.tree_util.tree_leaves(server_h)):
        np.testing.assert_array_equal(a, b)
    assert figures_d == figures_h
    population = exp.dataset
    assert len(population.global_test[1]) == population.counts["test"].sum()


def test_normalize_standardizes_images_only():
    """What a model sees: uint8 images as (x / 255 - mean) / std, float features and int tokens as they are."""
    import jax.numpy as jnp

    from fedjax_sparse.data.federated import normalize

    mean, std = jnp.asarray([0.5]), jnp.asarray([0.25])
    images = jnp.asarray([[[[0], [255]]]], jnp.uint8)
    np.testing.assert_allclose(normalize(images, mean, std), [[[[-2.0], [2.0]]]])
    features = jnp.asarray([[-1.5, 2.0]], jnp.float32)
    tokens = jnp.asarray([[3, 79]], jnp.int32)
    for x in (features, tokens):
        out = normalize(x, jnp.zeros(0), jnp.zeros(0))
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(out, x)
    with pytest.raises(ValueError, match="uint8 images, float32 features or int32 tokens, got float64"):
        data.Dataset("d", np.zeros((2, 3)), np.zeros(2, np.int32), np.zeros((1, 3)), np.zeros(1, np.int32), 2,
                     ("a", "b"), (), ())
