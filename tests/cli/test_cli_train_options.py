"""Every strategy and optimizer option of ``towerflow train`` reaches what it configures."""

from __future__ import annotations

import argparse
import json
import re
import subprocess

import pytest
import yaml

from towerflow.checkpoint import latest_checkpoint, read_checkpoint
from towerflow.cli import build_parser, main
from towerflow.cli._train_options import _STRATEGY_OPTIONS, FROM_THE_CLUSTER
from towerflow.cli.train import build_optimizer, build_strategy, byte_count
from towerflow.errors import InvalidArgumentError
from towerflow.training.schedules import decay_steps_for_epochs

PS_ENV = {"TF_CONFIG": json.dumps({
    "cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]},
    "task": {"type": "worker", "index": 0}})}


def _args(*flags: str):  # noqa: ANN202
    return build_parser().parse_args(["train", "digits", *flags])


def _ps_strategy(*flags: str):  # noqa: ANN202
    strategy = build_strategy(_args(*flags), env=PS_ENV)
    assert type(strategy).__name__ == "ParameterServer"
    return strategy


@pytest.mark.parametrize(("flags", "read", "expected"), [
    (["--mode", "ssp", "--staleness", "5"],
     lambda s: (s.aggregation.mode, s.aggregation.staleness), ("ssp", 5)),
    (["--mode", "sync", "--replicas-to-aggregate", "1"],
     lambda s: (s.aggregation.required, s.aggregation.backups, s.batches_per_step), (1, 1, 1)),
    (["--mode", "sync"], lambda s: (s.aggregation.required, s.batches_per_step), (2, 2)),
    (["--step-timeout", "7.5"], lambda s: s.aggregation.timeout, 7.5),
    (["--aggregation-timeout", "8"], lambda s: s.aggregation.timeout, 8.0),
    (["--ps-strategy", "greedy"], lambda s: s._ps_strategy, "greedy"),
    (["--partition-threshold", "1KiB"], lambda s: s._threshold, 1024),
    (["--ps-timeout", "3"], lambda s: s._timeout, 3.0),
    (["--init-timeout", "9"], lambda s: s._init_timeout, 9.0),
    (["--on-bad-gradient", "skip"], lambda s: s._policy, "skip"),
    (["--ps-prefetch"], lambda s: s._prefetch, True),
    (["--dense-apart"], lambda s: s._dense_with_rows, False),
    ([], lambda s: s._dense_with_rows, True),
    (["--sparse-threshold", "1MiB"], lambda s: s._sparse_threshold, 1048576),
    (["--sparse-threshold", "off"], lambda s: s._sparse_threshold, None),
    ([], lambda s: s._sparse_threshold, 64 << 20),
    (["--whole-tables", "64KiB"], lambda s: s._whole_below, 65536),
    (["--whole-tables", "off"], lambda s: s._whole_below, None),
    ([], lambda s: s._whole_below, 256 << 10),
    (["--table-part-bytes", "4KiB"], lambda s: s._table_part_bytes, 4096),
])
def test_each_ps_flag_reaches_the_parameter_server_strategy(flags, read, expected) -> None:
    strategy = _ps_strategy(*flags)
    try:
        assert read(strategy) == expected
    finally:
        strategy.shutdown()


def test_the_ps_defaults_are_the_strategy_defaults() -> None:
    from towerflow.cluster import resolve_cluster
    from towerflow.strategies.parameter_server import ParameterServer

    built = _ps_strategy()
    plain = ParameterServer(*resolve_cluster(env=PS_ENV), server=False)
    for name in ("aggregation", "_ps_strategy", "_threshold", "_timeout", "_init_timeout",
                 "_policy", "_prefetch", "_sparse_threshold", "_table_part_bytes", "_whole_below",
                 "_dense_with_rows"):
        ours, theirs = getattr(built, name), getattr(plain, name)
        assert ours == theirs, name


