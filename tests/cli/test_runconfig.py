"""``--config`` files and the run record ``run.yaml``: round trip, resume checks, eval reuse."""

from __future__ import annotations

import json
import logging
import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from towerflow.checkpoint import CheckpointManager
from towerflow.cli import main
from towerflow.errors import DataLossError, InvalidArgumentError
from towerflow.training.runconfig import (
    MAY_CHANGE,
    PER_RUN,
    load_run_settings,
    normalize_settings,
    read_settings_file,
    resume_conflicts,
    save_run_settings,
)

PRECISION = re.compile(r"^precision @ 1 = \d\.\d{3}$", re.MULTILINE)
#: a short digits run on the CPU, as a --config file spells it (dashes and underscores)
SETTINGS = {"model": "digits", "batch-size": 16, "max_steps": 4, "log_every": 2,
            "summary-every": 0, "checkpoint_every": 2, "no_progress": True, "device": "cpu",
            "seed": 3, "optimizer": "momentum", "momentum": 0.5, "ema_decay": 0.9}


def _write(path, settings) -> str:
    text = json.dumps(settings) if path.suffix == ".json" else yaml.safe_dump(settings)
    path.write_text(text)
    return str(path)


def _record(train_dir) -> dict:
    return yaml.safe_load((train_dir / "run.yaml").read_text())


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_config_file_trains_and_its_record_runs_again(tmp_path, suffix) -> None:
    first = tmp_path / "first"
    assert main(["train", "--config", _write(tmp_path / f"c{suffix}", SETTINGS),
                 "--train-dir", str(first)]) == 0
    record = _record(first)
    expected = {k.replace("-", "_"): v for k, v in SETTINGS.items()}
    assert {k: record[k] for k in expected} == expected
    assert record["train_dir"] == str(first) and record["lr"] == 0.1  # resolved defaults
    assert record["mode"] == "async" and record["staleness"] == 2
    assert CheckpointManager(first).latest().name == "ckpt-00000004"
    # the record is a --config file: the same run again elsewhere
    second = tmp_path / "second"
    assert main(["train", "--config", _write(tmp_path / "again.yaml", record | {
        "train_dir": str(second)})]) == 0
    assert _record(second) == record | {"train_dir": str(second)}
    assert CheckpointManager(second).latest().name == "ckpt-00000004"


def test_flags_override_the_file_even_at_their_default_value(tmp_path) -> None:
    config = _write(tmp_path / "c.yaml", SETTINGS)
    run = tmp_path / "run"
    assert main(["train", "--config", config, "--train-dir", str(run), "--batch-size", "8",
                 "--seed", "0", "--max-steps", "2"]) == 0
    record = _record(run)
    assert (record["batch_size"], record["seed"], record["max_steps"]) == (8, 0, 2)
    assert record["momentum"] == 0.5  # from the file


def test_an_unknown_setting_names_the_closest_and_every_known_one(tmp_path, capsys) -> None:
    config = _write(tmp_path / "c.yaml", {"model": "digits", "replica_to_aggregate": 1})
    assert main(["train", "--config", config]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"towerflow train: error: --config {re.escape(config)}: unknown setting "
                    r"'replica_to_aggregate'; did you mean 'replicas_to_aggregate'\? known "
                    r"settings: adam_beta1, adam_beta2, backend, batch_size, .*, weight_decay, whole_tables\.$",
                    err), err
    assert "config," not in err  # a config file cannot name another one


