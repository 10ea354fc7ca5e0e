"""Export for serving: a ps-trained model served from one ``serving.load`` call.

Two ps tasks are real ``Server``s on 127.0.0.1 in this process (authenticated gRPC); one
module-wide run trains a click model with an explicit table and swapped
``nn.Embedding`` / ``nn.EmbeddingBag`` modules, checkpointing after each of four stages.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from towerflow import serving
from towerflow.checkpoint import CheckpointManager
from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.errors import AlreadyExistsError, CheckpointError, InvalidArgumentError
from towerflow.ps.worker.tables.checkpoint import TABLES_GROUP, TABLES_KEY
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.serving.chain import read_export
from towerflow.serving.exporting import CHECKPOINT_TABLES, CHECKPOINT_TABLES_GROUP
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks
from towerflow.training.session import checkpoint_metadata

SECRET = Credentials(secret=b"serving-secret")
ITEMS, USERS, CTX = 50, 30, 20


class Click(nn.Module):
    """An explicit table (named apart from its path), two swapped ones, a dense embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(ITEMS, 4, mode="sum", name="items", partitioner="range")
        self.user = nn.Embedding(USERS, 3, sparse=True)
        self.ctx = nn.EmbeddingBag(CTX, 2, mode="mean", sparse=True)
        self.small = nn.Embedding(5, 2)
        self.out = nn.Linear(4 + 3 + 2 + 2, 1)

    def forward(self, items: torch.Tensor, user: torch.Tensor, ctx: torch.Tensor,
                small: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.emb(items), self.user(user), self.ctx(ctx), self.small(small)], 1)
        return self.out(x).squeeze(1)


def inputs(seed: int, batch: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, ITEMS, (batch, 4), generator=g),
            torch.randint(0, USERS, (batch,), generator=g),
            torch.randint(0, CTX, (batch, 3), generator=g),
            torch.randint(0, 5, (batch,), generator=g))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    *x, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(*x), labels)


