"""benchmarks.suite_compile: what the suite's processes compile, per test, and the compilation floor."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder of the repository
    sys.path.insert(0, str(ROOT))
from benchmarks.suite_compile import FIELDS, main, summarize  # noqa: E402


def record(**figures):
    return {**dict.fromkeys(FIELDS, 0.0), **figures}


def test_the_floor_is_the_compilation_no_cache_held_over_the_workers():
    """Two modules by hand: 9 s of compilation of which 1 s read 2 hits from the cache leaves 8 s, 4 s of wall
    time on 2 workers; the modules come longest first."""
    records = {"tests/test_a.py::one": record(wall=3.0, compile=2.0, compiles=4, tracing=0.5),
               "tests/test_b.py::two": record(wall=5.0, compile=6.0, compiles=3, cache_reads=1.0, cache_hits=2),
               "tests/test_b.py::three": record(wall=1.0, compile=1.0, compiles=1, lowering=0.25)}
    summary = summarize(records, workers=2, pytest_wall=7.0, target_minutes=6)
    assert summary["totals"]["compile"] == 9.0 and summary["totals"]["compiles"] == 8
    assert summary["uncached_compile_seconds"] == 8.0
    assert summary["compile_floor_seconds"] == 4.0 and summary["target_seconds"] == 360
    assert list(summary["modules"]) == ["tests/test_b.py", "tests/test_a.py"]
    assert summary["modules"]["tests/test_b.py"]["tests"] == 2 and summary["modules"]["tests/test_b.py"]["wall"] == 6.0
    assert list(summary["tests_by_wall"]) == ["tests/test_b.py::two", "tests/test_a.py::one", "tests/test_b.py::three"]


def test_two_workers_record_what_each_test_compiled(tmp_path):
    """Under pytest-xdist the tests run in the workers and the controller only hears of them: a test that
    jits a new program records its compilation, one that runs none records none."""
    tests = tmp_path / "test_tiny.py"
    tests.write_text(textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as tests/conftest.py sets its own
        import jax, numpy as np

        def test_compiles():
            assert float(jax.jit(lambda x: (x * 3 + 1).sum())(np.arange(5.0))) == 35.0

        def test_compiles_nothing():
            assert sum(range(5)) == 10
    """))
    out = tmp_path / "out"
    assert main(["--workers", "2", "--out", str(out), "--", str(tests), "-x"]) == 0
    written = json.loads(next(out.glob("suite_compile_*.json")).read_text())
    records = {test.split("::")[-1]: figures for test, figures in written["records"]["tests_by_wall"].items()}
    assert set(records) == {"test_compiles", "test_compiles_nothing"}
    assert records["test_compiles"]["compiles"] >= 1 and records["test_compiles"]["compile"] > 0
    assert records["test_compiles"]["tracing"] > 0 and records["test_compiles"]["wall"] > 0
    assert records["test_compiles_nothing"]["compiles"] == 0
    assert written["records"]["test_process_xla_flags"] == "--xla_backend_optimization_level=0"
    assert written["records"]["workers"] == 2 and written["environment"]["command"].endswith(str(tests) + " -x")
    assert "compilation floor" in next(out.glob("suite_compile_*.md")).read_text()


def test_a_failing_run_writes_nothing_and_passes_pytests_exit_code_on(tmp_path):
    tests = tmp_path / "test_fails.py"
    tests.write_text("def test_fails():\n    assert False\n")
    assert main(["--workers", "1", "--out", str(tmp_path / "out"), "--", str(tests)]) == 1
    assert not (tmp_path / "out").exists()


def test_bad_workers_are_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--workers", "0"])
    assert "--workers must be 1 or more, got 0" in capsys.readouterr().err


def test_the_test_processes_get_each_of_conftests_xla_flags_once():
    """The flags the report shows: under pytest-xdist a worker inherits the environment of the controller, which
    had already loaded conftest, and each flag used to be given twice."""
    flags = os.environ["XLA_FLAGS"].split()
    for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
        assert flags.count(flag) == 1, flags
