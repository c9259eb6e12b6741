"""`fedjax-sparse run ...`: one federated experiment from the command line.

The flags are built from the option declarations: the run's shared options
(`runner.RunConfig`) and each algorithm's own dataclass. A flag is refused
when the chosen algorithm does not read it, so a mistyped setting never
passes silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_HELP_EPILOG = "Algorithm options list, in brackets, the algorithms that read them."


def _run_parser(sub) -> argparse.ArgumentParser:
    from fedjax_sparse.algorithms import ALGORITHMS, option_users
    from fedjax_sparse.core.options import add_flags
    from fedjax_sparse.runner import RunConfig

    p = sub.add_parser("run", help="run one federated experiment", epilog=_HELP_EPILOG)
    # The parsed namespace holds exactly the flags given (`add_flags` sets no defaults).
    shared = p.add_argument_group("run options")
    seen: set[str] = set()
    add_flags(shared, RunConfig, seen=seen)
    algo = p.add_argument_group("algorithm options")
    users = option_users()
    for spec in ALGORITHMS.values():
        add_flags(algo, spec.options, used_by=users, seen=seen)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="read the options from a JSON, YAML or TOML file (a run's config.json is one); flags "
                        "given with it override it")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run in DIR from its latest checkpoint; its config.json is the "
                        "default for every flag, and flags that would change the results are refused")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedjax-sparse",
                                     description="Communication-efficient, sparse federated learning in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    return parser


def _config(args: argparse.Namespace):
    """The run's config: the flags given, over a --config file's options, or for --resume over the saved config."""
    from fedjax_sparse.algorithms import get_spec, option_users
    from fedjax_sparse.core.options import flag_name
    from fedjax_sparse.runner import SHARED_OPTIONS, RunConfig

    given = {k: v for k, v in vars(args).items() if k not in ("command", "config", "resume", "no_progress")}
    base = {}
    if args.config is not None:
        if args.resume is not None:
            raise ValueError("--config and --resume do not combine: --resume DIR continues with DIR/config.json")
        from fedjax_sparse.config_file import read_config_file

        base = read_config_file(args.config)
    if args.resume is not None:
        saved_path = Path(args.resume) / "config.json"
        if not saved_path.exists():
            raise FileNotFoundError(f"--resume {args.resume}: no config.json there (is it a run directory?)")
        base = json.loads(saved_path.read_text())
        given["out"] = args.resume
    config = RunConfig.from_dict({**base, **given})
    own = {f for f in vars(config.algorithm_options)}
    users = option_users()
    for name in {**base, **given} if args.config is not None else given:
        if name not in SHARED_OPTIONS and name not in own:
            where = "" if name in given else f"--config {args.config}, key {name!r}: "
            raise ValueError(f"{where}{flag_name(name)} is an option of {', '.join(users[name])}; --algorithm "
                             f"{config.algorithm} does not read it")
    get_spec(config.algorithm)
    return config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from fedjax_sparse.runner import DivergenceError, Interrupted, run_experiment
    try:
        config = _config(args)
        summary = run_experiment(config, progress=not args.no_progress, resume=args.resume is not None)
    except (ValueError, FileNotFoundError, DivergenceError) as e:
        print(f"fedjax-sparse: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"fedjax-sparse: {e}", file=sys.stderr)
        return 130
    if summary["has_global_model"]:
        accuracy = f"test accuracy {summary['final_test_accuracy']:.4f}"
    else:
        accuracy = "no global model"
    print(f"done: {accuracy}, personalized accuracy {summary['final_personalized_accuracy']:.4f}, "
          f"{summary['cumulative_bytes']:,} bytes in {summary['wall_seconds']:.1f} s; results in {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
