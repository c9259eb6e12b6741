import functools
import os
import tempfile

# The tests check what is computed, not how fast it runs, and on 2 CPU cores most of their time is
# XLA compiling: its cheapest settings cut the suite by about a third (every test passes either way). Not
# XLA's older CPU fusion code generator (`--xla_cpu_use_fusion_emitters=false`), though it compiles in
# 0.6-0.7 of the time: under it a client's arithmetic depends on how many are vmapped together, and 19
# layout tests (stores, devices, processes: bit for bit) fail, as they would for a user who set it.
# (Once: pytest-xdist's workers inherit the environment of the controller, which loaded this file too.)
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in ("--xla_backend_optimization_level=0",
                                                        "--xla_llvm_disable_expensive_passes=true")
                                             if f not in _flags])
# What runs cache beside their programs (decoded data sets) goes to a folder of this session only, one for both of
# pytest-xdist's workers.
_SESSION = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _SESSION:
    os.environ["FEDJAX_SPARSE_CACHE"] = os.path.join(tempfile.gettempdir(), f"fedjax_sparse_test_cache_{_SESSION}")
    os.makedirs(os.environ["FEDJAX_SPARSE_CACHE"], exist_ok=True)
else:
    os.environ["FEDJAX_SPARSE_CACHE"] = tempfile.mkdtemp(prefix="fedjax_sparse_test_cache_")
# Everything compiled, by runs and by tests alike, goes to a persistent JAX cache in the user's cache folder
# ($FEDJAX_SPARSE_TEST_JAX_CACHE names another; "session" keeps it to this session, as before issue 57): many tests
# compile the same program again (an algorithm's round on the same model, rebuilt from fresh functions), and a
# second run of the suite on this machine skips what the first compiled (the README gives both times). JAX keys
# an entry by the program, its compile options and JAX's version, so an entry is never stale. Past 2 GB the
# session's first process drops the entries least recently written (JAX's own size limit needs the filelock
# package, which a test must not depend on).
_JAX_CACHE = os.environ.get("FEDJAX_SPARSE_TEST_JAX_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fedjax_sparse", "tests-jax")
os.environ["FEDJAX_SPARSE_JAX_CACHE"] = (os.environ["FEDJAX_SPARSE_CACHE"] if _JAX_CACHE == "session"
                                         else _JAX_CACHE)
os.makedirs(os.environ["FEDJAX_SPARSE_JAX_CACHE"], exist_ok=True)


