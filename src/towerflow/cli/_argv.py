"""A command line rebuilt from what a parser parsed, so that a spawned copy loses no flag.

Every option the parser defines and the user set (a value other than its
default) is written again with its first spelling; positionals in order.
Because the rebuilt line comes from the parser itself, a flag added to the
parser later reaches the replicas with no table to keep up to date.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("model"); _ = p.add_argument("--device", "--dev")
    >>> _ = p.add_argument("--fast", action="store_true")
    >>> argv_from_namespace(p, p.parse_args(["digits", "--dev", "cpu", "--fast"]))
    ['digits', '--device', 'cpu', '--fast']
"""

from __future__ import annotations

import argparse

__all__ = ["argv_from_namespace"]


def _option(action: argparse.Action, value: object, defaults: bool) -> list[str]:
    flag = action.option_strings[0]
    if action.nargs == 0:  # store_true / store_false / store_const
        return [flag] if value != action.default else []
    if value is None or (value == action.default and not defaults):
        return []
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [part for item in value for part in (flag, str(item))]
        return [flag, *map(str, value)]
    return [flag, str(value)]


def argv_from_namespace(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
                        defaults: bool = False) -> list[str]:
    """The arguments that make ``parser`` parse ``args`` again (sub-commands aside).

    With ``defaults``, an option whose value is its default is written too
    (switches that are off and options that are None excepted), so that the
    line names every setting explicitly.
    """
    argv: list[str] = []
    positionals: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction) \
                or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if action.option_strings:
            argv += _option(action, value, defaults)
        elif isinstance(value, list):
            positionals += map(str, value)
        elif value is not None:
            positionals.append(str(value))
    return positionals + argv