def test_mirrored_flags_reach_the_all_reduce_strategy(monkeypatch) -> None:
    from towerflow.strategies.mirrored import Mirrored

    groups: list[float] = []
    monkeypatch.setattr(Mirrored, "_init_group", lambda self, timeout_s: groups.append(timeout_s))
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    strategy = build_strategy(_args("--backend", "gloo", "--collective-timeout", "60",
                                    "--device", "cpu"), env=env)
    try:
        assert type(strategy).__name__ == "Mirrored"
        assert strategy.backend == "gloo" and groups == [60.0]
    finally:
        strategy.shutdown()  # its replica's task name is withdrawn


def test_every_keyword_of_the_strategies_has_a_flag_or_comes_from_the_cluster() -> None:
    from towerflow.strategies.choose import strategy_options

    flags = {(owner, keyword) for owner, keyword in _STRATEGY_OPTIONS.values()}
    for kind in ("ps", "mirrored"):
        missing = {k for k in strategy_options(kind)
                   if (kind, k) not in flags and k not in FROM_THE_CLUSTER[kind]}
        assert not missing, f"{kind} keywords without a flag: {missing}"


def test_the_flags_choices_are_the_librarys() -> None:
    from towerflow.ps.placement import STRATEGY_NAMES
    from towerflow.ps.spec.dense import OPTIMIZER_NAMES
    from towerflow.ps.wire.calls import MODES
    from towerflow.training.user_task import LOSSES

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["train"]
    choices = {a.dest: tuple(a.choices) for a in parser._actions if a.choices}
    assert choices["mode"] == MODES
    assert choices["loss"] == tuple(LOSSES)
    assert choices["ps_strategy"] == STRATEGY_NAMES
    assert choices["optimizer"] == OPTIMIZER_NAMES


def test_optimizer_flags_build_the_optimizer() -> None:
    opt = build_optimizer(_args("--optimizer", "adam", "--lr", "0.01", "--weight-decay", "0.5",
                                "--adam-beta1", "0.8", "--adam-beta2", "0.99", "--eps", "1e-6"))
    assert (opt.name, opt.lr, opt.weight_decay, opt.betas, opt.eps) == \
        ("adam", 0.01, 0.5, (0.8, 0.99), 1e-6)
    opt = build_optimizer(_args("--optimizer", "adagrad", "--initial-accumulator-value", "0.3"))
    assert (opt.name, opt.lr, opt.initial_accumulator_value) == ("adagrad", 0.1, 0.3)
    assert build_optimizer(_args("--optimizer", "momentum", "--momentum", "0.9")).momentum == 0.9


