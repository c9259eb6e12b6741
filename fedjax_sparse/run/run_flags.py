"""The `run` command's flags: built from the option declarations, grouped as the docs are, and read into a config.

Every flag comes from an `option(...)` declaration: the run's shared options (`run.config.RunConfig`, with the
federation's, the patterns' and the trackers' mixed in) and each algorithm's own dataclass. A flag is refused when
the chosen algorithm does not read it, or when its other options make it ignore it
(`core.contract.options.refuse_ignored`), so a mistyped setting never passes silently.

The flags come in groups (`core.contract.options.option_group`), as docs/cli.md and the other pages are: data, model
and training; the federation; compression and personal layers; privacy; output, logging and checkpoints; scale
(devices, stores, processes, precision); then each algorithm's own, by the class that declares them (SPATL's,
the sub-model methods', the server optimizer's, ...). `--help` lists the groups, a line each, and `--help-group
NAME` shows one in full (`all`: every flag). The launch flags of a run over several processes (`--coordinator`,
`--num-processes`, `--process-id`, `--cluster`, `--launch-timeout`) belong to the process, not the run: they are
not saved with its config, and a resumed run gives them again.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from pathlib import Path

from fedjax_sparse.run.parsing import OneLineParser

LAUNCH_FLAGS = ("coordinator", "num_processes", "process_id", "cluster", "launch_timeout")
COMMAND_FLAGS = ("command", "version", "config", "resume", "overwrite", "allow_data_change", "no_progress")
# the run's groups, in the order --help lists them: name -> what it holds
GROUPS = {
    "data": "data, model and local training: --algorithm, --dataset, --model, --num-clients, --rounds, --lr, ...",
    "federation": "who takes part and how long it takes: samplers, device profiles, deadlines, stragglers, "
                  "asynchronous rounds (docs/federation.md)",
    "compression": "uplink compression (top-k, random-k, QSGD, error feedback) and personal layers, for any "
                   "algorithm they fit (docs/methods/patterns.md)",
    "privacy": "client-level differential privacy and its accountant, secure aggregation (docs/privacy.md)",
    "output": "the run folder, config files, resuming, checkpoints, TensorBoard, MLflow, W&B, progress",
    "scale": "devices, client stores, several processes, matrix-product precision and mixed precision "
             "(docs/scale.md, docs/precision.md)",
}
HELP_EPILOG = ("`--help-group NAME` shows one group in full, `--help-group all` every flag. Algorithm options list, "
               "in brackets, the algorithms that read them. An error is one line; FEDJAX_SPARSE_TRACEBACK=1 prints "
               "its whole traceback first.")


def warn_refused() -> None:
    """One line for each installed algorithm the registry left out (it breaks no other command)."""
    from fedjax_sparse.algorithms import refused

    for why in refused().values():
        print(f"fedjax-sparse: warning: {why}; skipped", file=sys.stderr)


class _Groups:
    """The run parser's argument groups by name, made as the first flag of each arrives."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser, self.by_name, self.about = parser, {}, {}

    def __call__(self, name: str, about: str = "") -> argparse._ArgumentGroup:
        if name not in self.by_name:
            self.by_name[name] = self.parser.add_argument_group(name, GROUPS.get(name) or about or None)
            self.about[name] = GROUPS.get(name) or about
        return self.by_name[name]


class _GroupedHelp(argparse.Action):
    """--help: the groups, a line each; --help-group NAME: one group (or all of them) in full."""

    def __init__(self, option_strings, dest, groups: _Groups, nargs=0, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS, **kwargs)
        self.groups = groups

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--help-group":
            name = values[0]
            if name != "all" and name not in self.groups.by_name:
                parser.error(f"--help-group {name!r} is no group; valid: all, {', '.join(self.groups.by_name)}")
            if name == "all":
                parser.print_help()
            else:
                warn_refused()
                formatter = parser._get_formatter()
                group = self.groups.by_name[name]
                formatter.start_section(group.title)
                formatter.add_text(group.description)
                formatter.add_arguments(group._group_actions)
                formatter.end_section()
                print(formatter.format_help(), end="")
            parser.exit()
        warn_refused()
        lines = [parser.format_usage().rstrip(), "", parser.description or "", "",
                 "Option groups (`fedjax-sparse run --help-group NAME` shows one in full, `--help-group all` every "
                 "option):", ""]
        width = max(len(name) for name in self.groups.by_name)
        for name, group in self.groups.by_name.items():
            count = len(group._group_actions)
            lines += textwrap.wrap(f"{count:3d} option{'s' if count > 1 else ' '}: {self.groups.about[name]}", 100,
                                   initial_indent=f"  {name:<{width}} ", subsequent_indent=" " * (width + 16))
        lines += ["", *textwrap.wrap(HELP_EPILOG, 100)]
        print("\n".join(lines))
        parser.exit()


