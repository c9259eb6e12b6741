"""`fedjax-sparse run ...`: one federated experiment from the command line.

The flags are built from the option declarations: the run's shared options
(`run.config.RunConfig`) and each algorithm's own dataclass. A flag is refused
when the chosen algorithm does not read it, or when its other options make it
ignore it (`core.contract.options.refuse_ignored`), so a mistyped setting never passes
silently. The launch flags of a run over several processes (`--coordinator`,
`--num-processes`, `--process-id`, `--cluster`, `--launch-timeout`) belong to
the process, not the run: they are not saved with its config, and a resumed
run gives them again. `fedjax-sparse sweep`, `experiment` and `benchmark` are
handed on whole (`run.sweep`, `run.installed`).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path

from fedjax_sparse.run.parsing import OneLineParser
from fedjax_sparse.run.signals import stop_start_up_at_once

_HELP_EPILOG = ("Algorithm options list, in brackets, the algorithms that read them. An error is one line; "
                "FEDJAX_SPARSE_TRACEBACK=1 prints its whole traceback first.")
LAUNCH_FLAGS = ("coordinator", "num_processes", "process_id", "cluster", "launch_timeout")


def _warn_refused() -> None:
    """One line for each installed algorithm the registry left out (it breaks no other command)."""
    from fedjax_sparse.algorithms import refused

    for why in refused().values():
        print(f"fedjax-sparse: warning: {why}; skipped", file=sys.stderr)


def _run_parser(sub) -> argparse.ArgumentParser:
    from fedjax_sparse.algorithms import algorithm_names, option_users, refused, registered, reserve
    from fedjax_sparse.core.round.distributed import DEFAULT_TIMEOUT_S, LAUNCH_FAILURE_EXIT
    from fedjax_sparse.core.contract.options import add_flags
    from fedjax_sparse.run import RunConfig

    p = sub.add_parser("run", help="run one federated experiment", epilog=_HELP_EPILOG, before_help=_warn_refused)
    # The parsed namespace holds exactly the flags given (`add_flags` sets no defaults).
    shared = p.add_argument_group("run options")
    seen: set[str] = set()
    add_flags(shared, RunConfig, seen=seen)
    algo = p.add_argument_group("algorithm options")  # filled last, once the command line's own flags are reserved
    p.add_argument("--config", metavar="FILE", default=None,
                   help="read the options from a JSON, YAML or TOML file (a run's config.json is one); flags "
                        "given with it override it")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run in DIR from its latest checkpoint; its config.json (or, when that "
                        "is unusable, the checkpoint's config) is the default for every flag, and flags that "
                        "would change the results are refused")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the files an earlier run wrote in --out first, those its fedjax_sparse_files.json "
                        "records (without it such a folder is refused; files it does not record are refused always)")
    p.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: go on although the data differ from those the run started on (refused "
                        "without it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    launch = p.add_argument_group(
        "several processes (one run over every process's devices; start each process with the same flags "
        "but --process-id; see docs/scale.md)")
    launch.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                        help="address of process 0, where the processes meet")
    launch.add_argument("--num-processes", metavar="P", type=int, default=None, help="how many processes")
    launch.add_argument("--process-id", metavar="I", type=int, default=None, help="this process, 0..P-1")
    launch.add_argument("--cluster", action="store_true",
                        help="let JAX find the processes of a SLURM, Open MPI or TPU pod job itself (instead of "
                             "the three flags above)")
    launch.add_argument("--launch-timeout", metavar="S", type=int, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds within which all processes must meet, else each ends with one line and "
                             f"exit code {LAUNCH_FAILURE_EXIT} (default {DEFAULT_TIMEOUT_S}); also how long they wait "
                             f"for each other in a checkpoint's save (JAX's heartbeat waits three times as long for a "
                             f"process that stopped answering)")
    reserve(p._option_string_actions, "fedjax-sparse run's own flags")  # (argparse's table of the flags so far)
    users = option_users()
    for spec in registered().values():
        add_flags(algo, spec.options, used_by=users, seen=seen)
    for action in shared._group_actions:  # the live registry's names, not a list frozen at import
        if action.dest == "algorithm":  # a refused plug-in's name too: asking for it says why it was left out
            action.choices = (*algorithm_names(), *(name for name in refused() if name not in registered()))
    return p


def _parser() -> argparse.ArgumentParser:
    from fedjax_sparse.algorithms import PluginSkipped

    parser = OneLineParser(prog="fedjax-sparse",
                           description="Communication-efficient, sparse federated learning in JAX.")
    parser.add_argument("--version", action="store_true", help="print the version (and JAX's, Flax's, Optax's)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    with warnings.catch_warnings():  # a skipped plug-in: `_warn_refused` says it in one line, once the command is known
        warnings.simplefilter("ignore", PluginSkipped)
        _run_parser(sub)
    # listed for --help only: `_main` hands `sweep ...` to run.sweep, whose other flags are run flags
    sub.add_parser("sweep", add_help=False, help="run a grid or an Optuna search of run options over seeds, and "
                                                 "tabulate it (`fedjax-sparse sweep --help`)")
    # listed for --help only: `_main` hands them to run.installed
    sub.add_parser("experiment", add_help=False, help="run a paper's setting, its arms and any registered algorithm "
                                                      "side by side, and tabulate it (`fedjax-sparse experiment "
                                                      "--list`)")
    sub.add_parser("benchmark", add_help=False, help="measure the library on this machine (`fedjax-sparse benchmark "
                                                     "--list`)")
    sub.add_parser("compare", add_help=False, help="existing runs side by side: a table of their options that "
                                                   "differ and their figures, and a plot (`fedjax-sparse compare "
                                                   "--help`)")
    # listed for --help only: `_main` hands it to data.convert
    sub.add_parser("convert", add_help=False, help="write a data set as memory-mapped files for --dataset mmap:FOLDER "
                                                   "(`fedjax-sparse convert --help`)")
    return parser


def _config(args: argparse.Namespace):
    """The run's config: the flags given, over a --config file's options, or for --resume over the saved config."""
    from fedjax_sparse.algorithms import UnknownAlgorithm, get_spec, option_users
    from fedjax_sparse.run.checkpoints import RunCheckpointer, has_checkpoints
    from fedjax_sparse.core.contract.options import flag_name, refuse_ignored
    from fedjax_sparse.console import say
    from fedjax_sparse.run.folder import read_saved_config
    from fedjax_sparse.run import SHARED_OPTIONS, RunConfig

    given = {k: v for k, v in vars(args).items() if k not in ("command", "version", "config", "resume", "overwrite",
                                                               "allow_data_change", "no_progress", *LAUNCH_FLAGS)}
    base = {}
    if args.config is not None:
        if args.resume is not None:
            raise ValueError("--config and --resume do not combine: --resume DIR continues with DIR/config.json")
        from fedjax_sparse.run.config_file import read_config_file

        base = read_config_file(args.config)
    if args.resume is not None:
        if args.overwrite:
            raise ValueError(f"--overwrite deletes the run that --resume {args.resume} would continue; give one "
                             f"of them")
        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            raise FileNotFoundError(f"--resume {run_dir}: no such folder")

        def checkpoint_config():
            meta = RunCheckpointer(run_dir).read_meta() if has_checkpoints(run_dir) else None
            return None if meta is None else meta["config"]

        base = read_saved_config(run_dir, RunConfig.from_dict, checkpoint_config, say, fatal=(UnknownAlgorithm,))
        given["out"] = args.resume
    config = RunConfig.from_dict({**base, **given})
    own = {f for f in vars(config.algorithm_options)}
    users = option_users()
    for name in {**base, **given} if args.config is not None else given:
        if name not in SHARED_OPTIONS and name not in own:
            where = "" if name in given else f"--config {args.config}, key {name!r}: "
            raise ValueError(f"{where}{flag_name(name)} is an option of {', '.join(users[name])}; --algorithm "
                             f"{config.algorithm} does not read it")
    refuse_ignored(config.algorithm_options, given)
    refuse_ignored(config, given)  # the run's own patterns (uplink compression's settings)
    if args.config is not None:  # a file's key set away from its default is as deliberate as a flag
        try:
            config.refuse_unread_values()
        except ValueError as e:
            raise ValueError(f"--config {args.config}: {e}") from None
    get_spec(config.algorithm)
    return config


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns its exit code (2: an error, 128 + the signal: interrupted)."""
    with stop_start_up_at_once():
        return _main(argv)


