"""The parity harness's own logic, without torch or the official code: verdicts come from measurements
(a row is explained only by a case that aligns more causes and brings it to round-off), near-tie
decisions are recorded and mapped between the two sides' layouts, and two runs' tables compare."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.parity import arrays as A  # noqa: E402
from benchmarks.parity import decisions as D  # noqa: E402
from benchmarks.parity import verdicts as V  # noqa: E402
from benchmarks.parity.__main__ import markdown, same  # noqa: E402
from benchmarks.parity.methods import METHODS  # noqa: E402
from benchmarks.parity.planted import plants  # noqa: E402

CAUSES = {"scaler": "their Scaler", "clip": "their clipping"}


def numeric(name, max_rel):
    return {"compared": name, "tensors": 1, "max_abs": max_rel, "max_rel": max_rel, "worst": "w"}


def cases(**rows_by_case):
    aligns = {"published": [], "no_scaler": ["scaler"], "no_clip": ["clip"], "neither": ["scaler", "clip"]}
    return {case: {"description": case, "aligns": aligns[case], "rows": rows} for case, rows in rows_by_case.items()}


def test_a_row_is_explained_only_by_a_case_that_aligns_more_and_brings_it_to_round_off():
    judged = cases(published=[numeric("a", 3e-2), numeric("b", 1e-6), numeric("c", 2e-3)],
                   no_scaler=[numeric("a", 4e-6), numeric("b", 1e-6), numeric("c", 2e-3)],
                   neither=[numeric("a", 4e-6), numeric("b", 1e-6), numeric("c", 5e-6)])
    failing = V.judge(judged, CAUSES)
    a, b, c = judged["published"]["rows"]
    assert (a["verdict"], a["explained_by"], a["removed_in"]) == (V.EXPLAINED, ["scaler"], "no_scaler")
    assert b["verdict"] == V.ROUND
    # c falls only when both are aligned: the fewest causes that remove it
    assert (c["verdict"], c["explained_by"], c["removed_in"]) == (V.EXPLAINED, ["scaler", "clip"], "neither")
    assert judged["no_scaler"]["rows"][2]["explained_by"] == ["clip"]
    assert failing == []


def test_a_difference_no_aligned_case_removes_fails():
    # a planted bug: it shows in every case, the one aligning every cause too
    judged = cases(published=[numeric("server", 0.6)], no_scaler=[numeric("server", 0.6)],
                   neither=[numeric("server", 0.6)])
    failing = V.judge(judged, CAUSES)
    assert [r["rows"][0]["verdict"] for r in judged.values()] == [V.UNEXPLAINED] * 3
    assert len(failing) == 3
    # a case aligning other causes, not a superset, explains nothing
    judged = cases(no_scaler=[numeric("x", 1e-3)], no_clip=[numeric("x", 0.0)])
    assert V.judge(judged, CAUSES) == ["no_scaler: x (UNEXPLAINED)"]


def test_exact_margin_and_aligned_rows():
    exact = {"compared": "entries", "kind": "exact", "mismatched_entries": 2, "tensors": 1}
    margin = {"compared": "gap", "kind": "margin", "margin": 1e-7, "required": 1e-4, "tensors": 0}
    aligned = {"compared": "ties", "kind": "aligned", "aligned": 3, "beyond": 1, "tensors": 0}
    judged = cases(published=[exact, margin, aligned],
                   neither=[{**exact, "mismatched_entries": 0}, {**margin, "margin": 1e-3}, {**aligned, "beyond": 0}])
    failing = V.judge(judged, CAUSES)
    # an exact or aligned row is explained like a number; a margin is about the inputs: never explained
    assert [r["verdict"] for r in judged["published"]["rows"]] == [V.EXPLAINED, V.NEAR_TIE, V.EXPLAINED]
    assert [r["verdict"] for r in judged["neither"]["rows"]] == [V.ROUND] * 3
    assert failing == ["published: gap (NEAR A TIE)"]


def test_entries_are_judged_against_their_measured_round_off_floor():
    """An entry round-off moves far (here 1e-3 under the floor's noise) may differ by FLOOR_FACTOR times that;
    every other entry only by FLOOR_FACTOR times its tensor's typical floor (1e-7), at least ROUND_OFF."""
    theirs = np.random.default_rng(0).uniform(1.0, 2.0, 10_000)
    noisy = theirs + 1e-7
    noisy[5] += 1e-3
    with A.Floor({"w": theirs}, {"w": noisy}):
        sensitive = theirs.copy()
        sensitive[5] += 5e-3
        assert A.difference("w", sensitive, theirs, key="w")["beyond"] == 0
        ordinary = theirs.copy()
        ordinary[7] += 1e-4  # beyond max(1e-5 x 2, 100 x 1e-7)
        row = A.group("w", [A.difference("w", ordinary, theirs, key="w")])
    assert row["beyond"] == 1 and not V.within(row)
    assert "beyond" not in A.difference("w", ordinary, theirs, key="w")  # no floor in force: max rel alone
    specs = {"published": V.Case("p"), "code": V.Case("c", ("control",)),
             "distinct": V.Case("d", floor="distinct_code"), "distinct_code": V.Case("dc", ("control",))}
    assert V.terminal(specs) == ["code", "distinct_code"]
    assert V.floor_case(specs, "distinct") == "distinct_code"
    with pytest.raises(ValueError, match="name one as its floor"):
        V.floor_case(specs, "published")


def test_a_row_whose_floor_shows_the_official_run_unsteady_is_near_a_tie_and_redrawn():
    """FLOOR_FACTOR times a floor of 0.2 (SpaFL's third round on one draw) would pass a 20 % difference: such a
    row is NEAR A TIE, never round-off, and the driver redraws the inputs."""
    from benchmarks.parity.__main__ import near_ties
    unsteady = {**numeric("client 2", 0.2), "beyond": 0, "entries": 10, "floor": 0.19, "tolerance": 19.0}
    steady = {**numeric("client 1", 2e-6), "beyond": 0, "entries": 10, "floor": 1e-7, "tolerance": 1e-5}
    judged = cases(published=[dict(unsteady), dict(steady)], no_scaler=[dict(unsteady), dict(steady)])
    assert V.within(unsteady)  # its own tolerance would pass it
    failing = V.judge(judged, CAUSES)
    assert [r["verdict"] for r in judged["no_scaler"]["rows"]] == [V.NEAR_TIE, V.ROUND]
    assert failing == ["published: client 2 (NEAR A TIE)", "no_scaler: client 2 (NEAR A TIE)"]
    assert near_ties(judged) == [f"{case}: client 2 {V.figure(unsteady)}" for case in ("published", "no_scaler")]


def test_every_method_has_a_case_aligning_every_cause_where_its_floor_is_measured():
    """A cause without a case that aligns it along with all the others leaves no case where nothing known
    differs: its rows could never be shown at round-off, and a bug there would read as that cause."""
    from benchmarks.parity.methods import get
    for name in METHODS:
        method = get(name)
        assert all(set(case.aligns) <= set(method.CAUSES) for case in method.CASES.values()), name
        full = [t for t in V.terminal(method.CASES) if set(method.CASES[t].aligns) == set(method.CAUSES)]
        assert full, f"{name}: no case aligns all of {sorted(method.CAUSES)}"
        assert all(V.floor_case(method.CASES, case) in V.terminal(method.CASES) for case in method.CASES), name


def test_judge_refuses_unknown_causes_and_shared_row_names():
    with pytest.raises(ValueError, match="not among the causes"):
        V.judge({"x": {"aligns": ["epsilon"], "rows": []}}, CAUSES)
    with pytest.raises(ValueError, match="share a name"):
        V.judge({"x": {"aligns": [], "rows": [numeric("a", 0), numeric("a", 0)]}}, CAUSES)


def test_near_ties_of_relu_and_max_pool():
    x = np.array([[[[4.0, 3.99995], [-1.0, 2e-4]], [[0.0, 0.0], [0.0, 0.0]]]], np.float32)  # NCHW, max 4
    where, decided = D.relu_near(x, 1e-4)  # |x| <= 4e-4
    assert list(where) == [3, 4, 5, 6, 7] and list(decided) == [True, False, False, False, False]
    where, chosen = D.pool_near(x, 1e-5)  # channel 0's window: 4 and 3.99995 are 5e-5 apart, > 1e-5 x 4
    assert list(where) == []
    where, chosen = D.pool_near(x, 2e-5)  # 5e-5 <= 8e-5: near; channel 1's window is all zeros: left out
    assert list(where) == [0] and list(chosen) == [0]


def test_library_positions_map_onto_the_official_tensor():
    library_shape, official_shape = (4, 6, 2, 2), (3, 3, 2, 2)  # a padded batch of 4, a sub-model of 3 channels
    wanted = [(0, 4, 1, 1), (3, 0, 0, 0), (2, 1, 0, 1), (1, 5, 1, 0)]
    where = np.ravel_multi_index(np.array(wanted).T, library_shape)
    at, source = D.to_official(where, library_shape, official_shape, lambda n, k: np.array([4, 1, 2]))
    # row 3 is padding, channel 5 is not in the sub-model; global channel 4 is the official 0, 1 is 1
    assert list(source) == [0, 2]
    assert list(at) == list(np.ravel_multi_index(np.array([(0, 0, 1, 1), (2, 1, 0, 1)]).T, official_shape))
    with pytest.raises(ValueError, match="no channel map"):
        D.to_official(where, library_shape, official_shape, None)
    # a sub-model as wide as the model can still hold its channels in another order (FedRolex's rolled window)
    at, _ = D.to_official(np.array([0, 2]), (1, 3, 1, 1), (1, 3, 1, 1), lambda n, k: np.array([2, 0, 1]))
    assert list(at) == [1, 0]


def test_the_library_recorder_sees_each_relu_and_pool_in_order():
    from fedjax_sparse.models import layers

    recorder = D.LibraryDecisions(margin=1e-3)
    x = np.zeros((2, 4, 4, 3), np.float32)  # NHWC
    x[0, 0, 0, 1], x[0, 0, 1, 1] = 2.0, 1.9995  # a near tie of window (0, 0) of channel 1 (gap 5e-4 of 2)
    x[1, 2, 3, 2] = -1e-3  # within 1e-3 x 2 of the ReLU's kink
    with recorder.installed():
        @jax.jit
        def forward(x):
            import flax.linen as nn
            return jnp.sum(layers.max_pool2(nn.relu(x)))
        jax.grad(forward)(jnp.asarray(x))
        jax.effects_barrier()
    calls = D.unpack(recorder.take("r0/c0"), "r0/c0")
    assert [(kind, shape) for kind, shape, _, _ in calls] == [(D.RELU, (2, 3, 4, 4)), (D.POOL, (2, 3, 4, 4))]
    relu_where, relu_decided = calls[0][2], calls[0][3]
    nchw = D.nchw(x)
    assert np.array_equal(relu_where, np.flatnonzero(np.abs(nchw) <= 2e-3))
    assert np.array_equal(relu_decided.astype(bool), nchw.reshape(-1)[relu_where] > 0)
    pool_where, pool_chosen = calls[1][2], calls[1][3]
    assert list(pool_where) == [np.ravel_multi_index((0, 1, 0, 0), (2, 3, 2, 2))] and list(pool_chosen) == [0]
    assert jax.nn.relu is not None and layers.max_pool2.__name__ == "max_pool2"  # restored


def test_tables_of_two_runs_compare(tmp_path):
    judged = cases(published=[numeric("a", 3e-2)], no_scaler=[numeric("a", 4e-6)])
    V.judge(judged, CAUSES)
    method = {"repository": "o/r", "pinned_commit": "c", "checkout_commit": "c", "model": "m", "setup": "s.",
              "library_options": {}, "causes": CAUSES, "seed": 0, "redrawn": [], "cases": judged, "failing": []}
    env = {"host": "h", "jax": "j", "flax": "f", "optax": "o", "torch": "t", "python": "p", "command": "c", "date": "d"}
    text = markdown({"methods": {"heterofl": method}, "environment": env})
    assert "explained: scaler (aligned in `no_scaler`: 4.00e-06)" in text
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"methods": {"heterofl": method}}))
    changed = json.loads(first.read_text())
    changed["methods"]["heterofl"]["cases"]["no_scaler"]["rows"][0].update(max_rel=3e-2)
    V.judge(changed["methods"]["heterofl"]["cases"], CAUSES)
    second.write_text(json.dumps(changed))
    assert same(first, first) == 0
    assert same(first, second) == 1