def _trim(folder: str, most: int = 2 * 1024 ** 3, keep: int = 3 * 1024 ** 3 // 2) -> None:
    entries = sorted((e for e in os.scandir(folder) if e.is_file()), key=lambda e: e.stat().st_mtime)
    total = sum(e.stat().st_size for e in entries)
    if total <= most:
        return
    while total > keep and entries:
        entry = entries.pop(0)
        total -= entry.stat().st_size
        os.unlink(entry.path)


if "PYTEST_XDIST_WORKER" not in os.environ:
    _trim(os.environ["FEDJAX_SPARSE_JAX_CACHE"])

# Every test computes float32 matrix products and convolutions in float32, by construction: on an Ampere or Hopper
# GPU JAX computes them in TF32 unless told otherwise, and the tests that compare two computations failed there
# (issue 52; JAX's own suite did the same, jax-ml/jax#12008). Runs set the run's --matmul-precision (float32 by
# default) themselves; this covers what tests compute directly, here and in the processes they start.
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "float32"

# The runs that tests start, in this process or in processes of their own, keep every program in that cache too
# (a run keeps only what compiles for 0.5 s or longer unless JAX's own variable says otherwise): a resumed or
# relaunched run then compiles nothing again.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402


def _cache_everything():
    jax.config.update("jax_default_matmul_precision", "float32")  # also where a plugin imported JAX before us
    jax.config.update("jax_compilation_cache_dir", os.environ["FEDJAX_SPARSE_JAX_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_cache_everything()

import socket  # noqa: E402

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from fedjax_sparse.data.federated import federated_split  # noqa: E402
from fedjax_sparse.models import Model, ModelStructure, get_model  # noqa: E402


# Modules that one worker runs together, in file order, because they compute the same things: conftest's SCAFFOLD
# run (`scaffold_reference`, a session fixture), computed once; and every algorithm's float32 round on the MLP,
# which test_precision.py compares its bfloat16 rounds against and finds in the JAX cache that
# test_participation_algorithms.py filled (measured: test_precision's rounds took 75 s after it, 195 s beside it).
MODULE_GROUPS = {
    "scaffold_reference": ("test_distributed.py", "test_elastic_resume.py", "test_run_folder.py"),
    "algorithm_rounds": ("test_participation_algorithms.py", "test_precision.py"),
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n`), each test module runs whole on one worker (MODULE_GROUPS's together),
    so that its module fixtures are computed once, not once on each worker: a module's run folders, sweeps
    and process launches (up to a minute each) were computed twice under `--dist load`. The modules with
    the most tests are handed out first. Not `xdist_group` marks: pytest 9.2 keeps a test's id where
    xdist 3.8 can no longer append the group to it, and the groups went unheeded."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return next((group for group, modules in MODULE_GROUPS.items()
                         if os.path.basename(module) in modules), module)

    if not hasattr(config.option, "loadscopereorder"):  # xdist before its --loadscope-reorder flag
        config.option.loadscopereorder = True
    return ModuleScheduling(config, log)


# The fast tier (`pytest -m "not slow"`, the edit-test loop): tests/slow_tests.txt names the tests it leaves out,
# whole (`test_x.py::test_name`) or one parametrization (`test_x.py::test_name[id]`), under a line saying why; a
# test may also carry `@pytest.mark.slow` itself. CI runs both tiers. tests/test_fast_tier.py keeps the list true
# to the tests and every test module in the fast tier.
SLOW_TESTS = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def slow_entries(path: str | None = None) -> list[str]:
    with open(path or SLOW_TESTS) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def listed_name(nodeid: str) -> str:
    """A test's name as slow_tests.txt writes it: `test_x.py::test_name[id]`, whatever folder it was run from."""
    module, _, name = nodeid.partition("::")
    return f"{os.path.basename(module)}::{name}"


def is_listed(name: str, entries) -> bool:
    """Whether `entries` name this test (`listed_name`): itself, or its function with every parametrization."""
    return name in entries or name.split("[", 1)[0] in entries


def pytest_collection_modifyitems(config, items):
    entries = set(slow_entries())
    for item in items:
        if is_listed(listed_name(item.nodeid), entries):
            item.add_marker(pytest.mark.slow)


def synthetic_split(counts, seed=0, shape=(8, 8, 1), num_classes=10):
    """A FederatedSplit of random images whose clients hold `counts` examples."""
    rng = np.random.default_rng(seed)
    total = int(sum(counts))
    x = rng.integers(0, 256, size=(total, *shape), dtype=np.uint8)
    y = rng.integers(0, num_classes, size=total).astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    indices = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(counts))]
    return federated_split(x, y, indices, mean=[0.5] * shape[-1], std=[0.25] * shape[-1])


@pytest.fixture(autouse=True)
def _session_compilation_cache():
    """The session's cache again after a test whose run set its own (`use_compilation_cache`: runs cache only
    what compiles for longer, or nothing with --no-compilation-cache), and float32 products again."""
    yield
    _cache_everything()


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test. Name resolution is refused too: where DNS
    itself fails (a sandbox), a download would otherwise never reach connect() and would instead
    retry for minutes and end in an ordinary connection error, which an "offline" path could swallow."""

    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture
def make_split():
    return synthetic_split


LINEAR_CLASSES = 3


class _Linear(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train, mask=None, unit_masks=None):
        del train, mask, unit_masks
        return nn.Dense(self.num_classes, name="fc")(x.reshape(x.shape[0], -1))


def linear_model() -> Model:
    """A linear softmax model on 2x2x1 inputs with 3 classes, simple enough to differentiate by hand."""
    return Model(name="linear", module=_Linear(LINEAR_CLASSES), input_shape=(2, 2, 1), num_classes=LINEAR_CLASSES,
                 structure=ModelStructure(()))


@functools.cache
def _initialized(name, input_shape, num_classes):
    model = get_model(name, input_shape, num_classes)
    return model, jax.jit(model.init)(jax.random.key(0))


def jitted_exchange(algorithm, info):
    """(server state, client id, client state, data, key) -> (upload, new client state, metrics): `algorithm`'s
    broadcast to one client and its update as one program, as a round runs them (op by op, each operation
    compiles on its own, per leaf shape)."""
    return jax.jit(lambda server, client, state, data, key: algorithm.client_update(
        algorithm.broadcast(server, client, info), state, data, key, info))


def initialized(name: str, input_shape: tuple[int, ...], num_classes: int) -> tuple[Model, dict]:
    """(model, variables from key 0) of a zoo model, initialized once per worker and compiled: Flax's eager
    initialization compiles its operations one at a time (seconds for the larger models, in every test that
    ran it). The variables' dicts are the caller's own; the arrays, immutable, are shared."""
    model, variables = _initialized(name, tuple(input_shape), num_classes)
    return model, jax.tree_util.tree_map(lambda a: a, variables)


# A small SCAFFOLD run (its clients keep state) on the device store, uninterrupted: what the run-folder
# tests' interrupted runs and the two-process runs must reproduce (tests/test_run_folder.py,
# tests/test_distributed.py, tests/test_elastic_resume.py), to the last bit. 6 of 15 clients a round: K
# divides over one, two or three processes (6, 3 or 2 on each one's device), and 15 clients leave some
# never sampled in 6 rounds (2 and 14), so a process holding exactly its sampled clients' rows is a real
# check (10 would all be sampled by round 4); the rounds train the same 160 examples as 4 of 10 did.
SCAFFOLD_ARGS = ["--algorithm", "scaffold", "--num-clients", "15", "--clients-per-round", "6", "--local-epochs", "1",
                 "--max-train-examples", "400", "--max-test-examples", "100", "--checkpoint-every", "2",
                 "--no-progress"]
SCAFFOLD_ROUNDS = 6


@pytest.fixture(scope="session")
def scaffold_reference(tmp_path_factory):
    from fedjax_sparse.run.cli import main

    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(["run", *SCAFFOLD_ARGS, "--rounds", str(SCAFFOLD_ROUNDS), "--out", str(run)]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == SCAFFOLD_ROUNDS
    return run


def record_runs(monkeypatch, figures):
    """The experiment modules' runs replaced by records: each arm's run writes the metrics records and
    returns the summary that `figures(config)` gives as (records, summary), and its config.json as a run
    does, without training. The table code runs on real runs in tests/test_experiments.py; a module's own
    columns and reports are checked on records whose figures the test chose (no compilation per arm)."""
    import json
    from pathlib import Path

    import experiments.common as common
    from fedjax_sparse.run.outputs import dumps

    def run_experiment(config, progress=True, overwrite=False):
        records, summary = figures(config)
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(dumps(config.to_dict()))
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return summary

    monkeypatch.setattr(common, "run_experiment", run_experiment)
