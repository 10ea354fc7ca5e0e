"""examples/click_model.py: a wide-and-deep click model on sparse ps tables learns the planted truth."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from file_modules import load_file

from towerflow.checkpoint import CheckpointManager, read_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "click_model.py"
RESULT = re.compile(r"held-out click rate ([\d.]+): model AUC ([\d.]+), truth AUC ([\d.]+), "
                    r"gap (-?[\d.]+)")
FINISHED = re.compile(r"\[worker:(\d)\] finished: (\d+) local steps, global step (\d+)")


def load_example():  # noqa: ANN201 - the example module
    return load_file(EXAMPLE, "click_model")


def pairwise_auc(scores: list[float], labels: list[int]) -> float:
    """The definition: P(score of a positive > score of a negative), ties counting half."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_is_exact_with_ties() -> None:
    example = load_example()
    gen = torch.Generator().manual_seed(3)
    for n in (2, 7, 300):
        scores = torch.randint(0, 5, (n,), generator=gen).float()  # many ties
        labels = torch.arange(n) % 2
        labels = labels[torch.randperm(n, generator=gen)]
        expected = pairwise_auc(scores.tolist(), labels.tolist())
        assert example.auc(scores, labels) == pytest.approx(expected, abs=1e-12)
    assert example.auc(torch.tensor([0.1, 0.9]), torch.tensor([0, 1])) == 1.0
    assert example.auc(torch.tensor([0.9, 0.1]), torch.tensor([0, 1])) == 0.0
    with pytest.raises(ValueError, match="both classes"):
        example.auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1]))


def test_planted_logs_click_at_the_rate_asked_with_zipf_ids() -> None:
    example = load_example()
    logs = example.ClickLogs([5000, 50], bag=3, zipf=1.2, ctr=0.2, weight_std=0.5, seed=1)
    fields, clicks = logs.sample(40000, torch.Generator().manual_seed(2))
    assert [tuple(f.shape) for f in fields] == [(40000, 3), (40000, 1)]
    assert abs(clicks.mean().item() - 0.2) < 0.01
    main = fields[0].reshape(-1)
    assert 0 <= int(main.min()) and int(main.max()) < 5000
    counts = torch.bincount(main, minlength=5000).sort(descending=True).values.double()
    top = counts[0] / main.numel()  # Zipf: rank 1 has probability 1 / sum(r^-1.2)
    harmonic = torch.arange(1, 5001, dtype=torch.float64).pow(-1.2).sum()
    assert abs(top.item() - 1 / harmonic.item()) < 0.01
    assert counts[9] / counts[0] == pytest.approx(10 ** -1.2, rel=0.3)
    again, _ = logs.sample(10, torch.Generator().manual_seed(2))
    assert torch.equal(again[0], fields[0][:10])  # seeded: the same logs again
    # the truth's own probabilities rank the clicks well above chance
    assert example.auc(logs.logits(fields), clicks) > 0.7


@pytest.mark.slow
def test_trains_on_two_ps_and_two_workers_to_the_truth_auc(tmp_path, python,
                                                          subprocess_env) -> None:
    steps = 1000  # the gap is about 0.013 by then (0.010 at the example's default 2,000)
    command = [python, "-m", "towerflow", "launch", "--ps", "2", "--workers", "2", "--grace", "5",
               "--", python, str(EXAMPLE), "--logdir", "run", "--steps", str(steps)]
    proc = subprocess.run(command, env=subprocess_env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    finished = {int(w): (int(local), int(final)) for w, local, final in FINISHED.findall(out)}
    assert set(finished) == {0, 1}, out
    assert all(local > 0 for local, _ in finished.values()), out  # both workers stepped
    assert max(final for _, final in finished.values()) >= steps
    # the tables live on the 2 ps tasks: FTRL for the wide part, the Adagrad counterpart deep
    assert "[worker:0] table wide: 22600 x 1 sharded over 2 ps tasks (mod), row-wise ftrl" in out
    assert "[worker:0] table deep.0: 20000 x 8 sharded over 2 ps tasks (mod), row-wise adagrad" \
        in out
    result = RESULT.search(out)
    assert result is not None, out
    rate, model_auc, truth_auc, gap = (float(x) for x in result.groups())
    assert 0.1 <= rate <= 0.25 and truth_auc > 0.75
    assert gap == pytest.approx(truth_auc - model_auc, abs=2e-4)
    assert gap <= 0.02, out
    ckpt = read_checkpoint(CheckpointManager(tmp_path / "run").latest())
    assert ckpt.step >= steps
    assert "mlp.0.weight" in ckpt.groups["model"]


@pytest.mark.slow
def test_trains_in_one_process_without_a_cluster(tmp_path, python, subprocess_env) -> None:
    proc = subprocess.run([python, str(EXAMPLE), "--steps", "1000"], env=subprocess_env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = RESULT.search(proc.stdout)
    assert result is not None, proc.stdout
    assert float(result.group(4)) <= 0.02, proc.stdout
    assert CheckpointManager(tmp_path / "log" / "click_model").restore().step == 1000
