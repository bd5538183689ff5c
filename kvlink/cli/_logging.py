"""Every command's ``--log-level``: kvlink's log records (``logging.getLogger("kvlink")``, which
the library leaves to the application: a NullHandler) go to stderr at the level it names.

Commands call :func:`add_log_level` on their parser (it reaches every subcommand's parser too,
so ``kvlink-bench loopback --log-level debug`` and ``kvlink-bench --log-level debug loopback``
both work) and :func:`setup` with the parsed value before they start anything.
"""

from __future__ import annotations

import argparse
import logging
import sys

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger("kvlink")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler a command installs, told apart from any other the application added."""


def add_log_level(parser: argparse.ArgumentParser, default: str = "warning") -> None:
    """Adds ``--log-level`` to ``parser`` and to each of its subcommands' parsers."""
    _add(parser, default)


def _add(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument(
        "--log-level",
        choices=list(LEVELS),
        # a subcommand's parser must not overwrite a level given before the subcommand
        default=argparse.SUPPRESS if default is None else default,
        help="kvlink's log records at this level and above go to stderr "
        f"(default: {default or 'as above'})",
    )
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                if sub.add_help:  # a placeholder (add_help=False) hands its argv on whole
                    _add(sub, None)


def setup(level: str, prog: str) -> None:
    """Sends kvlink's records at ``level`` ("debug", "info", ...) and above to stderr.
    Idempotent: a second call replaces the first's handler."""
    for h in list(log.handlers):
        if isinstance(h, _StderrHandler):
            log.removeHandler(h)
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    log.addHandler(handler)
    log.setLevel(LEVELS[level])
    log.debug("%s: kvlink's records at %s and above go to stderr", prog, level.upper())
