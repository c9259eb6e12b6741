"""The algorithm contract is checked on shapes before the first round: every shipped algorithm passes, and each
mistake an author can make gets one line naming the function and the leaf, not a JAX traceback."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from conftest import synthetic_split
from fedjax_sparse.algorithms import BUILT_IN, fedavg, make_algorithm, make_options
from fedjax_sparse.algorithms.personalization import PersonalizationOptions, personalize
from fedjax_sparse.core.contract.algorithm import BuildContext, PrivateSum
from fedjax_sparse.core.contract.check import ContractError, check_contract
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map


@pytest.fixture(scope="module")
def setting():
    model = get_model("mlp", (8, 8, 1), 10)
    split = synthetic_split([10, 12, 8, 9])
    local = LocalSGD(model, 0.1, 1, 8)
    context = BuildContext(local=local, num_clients=4, clients_per_round=2, train=split, num_classes=10,
                           labels_per_client=2)
    return model, split, local, context, jax.eval_shape(model.init, jax.random.key(0))


def test_every_shipped_algorithm_meets_the_contract(setting):
    model, split, _, context, variables = setting
    for name in sorted(BUILT_IN):  # an installed plug-in's is checked before its first round
        check_contract(make_algorithm(name, context, make_options(name, {"clients_per_layer": 1})), variables, 4, 2,
                       split)


def with_state(base, **changes):
    """FedAvg keeping a per-client counter, so that its client state can go wrong."""
    def init_clients(key, variables, ids):
        return {"count": jnp.zeros((len(ids),), jnp.int32)}

    def init(key, variables, n):
        return base.init(key, variables, n)[0], init_clients(key, variables, jnp.arange(n))

    def client_update(down, state, data, key, info):
        up, _, metrics = base.client_update(down, {}, data, key, info)
        return up, {"count": state["count"] + 1}, metrics

    return dataclasses.replace(base, init=init, init_clients=init_clients, client_update=client_update,
                               **{k: v(base) if callable(v) and k.endswith("_factory") else v for k, v in changes.items()})


@pytest.mark.parametrize("mistake,words", [
    ("client state shape", "client_update (tests/test_contract.py:LINE) returns a client state whose leaf count is "
                           "float32[3], init's is int32[]"),
    ("client state key", "client_update (tests/test_contract.py:LINE) returns a client state with a leaf extra "
                         "(int32[]) that init's has not"),
    ("no loss", "client_update (tests/test_contract.py:LINE)'s metrics lack 'loss' (they hold ['num_steps'])"),
    ("server state key", "server_update (tests/test_contract.py:LINE) returns a server state with a leaf round "
                         "(int32[]) that init's has not"),
    ("not a message", "broadcast or client_update returns a leaf that is not an array: client_update/message/note is a str"),
    ("object in message", "broadcast or client_update returns a leaf that is not an array: client_update/message/tag is a Marker"),
])
def test_each_mistake_is_one_line_naming_the_function_and_the_leaf(setting, mistake, words):
    model, split, local, context, variables = setting
    base = with_state(fedavg(local))

    def client_update(down, state, data, key, info):
        up, new, metrics = base.client_update(down, state, data, key, info)
        if mistake == "client state shape":
            new = {"count": jnp.zeros((3,), jnp.float32)}
        elif mistake == "client state key":
            new = {**new, "extra": jnp.zeros((), jnp.int32)}
        elif mistake == "no loss":
            metrics = {"num_steps": metrics["num_steps"]}
        elif mistake == "not a message":
            up = {"model": up, "note": "a string"}
        elif mistake == "object in message":
            up = {"model": up, "tag": Marker()}
        return up, new, metrics

    def server_update(server_state, ups, weights, info):
        if mistake in ("not a message", "object in message"):
            ups = ups["model"]
        new = base.server_update(server_state, ups, weights, info)
        return {**new, "round": info.index} if mistake == "server state key" else new

    broken = dataclasses.replace(base, client_update=client_update, server_update=server_update)
    with pytest.raises(ContractError) as caught:
        check_contract(broken, variables, 4, 2, split)
    message = str(caught.value)
    line = (client_update if words.startswith("client_update") else server_update).__code__.co_firstlineno
    assert words.replace("LINE", str(line)) in message and "\n" not in message and message.startswith("fedavg: ")


class Marker:
    """An object that is no array: it cannot travel in a message."""


def test_a_server_update_that_cannot_take_a_participation_mask_is_refused_where_participation_varies(setting):
    model, split, local, context, variables = setting
    base = fedavg(local)

    def server_update(server_state, ups, weights, info):  # written for fixed participation only
        assert info.participating is None, "no mask expected"
        return base.server_update(server_state, ups, weights, info)

    fixed_only = dataclasses.replace(base, server_update=server_update)
    check_contract(fixed_only, variables, 4, 2, split)
    with pytest.raises(ContractError, match="server_update with RoundInfo.participating a \\[K\\] bool mask"):
        check_contract(fixed_only, variables, 4, 2, split, varies=True)
    for name in sorted(BUILT_IN):  # every shipped algorithm takes the mask
        check_contract(make_algorithm(name, context, make_options(name, {"clients_per_layer": 1})), variables, 4, 2,
                       split, varies=True)


def test_a_server_step_may_report_metrics_and_the_run_logs_them(setting, tmp_path, monkeypatch):
    """FedExP-style: a server update returning ServerStep(state, metrics) has them logged every evaluated round as
    server_<name>; here the clients it aggregated (K = 2) and the norm of the step it took; the run's other
    figures are FedAvg's."""
    from fedjax_sparse.algorithms import registry  # noqa: PLC0415
    from fedjax_sparse.algorithms.fedavg import FedAvgOptions  # noqa: PLC0415
    from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, ServerStep  # noqa: PLC0415
    from fedjax_sparse.run import RunConfig, run_experiment  # noqa: PLC0415
    import json  # noqa: PLC0415

    def build(context, options):
        base = fedavg(context.local)

        def server_update(server_state, ups, weights, info):
            new = base.server_update(server_state, ups, weights, info)
            moved = jnp.sqrt(sum(jnp.sum(jnp.square(a - b)) for a, b in zip(
                jax.tree_util.tree_leaves(new["variables"]["params"]),
                jax.tree_util.tree_leaves(server_state["variables"]["params"]))))
            return ServerStep(new, {"clients": jnp.sum(weights > 0).astype(jnp.float32), "step_norm": moved})

        return dataclasses.replace(base, name="fedavg_reporting", server_update=server_update)

    monkeypatch.setitem(registry.ALGORITHMS, "fedavg_reporting", AlgorithmSpec("fedavg_reporting", FedAvgOptions,
                                                                               build))
    config = RunConfig.create(algorithm="fedavg_reporting", rounds=2, num_clients=4, clients_per_round=2,
                              local_epochs=1, max_train_examples=200, max_test_examples=100, tensorboard=False,
                              out=str(tmp_path / "run"))
    run_experiment(config, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["server_clients"] for r in rows] == [2.0, 2.0]
    assert all(r["server_step_norm"] > 0 for r in rows)
    plain = RunConfig.create(**{**config.to_dict(), "algorithm": "fedavg", "out": str(tmp_path / "plain")})
    run_experiment(plain, progress=False)
    same = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in same]  # metrics change no figure


