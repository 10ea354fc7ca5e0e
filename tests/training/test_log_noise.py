"""What a run prints and leaves: gRPC's own log at ERROR, no empty events file, a lean run.yaml."""

from __future__ import annotations

import subprocess
import sys

import yaml

from towerflow.training import TrainConfig, run_training
from towerflow.training.summaries import SummaryWriter

_SHOW = "import os, towerflow; print(os.environ.get('GRPC_VERBOSITY'))"


def test_grpc_logs_at_error_unless_the_user_asks_for_more(subprocess_env) -> None:
    subprocess_env.pop("GRPC_VERBOSITY", None)
    quiet = subprocess.run([sys.executable, "-c", _SHOW], env=subprocess_env,
                           capture_output=True, text=True, timeout=60, check=True)
    asked = subprocess.run([sys.executable, "-c", _SHOW], env={**subprocess_env,
                                                               "GRPC_VERBOSITY": "DEBUG"},
                           capture_output=True, text=True, timeout=60, check=True)
    assert (quiet.stdout, asked.stdout) == ("ERROR\n", "DEBUG\n")


def test_a_summary_writer_creates_its_event_file_with_its_first_summary(tmp_path) -> None:
    writer = SummaryWriter(tmp_path)
    writer.flush()
    assert list(tmp_path.iterdir()) == []
    writer.scalars(1, {"loss": 0.5})
    writer.close()
    assert [p.name.startswith("events.out.tfevents.") for p in tmp_path.iterdir()] == [True]


def test_a_rerun_with_nothing_to_train_leaves_no_event_file_and_digits_records_no_data_dir(
        tmp_path) -> None:
    config = TrainConfig(train_dir=tmp_path, max_steps=3, batch_size=8, summary_every=1,
                         ema_decay=None)
    run_training("digits", config)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert len([name for name in before if name.startswith("events.out")]) == 1
    assert run_training("digits", config).step == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    record = yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert record["model"] == "digits" and "data_dir" not in record
