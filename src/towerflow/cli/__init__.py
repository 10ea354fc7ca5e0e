"""The ``towerflow`` command line: ``devices | train | eval | server | launch | status | export``.

Each sub-command lives in its own module of this package and exposes
``add_parser(subparsers)`` (cheap: no torch import) and ``run(args) -> int``.
The table below is the whole registry; modules are imported only when needed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from towerflow.cli._help import HelpFormatter, Parser, polish

# command -> module (in towerflow.cli) implementing it
_COMMANDS: dict[str, str] = {
    "devices": "devices",
    "train": "train",
    "eval": "evaluate",
    "server": "server",
    "launch": "launch",
    "status": "status",
    "export": "export",
}


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered.

    Each command's namespace carries ``_run`` (its ``run`` function) and
    ``_prog`` (``"towerflow train"``, the prefix of its error messages).
    """
    from towerflow import __version__

    parser = Parser(
        prog="towerflow",
        description="Device placement, multi-GPU training and parameter-server clusters "
        "for PyTorch.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"towerflow {__version__}",
                        help="print the version and exit")
    # the chosen command's name is not stored: a command may have an argument of any name
    sub = parser.add_subparsers(metavar="COMMAND")
    sub.required = True
    for module_name in _COMMANDS.values():
        module = importlib.import_module(f"towerflow.cli.{module_name}")
        command_parser = polish(module.add_parser(sub))
        command_parser.set_defaults(_run=module.run, _prog=command_parser.prog)
    return parser


def _command_argv(argv: list[str]) -> list[str]:
    """The arguments after the command's name (``towerflow`` itself takes no option values)."""
    for index, arg in enumerate(argv):
        if not arg.startswith("-"):
            return argv[index + 1:]
    return []


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``towerflow`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    from towerflow.cli._absl import absl_booleans
    from towerflow.errors import TowerflowError

    try:
        argv = absl_booleans(parser, argv)  # --log_device_placement=true, as TensorFlow's
    except TowerflowError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    args._argv = _command_argv(argv)  # what was given on the command line, for --config
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    from towerflow.errors import TowerflowError

    try:
        return int(args._run(args) or 0)
    except TowerflowError as exc:
        print(f"{args._prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