@pytest.mark.parametrize(("flags", "message"), [
    (["--staleness", "5"], r"--staleness 5 does not apply: this run trains with --mode async; "
     r"remove it, or train with --mode ssp\."),
    (["--mode", "ssp", "--replicas-to-aggregate", "1"],
     r"--replicas-to-aggregate 1 does not apply: this run trains with --mode ssp; remove it, "
     r"or train with --mode sync\."),
    (["--backend", "gloo"], r"--backend gloo does not apply: this run trains with the "
     r"parameter-server strategy .*; remove it, or train with all-reduce replicas"),
])
def test_a_flag_of_another_strategy_or_mode_is_refused(flags, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        build_strategy(_args(*flags), env=PS_ENV)


def test_a_ps_flag_without_a_ps_is_refused_before_replicas_start(tmp_path, capsys) -> None:
    argv = ["train", "digits", "--replicas", "2", "--mode", "sync", "--train-dir", str(tmp_path)]
    assert main(argv) == 2
    assert re.search(r"^towerflow train: error: --mode sync does not apply: this run trains with "
                     r"all-reduce replicas .*; remove it, or train with the parameter-server "
                     r"strategy \(--ps K", capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def test_byte_counts_take_units_and_refuse_what_is_not_a_size() -> None:
    assert byte_count("1048576") == 1 << 20 and byte_count("64MiB") == 64 << 20
    assert byte_count("1.5 KB") == 1500
    for bad in ("", "-3", "12 parsecs", "0.1"):
        with pytest.raises(ValueError, match="size in bytes|less than one byte"):
            byte_count(bad)


def _shard_variables(out: str) -> list[int]:
    return [int(n) for n in re.findall(r"ps shard \d initialised: (\d+) variables", out)]


@pytest.mark.slow
def test_a_local_ps_run_trains_with_every_option_given(tmp_path, python, subprocess_env,
                                                       capsys) -> None:
    """``towerflow train --ps 2 --workers 2``: the options reach the ps tasks and the chief."""
    train_dir = tmp_path / "run"
    argv = [python, "-m", "towerflow", "train", "digits", "--ps", "2", "--workers", "2",
            "--mode", "sync", "--replicas-to-aggregate", "1", "--optimizer", "momentum",
            "--momentum", "0.9", "--lr", "0.05", "--partition-threshold", "1KiB",
            "--ps-strategy", "greedy", "--step-timeout", "60", "--max-steps", "4",
            "--batch-size", "16", "--log-every", "2", "--checkpoint-every", "2",
            "--summary-every", "0", "--no-progress", "--train-dir", str(train_dir)]
    proc = subprocess.run(argv, env=subprocess_env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"ps shard 0 initialised: .* mode sync", out), out
    assert sum(_shard_variables(out)) > 4, out  # the digits net's weights are partitioned
    ckpt = read_checkpoint(latest_checkpoint(train_dir))
    assert ckpt.metadata["strategy"]["mode"] == "sync"
    assert ckpt.metadata["strategy"]["optimizer"] == "momentum"
    assert any(v.abs().sum() > 0 for k, v in ckpt.groups["optimizer"].items()
               if k.endswith("/momentum_buffer"))
    schedule = ckpt.metadata["schedule"]
    assert schedule["initial"] == 0.05
    # one worker's batch per sync step: replicas_to_aggregate=1 reached the strategy
    assert schedule["decay_steps"] == decay_steps_for_epochs(1437, 16, 350.0)
    record = yaml.safe_load((train_dir / "run.yaml").read_text())
    assert {k: record[k] for k in ("ps", "replicas", "mode", "replicas_to_aggregate",
                                   "partition_threshold", "ps_strategy", "optimizer")} == \
        {"ps": 2, "replicas": 2, "mode": "sync", "replicas_to_aggregate": 1,
         "partition_threshold": 1024, "ps_strategy": "greedy", "optimizer": "momentum"}
    resume = [*argv[:argv.index("--mode")], "--max-steps", "6", "--train-dir", str(train_dir),
              "--no-progress", "--summary-every", "0"]
    capsys.readouterr()
    assert main([*resume[3:], "--replicas-to-aggregate", "2"]) == 2  # refused in this process
    refused = capsys.readouterr()
    assert "launching" not in refused.out  # stopped before any task started
    assert re.search(r"holds a run trained with replicas_to_aggregate 1, and this run asks for "
                     r"--replicas-to-aggregate 2, but this setting cannot change", refused.err)
    # the same command without the settings resumes with the recorded ones
    proc = subprocess.run(resume, env=subprocess_env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ckpt = read_checkpoint(latest_checkpoint(train_dir))
    assert ckpt.step == 6 and ckpt.metadata["strategy"]["mode"] == "sync"
    assert ckpt.metadata["schedule"]["decay_steps"] == decay_steps_for_epochs(1437, 16, 350.0)


def test_a_settings_file_turns_the_sparse_tables_off_with_a_bare_off(tmp_path) -> None:
    from towerflow.cli._config import convert_settings
    from towerflow.cli._train_options import add_train_arguments

    parser = add_train_arguments(argparse.ArgumentParser())
    settings = yaml.safe_load("sparse_threshold: off\n")  # YAML 1.1: false
    assert convert_settings(parser, settings, "run.yaml")["sparse_threshold"] == "off"
    whole = yaml.safe_load("whole_tables: off\n")
    assert convert_settings(parser, whole, "run.yaml")["whole_tables"] == "off"
    with pytest.raises(InvalidArgumentError, match=r"'lots' is not a valid byte_count_or_off"):
        convert_settings(parser, {"sparse_threshold": "lots"}, "run.yaml")
