"""Where the settings of ``towerflow train`` come from: flags, a ``--config`` file, a resumed run.

Flags given on the command line win over the file, the file over the record
(``run.yaml``) of the run resumed from ``--train-dir``, the record over the
defaults; a setting that cannot change when a run resumes is refused when
given with another value. :func:`run_record` is what the chief writes to
``run.yaml`` for the next resume.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from towerflow.cli._train_options import add_train_arguments, flag_of_dest, option_defaults

__all__ = ["resolve_args", "run_record"]

log = logging.getLogger("towerflow.training")


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``args`` from its ``--config`` file and the record of the run it resumes.

    Flags given on the command line (``args._argv``, set by the ``towerflow``
    entry point) win over the file, the file over the record, the record
    over the defaults. ``args._explicit`` becomes the names the command line
    or the file set.

    Raises:
        InvalidArgumentError: an unknown setting or bad value in the file, no
            model named anywhere, or a resume that changes a setting it may not.
    """
    from towerflow.cli._config import (
        check_exclusive,
        convert_settings,
        given_dests,
        merge_layers,
        option_actions,
    )
    from towerflow.training.runconfig import normalize_settings, read_settings_file

    parser = add_train_arguments(argparse.ArgumentParser(add_help=False))
    actions = option_actions(parser, skip=frozenset({"config"}))
    argv = getattr(args, "_argv", None)
    given = (given_dests(parser, argv) if argv is not None
             else {d for d, a in actions.items() if getattr(args, d) != a.default})
    explicit = {d: getattr(args, d) for d in given if d in actions}
    if args.config:
        source = f"--config {args.config}"
        from_file = convert_settings(parser, normalize_settings(
            read_settings_file(args.config), actions, source), source)
        check_exclusive(parser, from_file, source)
        explicit = merge_layers(parser, from_file, explicit)
    _fold_model_option(explicit)
    args.model_spec = None
    for dest, value in explicit.items():
        setattr(args, dest, value)
    args.config = None  # its settings are in args now: a replica gets them as flags
    _resume(args, parser, explicit)
    args._explicit = frozenset(explicit)
    return args


def _fold_model_option(explicit: dict[str, Any]) -> None:
    """``--model MODULE:FACTORY`` is the positional model spelled as a flag."""
    from towerflow.errors import InvalidArgumentError

    spec = explicit.pop("model_spec", None)
    if spec is None:
        return
    if explicit.get("model") not in (None, spec):
        raise InvalidArgumentError(
            f"towerflow train names two models, {explicit['model']} and --model {spec}; "
            "keep one.")
    explicit["model"] = spec


def _resume(args: argparse.Namespace, parser: argparse.ArgumentParser,
            explicit: Mapping[str, Any]) -> None:
    """Check the settings against the record of the run resumed, and take the rest from it."""
    from towerflow.cli._config import convert_settings, flag_of, merge_layers, option_actions
    from towerflow.errors import InvalidArgumentError
    from towerflow.training.runconfig import (
        PER_RUN,
        RUN_FILE,
        conflict_message,
        holds_checkpoint,
        load_run_settings,
        normalize_settings,
        resume_conflicts,
    )
    from towerflow.training.tasks import default_train_dir

    if args.train_dir is None and args.model is not None:
        args.train_dir = default_train_dir(args.model)
    saved = None
    if args.train_dir is not None and holds_checkpoint(args.train_dir):
        saved = load_run_settings(args.train_dir)
    if saved is not None:
        actions = option_actions(parser, skip=frozenset({"config"}))
        source = str(Path(args.train_dir) / RUN_FILE)
        saved = convert_settings(parser, normalize_settings(saved, actions, source), source)
        conflicts = resume_conflicts(saved, explicit)
        if conflicts:
            flags = {dest: flag_of(action) for dest, action in actions.items()}
            raise InvalidArgumentError(conflict_message(args.train_dir, conflicts, flags))
        kept = merge_layers(parser, {d: v for d, v in saved.items() if d not in PER_RUN},
                            explicit)
        reused = sorted(d for d in kept if d not in explicit)
        for dest in reused:
            setattr(args, dest, saved[dest])
        unusual = [f"{d}={saved[d]}" for d in reused if saved[d] != option_defaults().get(d)]
        log.info("resuming %s with its recorded settings%s", args.train_dir,
                 f" ({', '.join(unusual)})" if unusual else "")
    if args.model is None:
        raise InvalidArgumentError(
            "towerflow train needs a model: name it (cifar10, digits, click, movielens or "
            "criteo, or your own as --model MODULE:FACTORY), give a --config file that names "
            "it, or a --train-dir whose run.yaml does.")
    if args.train_dir is None:
        args.train_dir = default_train_dir(args.model)
    _task_options(args, explicit, saved)


def _task_options(args: argparse.Namespace, explicit: Mapping[str, Any],
                  saved: Mapping[str, Any] | None) -> None:
    """Give the model's own defaults to options neither given nor recorded; refuse the
    options of another model (``--table-rows`` for digits).

    Raises:
        InvalidArgumentError: an option of another model set to anything but its default.
    """
    from towerflow.errors import InvalidArgumentError
    from towerflow.training.tasks import TASKS, task_class
    from towerflow.training.user_task import UserTask, is_factory_spec, load_factory

    task = task_class(args.model)
    for dest, value in task.option_defaults.items():
        if dest not in explicit and (saved is None or dest not in saved):
            setattr(args, dest, value)
    if is_factory_spec(args.data) and task is not UserTask:
        raise InvalidArgumentError(
            f"--data {args.data} is the data of your own model, not of {args.model}; "
            "remove it, or train your model with --model MODULE:FACTORY.")
    if task is UserTask:  # refused here, before any process starts
        user = UserTask.from_settings(vars(args))
        load_factory(user.name, "--model"), load_factory(user.data, "--data")
    others = {**TASKS, "MODULE:FACTORY": UserTask}
    for name, other in others.items():
        for dest, default in other.options.items():
            value = getattr(args, dest)
            if dest not in task.options and value != default:
                raise InvalidArgumentError(
                    f"{flag_of_dest(dest)} {value} applies to the {name} model only, not "
                    f"{args.model}; remove it, or train {name}.")


def run_record(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of this run, for its ``run.yaml``."""
    return {dest: getattr(args, dest) for dest in option_defaults()
            if dest not in ("config", "model_spec")}
