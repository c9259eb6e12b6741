"""Issue 36, plug-ins and start-up: an algorithm's option cannot shadow a flag the run declares itself, a
signal in the first second gets the same one line as a later one, and an installed plug-in that fails (to
import, to name an AlgorithmSpec, to keep to its own names and flags) breaks no other command.

Installed packages are simulated by dist-info folders in a temporary directory, read through the same
`importlib.metadata` calls an installed package's entry points go through."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

from fedjax_sparse import plugins
from fedjax_sparse.algorithms import registry
from fedjax_sparse.building_blocks import AlgorithmSpec, option
from fedjax_sparse.run.cli import main
from fedjax_sparse.run.config import RunConfig
from fedjax_sparse.run.signals import StopAfterRound
from test_faults import ROOT, TINY, one_line

if ROOT not in sys.path:  # `benchmarks` is a top-level folder of the repository, not installed
    sys.path.insert(0, ROOT)
from benchmarks.plugin_dists import install_plugins  # noqa: E402 - the fault sweep installs them the same way


@pytest.fixture
def clean_registry():
    """The registry as the library leaves it, after each test (entry points read again)."""
    saved = (dict(registry.ALGORITHMS), dict(registry.REFUSED), dict(registry._PLUGIN_PACKAGES))
    loaded = registry.INSTALLED.loaded
    yield
    for live, before in zip((registry.ALGORITHMS, registry.REFUSED, registry._PLUGIN_PACKAGES), saved):
        live.clear()
        live.update(before)
    registry.INSTALLED.loaded = loaded


@dataclasses.dataclass(frozen=True)
class LrOptions:
    lr: float = option(0.5, "a plug-in's own step size, named like the run's --lr", low=0.0)


@dataclasses.dataclass(frozen=True)
class ProgressOptions:
    progress: bool = option(False, "makes --progress and --no-progress, the command line's own flag")


def fedavg_build(context, options):
    return registry.ALGORITHMS["fedavg"].build(context, registry.ALGORITHMS["fedavg"].options())


def test_36_2_an_option_named_like_a_run_flag_is_refused_when_the_algorithm_registers(clean_registry, tmp_path,
                                                                                     capsys, monkeypatch):
    """The review registered `lr: float = option(0.5)`: accepted; training used the run's --lr while
    config.json recorded 0.5, and a rerun from that config trained at 0.5."""
    assert RunConfig.create().lr == 0.1  # the run layer is imported: its flags are reserved
    with pytest.raises(TypeError) as refused:
        registry.register(AlgorithmSpec("lr_clash", LrOptions, fedavg_build))
    one_line(f"{refused.value}\n", "option 'lr' of algorithm lr_clash (module test_faults_plugins) makes the flag --lr",
             "fedjax-sparse's run options (fedjax_sparse.run.config.RunConfig)")
    assert "lr_clash" not in registry.ALGORITHMS

    with pytest.raises(SystemExit):  # the command line's own flags, --no-progress among them, are reserved too
        main(["run", "--help"])
    capsys.readouterr()
    with pytest.raises(TypeError, match="option 'progress' of algorithm progress_clash .* makes the flag "
                                        "--no-progress, which fedjax-sparse run's own flags declares"):
        registry.register(AlgorithmSpec("progress_clash", ProgressOptions, fedavg_build))

    # a script may register before it imports the run layer: the algorithm is refused when the flags are
    # reserved, and asking for it gives the line
    monkeypatch.setattr(registry, "_RESERVED", {})
    registry.register(AlgorithmSpec("lr_clash", LrOptions, fedavg_build))
    code = main(["run", *TINY, "--algorithm", "lr_clash", "--rounds", "1", "--out", str(tmp_path / "r")])
    assert code == 2 and "lr_clash" not in registry.ALGORITHMS
    one_line(capsys.readouterr().err, "fedjax-sparse: error: option 'lr' of algorithm lr_clash", "the flag --lr")
    assert not (tmp_path / "r").exists()


CHILD = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a process started from a terminal has them
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)

class SignalAtImport:
    # the signal arrives while {module} is first imported: within the first second, before anything ran
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), {signum})
        return None

sys.meta_path.insert(0, SignalAtImport())
from fedjax_sparse.run.cli import main  # what the fedjax-sparse script and python -m fedjax_sparse run
sys.exit(main())
"""


