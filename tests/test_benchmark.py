"""The round-throughput benchmark: its smallest setting runs, and its variants do the same work."""

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import round_throughput as rt  # noqa: E402


def _positive_finite(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smallest_record():
    return rt.run_setting(rt.SMALLEST)


def test_smallest_setting_gives_a_full_record(smallest_record):
    record = smallest_record
    for key in rt.RECORD_KEYS:
        assert key in record
    assert record["model"] == "mlp" and record["clients_per_round"] == rt.SMALLEST.clients_per_round
    skipped = {"engine_vmap": record["engine_client_chunk"] is None,  # the engine's own layout then
               "engine_1cpu": (record["engine_cpu_devices"] or 1) == 1}
    measured = [v for v in rt.VARIANTS if not skipped.get(v)]
    assert measured == [v for v in rt.VARIANTS if v in record["round_seconds"]]
    for variant in measured:
        assert _positive_finite(record[variant]), (variant, record[variant])
        assert _positive_finite(record["round_seconds"][variant])
        assert record["compile_seconds"][variant] >= 0.0
    assert record["padded_step_fraction"] == 0.0
    assert record["examples_per_round"] == rt.SMALLEST.clients_per_round * rt.SMALLEST.examples_per_client
    json.dumps(record)  # what --json writes


def test_engine_and_loops_compute_the_same_rounds():
    """step_loop, client_loop and the chunked engine replay the vmapped engine's rounds
    (same keys, orders, steps, aggregation)."""
    setting = rt.Setting("mlp", 3, 20, batch_size=8, epochs=2, momentum=0.5)  # 3 steps an epoch, the last short
    w = rt.build_workload(setting)
    engine = rt.EngineRunner(w, client_chunk=None)
    loops = [rt.EngineRunner(w, client_chunk=2), rt.step_loop_runner(w), rt.client_loop_runner(w)]
    for r in range(2):
        expected = engine(r)[0]
        for run in loops:
            got = run(r)
            got = got[0] if isinstance(run, rt.EngineRunner) else got
            jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                                   got, expected)
    central = rt.centralized_runner(w)
    moved = central(0)  # a different computation: it only has to train
    delta = jax.tree_util.tree_map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                                   moved["params"], w.variables["params"])
    assert all(math.isfinite(d) for d in jax.tree_util.tree_leaves(delta))
    assert max(jax.tree_util.tree_leaves(delta)) > 0


def test_command_line_writes_a_list_of_records(tmp_path, monkeypatch, capsys, smallest_record):
    """--quick --only --json plumbing; the measurement itself is the record measured above."""
    monkeypatch.setattr(rt, "run_setting", lambda setting, **options: dict(smallest_record))
    out = tmp_path / "records.json"
    rt.main(["--quick", "--only", "mlp:10", "--json", str(out)])
    records = json.loads(out.read_text())
    assert isinstance(records, list) and len(records) == 1
    assert all(_positive_finite(records[0][v]) for v in rt.RECORD_KEYS[2:])
    assert records[0]["environment"]["command"].endswith("--quick --only mlp:10 --json " + str(out))
    assert "| mlp | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        rt.main(["--quick", "--only", "resnet20"])


