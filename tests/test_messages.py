"""Bytes are derived from the messages: hand-computed and analytic counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import fedavg, fednova, local_only, scaffold
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import SparseArray, index_itemsize, message_bytes, unit_sparse
from fedjax_sparse.core.round.step import build_round
from fedjax_sparse.models import Layer, ModelStructure, get_model


def test_dense_leaves_cost_size_times_itemsize():
    message = {"w": jnp.zeros((3, 4), jnp.float32), "b": jnp.zeros(5, jnp.bfloat16), "n": jnp.zeros((), jnp.int32)}
    assert int(message_bytes(message)) == 12 * 4 + 5 * 2 + 4


def test_sparse_leaves_cost_values_plus_cheaper_index_encoding():
    mask = np.zeros(1000, bool)
    mask[:10] = True
    few = SparseArray(values=jnp.ones(1000), mask=jnp.asarray(mask))
    # 10 float32 values + an index list of 10 two-byte indices (bitmask would be 125 bytes).
    assert int(message_bytes(few)) == 10 * 4 + 10 * 2
    many = SparseArray(values=jnp.ones(1000), mask=jnp.asarray(np.arange(1000) < 900))
    # 900 values + a 125-byte bitmask (an index list would be 1800 bytes).
    assert int(message_bytes(many)) == 900 * 4 + 125
    assert int(jax.jit(message_bytes)({"s": few, "d": jnp.zeros(3)})) == 60 + 12
    # A leaf sent whole goes dense (no index); a leaf not sent costs nothing.
    assert int(message_bytes(SparseArray(values=jnp.ones(1000), mask=jnp.ones(1000, bool)))) == 4000
    assert int(message_bytes(SparseArray(values=jnp.ones(1000), mask=jnp.zeros(1000, bool)))) == 0
    # 990 of 1000: values + bitmask (3960 + 125) exceed the dense 4000 bytes.
    assert int(message_bytes(SparseArray(values=jnp.ones(1000), mask=jnp.arange(1000) < 990))) == 4000
    assert [index_itemsize(n) for n in (256, 257, 65536, 65537)] == [1, 2, 2, 4]


def test_unit_structured_leaves_pay_their_layers_unit_index_once():
    """Three dense layers by hand: a (3 -> 20, bias, a norm with scale, bias, mean, var), b (20 -> 300,
    no bias), c (300 -> 2). Each layer pays the cheaper of a bitmask over its units and a list of
    kept unit ids once, plus the kept values of all its leaves, unless its leaves priced one by one
    (entry index or dense) are cheaper."""
    structure = ModelStructure((
        Layer("a", "dense", ("a", "kernel"), ("a", "bias"), ("bn",), 20, 3, ("input",)),
        Layer("b", "dense", ("b", "kernel"), None, None, 300, 20, ("a",)),
        Layer("c", "dense", ("c", "kernel"), None, None, 2, 300, ("b",))))
    variables = {"params": {"a": {"kernel": jnp.ones((3, 20)), "bias": jnp.ones(20)},
                            "bn": {"scale": jnp.ones(20), "bias": jnp.ones(20)},
                            "b": {"kernel": jnp.ones((20, 300))}, "c": {"kernel": jnp.ones((300, 2))}},
                 "batch_stats": {"bn": {"mean": jnp.zeros(20), "var": jnp.ones(20)}}}
    masks = {"a": jnp.arange(20) < 5, "b": jnp.arange(300) < 3, "c": jnp.ones(2)}
    price = jax.jit(lambda variables, masks: message_bytes(unit_sparse(structure, variables, masks)))
    # a: 5 of 20 units: 3 inputs x 5 + 5 x (bias, scale, bias, mean, var) = 40 values, and a 3-byte
    #    bitmask (5 one-byte ids would be 5) once: 163. Its six leaves on their own would pay 183.
    # b: 3 of 300 units reading a's 5: 15 values and 3 two-byte ids (the bitmask is 38 bytes): 66.
    # c: both units reading b's 3: 6 values and a 1-byte bitmask: 25 (per entry: 24 + 12 = 36).
    assert int(price(variables, masks)) == 163 + 66 + 25
    # Every unit kept: each leaf goes dense, no index at all.
    assert int(price(variables, {k: jnp.ones_like(m) for k, m in masks.items()})) == 4 * (60 + 5 * 20 + 6000 + 600)


def test_sparse_array_dense_view_zeroes_unsent_entries():
    s = SparseArray(values=jnp.array([1.0, 2.0, 3.0]), mask=jnp.array([True, False, True]))
    np.testing.assert_array_equal(s.dense(), [1.0, 0.0, 3.0])


@pytest.mark.parametrize("name,up_factor,down_factor,extra_up", [
    ("fedavg", 1, 1, 0), ("scaffold", 2, 2, 0), ("fednova", 1, 1, 4), ("local", 0, 0, 0)])
def test_round_bytes_equal_analytic_counts(make_split, name, up_factor, down_factor, extra_up):
    model = get_model("mlp", (8, 8, 1), 10)
    num_params = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    local = LocalSGD(model, 0.1, 1, 8)
    algorithm = {"fedavg": fedavg(local), "scaffold": scaffold(local, 5), "fednova": fednova(local),
                 "local": local_only(local)}[name]
    split = make_split([8, 9, 10, 11, 12])
    server, clients = algorithm.init(jax.random.key(0), model.init(jax.random.key(1)), 5)
    _, _, out = build_round(algorithm, split, 3, seed=0)(server, clients, 0)
    np.testing.assert_array_equal(out.uplink_bytes, [up_factor * num_params * 4 + extra_up] * 3)
    np.testing.assert_array_equal(out.downlink_bytes, [down_factor * num_params * 4] * 3)


def test_masked_mean_weights_only_the_senders_and_keeps_the_rest():
    from fedjax_sparse.core.messages.aggregation import masked_mean
    x = jnp.array([[1.0, 2.0, 3.0], [5.0, 6.0, 7.0], [9.0, 10.0, 11.0]])
    m = jnp.array([[True, True, False], [True, False, False], [False, True, False]])
    w = jnp.array([1.0, 3.0, 4.0])
    out = masked_mean({"a": x}, {"a": m}, w, {"a": jnp.array([-1.0, -1.0, -1.0])})
    # entry 0: (1*1 + 3*5) / 4; entry 1: (1*2 + 4*10) / 5; entry 2: nobody sent it.
    np.testing.assert_allclose(out["a"], [4.0, 8.4, -1.0], rtol=1e-6)
