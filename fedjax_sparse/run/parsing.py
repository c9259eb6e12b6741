"""The command line's parser: a malformed or unknown flag is one line naming it, as every other error is."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """A malformed or unknown flag is one line naming it (argparse prints its whole usage first);
    `before_help` says what `--help` should be preceded by on stderr."""

    def __init__(self, *args, before_help=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._before_help = before_help

    def print_help(self, file=None):
        if self._before_help is not None:
            self._before_help()
        super().print_help(file)

    def error(self, message: str):
        self.exit(2, f"fedjax-sparse: error: {' '.join(message.split())} (`{self.prog} --help` lists the "
                     f"options)\n")
