"""Where a task's server listens and when a ps task ends: options of ``towerflow train`` and
``towerflow server`` alike.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(); _ = p.add_argument("--bind"); add_lifecycle_arguments(p)
    >>> args = p.parse_args(["--idle-timeout", "0"])
    >>> bind_host(args, {"TOWERFLOW_BIND": "0.0.0.0"}), idle_timeout_from_args(args)
    ('0.0.0.0', None)
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping

__all__ = ["BIND_ENV", "bind_host", "add_lifecycle_arguments", "idle_timeout_from_args"]

#: the environment variable that names the interface a task's server listens on (--bind)
BIND_ENV = "TOWERFLOW_BIND"


def bind_host(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str | None:
    """Where this task's server listens: ``--bind``, else ``$TOWERFLOW_BIND``, else None (the
    host its cluster names)."""
    env = os.environ if env is None else env
    return args.bind or env.get(BIND_ENV) or None


def add_lifecycle_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--serve-forever`` and ``--idle-timeout``: when a ps task ends."""
    parser.add_argument(
        "--serve-forever",
        action="store_true",
        help="ps: serve until stopped (SIGTERM, Ctrl-C) instead of ending once every worker "
        "and the chief have finished",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="ps: while every worker that has not finished is dead or suspended, keep the "
        "parameters for their return this long, then exit with an error (default 3600; 0 "
        "waits forever)",
    )


def idle_timeout_from_args(args: argparse.Namespace) -> float | None:
    """``--idle-timeout SECONDS`` as ``ServerOptions.idle_timeout`` (None for 0).

    Raises:
        InvalidArgumentError: a negative or non-finite value.
    """
    from towerflow.errors import InvalidArgumentError

    seconds = args.idle_timeout
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise InvalidArgumentError(
            f"--idle-timeout {seconds:g} is not a number of seconds >= 0; give how long a ps "
            "keeps the parameters while its workers are away, or 0 to keep them forever."
        )
    return seconds or None
