"""``--help`` as plain text: module docstrings without reStructuredText, every default shown.

The commands' descriptions are their modules' docstrings, written for the
documentation (double backticks, ``::`` before a literal block, roles such as
``:class:`X```). :func:`plain_text` turns them into what a terminal should
show, and :class:`HelpFormatter` appends each option's default to its help.

Example:
    >>> plain_text("Run ``towerflow train`` with :class:`~towerflow.Trainer`::")
    'Run towerflow train with Trainer:'
"""

from __future__ import annotations

import argparse
import re

__all__ = ["HelpFormatter", "Parser", "plain_text", "polish"]

_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]+\.)?([^`<>]+?)`")  # :class:`~a.b.C` -> C
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def plain_text(text: str) -> str:
    """``text`` with reStructuredText markup removed (see the module example)."""
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)
    text = re.sub(r"^(\s*)::$", "", text, flags=re.MULTILINE)
    return text.replace("\\\\\n", "\\\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and ends each option's help with its default.

    Flags that are off by default and options whose help already states the
    default are left as they are.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or "default" in text
                or isinstance(action, argparse._HelpAction | argparse._VersionAction)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def polish(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser`` plain-text descriptions and the defaults-showing formatter."""
    parser.formatter_class = HelpFormatter
    if parser.description:
        parser.description = plain_text(parser.description)
    if parser.epilog:
        parser.epilog = plain_text(parser.epilog)
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = plain_text(action.help)
    return parser


class Parser(argparse.ArgumentParser):
    """The command line's parser: no abbreviated options (``--max-step`` is not taken for
    ``--max-steps``), and an error says its sentence first, the usage after it.

    Example:
        >>> p = Parser(prog="towerflow x"); _ = p.add_argument("--max-steps", type=int)
        >>> p.parse_known_args(["--max-step", "5"])[1]
        ['--max-step', '5']
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n\n{self.format_usage()}")
