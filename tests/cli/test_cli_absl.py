"""absl-style boolean flags (``--log_device_placement=true``, ``--noflag``) on the command line."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from towerflow.cli import build_parser, main
from towerflow.cli._absl import absl_booleans
from towerflow.errors import InvalidArgumentError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log_device_placement", action="store_true")
    parser.add_argument("--no-progress", action="store_false", dest="progress")
    parser.add_argument("--name")
    return parser


@given(st.sampled_from(["true", "True", "TRUE", "1", "yes", "t"]),
       st.sampled_from(["false", "False", "0", "no", "f"]))
def test_true_and_false_spellings_turn_a_switch_on_and_off(yes: str, no: str) -> None:
    parser = _parser()
    on = parser.parse_args(absl_booleans(parser, [f"--log_device_placement={yes}"]))
    off = parser.parse_args(absl_booleans(parser, [f"--log_device_placement={no}"]))
    assert (on.log_device_placement, off.log_device_placement) == (True, False)
    assert parser.parse_args(absl_booleans(parser, [f"--no-progress={no}"])).progress is True


def test_noflag_turns_a_switch_off_and_other_arguments_are_kept() -> None:
    parser = _parser()
    argv = ["--nolog_device_placement", "--name=--x=true", "--", "--log_device_placement=1"]
    assert absl_booleans(parser, argv) == ["--name=--x=true", "--", "--log_device_placement=1"]


def test_a_value_that_is_no_boolean_is_refused_with_the_way_out() -> None:
    with pytest.raises(InvalidArgumentError, match=r"--log_device_placement=maybe: .* give "
                       r"--log_device_placement, --log_device_placement=true or "):
        absl_booleans(_parser(), ["--log_device_placement=maybe"])


def test_the_train_command_takes_the_articles_flag(capsys) -> None:
    argv = absl_booleans(build_parser(), ["train", "digits", "--log_device_placement=True"])
    assert build_parser().parse_args(argv).log_device_placement is True
    with pytest.raises(SystemExit):
        main(["train", "digits", "--log_device_placement=perhaps"])
    assert "--log_device_placement is a switch" in capsys.readouterr().err