def test_the_lease_quick_runs_its_three_steps_and_the_suite_records_every_section(tmp_path):
    """`python -m benchmarks.lease --quick --out DIR`, the CI version of what a lent GPU runs: the tests (their
    JUnit counts), `benchmarks.suite --quick` (every section measured or said to be left out, every ratio
    positive and finite, each section's compile seconds, device, versions and command) and the SpaFL arm,
    in at most 8 files (what the device tool brings back)."""
    from benchmarks import lease
    from benchmarks.common import device_name

    result = lease.main(["--quick", "--out", str(tmp_path)])
    assert len(list(tmp_path.iterdir())) <= 8
    tests = result["tests"]
    assert tests["exit_code"] == 0 and tests["tests"] >= 3 and tests["failures"] == tests["errors"] == 0
    assert result["arm"]["status"] == "completed" and result["arm"]["rounds_done"] == 2
    assert json.loads((tmp_path / "arm_config.json").read_text())["compute_dtype"] == "bfloat16"
    assert len((tmp_path / "arm_metrics.jsonl").read_text().splitlines()) == 2
    lease_md = (tmp_path / "lease.md").read_text()
    assert "2 of 2 rounds in bfloat16" in lease_md and "failed, 0 errors" in lease_md

    assert result["suite"]["exit_code"] == 0
    device = device_name().split(" (")[0].replace(" x ", "x").replace(" ", "-").lower()
    (md,) = tmp_path.glob("suite_*.md")
    (js,) = tmp_path.glob("suite_*.json")
    assert md.stem == js.stem and md.stem[-10:].count("-") == 2  # ..._YYYY-MM-DD
    saved = json.loads(js.read_text())
    env = saved["environment"]
    assert env["platform"] == "cpu" and env["jax"] == jax.__version__ and device.split("x")[-1] in md.stem
    assert env["command"] == f"python -m benchmarks.suite --quick --out {tmp_path}"
    records = saved["records"]
    ratios = [r["engine_over_step_loop"] for r in records["round_throughput"]["records"]]
    ratios += [r["engine_over_centralized"] for r in records["round_throughput"]["records"]]
    ratios += [r[k] for r in records["precision"]["records"] for k in ("engine_over_float32",
                                                                       "centralized_over_float32")]
    ratios += [r["engine_over_centralized"] for r in records["layouts"]["records"]]
    ratios += [r[k] for r in records["evaluation"]["records"] for k in ("personalized_over_training",
                                                                        "global_over_training")]
    assert len(ratios) == 12 and all(_positive_finite(x) for x in ratios)
    assert [r["precision"] for r in records["precision"]["records"]] == ["float32", "tensorfloat32", "bfloat16"]
    assert [r["layout"] for r in records["layouts"]["records"]] == ["all", 1]
    assert sum(r["fastest"] for r in records["layouts"]["records"]) == 1
    for name in ("round_throughput", "precision", "layouts", "evaluation"):  # compiles seen, within the section
        compiling = records[name]["compile_seconds"]
        assert 0 < compiling["xla"] <= records[name]["seconds"], (name, compiling)
    assert "skipped" in records["agent_search"]["records"][0] and "skipped" in records["spatl_run"]["records"][0]
    text = md.read_text()
    assert env["command"] in text and "| mlp | 4 |" in text and "of which JAX compiling" in text
    assert records["total_seconds"] > 0 and records["budget_seconds"] == 120


def test_the_suite_and_the_lease_refuse_a_budget_of_nothing(capsys):
    from benchmarks import lease, suite

    for main in (suite.main, lease.main):
        with pytest.raises(SystemExit):
            main(["--quick", "--budget", "0"])
        assert "--budget must be" in capsys.readouterr().err


def test_client_scale_quick_run_measures_every_store(tmp_path):
    """benchmarks.client_scale --quick: every store's round, its memory and (disk) file; the same
    SCAFFOLD rounds whichever store (so the same final loss)."""
    from benchmarks import client_scale

    out = tmp_path / "scale.json"
    client_scale.main(["--quick", "--json", str(out)])
    result = json.loads(out.read_text())
    records = {r["setting"]["store"]: r for r in result["settings"]}
    assert set(records) == {"device", "host", "disk"}
    rows = client_scale.row_bytes("scaffold")
    for store, r in records.items():
        assert _positive_finite(r["round_seconds"]) and r["peak_rss_bytes"] >= r["rss_data_bytes"] > 0
    assert records["device"]["store_bytes"] == 200 * rows  # every client on the device
    for store in ("host", "disk"):
        # the clients sampled in the warm-up and the timed round, and no others
        assert 0 < records[store]["store_bytes"] <= 20 * rows and records[store]["store_bytes"] % rows == 0
        assert records[store]["final_loss"] == records["device"]["final_loss"]
    assert records["disk"]["store_file_bytes"] == records["disk"]["store_bytes"]
    assert result["environment"]["command"].startswith("python -m benchmarks.client_scale --quick")


def test_side_by_side_with_pytorch_refuses_a_python_without_torch_in_one_line(tmp_path):
    """PyTorch is no dependency: a --torch-python that cannot import torch (or does not exist), or a
    --spafl-code folder that is no checkout of the official code, ends the benchmark at once, naming
    the flag, before anything is compiled."""
    from benchmarks import pytorch_side_by_side

    no_torch = tmp_path / "python"
    no_torch.write_text("#!/bin/sh\nexit 1\n")
    no_torch.chmod(0o755)
    with pytest.raises(SystemExit, match=f"--torch-python {no_torch}: it cannot import torch"):
        pytorch_side_by_side.main(["--quick", "--torch-python", str(no_torch), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--torch-python /no/such/python: cannot run it"):
        pytorch_side_by_side.main(["--quick", "--torch-python", "/no/such/python", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*.md"))
    with pytest.raises(SystemExit, match="--spafl-code /no/such/folder: no main/cifar10/client/Client_Class.py"):
        pytorch_side_by_side.main(["--quick", "--spafl-code", "/no/such/folder", "--out", str(tmp_path)])