def labelled(seed: int) -> tuple[torch.Tensor, ...]:
    x = inputs(seed)
    return (*x, (x[0][:, 0] % 2).float())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints of four stages of training (3, 2, 2, 2 steps) and the ps model's
    predictions on ``inputs(99)`` at each."""
    root = tmp_path_factory.mktemp("serving")
    manager = CheckpointManager(root / "train", max_to_keep=None)
    stages = []
    with ps_tasks(SECRET) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET,
                                   device="cpu", server=False, table_part_bytes=256)
        try:
            model = Click()
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.3))
            seed = 0
            for steps in (3, 2, 2, 2):
                for _ in range(steps):
                    strategy.run_step(loss_fn, labelled(seed))
                    seed += 1
                groups = strategy.state_dict()
                metadata = checkpoint_metadata(strategy)
                path = manager.save(metadata["step"], groups, metadata)
                with torch.no_grad():
                    stages.append((path, model(*inputs(99))))
        finally:
            strategy.shutdown()
    return root, stages


def test_towerflow_serving_and_export_are_public_names(python, subprocess_env) -> None:
    import subprocess

    proc = subprocess.run([python, "-c", "import towerflow; print(towerflow.serving.load."
                           "__module__, towerflow.export.__module__)"],
                          env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["towerflow.serving.load", "towerflow.serving.exporting"]


def test_the_constants_of_the_training_checkpoint_are_the_ps_wings() -> None:
    assert (CHECKPOINT_TABLES_GROUP, CHECKPOINT_TABLES) == (TABLES_GROUP, TABLES_KEY)


def test_a_full_export_serves_the_ps_models_predictions(trained, tmp_path) -> None:
    root, stages = trained
    ckpt, want = stages[-1]
    out = serving.export(ckpt, tmp_path / "full")
    manifest = read_export(out).description
    assert manifest["kind"] == "full" and manifest["step"] == 9
    assert {n: (t["num_rows"], t["dim"], t["rows"]) for n, t in manifest["tables"].items()} == {
        "items": (ITEMS, 4, ITEMS), "user": (USERS, 3, USERS), "ctx": (CTX, 2, CTX)}
    parts = [f for f in os.listdir(out) if f.startswith("tables-")]
    assert len(parts) > 3  # one part per shard and table at least: never gathered
    model = serving.load(out, Click())
    assert not model.training
    assert type(model.emb).__name__ == "FixedLookup" and type(model.user).__name__ == "FixedLookup"
    assert isinstance(model.small, nn.Embedding)  # a dense module stays itself
    with torch.no_grad():
        got = model(*inputs(99))
    assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_no_optimizer_slots_unless_asked(trained, tmp_path) -> None:
    ckpt = trained[1][-1][0]
    plain = read_export(serving.export(ckpt, tmp_path / "plain"))
    slots = read_export(serving.export(ckpt, tmp_path / "slots", with_optimizer=True))
    def names(export):
        return {k for e in export.entries.values() for k in e["tensors"]}
    assert names(plain) == {"keys", "rows"}
    assert "slot.accumulator" in names(slots) or any(n.startswith("slot.") for n in names(slots))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_full_export_and_three_deltas_load_bit_exact_to_a_full_export_at_the_last_step(
        trained, tmp_path) -> None:
    _, stages = trained
    chain = [serving.export(stages[0][0], tmp_path / "full-a")]
    for i, (ckpt, _) in enumerate(stages[1:]):
        chain.append(serving.export(ckpt, tmp_path / f"delta-{i}", since=chain[-1]))
    last = read_export(chain[-1]).description
    assert last["kind"] == "delta" and last["base"]["name"] == "delta-1"
    # a delta holds the rows touched by 2 steps, not the table
    assert 0 < last["tables"]["items"]["rows"] < ITEMS
    full = serving.export(stages[-1][0], tmp_path / "full-d")
    from_chain = _state(serving.load(chain, Click()))
    from_full = _state(serving.load(full, Click()))
    assert from_chain.keys() == from_full.keys()
    for key in from_full:
        assert torch.equal(from_chain[key], from_full[key]), key
    # a delta alone finds its chain by the names it records
    alone = _state(serving.load(chain[-1], Click()))
    assert all(torch.equal(alone[k], from_full[k]) for k in from_full)


def test_the_loaded_module_passes_torch_export_with_a_dynamic_batch(trained, tmp_path) -> None:
    ckpt, want = trained[1][-1]
    model = serving.load(serving.export(ckpt, tmp_path / "e"), Click())
    served = model(*inputs(99))  # outside no_grad, as a server calls it: no autograd graph
    assert served.grad_fn is None and not served.requires_grad
    batch = torch.export.Dim("batch", min=2, max=4096)
    program = torch.export.export(model, inputs(99), dynamic_shapes=(
        {0: batch}, {0: batch}, {0: batch}, {0: batch}))
    assert torch.allclose(program.module()(*inputs(99)), want, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert torch.equal(program.module()(*inputs(5, batch=300)), model(*inputs(5, batch=300)))


# --------------------------------------------------------------------------- bad input
@pytest.fixture
def export_dir(trained, tmp_path) -> Path:
    return serving.export(trained[1][0][0], tmp_path / "full")


def _unchanged(model: Click, before: dict[str, torch.Tensor]) -> bool:
    return isinstance(model.emb, ShardedEmbedding) and isinstance(model.user, nn.Embedding) \
        and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_missing_part_is_refused_naming_it(export_dir) -> None:
    part = sorted(p for p in os.listdir(export_dir) if p.startswith("tables-"))[1]
    os.unlink(export_dir / part)
    model = Click()
    before = _state(model)
    with pytest.raises(CheckpointError, match=f"{part}.*missing.*export it again"):
        serving.load(export_dir, model)
    assert _unchanged(model, before)


def test_a_changed_byte_is_refused_by_its_digest(export_dir) -> None:
    part = export_dir / sorted(p for p in os.listdir(export_dir) if p.startswith("tables-"))[0]
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    os.chmod(part, 0o644)
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{part.name}.*checksum.*export it again"):
        serving.load(export_dir, Click())
    manifest = export_dir / "manifest.json"
    os.chmod(manifest, 0o644)
    manifest.write_text(manifest.read_text().replace('"step": 3', '"step": 4', 1))
    with pytest.raises(CheckpointError, match="manifest.json.*does not match its digest.*"
                                              "export it again"):
        serving.load(export_dir, Click())


def test_a_delta_on_another_base_is_refused(trained, tmp_path) -> None:
    _, stages = trained
    full = serving.export(stages[0][0], tmp_path / "full")
    one = serving.export(stages[1][0], tmp_path / "d1", since=full)
    two = serving.export(stages[2][0], tmp_path / "d2", since=one)
    with pytest.raises(InvalidArgumentError, match=r"d2.*step 5 .'d1'.*follows .*full.* of step 3.*"
                                                   r"load the chain it was written on"):
        serving.load([full, two], Click())
    with pytest.raises(InvalidArgumentError, match="starts with delta"):
        serving.load([one, two], Click())
    with pytest.raises(AlreadyExistsError, match="choose a new --out"):
        serving.export(stages[1][0], one, since=full)


def test_a_model_whose_tables_differ_is_refused_and_left_as_it_was(export_dir) -> None:
    class Wider(Click):
        def __init__(self) -> None:
            super().__init__()
            self.user = nn.Embedding(USERS, 5, sparse=True)

    class Renamed(Click):
        def __init__(self) -> None:
            super().__init__()
            self.emb = ShardedEmbedding(ITEMS, 4, mode="sum", name="products")

    model = Wider()
    before = _state(model)
    with pytest.raises(InvalidArgumentError, match=r"'user' is 30 x 3 in the export, 30 x 5 in "
                                                   r"the model.*model class that was trained"):
        serving.load(export_dir, model)
    assert _unchanged(model, before)
    with pytest.raises(InvalidArgumentError, match=r"table 'items' is no embedding module.*"
                                                   r"model's table 'emb' is not in the export"):
        serving.load(export_dir, Renamed())


def test_the_click_example_trained_on_the_ps_exports_through_torch_export(tmp_path) -> None:
    from towerflow.models.click import ClickNet, click_loss

    def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 400, (32, 6), generator=g)
        return ids, (ids[:, 0] % 2).float()

    manager = CheckpointManager(tmp_path / "train")
    with ps_tasks(SECRET) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET,
                                   device="cpu", server=False)
        try:
            model = ClickNet(400, 8, sparse_gradients=True)  # its table swapped for the ps's
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))
            for seed in range(3):
                strategy.run_step(click_loss, batch(seed))
            groups, metadata = strategy.state_dict(), checkpoint_metadata(strategy)
            manager.save(metadata["step"], groups, metadata)
            with torch.no_grad():
                want = model(batch(50)[0])
        finally:
            strategy.shutdown()
    served = serving.load(serving.export(tmp_path / "train", tmp_path / "e"),
                          ClickNet(400, 8, table_device="meta"))
    program = torch.export.export(served, (batch(50)[0],),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=2)},))
    assert torch.allclose(program.module()(batch(50)[0]), want, atol=1e-6, rtol=0)
    assert program.module()(batch(51)[0][:7]).shape == (7,)
