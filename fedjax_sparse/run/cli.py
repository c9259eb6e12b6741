"""`fedjax-sparse`: the command line's entry point, which hands each command to its module.

`run` runs one federated experiment (its flags and their groups: `run.run_flags`); `sweep` (`run.sweep`),
`experiment` and `benchmark` (`run.installed`), `compare` (`run.compare`) and `convert` (`data.convert`) are handed
on whole. `--version` names the library's version and what it computes with.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

from fedjax_sparse.run.run_flags import command_parser, config_from_args, warn_refused
from fedjax_sparse.run.signals import stop_start_up_at_once


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
            warn_refused()
        return installed(argv[0], argv[1:])
    if argv[:1] == ["compare"]:
        from fedjax_sparse.run.compare import main as compare

        return compare(argv[1:])
    if argv[:1] == ["convert"]:
        from fedjax_sparse.data.convert import main as convert

        return convert(argv[1:])
    from fedjax_sparse.run.sweep import follow_parent

    follow_parent()
    args = command_parser().parse_args(argv)

    from fedjax_sparse.core.round.cpu import use_cpu_cores
    from fedjax_sparse.run import DivergenceError, Interrupted, RunFailed, run_experiment
    from fedjax_sparse.run.failures import ProcessLost
    from fedjax_sparse.run.checkpoints import CheckpointError, io_reason
    from fedjax_sparse.run.outputs import RunWriteError
    try:
        if args.coordinator is None and not args.cluster:  # one process: a CPU device per core (core.round.cpu)
            use_cpu_cores(getattr(args, "cpu_devices", None))
        lead = _launch(args) == 0
        if args.allow_data_change and args.resume is None:
            raise ValueError("--allow-data-change goes with --resume: a new run takes whatever data it is given")
        config = config_from_args(args)
        if lead:
            warn_refused()
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
