"""A run's settings as a file: ``--config`` files and the record ``run.yaml`` in its train dir.

A setting is named after ``towerflow train``'s option (its ``dest``:
``batch_size`` for ``--batch-size``); a file may spell it with dashes or
underscores. The same mapping is read from a ``--config`` file (YAML or JSON)
and written, resolved, to ``<train_dir>/run.yaml`` by the chief when training
starts, so the record of a run is itself a valid ``--config`` file.

A resumed run (its train dir holds a checkpoint) checks the settings it was
asked for against the record: the settings in :data:`MAY_CHANGE` and
:data:`PER_RUN` may differ between runs; any other setting (the model, the
batch size, the update mode, the optimizer, ...) must keep its recorded value.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = save_run_settings(d, {"model": "digits", "batch_size": 32})
    ...     load_run_settings(d)["batch_size"]
    32
    >>> normalize_settings({"batch-size": 8}, {"batch_size"}, "run.yaml")
    {'batch_size': 8}
"""

from __future__ import annotations

import difflib
import json
import reprlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from towerflow.checkpoint.files import json_depth_exceeds
from towerflow.errors import DataLossError, InvalidArgumentError, NotFoundError

__all__ = ["RUN_FILE", "MAY_CHANGE", "PER_RUN", "read_settings_file", "normalize_settings",
           "save_run_settings", "load_run_settings", "resume_conflicts", "conflict_message",
           "holds_checkpoint", "quoted", "MAX_DEPTH"]

#: the record of a run's resolved settings, in its train dir
RUN_FILE = "run.yaml"

#: settings a resumed run may change; a run started without them takes the recorded values
MAY_CHANGE = frozenset({
    "ps", "replicas", "num_gpus", "max_steps", "log_every", "summary_every", "checkpoint_every",
    "max_to_keep", "data_dir", "no_download", "ps_strategy", "partition_threshold", "ps_timeout",
    "step_timeout", "init_timeout", "on_bad_gradient", "ps_prefetch", "collective_timeout",
    "table_part_bytes", "serve_forever", "idle_timeout", "max_elastic_workers", "stop_deadline",
    "export_dir", "export_every_secs", "dense", "embedding_staleness", "ps_replicas",
})

#: settings of this machine or this invocation: never taken from the record
PER_RUN = frozenset({
    "train_dir", "device", "no_progress", "log_device_placement", "backend", "bind", "join",
})

#: deepest nesting of lists and mappings a settings file may hold
MAX_DEPTH = 32
#: characters of a bad value an error message quotes
_QUOTED = 80

_HEADER = ("# towerflow train's resolved settings of the run in this directory.\n"
           "# A resumed run checks them; `towerflow eval` takes its model and data from them;\n"
           "# `towerflow train --config run.yaml` runs with them again.\n")


def quoted(value: Any, limit: int = _QUOTED) -> str:
    """``repr(value)`` cut to ``limit`` characters (``...`` marks the cut), for messages.

    Example:
        >>> quoted("x" * 100, 12), quoted(list(range(100)))
        ("'xxx...xxxx'", '[0, 1, 2, 3, 4, 5, 6, 7, ...]')
    """
    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    short.maxlist = short.maxdict = short.maxtuple = short.maxset = 8
    short.maxlevel = 3
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _strict_loader() -> type:
    """YAML's safe loader without aliases and with at most :data:`MAX_DEPTH` levels of nesting.

    An alias repeats a node without its bytes ("billion laughs": 300 bytes
    that expand to gigabytes); a settings file never needs one.
    """
    import yaml

    class Strict(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, f"an alias (*{event.anchor[:40]}) repeats another node; settings "
                    "files may not use anchors and aliases, write the value out", event.start_mark)
            if self.depth >= MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"values are nested more than {MAX_DEPTH} levels deep",
                    self.peek_event().start_mark)
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Strict