@pytest.mark.parametrize(("settings", "message"), [
    ({"batch_size": "many"}, r"batch_size: 'many' is not a valid int"),
    ({"mode": "eventually"}, r"mode: 'eventually' is not one of async, sync, ssp\."),
    ({"no_progress": "yes please"}, r"no_progress is a switch: write true or false"),
    ({"lr": [0.1, 0.2]}, r"lr takes one value like --lr does"),
    ({"replicas": 2, "num_gpus": 2}, r"sets --num-gpus 2 and --replicas 2, which exclude each "
     r"other; keep one\."),
    ({"batch_size": 1, "batch-size": 2}, r"setting 'batch_size' is given twice"),
])
def test_a_bad_value_in_a_config_file_is_named(tmp_path, capsys, settings, message) -> None:
    config = _write(tmp_path / "c.yaml", {"model": "digits", **settings})
    assert main(["train", "--config", config]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_config_file_that_is_not_a_mapping_or_not_there_is_named(tmp_path) -> None:
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(InvalidArgumentError, match=r"holds a list, not a mapping"):
        read_settings_file(tmp_path / "list.yaml")
    (tmp_path / "bad.json").write_text("{batch_size: 1")
    with pytest.raises(InvalidArgumentError, match=r"'.*bad\.json' is not valid JSON"):
        read_settings_file(tmp_path / "bad.json")
    with pytest.raises(Exception, match=r"Settings file '.*nowhere\.yaml' does not exist"):
        read_settings_file(tmp_path / "nowhere.yaml")


def test_the_command_line_replicas_option_replaces_the_files_gpus(tmp_path) -> None:
    from towerflow.cli import build_parser
    from towerflow.cli.train import resolve_args

    config = _write(tmp_path / "c.yaml", {"model": "digits", "num_gpus": 2})
    args = build_parser().parse_args(["train", "--config", config, "--replicas", "2",
                                      "--train-dir", str(tmp_path / "run")])
    args._argv = ["--config", config, "--replicas", "2", "--train-dir", str(tmp_path / "run")]
    resolve_args(args)
    assert (args.replicas, args.num_gpus, args.model) == (2, None, "digits")


def _train(run, *flags: str) -> int:
    return main(["train", "digits", "--train-dir", str(run), "--max-steps", "2",
                 "--batch-size", "16", "--summary-every", "0", "--no-progress", "--device", "cpu",
                 "--checkpoint-every", "2", *flags])


@pytest.mark.parametrize(("flags", "saved", "asked"), [
    (["--batch-size", "32"], "batch_size 16", "--batch-size 32"),
    (["--lr", "0.5"], "lr 0.1", "--lr 0.5"),
    (["--optimizer", "adam"], "optimizer sgd", "--optimizer adam"),
    (["--seed", "4"], "seed 0", "--seed 4"),
])
def test_a_resume_that_changes_a_fixed_setting_stops_naming_it(tmp_path, capsys, flags, saved,
                                                               asked) -> None:
    run = tmp_path / "run"
    assert _train(run) == 0
    capsys.readouterr()
    assert _train(run, *flags, "--max-steps", "4") == 2
    err = capsys.readouterr().err
    setting = re.escape(asked)
    assert re.fullmatch(
        rf"towerflow train: error: '{re.escape(str(run))}' holds a run trained with "
        rf"{re.escape(saved)}, and this run asks for {setting}, but this setting cannot change "
        r"when a run resumes \(run\.yaml in the train dir records them\); resume with "
        rf"{re.escape(asked.split()[0])} {re.escape(saved.split()[1])} \(or leave this setting "
        r"out\), or start a new run with another --train-dir\.\n", err), err
    assert CheckpointManager(run).latest().name == "ckpt-00000002"


def test_a_resume_with_another_model_names_both(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert _train(run) == 0
    capsys.readouterr()
    argv = ["train", "cifar10", "--train-dir", str(run)]
    assert main(argv) == 2
    assert re.search(r"holds a run trained with model digits, and this run asks for model "
                     r"cifar10, but this setting cannot change", capsys.readouterr().err)


def test_a_resume_may_change_what_may_change_and_keeps_the_rest(tmp_path, caplog) -> None:
    run = tmp_path / "run"
    assert _train(run, "--seed", "5", "--optimizer", "momentum", "--momentum", "0.7") == 0
    with caplog.at_level(logging.INFO, logger="towerflow.training"):
        assert main(["train", "--train-dir", str(run), "--max-steps", "6", "--log-every", "3",
                     "--checkpoint-every", "3", "--max-to-keep", "2", "--device", "cpu",
                     "--no-progress"]) == 0
    record = _record(run)
    assert (record["model"], record["seed"], record["optimizer"], record["momentum"]) == \
        ("digits", 5, "momentum", 0.7)
    assert (record["max_steps"], record["log_every"], record["max_to_keep"]) == (6, 3, 2)
    assert record["summary_every"] == 0  # recorded, may change, not given: kept
    assert "resuming" in caplog.text and "seed=5" in caplog.text
    assert CheckpointManager(run).latest().name == "ckpt-00000006"


def _resolved(*argv: str):  # noqa: ANN202
    from towerflow.cli import build_parser
    from towerflow.cli.train import resolve_args

    args = build_parser().parse_args(["train", *argv])
    args._argv = list(argv)
    return resolve_args(args)


def test_a_resume_takes_the_recorded_processes_unless_told_otherwise(tmp_path) -> None:
    assert _train(tmp_path) == 0
    record = _record(tmp_path)
    save_run_settings(tmp_path, record | {"replicas": 2, "ps": 1})  # as a --ps 1 --replicas 2 run
    args = _resolved("--train-dir", str(tmp_path))
    assert (args.model, args.replicas, args.num_gpus, args.ps) == ("digits", 2, None, 1)
    args = _resolved("--train-dir", str(tmp_path), "--num-gpus", "1", "--ps", "0")
    assert (args.replicas, args.num_gpus, args.ps) == (None, 1, 0)
    assert args.device is None  # this machine's device is never taken from the record


def test_a_resume_may_change_the_table_part_size_but_not_the_sparse_threshold(tmp_path) -> None:
    assert _train(tmp_path) == 0
    record = _record(tmp_path)
    save_run_settings(tmp_path, record | {"ps": 1, "replicas": 2, "sparse_threshold": 1 << 20,
                                          "table_part_bytes": 1 << 16})
    args = _resolved("--train-dir", str(tmp_path), "--table-part-bytes", "1MiB")
    assert (args.sparse_threshold, args.table_part_bytes) == (1 << 20, 1 << 20)
    assert _resolved("--train-dir", str(tmp_path)).table_part_bytes == 1 << 16
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "holds a run trained with sparse_threshold 1048576, and this run asks for "
            "--sparse-threshold 2097152, but this setting cannot change when a run resumes")):
        _resolved("--train-dir", str(tmp_path), "--sparse-threshold", "2MiB")


