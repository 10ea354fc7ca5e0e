"""Settings from files under the command line: a ``--config`` file and a run's record.

A command's settings are resolved in layers, the first that has a value wins:

1. the flags given on the command line;
2. the ``--config`` file (YAML or JSON; names are the options' ``dest``,
   with dashes or underscores);
3. the record of the run being resumed (``run.yaml`` in its train dir),
   for the settings that a resumed run keeps;
4. the parser's defaults.

A value from a file goes through its option's type and choices, so a file
can say nothing the command line could not.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--steps", type=int, default=1); _ = p.add_argument("--fast",
    ...                                                                    action="store_true")
    >>> sorted(given_dests(p, ["--steps", "1"]))
    ['steps']
    >>> convert_settings(p, {"steps": "7", "fast": True}, "run.yaml")
    {'steps': 7, 'fast': True}
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping
from typing import Any

from towerflow.errors import InvalidArgumentError
from towerflow.training.runconfig import quoted

__all__ = ["given_dests", "option_actions", "convert_settings", "flag_of", "check_exclusive",
           "merge_layers"]

_UNSET = object()


def option_actions(parser: argparse.ArgumentParser,
                   skip: frozenset[str] = frozenset()) -> dict[str, argparse.Action]:
    """``dest -> action`` of every argument of ``parser`` but help, version and ``skip``."""
    return {a.dest: a for a in parser._actions
            if not isinstance(a, argparse._HelpAction | argparse._VersionAction
                              | argparse._SubParsersAction) and a.dest not in skip}


def flag_of(action: argparse.Action) -> str:
    """How a user spells ``action``: its first flag (``--batch-size``), or its name."""
    return action.option_strings[0] if action.option_strings else action.dest


def given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The ``dest`` of every argument that ``argv`` gives explicitly (a default's value too).

    ``parser`` is not changed: a copy of it parses ``argv`` with every default
    replaced by a marker.
    """
    marked = copy.deepcopy(parser)
    for action in option_actions(marked).values():
        action.default = _UNSET
    parsed = marked.parse_args(argv)
    return {dest for dest, value in vars(parsed).items() if value is not _UNSET}


def _takes_off(action: argparse.Action) -> bool:
    """Whether the option's type reads the word ``off`` (``--sparse-threshold off``)."""
    try:
        return callable(action.type) and action.type("off") == "off"
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False


def _convert(action: argparse.Action, value: Any, source: str) -> Any:
    name = f"{source}: {action.dest}"
    if value is None:
        return None
    if action.nargs == 0:  # a switch: store_true / store_false / BooleanOptionalAction
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} is a switch: write true or false, not {quoted(value)}.")
        return value
    if value is False and _takes_off(action):  # YAML 1.1 reads a bare `off` as false
        value = "off"
    if isinstance(value, dict | list | bool):
        raise InvalidArgumentError(f"{name} takes one value like {flag_of(action)} does, "
                                   f"not {quoted(value)}.")
    try:
        converted = action.type(str(value)) if callable(action.type) else str(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        kind = getattr(action.type, "__name__", "value")
        raise InvalidArgumentError(f"{name}: {quoted(value)} is not a valid {kind} "
                                   f"({str(exc)[:200]}).") from None
    if action.choices is not None and converted not in action.choices:
        raise InvalidArgumentError(
            f"{name}: {quoted(value)} is not one of {', '.join(map(str, action.choices))}."
        )
    return converted


def convert_settings(parser: argparse.ArgumentParser, settings: Mapping[str, Any],
                     source: str) -> dict[str, Any]:
    """``settings`` (names already known to ``parser``) as the parser would have stored them.

    Raises:
        InvalidArgumentError: a value its option would refuse, named with ``source``.
    """
    actions = option_actions(parser)
    return {dest: _convert(actions[dest], value, source) for dest, value in settings.items()}


def check_exclusive(parser: argparse.ArgumentParser, values: Mapping[str, Any],
                    source: str) -> None:
    """Refuse values that set two options of one mutually exclusive group."""
    for group in parser._mutually_exclusive_groups:
        chosen = [a for a in group._group_actions
                  if values.get(a.dest) not in (None, False, a.default)]
        if len(chosen) > 1:
            names = " and ".join(f"{flag_of(a)} {values[a.dest]}" for a in chosen)
            raise InvalidArgumentError(f"{source} sets {names}, which exclude each other; "
                                       "keep one.")


def merge_layers(parser: argparse.ArgumentParser, lower: Mapping[str, Any],
                 upper: Mapping[str, Any]) -> dict[str, Any]:
    """``upper`` over ``lower``; an option ``upper`` sets also removes the other options of
    its mutually exclusive group from ``lower`` (``--num-gpus`` on the command line replaces
    a file's ``replicas``)."""
    merged = dict(lower)
    for group in parser._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        if dests & set(upper):
            for dest in dests:
                merged.pop(dest, None)
    merged.update(upper)
    return merged
