"""The experiment and benchmark modules from an installed package, in any folder (issue 39, part 1).

What `pip install .` puts in site-packages holds the repository's experiments/ and benchmarks/ under the
package's name, and no top-level package named experiments or benchmarks; `fedjax-sparse experiment` and
`fedjax-sparse benchmark` run them from another folder with that install alone on the path (not the clone),
an algorithm that another installed package declares through its entry point as an arm."""

import ast
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_sparse.run.cli import main

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("experiments", "benchmarks")
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder of the repository
    sys.path.insert(0, str(ROOT))
from benchmarks.plugin_dists import install_plugins  # noqa: E402 - the plug-in tests install them the same way


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The package as `pip install .` lays it out in site-packages: setuptools' build_py, the step of a wheel
    build that chooses and copies the modules (pyproject.toml's packages and package-dir), run on a copy of
    the sources (it writes its egg-info beside them). A wheel adds its dist-info and the console script,
    which calls `fedjax_sparse.run.cli:main`, as this test does."""
    tmp = tmp_path_factory.mktemp("installed")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "results")
    for name in ("fedjax_sparse", *SHIPPED):
        shutil.copytree(ROOT / name, tmp / "source" / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp / "source" / name)
    subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "build_py", "--build-lib",
                    str(tmp / "site")], cwd=tmp / "source", check=True, capture_output=True)
    return tmp / "site"


def test_the_install_holds_every_module_of_the_package_experiments_and_benchmarks(site):
    """Every module of fedjax_sparse/, and every module of experiments/ and benchmarks/ as
    fedjax_sparse.experiments and fedjax_sparse.benchmarks (benchmarks/parity, which runs from a clone beside
    the authors' code, stays out); nothing at the top but the package."""
    installed = {p.relative_to(site).as_posix() for p in site.rglob("*.py")}
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fedjax_sparse").rglob("*.py")
                if "__pycache__" not in p.parts}
    expected |= {f"fedjax_sparse/{folder}/{p.name}" for folder in SHIPPED for p in (ROOT / folder).glob("*.py")}
    assert installed == expected
    assert [p.name for p in site.iterdir()] == ["fedjax_sparse"]


def test_the_shipped_modules_import_each_other_relatively():
    """Installed, experiments.common is fedjax_sparse.experiments.common: a module that imports
    `experiments.X` or `benchmarks.X` by that name fails there (from a clone both names work)."""
    absolute = []
    for folder in SHIPPED:
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                absolute += [f"{folder}/{path.name}:{node.lineno} imports {name}" for name in names
                             if name.split(".")[0] in SHIPPED]
    assert not absolute, "\n".join(absolute)


OUTSIDE = """import dataclasses
from fedjax_sparse.algorithms.fedavg import SPEC as FEDAVG
SPEC = dataclasses.replace(FEDAVG, name="outside_fedavg")  # FedAvg under another name, from another package
"""
COMMANDS = """import json, sys
from fedjax_sparse.run.cli import main
codes = [main(["experiment", "--list"]),
         main(["experiment", "baselines_digits", "--quick", "--arms", "fedavg,outside_fedavg", "--rounds", "1",
               "--out", "out", "--no-progress"]),
         main(["benchmark", "before_after"])]
try:
    main(["benchmark", "suite", "--help"])
except SystemExit as e:
    codes.append(e.code)
import fedjax_sparse
print(json.dumps({"codes": codes, "package": fedjax_sparse.__file__,
                  "top_level": sorted(m for m in sys.modules if m.split(".")[0] in ("experiments", "benchmarks"))}))
"""


def test_experiments_and_benchmarks_run_from_any_folder_with_an_outside_algorithm_as_an_arm(site, tmp_path):
    """From a folder that is not the clone, with the install and an outside package alone on the path:
    `experiment --list` names the experiments, their arms and the outside algorithm; one round of the digits
    baselines runs FedAvg beside the outside algorithm, FedAvg under another name, which in the setting's
    config gives FedAvg's figures exactly; the results land under the current folder with the command that
    reproduces them, and nothing is written into the install; a benchmark that needs the clone is refused in
    one line; the benchmark suite's modules import from the install."""
    plugins = install_plugins(tmp_path / "plugins", {"fl-outside": ({"fl_outside.py": OUTSIDE},
                                                                    {"outside_fedavg": "fl_outside:SPEC"})})
    work = tmp_path / "work"
    work.mkdir()
    before = {p for p in site.rglob("*") if "__pycache__" not in p.parts}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(plugins)]), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", COMMANDS], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["codes"] == [0, 0, 2, 0]
    assert Path(report["package"]) == site / "fedjax_sparse" / "__init__.py" and report["top_level"] == []
    assert "baselines_digits: FedAvg, FedProx, SCAFFOLD and FedNova" in done.stdout
    assert "--setting baselines_digits: --arms fedavg,fedprox,scaffold,fednova" in done.stdout
    assert "outside_fedavg" in done.stdout.split("Registered algorithms", 1)[1]
    assert "usage: fedjax-sparse benchmark suite" in done.stdout
    assert ("fedjax-sparse: error: benchmark before_after is not run by this command: it unpacks an earlier commit "
            "from the clone's git history; run `python -m benchmarks.before_after` from a clone") in done.stderr

    out = work / "out" / "baselines_digits"
    with (out / "results.csv").open() as f:
        fedavg, outside = list(csv.DictReader(f))
    assert (fedavg["algorithm"], outside["algorithm"]) == ("fedavg", "outside_fedavg")
    for column in ("final_accuracy", "total_gbit"):
        assert outside[column] == fedavg[column]
    config = json.loads((out / "outside_fedavg" / "config.json").read_text())
    assert (config["algorithm"], config["rounds"], config["num_clients"]) == ("outside_fedavg", 1, 20)
    assert ("Command: `fedjax-sparse experiment baselines_digits --quick --arms fedavg,outside_fedavg --rounds 1 "
            "--out out --no-progress`") in (out / "results.md").read_text()
    assert {p for p in site.rglob("*") if "__pycache__" not in p.parts} == before


def test_a_name_that_is_no_experiment_or_benchmark_is_refused_in_one_line(capsys):
    """The command's own refusals, one line each, naming what is valid (from the clone: its top-level
    folders, where the benchmarks that need a clone run and the parity harness is still no module)."""
    assert main(["experiment", "spafll"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("fedjax-sparse: error: no experiment named 'spafll'; valid: baselines_cifar10, "
                           "baselines_digits, federation, fedgse, fedldf, precision, privacy, spafl, spatl,")
    assert main(["benchmark", "--quick"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("fedjax-sparse: error: --quick: name the benchmark first (`fedjax-sparse benchmark --list` lists "
                    "them)")
    assert main(["benchmark", "parity"]) == 2
    assert "benchmark parity is not run by this command" in capsys.readouterr().err
    assert main(["benchmark", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "\nsuite: One command that measures this library" in listed and "\nbefore_after: " in listed
    assert "\ncommon:" not in listed and "\nplugin_dists:" not in listed
