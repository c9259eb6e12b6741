"""What the library says to the user (one line, clear of any progress bar), and the libraries' log lines it
reports itself, or that are no concern of the user's, held back."""

from __future__ import annotations

import contextlib
import logging
import sys


def say(message: str) -> None:
    """One line to the user on stderr, clear of any progress bar."""
    from tqdm.auto import tqdm
    tqdm.write(f"fedjax-sparse: {message}", file=sys.stderr)


@contextlib.contextmanager
def quieted(logger_name: str, level: int):
    """Within the block, `logger_name` passes only records of `level` and above (absl's: orbax and
    dp-accounting log through it)."""
    logger = logging.getLogger(logger_name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