def _launch(args: argparse.Namespace) -> int:
    """Joins the run's other processes (before any other JAX call); returns this process's index."""
    from fedjax_sparse.core.round.distributed import LaunchError, initialize

    if args.launch_timeout < 1:
        raise LaunchError(f"--launch-timeout must be >= 1 second, got {args.launch_timeout}")
    if args.cluster and args.coordinator is not None:
        raise LaunchError("--cluster lets JAX find the processes; give it or --coordinator, --num-processes and "
                          "--process-id, not both")
    return initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=args.launch_timeout,
                      cluster=args.cluster).index


def version() -> str:
    """The library's version with those of what it computes with (read from the installed metadata: no import)."""
    from importlib import metadata

    from fedjax_sparse import __version__

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    parts = ", ".join(f"{name} {of(name)}" for name in ("jax", "jaxlib", "flax", "optax"))
    return f"fedjax-sparse {__version__} ({parts}; Python {sys.version.split()[0]})"


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--version"]:
        print(version())
        return 0
    if argv[:1] == ["sweep"]:
        from fedjax_sparse.run.sweep import main as sweep

        return sweep(argv[1:])
    if argv[:1] in (["experiment"], ["benchmark"]):
        from fedjax_sparse.run.installed import main as installed

        if argv[0] == "experiment":  # outside algorithms may be arms: a skipped plug-in is one line, as for `run`
            from fedjax_sparse.algorithms import PluginSkipped, registered

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PluginSkipped)
                registered()
            _warn_refused()
        return installed(argv[0], argv[1:])
    if argv[:1] == ["compare"]:
        from fedjax_sparse.run.compare import main as compare

        return compare(argv[1:])
    if argv[:1] == ["convert"]:
        from fedjax_sparse.data.convert import main as convert

        return convert(argv[1:])
    from fedjax_sparse.run.sweep import follow_parent

    follow_parent()
    args = _parser().parse_args(argv)

    from fedjax_sparse.core.round.cpu import use_cpu_cores
    from fedjax_sparse.run import DivergenceError, Interrupted, RunFailed, run_experiment
    from fedjax_sparse.run.loop import ProcessLost
    from fedjax_sparse.run.checkpoints import CheckpointError, io_reason
    from fedjax_sparse.run.outputs import RunWriteError
    try:
        if args.coordinator is None and not args.cluster:  # one process: a CPU device per core (core.round.cpu)
            use_cpu_cores(getattr(args, "cpu_devices", None))
        lead = _launch(args) == 0
        if args.allow_data_change and args.resume is None:
            raise ValueError("--allow-data-change goes with --resume: a new run takes whatever data it is given")
        config = _config(args)
        if lead:
            _warn_refused()
        summary = run_experiment(config, progress=not args.no_progress, resume=args.resume is not None,
                                 overwrite=args.overwrite, allow_data_change=args.allow_data_change)
    except ProcessLost as e:
        print(f"fedjax-sparse: error: {' '.join(str(e).split())}", file=sys.stderr)
        # JAX's exit handler would wait for the lost process at a shutdown barrier, then abort with a trace
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except (ValueError, FileNotFoundError, DivergenceError, CheckpointError, RunFailed, RunWriteError) as e:
        from fedjax_sparse.core.contract.check import TRACEBACK_VARIABLE

        if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):  # the whole story, then the one line
            traceback.print_exception(e)
        print(f"fedjax-sparse: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # an I/O failure outside the rounds (reading the data, the run folder)
        print(f"fedjax-sparse: error: {io_reason(e)}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"fedjax-sparse: {e}", file=sys.stderr)
        return 128 + e.signum
    if not lead:  # process 0 reports the run
        return 0
    if summary["has_global_model"]:
        accuracy = f"test accuracy {summary['final_test_accuracy']:.4f}"
    else:
        accuracy = "no global model"
    # a private run's summary holds what it releases alone (docs/privacy.md): the rest is not reported either
    if summary.get("final_personalized_accuracy") is not None:
        accuracy += f", personalized accuracy {summary['final_personalized_accuracy']:.4f}"
    if "cumulative_bytes" in summary:
        accuracy += f", {summary['cumulative_bytes']:,} bytes"
    simulated = summary.get("simulated_seconds_total")
    clock = f" ({simulated:,.1f} simulated s)" if simulated is not None else ""
    print(f"done: {accuracy} in {summary['wall_seconds']:.1f} s{clock}; results in {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