def run_parser(sub) -> argparse.ArgumentParser:
    """The `run` command's parser, its flags in their groups."""
    from fedjax_sparse.algorithms import algorithm_names, option_users, refused, registered, reserve
    from fedjax_sparse.core.contract.options import add_flags, option_group
    from fedjax_sparse.core.round.distributed import DEFAULT_TIMEOUT_S, LAUNCH_FAILURE_EXIT
    from fedjax_sparse.run import RunConfig

    p = sub.add_parser("run", help="run one federated experiment (`fedjax-sparse run --help` lists its option groups)",
                       add_help=False, description="Runs one federated experiment and writes its run folder.",
                       usage="fedjax-sparse run [--help] [--help-group NAME] [--config FILE | --resume DIR] "
                             "[--OPTION VALUE ...]",
                       epilog=HELP_EPILOG)
    groups = _Groups(p)
    for name in GROUPS:  # in their order, whatever declares its flags first
        groups(name)
    p.add_argument("-h", "--help", action=_GroupedHelp, groups=groups, help="list the option groups")
    p.add_argument("--help-group", action=_GroupedHelp, groups=groups, nargs=1, metavar="NAME",
                   help="show one option group in full (all: every option)")
    users = option_users()

    def container(cls, field):
        name = option_group(cls, field)
        readers = users.get(field.name, ())
        return groups(name, f"options of {', '.join(readers)}" if readers else "")

    # The parsed namespace holds exactly the flags given (`add_flags` sets no defaults).
    seen: set[str] = set()
    add_flags(p, RunConfig, seen=seen, container=container)
    output, scale = groups("output"), groups("scale")
    output.add_argument("--config", metavar="FILE", default=None,
                        help="read the options from a JSON, YAML or TOML file (a run's config.json is one); flags "
                             "given with it override it")
    output.add_argument("--resume", metavar="DIR", default=None,
                        help="continue the run in DIR from its latest checkpoint; its config.json (or, when that "
                             "is unusable, the checkpoint's config) is the default for every flag, and flags that "
                             "would change the results are refused")
    output.add_argument("--overwrite", action="store_true",
                        help="delete the files an earlier run wrote in --out first, those its "
                             "fedjax_sparse_files.json records (without it such a folder is refused; files it does "
                             "not record are refused always)")
    output.add_argument("--allow-data-change", action="store_true",
                        help="with --resume: go on although the data differ from those the run started on (refused "
                             "without it)")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    scale.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="several processes (one run over every process's devices; start each with the same "
                            "flags but --process-id; docs/scale.md): the address of process 0, where they meet")
    scale.add_argument("--num-processes", metavar="P", type=int, default=None, help="how many processes")
    scale.add_argument("--process-id", metavar="I", type=int, default=None, help="this process, 0..P-1")
    scale.add_argument("--cluster", action="store_true",
                       help="let JAX find the processes of a SLURM, Open MPI or TPU pod job itself (instead of "
                            "the three flags above)")
    scale.add_argument("--launch-timeout", metavar="S", type=int, default=DEFAULT_TIMEOUT_S,
                       help=f"seconds within which all processes must meet, else each ends with one line and "
                            f"exit code {LAUNCH_FAILURE_EXIT} (default {DEFAULT_TIMEOUT_S}); also how long they wait "
                            f"for each other in a checkpoint's save (JAX's heartbeat waits five times as long for "
                            f"a process that stopped answering)")
    reserve(p._option_string_actions, "fedjax-sparse run's own flags")  # (argparse's table of the flags so far)
    for spec in registered().values():  # last, once the command line's own flags are reserved
        add_flags(p, spec.options, used_by=users, seen=seen, container=container)
    for action in groups("data")._group_actions:  # the live registry's names, not a list frozen at import
        if action.dest == "algorithm":  # a refused plug-in's name too: asking for it says why it was left out
            action.choices = (*algorithm_names(), *(name for name in refused() if name not in registered()))
    return p


def command_parser() -> argparse.ArgumentParser:
    """`fedjax-sparse`'s parser: `run` in full, the other commands (handed on whole by `run.cli`) listed."""
    from fedjax_sparse.algorithms import PluginSkipped

    parser = OneLineParser(prog="fedjax-sparse",
                           description="Communication-efficient, sparse federated learning in JAX.")
    parser.add_argument("--version", action="store_true", help="print the version (and JAX's, Flax's, Optax's)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    with warnings.catch_warnings():  # a skipped plug-in: `warn_refused` says it in one line, once the command is known
        warnings.simplefilter("ignore", PluginSkipped)
        run_parser(sub)
    for name, about in (
            ("sweep", "run a grid or an Optuna search of run options over seeds, and tabulate it (`fedjax-sparse "
                      "sweep --help`)"),
            ("experiment", "run a paper's setting, its arms and any registered algorithm side by side, and "
                           "tabulate it (`fedjax-sparse experiment --list`)"),
            ("benchmark", "measure the library on this machine (`fedjax-sparse benchmark --list`)"),
            ("compare", "existing runs side by side: a table of their options that differ and their figures, and "
                        "a plot (`fedjax-sparse compare --help`)"),
            ("convert", "write a data set as memory-mapped files for --dataset mmap:FOLDER (`fedjax-sparse convert "
                        "--help`)")):
        sub.add_parser(name, add_help=False, help=about)
    return parser


def config_from_args(args: argparse.Namespace):
    """The run's config: the flags given, over a --config file's options, or for --resume over the saved config."""
    from fedjax_sparse.algorithms import UnknownAlgorithm, get_spec, option_users
    from fedjax_sparse.console import say
    from fedjax_sparse.core.contract.options import flag_name, refuse_ignored
    from fedjax_sparse.run import SHARED_OPTIONS, RunConfig
    from fedjax_sparse.run.checkpoints import RunCheckpointer, has_checkpoints
    from fedjax_sparse.run.folder import read_saved_config

    given = {k: v for k, v in vars(args).items() if k not in (*COMMAND_FLAGS, *LAUNCH_FLAGS)}
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
