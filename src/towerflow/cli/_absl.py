"""absl-style boolean flags, as TensorFlow programs take them: ``--flag=true``, ``--noflag``.

The articles' programs are run as ``--log_device_placement=True``; argparse
switches take no value. :func:`absl_booleans` rewrites such arguments of a
command's switches before parsing: ``--flag=true`` (``1``, ``yes``, ``t``, any
case) becomes ``--flag``; ``--flag=false`` (``0``, ``no``, ``f``) and
``--noflag`` become nothing (the switch not given).

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--log-device-placement", "--log_device_placement",
    ...                    action="store_true")
    >>> absl_booleans(p, ["--log_device_placement=True"])
    ['--log_device_placement']
    >>> absl_booleans(p, ["--nolog_device_placement", "--log-device-placement=0"])
    []
"""

from __future__ import annotations

import argparse

from towerflow.errors import InvalidArgumentError

__all__ = ["absl_booleans"]

_TRUE = frozenset({"true", "1", "yes", "t", "y"})
_FALSE = frozenset({"false", "0", "no", "f", "n"})


def _switches(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The option strings of the switches of the parser and of the sub-command ``argv`` names."""
    found: set[str] = set()
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = next((a for a in argv if not a.startswith("-")), None)
            if chosen in action.choices:
                parsers.append(action.choices[chosen])
    for each in parsers:
        for action in each._actions:
            if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
                found.update(action.option_strings)
    return found


def absl_booleans(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with absl-style boolean flags of ``parser``'s switches in argparse's form.

    Raises:
        InvalidArgumentError: ``--flag=VALUE`` of a switch with a value that is no boolean.
    """
    switches = _switches(parser, argv)
    out: list[str] = []
    for index, arg in enumerate(argv):
        if arg == "--":
            return out + argv[index:]
        name, has_value, value = arg.partition("=")
        if has_value and name in switches:
            word = value.strip().lower()
            if word not in _TRUE | _FALSE:
                raise InvalidArgumentError(
                    f"{arg}: {name} is a switch; give {name}, {name}=true or {name}=false.")
            if word in _TRUE:
                out.append(name)
            continue
        if not has_value and arg.startswith("--no") and f"--{arg[4:]}" in switches \
                and arg not in switches:
            continue  # --noFLAG: FLAG not given
        out.append(arg)
    return out
