"""TensorBoard event files: what a run writes is what TensorBoard's own loader reads."""

import math

import pytest

from fedjax_sparse.run.tensorboard import TensorBoardWriter, scalars

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard loads the run folder."""
    loader = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
    loader.Reload()
    return {tag: [(e.step, e.value) for e in loader.Scalars(tag)] for tag in loader.Tags()["scalars"]}


def expected_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Every number of every metrics record, nested dicts as 'name/key', at step = its round."""
    out = {}
    for record in records:
        for tag, value in scalars({k: v for k, v in record.items() if k != "round"}):
            out.setdefault(tag, []).append((record["round"], value))
    return out


def assert_same_scalars(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        for (_, a), (_, b) in zip(got[tag], points):
            assert a == pytest.approx(b, rel=1e-6) or (math.isnan(a) and math.isnan(b)), tag


def test_scalars_flatten_nested_figures_and_skip_what_is_not_a_number():
    record = {"test_accuracy": 0.5, "density_per_layer": {"conv1": 0.25, "fc": 1}, "status": "ok",
              "test_loss": None, "flag": True, "per_client": [1, 2], "loss": float("nan")}
    got = dict(scalars(record))
    assert set(got) == {"test_accuracy", "density_per_layer/conv1", "density_per_layer/fc", "loss"}
    assert got["density_per_layer/fc"] == 1.0 and math.isnan(got["loss"])


def test_a_resumed_writer_replaces_the_rounds_after_the_checkpoint(tmp_path):
    """A run wrote rounds 1-3 but its checkpoint holds 2 rounds; the resumed process writes 3 and 4:
    TensorBoard shows each round once, round 3 as the resumed run computed it."""
    first = TensorBoardWriter(tmp_path)
    for r in (1, 2, 3):
        first.log_metrics(r, {"train_loss": float(r), "density_per_layer": {"fc": 0.5}})
    first.finish("interrupted")
    resumed = TensorBoardWriter(tmp_path, first_round=3)
    for r in (3, 4):
        resumed.log_metrics(r, {"train_loss": 10.0 * r, "density_per_layer": {"fc": 0.25}})
    resumed.finish("completed")
    got = read_scalars(tmp_path)
    assert got["train_loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert got["density_per_layer/fc"] == [(1, 0.5), (2, 0.5), (3, 0.25), (4, 0.25)]