def test_a_step_metric_that_is_not_a_scalar_is_refused(setting):
    model, split, local, context, variables = setting
    from fedjax_sparse.core.contract.algorithm import ServerStep  # noqa: PLC0415
    base = fedavg(local)
    bad = dataclasses.replace(base, server_update=lambda s, u, w, i: ServerStep(base.server_update(s, u, w, i),
                                                                                {"per_client": w}))
    with pytest.raises(ContractError, match="server_update's step metric 'per_client' is float32\\[2\\]"):
        check_contract(bad, variables, 4, 2, split)


@pytest.mark.parametrize("declared,words", [
    (PrivateSum(sensitivity=0.0), "PrivateSum.sensitivity must be a positive number of clip norms, got 0.0"),
    (PrivateSum(replace_sensitivity=float("inf")), "PrivateSum.replace_sensitivity must be a positive number"),
    (PrivateSum(denominator=3), "PrivateSum.denominator must be None or a count of uploads from 1 to the round's "
                                "2 slots, got 3"),
    (PrivateSum(feedback=("divergence",)), "PrivateSum.feedback names 'divergence', which is no upload leaf"),
    (PrivateSum(clip_layers=(("params/fc9/kernel", "fc9"),)),
     "PrivateSum.clip_layers names 'params/fc9/kernel', which is no upload leaf"),
    (PrivateSum(clip_layers=(("params/fc1/kernel", "fc1"),)),
     "PrivateSum.clip_layers gives the upload's params/fc1/bias no clipping layer"),
])
def test_a_private_sum_that_cannot_describe_the_upload_is_refused(setting, declared, words):
    """An outside algorithm's `PrivateSum` is checked against its upload before round 1, with or without
    privacy, in one line; a declaration that fits passes (FedLDF's and SCAFFOLD's, above)."""
    model, split, local, context, variables = setting
    with pytest.raises(ContractError) as caught:
        check_contract(dataclasses.replace(fedavg(local), private_sum=declared), variables, 4, 2, split)
    message = str(caught.value)
    assert words in message and "\n" not in message and message.startswith("fedavg: ")
    layers = tuple((f"params/{layer}/{kind}", layer) for layer in ("fc1", "fc2", "fc3") for kind in ("kernel", "bias"))
    declared = dataclasses.replace(fedavg(local), private_sum=PrivateSum(clip_layers=layers))
    check_contract(declared, variables, 4, 2, split)
    # personal layers are not uploaded: the wrapper's declaration keeps the shared layers' alone
    personal = personalize(declared, context, PersonalizationOptions(personal="predictor"))
    assert {p for p, _ in personal.private_sum.clip_layers} == {p for p, _ in layers if "fc3" not in p}
    check_contract(personal, variables, 4, 2, split)


