"""The fast tier (`pytest -m "not slow"`) is true to the tests: every entry of tests/slow_tests.txt names tests
that exist, and every test module keeps tests in the fast tier, so that the edit-test loop still runs each
module's core behaviour (issue 57). The README gives both tiers' measured times."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import SLOW_TESTS, is_listed, listed_name, slow_entries

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """{nodeid: slow?} of the whole suite, as a plain `pytest --collect-only` of tests/ sees it."""
    plugin = tmp_path_factory.mktemp("plugin")
    (plugin / "tier_report.py").write_text(textwrap.dedent("""
        def pytest_collection_finish(session):
            with open(session.config.getoption("tier_out"), "w") as f:
                for item in session.items:
                    f.write(f"{item.nodeid}\\t{int(item.get_closest_marker('slow') is not None)}\\n")

        def pytest_addoption(parser):
            parser.addoption("--tier-out")
    """))
    out = plugin / "tiers.tsv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tier_report",
                           "-p", "no:cacheprovider", "-p", "no:xdist", f"--tier-out={out}", TESTS],
                          cwd=os.path.dirname(TESTS), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {nodeid: flag == "1" for nodeid, flag in (line.split("\t") for line in out.read_text().splitlines())}


def test_every_listed_test_exists_and_is_marked(collected):
    own = {listed_name(nodeid): slow for nodeid, slow in collected.items()}
    stale = [entry for entry in slow_entries() if not any(is_listed(name, {entry}) for name in own)]
    assert not stale, f"{SLOW_TESTS} names tests that no longer exist: {stale}"
    unmarked = [entry for entry in slow_entries()
                if any(not slow for name, slow in own.items() if is_listed(name, {entry}))]
    assert not unmarked, f"listed tests the fast tier still runs: {unmarked}"


def test_every_module_keeps_fast_tests(collected):
    modules = {}
    for nodeid, slow in collected.items():
        modules.setdefault(os.path.basename(nodeid.split("::", 1)[0]), []).append(slow)
    assert len(modules) == len([f for f in os.listdir(TESTS) if f.startswith("test_") and f.endswith(".py")])
    without = sorted(m for m, slows in modules.items() if all(slows))
    assert not without, f"test modules with no test in the fast tier: {without}"
    fast = sum(not slow for slows in modules.values() for slow in slows)
    assert 0 < fast < len(collected)


def test_the_list_marks_a_test_and_only_it(tmp_path, monkeypatch):
    """The conftest hook marks an entry's parametrization alone, or every parametrization of a whole entry."""
    import conftest

    listing = tmp_path / "slow.txt"
    listing.write_text("# why\ntest_a.py::test_one[2]\ntest_a.py::test_two\n")
    monkeypatch.setattr(conftest, "SLOW_TESTS", str(listing))

    class Item:
        def __init__(self, nodeid):
            self.nodeid, self.marks = nodeid, []

        def add_marker(self, mark):
            self.marks.append(mark.name)

    items = [Item(n) for n in ("tests/test_a.py::test_one[1]", "tests/test_a.py::test_one[2]",
                               "tests/test_a.py::test_two[x]", "tests/test_a.py::test_two",
                               "tests/test_b.py::test_two", "tests/test_a.py::test_twofold")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [bool(i.marks) for i in items] == [False, True, True, True, False, False]
