"""Libraries' log lines the library reports itself, or that are no concern of the user's, held back."""

from __future__ import annotations

import contextlib
import logging


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
