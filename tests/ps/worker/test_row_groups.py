"""Tables fused on the ps are looked up as one on the worker: one leaf, one gather, one push.

Each test trains the same model twice, with the tables fused (grouped lookups) and with
every table apart, and asserts the tables' rows and the dense parameters come out bit for
bit alike, whatever the members do: a ``padding_idx``, a frozen member, a ``max`` bag that
needs a lookup of its own, ids that were not the predicted ones, an output changed in place.
ps tasks are real ``Server``s on 127.0.0.1 in this process (authenticated gRPC).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.errors import InvalidArgumentError
from towerflow.ps.worker.tables import groups, sparse_tables
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks

SECRET = Credentials(secret=b"row-groups")
ROWS = {"user": 30, "item": 17, "genre": 9, "tag": 11}


class Fields(nn.Module):
    """Four fields of one width, each its own ``nn.Embedding(sparse=True)``."""

    def __init__(self, *, padding: bool = False, frozen: bool = False, max_bag: bool = False,
                 in_place: bool = False, flip: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.Embedding(ROWS["user"], 4, sparse=True, padding_idx=0 if padding else None)
        self.item = nn.Embedding(ROWS["item"], 4, sparse=True)
        self.genre = nn.EmbeddingBag(ROWS["genre"], 4, mode="max" if max_bag else "sum",
                                     sparse=True)
        self.tag = nn.Embedding.from_pretrained(torch.randn(ROWS["tag"], 4), freeze=frozen,
                                                sparse=True)
        self.out = nn.Linear(16, 1)
        self.in_place, self.flip, self.calls = in_place, flip, 0
        self.nan_item = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        item_ids = ids[:, 1]
        if self.flip and self.calls % 2 == 0:  # ids the recipe does not predict
            item_ids = (ROWS["item"] - 1) - item_ids
        user = self.user(ids[:, 0])
        if self.in_place:
            user.mul_(2.0)
        item = self.item(item_ids)
        if self.nan_item:  # the item rows' gradient NaN, the others' finite
            item.register_hook(lambda grad: grad * float("nan"))
        rows = [user, item, self.genre(ids[:, 2:4]), self.tag(ids[:, 4])]
        return self.out(torch.cat(rows, 1)).squeeze(1)


def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(ids), (ids[:, 0] % 2).float())


def batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        cols = [torch.randint(0, n, (16,), generator=g) for n in
                (ROWS["user"], ROWS["item"], ROWS["genre"], ROWS["genre"], ROWS["tag"])]
        out.append(torch.stack(cols, 1))
    return out


def _counted(taken: list, counts: list[int]) -> list:
    counts.append(len(taken))
    return taken


def run(model_options: dict, *, fused: bool, monkeypatch, steps: int = 6,
        optimizer: str = "adagrad"):  # type: ignore[no-untyped-def]
    """The tables' rows and dense parameters after ``steps``, and how many group pushes."""
    pushes = []
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(sparse_tables, "fuse_tables", lambda configs, extras: ([], {}))
        real = groups.take_groups
        patch.setattr(sparse_tables, "take_groups", lambda modules: _counted(real(modules), pushes))
        model = Fields(**model_options)
        with ps_tasks(SECRET) as spec:
            strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET,
                                       device="cpu", server=False, whole_table_bytes=None)
            try:
                strategy.prepare(model, OptimizerConfig(optimizer, lr=0.2))
                for ids in batches(steps):
                    strategy.run_step(loss, ids)
                strategy.settle()
                tables = {name: m.client.pull(m.config, torch.arange(m.num_rows))
                          for name, m in strategy._tables.modules}
                dense = [p.detach().clone() for p in model.out.parameters()]
            finally:
                strategy.shutdown()
    return tables, dense, sum(pushes)


@pytest.mark.parametrize("options", [{}, {"padding": True}, {"frozen": True},
                                     {"max_bag": True}, {"in_place": True}, {"flip": True}],
                         ids=["plain", "padding_idx", "frozen", "max_bag", "in_place", "miss"])
def test_grouped_lookups_train_bit_for_bit_as_tables_apart(options, monkeypatch) -> None:
    grouped, dense_g, group_pushes = run(options, fused=True, monkeypatch=monkeypatch)
    apart, dense_a, none = run(options, fused=False, monkeypatch=monkeypatch)
    assert none == 0
    # the whole group pushes as one where every trainable member took its part once
    whole_group = not any(options.get(k) for k in ("frozen", "max_bag", "flip"))
    assert (group_pushes >= 5) if whole_group else (group_pushes <= 3)
    assert grouped.keys() == apart.keys() == set(ROWS)
    for name in ROWS:
        torch.testing.assert_close(grouped[name], apart[name], rtol=0, atol=0, msg=name)
    for a, b in zip(dense_g, dense_a, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if options.get("padding"):  # the padding row kept its value
        assert torch.equal(grouped["user"][0], Fields(padding=True).user.weight[0].detach())
    if options.get("frozen"):
        assert torch.equal(grouped["tag"], Fields(frozen=True).tag.weight.detach())


def test_a_grouped_lookup_shares_one_leaf_and_one_gather(monkeypatch) -> None:
    made = []
    real = groups.RowGroup.part

    def part(self, member, device):  # type: ignore[no-untyped-def]
        made.append((id(self), member))
        return real(self, member, device)

    monkeypatch.setattr(groups.RowGroup, "part", part)
    run({}, fused=True, monkeypatch=monkeypatch, steps=3)
    steps = {}
    for group, member in made:
        steps.setdefault(group, []).append(member)
    # the first step records the recipe (each table apart); then one group of 4 per step
    assert list(steps.values()) == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_a_nonfinite_row_gradient_names_the_member_not_the_fused_table(monkeypatch) -> None:
    model = Fields()
    pushes = []
    real = groups.take_groups
    monkeypatch.setattr(sparse_tables, "take_groups", lambda modules: _counted(real(modules), pushes))
    with ps_tasks(SECRET) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET,
                                   device="cpu", server=False, whole_table_bytes=None)
        try:
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.2))
            ids = batches(3)
            strategy.run_step(loss, ids[0])
            strategy.run_step(loss, ids[1])
            strategy.settle()
            before = model.out.weight.detach().clone()
            model.nan_item = True
            with pytest.raises(InvalidArgumentError, match=r"Gradient of 'item \(sparse table\)'"):
                strategy.run_step(loss, ids[2])
            assert pushes[-1] == 1  # it came as the whole group's push
            strategy.settle()
            assert torch.equal(model.out.weight, before)  # nothing was pushed
        finally:
            strategy.shutdown()
