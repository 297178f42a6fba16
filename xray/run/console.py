"""The driver's console: what `python -m xray.train` prints, at three levels.

    default      xray's INFO lines (models ready, eval, checkpoints, where the outputs are), the
                 libraries' warnings and errors, the progress bars, the result line
    -v           xray's DEBUG lines too (one per weight sync, ...), in the Workhorses as well,
                 and the libraries' INFO lines
    --quiet      warnings, errors and the result line: no progress bar, no INFO line

Log lines go to stderr; stdout carries only the result line (and `--dry-run`'s config and plan).
The Workhorses' environment and filters (`xray.workhorse.quiet`) keep the libraries' start-up
noise out; the progress line of an RL run is `xray.run.progress`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from xray.workhorse.quiet import LOG_LEVEL_ENV, quiet_driver

OWN_LOGGERS = ("xray", "algorithms")
"""Loggers of this project; every other logger is a library's."""
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = {"quiet": (logging.WARNING, logging.WARNING), "default": (logging.INFO, logging.WARNING),
          "verbose": (logging.DEBUG, logging.INFO)}
"""Console level -> (xray's level, the libraries' level)."""


def console_flags(exclusive: bool = True) -> argparse.ArgumentParser:
    """`-v` and `--quiet`, as a parent parser of the command line (`exclusive=False`: a parser
    that reads them before the command line is checked, and never fails)."""
    p = argparse.ArgumentParser(add_help=False)
    group = p.add_mutually_exclusive_group() if exclusive else p
    group.add_argument("-v", "--verbose", action="store_true", help="also print DEBUG lines (one per weight sync, ...)")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="print only warnings, errors and the result line (no progress bar)")
    return p


def console_level(args: argparse.Namespace) -> str:
    return "verbose" if args.verbose else "quiet" if args.quiet else "default"


def progress_shown() -> bool:
    """Whether progress bars are drawn: not under `--quiet`, nor when the user set tqdm's own
    TQDM_DISABLE (read here at call time; tqdm reads it only when it is first imported)."""
    return os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true", "yes")


def setup_console(level: str = "default") -> None:
    """Configure this process's logging for `level` (a key of `LEVELS`): one stderr handler on
    the root logger, xray's loggers and the libraries' at their levels; `quiet` turns the
    progress bars off (TQDM_DISABLE, also inherited by a local Ray cluster's processes; xray's
    bars ask `progress_shown`), and `verbose` travels to the Workhorses
    (`xray.workhorse.quiet.workhorse_env`)."""
    own, libraries = LEVELS[level]
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(libraries)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(own)
    if level == "quiet":
        os.environ["TQDM_DISABLE"] = "1"
    if level == "verbose":
        os.environ[LOG_LEVEL_ENV] = "DEBUG"
    quiet_driver()