def test_36_6_a_signal_while_jax_and_the_algorithms_are_imported_gives_the_one_line(tmp_path):
    """The review sent SIGINT in the first second (run.cli imported JAX and every algorithm before it
    installed its handlers): "Exception ignored in _xla_gc_callback ... KeyboardInterrupt" and exit 0, or a
    14-49-line traceback; SIGTERM and SIGHUP killed the process without the promised line."""
    procs = {}
    for signum, module in ((signal.SIGINT, "jax"), (signal.SIGTERM, "fedjax_sparse.algorithms"),
                           (signal.SIGHUP, "jax")):
        out = tmp_path / signum.name
        procs[signum] = (out, subprocess.Popen(
            [sys.executable, "-c", CHILD.format(module=module, signum=int(signum)), "run", "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for signum, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert (proc.returncode, stdout) == (128 + signum, ""), stderr[-3000:]
        assert stderr == f"fedjax-sparse: {signum.name} during start-up, before the first round: nothing was run\n"
        assert not out.exists()


def test_36_also_a_run_started_under_nohup_keeps_sighup_ignored(capsys):
    """The suite failed under `nohup`: a test expected the default SIGHUP handler. A process started
    ignoring SIGHUP asked that a closed terminal not stop it: the run leaves it ignored."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopAfterRound(first_round=2, last_round=3) as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)  # still answered
        assert stop.signum == signal.SIGTERM and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    assert capsys.readouterr().err == "fedjax-sparse: SIGTERM: stopping after round 2, then saving a checkpoint\n"


PLUGINS = {  # distribution -> {module file: text}, {entry point name: value}
    "fl-broken": ({"fl_broken.py": "import a_module_nobody_installed\n"}, {"broken": "fl_broken:SPEC"}),
    "fl-odd": ({"fl_odd.py": "SPEC = 3\n"}, {"odd": "fl_odd:SPEC"}),
    "fl-fedavg": ({"fl_fedavg.py": "from test_faults_plugins import spec\nSPEC = spec('fedavg')\n"},
                  {"fedavg": "fl_fedavg:SPEC"}),
    "fl-twin-a": ({"fl_twin_a.py": "from test_faults_plugins import spec\nSPEC = spec('twin')\n"},
                  {"twin": "fl_twin_a:SPEC"}),
    "fl-twin-b": ({"fl_twin_b.py": "from test_faults_plugins import spec\nSPEC = spec('twin')\n"},
                  {"twin": "fl_twin_b:SPEC"}),
    "fl-lr": ({"fl_lr.py": "from test_faults_plugins import LrOptions, spec\nSPEC = spec('with_lr', LrOptions)\n"},
              {"with_lr": "fl_lr:SPEC"}),
    "fl-mu": ({"fl_mu.py": textwrap.dedent("""
        import dataclasses
        from fedjax_sparse.building_blocks import option
        from test_faults_plugins import spec

        @dataclasses.dataclass(frozen=True)
        class MuOptions:
            mu: float = option(0.5, "not FedProx's mu")

        SPEC = spec('with_mu', MuOptions)
        """)}, {"with_mu": "fl_mu:SPEC"}),
    "fl-topk": ({"fl_topk.py": "from test_registry import SPEC\n"}, {"topk_fedavg": "fl_topk:SPEC"}),  # works
}


def spec(name, options=None):
    """FedAvg under another name (a plug-in's SPEC); a fresh build function each call, so each is its own."""
    return AlgorithmSpec(name, options or registry.ALGORITHMS["fedavg"].options,
                         lambda context, opts: fedavg_build(context, opts))


@pytest.fixture
def installed(tmp_path, monkeypatch, clean_registry):
    """PLUGINS installed: each package's module and its dist-info (METADATA, entry_points.txt)."""
    site = install_plugins(tmp_path / "site", PLUGINS)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins.metadata, "entry_points", lambda group: [
        entry for d in metadata.distributions(path=[str(site)]) for entry in d.entry_points if entry.group == group])
    registry.INSTALLED.reset()
    return site


WARNINGS = [  # one line each, naming the package (both, for a conflict)
    "plug-in algorithm 'broken' of package 'fl-broken' (entry point broken = 'fl_broken:SPEC') cannot be loaded: "
    "ModuleNotFoundError: No module named 'a_module_nobody_installed'",
    "plug-in algorithm 'odd' of package 'fl-odd' (entry point odd = 'fl_odd:SPEC') gives an object of type int, "
    "not an AlgorithmSpec",
    "plug-in algorithm 'fedavg' of package 'fl-fedavg' takes the name of algorithm fedavg of fedjax-sparse (built "
    "in)",
    "plug-in algorithm 'twin' is declared by packages 'fl-twin-a' and 'fl-twin-b'; uninstall one",
    "option 'lr' of algorithm with_lr (plug-in of package 'fl-lr') makes the flag --lr, which fedjax-sparse's run "
    "options (fedjax_sparse.run.config.RunConfig) declare",
    "option 'mu' is declared differently by with_mu (plug-in of package 'fl-mu') and fedprox (fedjax-sparse (built "
    "in))",
]


def test_36_7_a_failing_plugin_is_one_warning_line_and_breaks_no_other_command(installed, tmp_path, capsys):
    """The review installed a plug-in whose module fails to import: every command failed, `run --help` and
    `--algorithm fedavg` included (a 23-line traceback); a non-spec entry point, a plug-in named fedavg, two
    packages registering one name and a plug-in redeclaring a shared option gave 25-26-line tracebacks."""
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    captured = capsys.readouterr()
    assert done.value.code == 0 and "--algorithm" in captured.out
    lines = captured.err.splitlines()
    assert len(lines) == len(WARNINGS) and "Traceback" not in captured.err, captured.err
    for words in WARNINGS:
        assert any(line.startswith("fedjax-sparse: warning: ") and words in line and line.endswith("; skipped")
                   for line in lines), (words, captured.err)
    assert registry.ALGORITHMS["fedavg"].build.__module__ == "fedjax_sparse.algorithms.fedavg"

    # the plug-in that works runs, from its entry point, with its own option
    run = tmp_path / "topk"
    assert main(["run", *TINY, "--algorithm", "topk_fedavg", "--topk-ratio", "0.02", "--rounds", "1", "--out",
                 str(run)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(words in err for words in WARNINGS), err
    assert json.loads((run / "config.json").read_text())["topk_ratio"] == 0.02

    for name, words in (("broken", WARNINGS[0]), ("odd", WARNINGS[1]), ("twin", WARNINGS[3]),
                        ("with_lr", WARNINGS[4]), ("with_mu", WARNINGS[5])):
        assert main(["run", *TINY, "--algorithm", name, "--out", str(tmp_path / name)]) == 2
        one_line(capsys.readouterr().err, f"fedjax-sparse: error: {words}")
        assert not (tmp_path / name).exists()