def read_settings_file(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML (``.yaml``, ``.yml``) or JSON (``.json``) settings file holds.

    YAML anchors and aliases are refused, and so is nesting deeper than
    :data:`MAX_DEPTH`; messages quote at most a short prefix of a bad value.

    Raises:
        NotFoundError: there is no file at ``path``.
        InvalidArgumentError: the file is not a YAML / JSON mapping of names to values.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise NotFoundError(f"Settings file {str(path)!r} does not exist; pass the path of a "
                            "YAML or JSON file (--config run.yaml).")
    text = path.read_text()
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        if kind == "JSON":
            if json_depth_exceeds(text.encode(), MAX_DEPTH):
                raise ValueError(f"values are nested more than {MAX_DEPTH} levels deep")
            raw = json.loads(text)
        else:
            loader = _strict_loader()(text)  # YAML's safe loader, stricter
            try:
                raw = loader.get_single_data()
            finally:
                loader.dispose()
    except RecursionError:
        raise InvalidArgumentError(
            f"{str(path)!r} is not valid {kind}: values are nested more than {MAX_DEPTH} levels "
            "deep; fix it or pass another --config.") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise InvalidArgumentError(
            f"{str(path)!r} is not valid {kind}: {' '.join(str(exc).split())[:400]}; "
            "fix it or pass another --config."
        ) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise InvalidArgumentError(
            f"{str(path)!r} holds a {type(raw).__name__}, not a mapping of setting names to "
            "values (e.g. `batch_size: 64`); fix it or pass another --config."
        )
    return raw


def normalize_settings(raw: Mapping[str, Any], known: Iterable[str],
                       source: str) -> dict[str, Any]:
    """``raw`` with dashes in names turned into underscores; an unknown name is refused.

    Raises:
        InvalidArgumentError: a name is not in ``known`` (the message names the
            closest known one and lists them all), or two spellings of one name.
    """
    known = sorted(set(known))
    settings: dict[str, Any] = {}
    for name, value in raw.items():
        key = name.strip().replace("-", "_")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise InvalidArgumentError(
                f"{source}: unknown setting {quoted(name)}; {hint}known settings: "
                f"{', '.join(known)}."
            )
        if key in settings:
            raise InvalidArgumentError(f"{source}: setting {key!r} is given twice "
                                       f"(as {key!r} and {quoted(name)}); keep one.")
        settings[key] = value
    return settings


def save_run_settings(train_dir: str | Path, settings: Mapping[str, Any]) -> Path:
    """Write ``settings`` to ``<train_dir>/run.yaml`` atomically (a crash leaves the old file)."""
    import yaml

    from towerflow.checkpoint.atomic import write_file_atomic

    path = Path(train_dir) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump({k: _plain(v) for k, v in settings.items()}, sort_keys=False,
                          default_flow_style=False)
    write_file_atomic(path, _HEADER + body)
    return path


def _plain(value: Any) -> Any:
    """A value YAML's safe dumper writes: paths as strings, tuples as lists."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def load_run_settings(train_dir: str | Path) -> dict[str, Any] | None:
    """The settings recorded in ``<train_dir>/run.yaml``, or None when there is none.

    Raises:
        DataLossError: the file exists but is not a mapping of settings.
    """
    path = Path(train_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        return read_settings_file(path)
    except InvalidArgumentError as exc:
        raise DataLossError(
            f"{str(path)!r} does not hold a run's settings ({exc}); delete it and give the "
            "settings (--data, --data-dir, --synthetic-examples, ...) on the command line."
        ) from exc


def holds_checkpoint(train_dir: str | Path) -> bool:
    """True when ``train_dir`` holds a checkpoint a run would resume from."""
    from towerflow.checkpoint import latest_checkpoint

    return Path(train_dir).is_dir() and latest_checkpoint(train_dir) is not None


def resume_conflicts(saved: Mapping[str, Any],
                     wanted: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, saved value, wanted value)`` of each setting a resumed run may not change."""
    return [(name, saved[name], value) for name, value in wanted.items()
            if name in saved and name not in MAY_CHANGE and name not in PER_RUN
            and saved[name] != value]


def conflict_message(train_dir: str | Path, conflicts: list[tuple[str, Any, Any]],
                     flag_of: Mapping[str, str]) -> str:
    """One sentence naming each conflicting setting, both values and the ways out.

    Example:
        >>> conflict_message("runs/a", [("mode", "sync", "async")], {"mode": "--mode"})[:60]
        "'runs/a' holds a run trained with mode sync, and this run as"
    """
    def spell(value: Any) -> str:
        return "none" if value is None else str(value)

    saved = ", ".join(f"{name} {spell(old)}" for name, old, _ in conflicts)
    asked = ", ".join(f"{flag_of.get(name, name)} {spell(new)}" for name, _, new in conflicts)
    keep = ", ".join(f"{flag_of.get(name, name)} {spell(old)}" for name, old, _ in conflicts)
    these = "these settings" if len(conflicts) > 1 else "this setting"
    return (f"{str(train_dir)!r} holds a run trained with {saved}, and this run asks for "
            f"{asked}, but {these} cannot change when a run resumes ({RUN_FILE} in the train "
            f"dir records them); resume with {keep} (or leave {these} out), or start a new run "
            "with another --train-dir.")