def test_an_algorithms_shapes_are_traced_once_per_context_and_forgotten_with_it():
    """The wrappers, the contract check and the privacy ledger all ask for one algorithm's upload shapes: the
    second ask gets the first trace (its local training is not traced again); another context traces its own;
    the entry goes with the algorithm."""
    import gc

    from conftest import linear_model
    from fedjax_sparse.core.contract import wrapping

    context = BuildContext(local=LocalSGD(linear_model(), 0.1, 1, 2), num_clients=3, clients_per_round=3, train=None,
                           num_classes=3)
    inner, traced = fedavg(context.local), []
    algorithm = dataclasses.replace(inner, client_update=lambda *args: (traced.append(1), inner.client_update(*args))[1])
    upload = wrapping.upload_shapes(algorithm, context)
    assert wrapping.upload_shapes(algorithm, context) is upload and len(traced) == 1
    assert wrapping.broadcast_shapes(algorithm, context) is wrapping.broadcast_shapes(algorithm, context)
    assert wrapping.upload_shapes(algorithm, dataclasses.replace(context, num_clients=4)) == upload
    assert len(traced) == 2
    held = len(wrapping._TRACED)
    del algorithm
    gc.collect()
    assert len(wrapping._TRACED) < held


# The three classic mistakes of an algorithm written outside the library, as its author meets them on the command
# line: a client state that keeps an axis it should not (a step or batch axis), a server step that forgets to
# reduce over the clients' axis, and shapes that disagree inside the author's own arithmetic.
def _kept_axis(base):
    def client_update(down, state, data, key, info):
        up, new, metrics = base.client_update(down, state, data, key, info)
        return up, {"count": jnp.stack([new["count"]] * 2)}, metrics
    return {"client_update": client_update}, client_update, ("client state whose leaf count is int32[2], init's is "
                                                             "int32[]")


def _unreduced(base):
    def server_update(server_state, ups, weights, info):
        new = base.server_update(server_state, ups, weights, info)
        return {**new, "variables": {**new["variables"], "params": tree_map(
            lambda p, u: p + 0.0 * u, new["variables"]["params"], ups["params"])}}
    return {"server_update": server_update}, server_update, ("server state whose leaf variables/params/fc1/bias is "
                                                             "float32[2, 256], init's is float32[256]")


def _disagreeing(base):
    def server_update(server_state, ups, weights, info):
        new = base.server_update(server_state, ups, weights, info)
        kernel = new["variables"]["params"]["fc1"]["kernel"]
        scale = kernel @ kernel  # [64, 256] @ [64, 256]: the author meant kernel.T @ kernel
        return {**new, "variables": {**new["variables"], "params": {**new["variables"]["params"], "fc1": {
            **new["variables"]["params"]["fc1"], "kernel": kernel * scale.mean()}}}}
    return {"server_update": server_update}, server_update, "TypeError: dot_general requires contracting dimensions"


@pytest.mark.parametrize("mistake", [_kept_axis, _unreduced, _disagreeing], ids=lambda m: m.__name__.strip("_"))
def test_a_classic_mistake_on_the_command_line_is_one_line_naming_file_line_and_leaf(setting, tmp_path, capsys,
                                                                                   monkeypatch, mistake):
    """One line naming the function with its file:line (where it is defined, or for a failure the author's line
    it passed through) and the leaf, with JAX's statement whole; FEDJAX_SPARSE_TRACEBACK=1 adds the traceback."""
    from fedjax_sparse.algorithms import registry
    from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, NoOptions
    from fedjax_sparse.run.cli import main

    holder = {}

    def build(context, options):
        base = with_state(fedavg(context.local))
        changes, holder["fn"], holder["words"] = mistake(base)
        return dataclasses.replace(base, name="mistaken", **changes)

    monkeypatch.setitem(registry.ALGORITHMS, "mistaken", AlgorithmSpec("mistaken", NoOptions, build))
    args = ["run", "--algorithm", "mistaken", "--rounds", "1", "--num-clients", "4", "--clients-per-round", "2",
            "--max-train-examples", "80", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    code = holder["fn"].__code__
    if mistake is _disagreeing:  # the line of the product, in the function that failed
        line = next(i for i, text in enumerate(open(code.co_filename), 1) if "kernel @ kernel" in text)
        assert f"at tests/test_contract.py:{line} in server_update: " in err
        assert "FEDJAX_SPARSE_TRACEBACK=1" in err and "..." not in err
    else:
        assert f"(tests/test_contract.py:{code.co_firstlineno}) returns a " in err
    assert holder["words"] in err, err
    monkeypatch.setenv("FEDJAX_SPARSE_TRACEBACK", "1")
    assert main([*args, "--out", str(tmp_path / "two")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.strip().splitlines()[-1].startswith(
        "fedjax-sparse: error: mistaken: ")