def test_without_a_checkpoint_the_record_does_not_bind(tmp_path) -> None:
    save_run_settings(tmp_path, {"model": "digits", "batch_size": 64})
    assert _train(tmp_path, "--batch-size", "8") == 0
    assert _record(tmp_path)["batch_size"] == 8


def test_what_may_change_is_listed_and_the_rest_conflicts() -> None:
    assert {"max_steps", "log_every", "checkpoint_every", "summary_every"} <= MAY_CHANGE
    assert {"train_dir", "device"} <= PER_RUN and not MAY_CHANGE & PER_RUN
    saved = {"mode": "sync", "max_steps": 10, "device": "cpu", "replicas_to_aggregate": 2}
    wanted = {"mode": "async", "max_steps": 20, "device": "cuda:0", "replicas_to_aggregate": 1}
    assert resume_conflicts(saved, wanted) == [("mode", "sync", "async"),
                                               ("replicas_to_aggregate", 2, 1)]


def test_settings_names_take_dashes_and_unknown_ones_are_refused() -> None:
    assert normalize_settings({"max-steps": 3}, {"max_steps"}, "f") == {"max_steps": 3}
    with pytest.raises(InvalidArgumentError, match=r"f: unknown setting 'zzz'; known settings: "
                       r"max_steps\.$"):
        normalize_settings({"zzz": 1}, {"max_steps"}, "f")