def test_every_method_has_two_planted_departures_that_apply_to_the_library_as_it_is():
    """The planted-bug check (benchmarks/parity/planted.py) patches a copy of the library: a plant that no
    longer applies (the code it edits moved) would leave a method unchecked."""
    found = plants()
    assert sorted({name.split("-")[0] for name in found}) == sorted(METHODS)
    assert all(sum(name.startswith(f"{m}-") for name in found) >= 2 for m in METHODS)
    for name, patch in found.items():
        assert patch.read_text().startswith("# "), f"{name}: its first line says what it plants"
        done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"{name}: {done.stderr.strip()}"


def test_a_plant_is_caught_only_by_rows_that_do_not_fail_without_it(tmp_path):
    """A row failing in the table without a plant would 'catch' every plant of its method: those rows are set aside."""
    from benchmarks.parity.planted import unplanted_failing
    table = tmp_path / "parity.json"
    table.write_text(json.dumps({"methods": {"fedrolex": {"failing": [
        "published: round 1: client 0 (UNEXPLAINED)", "no_scaler_counts: round 1: client 0 (UNEXPLAINED)"]}}}))
    assert unplanted_failing(table, "fedrolex", ["no_scaler_counts"]) == {
        "no_scaler_counts: round 1: client 0 (UNEXPLAINED)"}
    assert unplanted_failing(table, "heterofl", ["no_scaler"]) == set()
    assert unplanted_failing(tmp_path / "none.json", "fedrolex", ["no_scaler_counts"]) == set()
