"""The ``towerflow`` command line as a whole: --version, --help text, error prefixes."""

from __future__ import annotations

import argparse
import re
import subprocess

import pytest

import towerflow
from towerflow.cli import build_parser, main
from towerflow.cli._help import plain_text


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


COMMANDS = sorted(_commands())


def test_version_prints_the_package_version(python, subprocess_env) -> None:
    proc = subprocess.run([python, "-m", "towerflow", "--version"], env=subprocess_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"towerflow {towerflow.__version__}"


def test_every_command_is_listed() -> None:
    assert {"devices", "train", "eval", "server", "launch"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_plain_text(command, python, subprocess_env) -> None:
    proc = subprocess.run([python, "-m", "towerflow", command, "--help"], env=subprocess_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert f"usage: towerflow {command}" in text
    for markup in ("``", ":class:", ":func:", ":mod:", ":meth:"):
        assert markup not in text, f"{markup!r} in towerflow {command} --help:\n{text}"
    assert not re.search(r"\S::$", text, re.MULTILINE), text


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_shows_its_default(command) -> None:
    parser = _commands()[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"towerflow {command} {name} has no help"
        shown = parser._get_formatter()._get_help_string(action) % vars(action)
        if action.option_strings and action.default not in (None, False):
            default = action.default
            spelled = {str(default)} | ({format(default, "g")} if isinstance(default, float)
                                        else set())
            assert "default" in shown and any(s in shown for s in spelled), (command, name, shown)


def test_train_help_shows_the_defaults_it_used_to_hide() -> None:
    parser = _commands()["train"]
    formatter = parser._get_formatter()
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    for flag, default in [("--max-steps", "1000000"), ("--log-every", "10"),
                          ("--summary-every", "100"), ("--checkpoint-every", "1000"),
                          ("--max-to-keep", "5"), ("--ema-decay", "0.9999"), ("--seed", "0"),
                          ("--lr-decay-factor", "0.1"), ("--synthetic-examples", "10000"),
                          ("--mode", "async")]:
        action = by_flag[flag]
        shown = formatter._get_help_string(action) % vars(action)
        assert shown.endswith(f"(default: {default})"), (flag, shown)
    flat = " ".join(parser.format_help().split())
    assert "global step at which training stops (default: 1000000)" in flat


def test_errors_of_a_command_are_prefixed_with_its_name(capsys) -> None:
    assert main(["launch"]) == 2  # no command to run: refused by launch itself
    err = capsys.readouterr().err
    assert err.startswith("towerflow launch: error: "), err
    assert "[]" not in err


def test_every_command_knows_its_own_name() -> None:
    parser = build_parser()
    for command in COMMANDS:
        argv = {"train": ["train", "digits"], "eval": ["eval", "digits"],
                "launch": ["launch", "--", "true"],
                "export": ["export", "--train-dir", "d", "--out", "e"]}.get(command, [command])
        assert parser.parse_args(argv)._prog == f"towerflow {command}"


def test_plain_text_removes_restructured_text_markup() -> None:
    doc = ("``towerflow train``: see :class:`~towerflow.Trainer` and :func:`run`.\n\n"
           "One process::\n\n    towerflow train cifar10\n\nA literal ``a`` or\n\n::\n\n    x\n")
    assert plain_text(doc) == ("towerflow train: see Trainer and run.\n\nOne process:\n\n"
                               "    towerflow train cifar10\n\nA literal a or\n\n\n    x\n")