def test_a_damaged_record_is_named(tmp_path) -> None:
    (tmp_path / "run.yaml").write_text("{unclosed: [")
    with pytest.raises(DataLossError, match=r"run\.yaml' does not hold a run's settings"):
        load_run_settings(tmp_path)


def test_eval_takes_the_model_and_data_from_the_record(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", "cifar10", "--train-dir", str(run), "--max-steps", "1",
                 "--batch-size", "4", "--data", "synthetic", "--synthetic-examples", "10",
                 "--device", "cpu", "--summary-every", "0", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", "--train-dir", str(run), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "on 10 test examples" in out and PRECISION.search(out)
    assert main(["eval", "digits", "--train-dir", str(run)]) == 2
    assert re.search(r"holds a run of model cifar10, not digits; run `towerflow eval cifar10 "
                     r"--train-dir .*`, or pass the --train-dir of a digits run\.",
                     capsys.readouterr().err)


def test_eval_without_a_model_or_a_record_says_what_to_give(tmp_path, capsys) -> None:
    assert main(["eval", "--train-dir", str(tmp_path)]) == 2
    assert re.search(r"towerflow eval needs a model: name it \(cifar10, digits, click, "
                     r"movielens or criteo\)", capsys.readouterr().err)
    assert main(["train", "--train-dir", str(tmp_path)]) == 2
    assert re.search(r"towerflow train needs a model: name it \(cifar10, digits, click, "
                     r"movielens or criteo, or your own as --model MODULE:FACTORY\), give a "
                     r"--config file", capsys.readouterr().err)


def test_a_resume_that_cannot_keep_a_recorded_ps_setting_says_how_to_resume(tmp_path,
                                                                            capsys) -> None:
    assert _train(tmp_path) == 0
    save_run_settings(tmp_path, _record(tmp_path) | {"ps": 1, "mode": "sync"})
    capsys.readouterr()
    assert main(["train", "--train-dir", str(tmp_path), "--ps", "0", "--device", "cpu"]) == 2
    assert re.search(r"holds a run trained with --mode sync \(run\.yaml\), which this run, with "
                     r"one process, cannot keep; resume it as it was trained \(the "
                     r"parameter-server strategy .*\), or start a new run with another "
                     r"--train-dir\.", capsys.readouterr().err)


def test_yaml_aliases_are_refused_so_a_billion_laughs_stays_small(tmp_path, capsys) -> None:
    lines = ['a0: &a0 ["ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 8)]
    lines += ["model: digits", "lr: *a7"]
    config = tmp_path / "laughs.yaml"
    config.write_text("\n".join(lines) + "\n")
    assert len(config.read_bytes()) < 500
    with pytest.raises(InvalidArgumentError, match=r"is not valid YAML: an alias \(\*a0\) repeats "
                                                   r"another node; settings files may not use"):
        read_settings_file(config)
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "anchors and aliases" in err and len(err) < 2000


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_deep_nesting_is_refused_in_one_sentence(tmp_path, suffix) -> None:
    config = tmp_path / f"deep{suffix}"
    config.write_text('{"lr": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(InvalidArgumentError, match=r"is not valid (YAML|JSON): .*nested more than "
                                                   r"32 levels deep"):
        read_settings_file(config)
    config.write_text('{"lr": ' + "[" * 30 + "1" + "]" * 30 + "}")
    assert _depth_ok(read_settings_file(config)["lr"])


def _depth_ok(value) -> bool:  # type: ignore[no-untyped-def]
    while isinstance(value, list):
        value = value[0]
    return value == 1


@settings(max_examples=30, deadline=None)
@given(value=st.one_of(st.text(min_size=200, max_size=5000).map(lambda t: "x" + t),
                       st.lists(st.integers(), min_size=50)))
def test_a_bad_value_is_quoted_by_a_short_prefix_only(value) -> None:
    import argparse

    from towerflow.cli._config import convert_settings

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int)
    with pytest.raises(InvalidArgumentError) as caught:
        convert_settings(parser, {"batch_size": value}, "c.yaml")
    assert len(str(caught.value)) < 500
