"""A ``torch.optim`` optimizer with parameter groups, under every strategy.

The user writes ``torch.optim.Adagrad([{"params": emb, "lr": 0.5}, {"params": head,
"lr": 0.05}])``; towerflow trains each parameter with its group's settings: a
single device and mirrored replicas by the same ``torch.optim`` groups, the ps
tasks by a learning-rate factor per dense variable and per table (the rows a
table's row-wise optimizer updates). Every result is compared with plain
PyTorch running the same steps in this process; a schedule's rate scales every
group's.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.errors import InvalidArgumentError
from towerflow.strategies import OptimizerConfig, SingleDevice
from towerflow.strategies.optim import as_optimizer_config
from towerflow.strategies.parameter_server import ParameterServer

SECRET = Credentials(secret=b"groups-secret")
RATES = [0.05, 0.05, 0.025, 0.025]  # a schedule's rate per step (the base group's)


class Rec(nn.Module):
    """A bag of ids through a ``sparse=True`` table, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(1)).squeeze(-1)


def model() -> Rec:
    torch.manual_seed(0)
    return Rec()


def adagrad(m: Rec) -> torch.optim.Adagrad:
    return torch.optim.Adagrad([{"params": m.emb.parameters(), "lr": 0.5},
                                {"params": [m.head.weight], "lr": 0.2},
                                {"params": [m.head.bias]}],
                               lr=0.05, initial_accumulator_value=0.1, eps=1e-10)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 40, (16, 3), generator=g), torch.randn(16, generator=g))
            for _ in RATES]


def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, target = batch
    return nn.functional.mse_loss(m(ids), target)


def plain_pytorch() -> dict[str, torch.Tensor]:
    """The reference: the same steps in plain PyTorch, each group's rate scaled by the
    schedule's over the base one."""
    m = model()
    opt = adagrad(m)
    initial = [group["lr"] for group in opt.param_groups]
    for rate, batch in zip(RATES, batches(), strict=True):
        for group, lr in zip(opt.param_groups, initial, strict=True):
            group["lr"] = lr * rate / 0.05
        opt.zero_grad()
        loss(m, batch).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_torch_groups_become_per_parameter_settings() -> None:
    m = model()
    config = as_optimizer_config(adagrad(m), m)
    assert (config.name, config.lr, config.eps, config.initial_accumulator_value) == (
        "adagrad", 0.05, 1e-10, 0.1)
    assert dict(config.param_settings) == {"emb.weight": {"lr": 0.5}, "head.weight": {"lr": 0.2}}
    assert config.lr_factor("emb.weight") == pytest.approx(10.0)
    assert config.lr_factor("head.weight") == pytest.approx(4.0)
    assert config.lr_factor("head.bias") == 1.0


def test_single_device_trains_each_group_with_its_rate() -> None:
    expected = plain_pytorch()
    m = model()
    strategy = SingleDevice("cpu")
    strategy.prepare(m, adagrad(m))
    for rate, batch in zip(RATES, batches(), strict=True):
        strategy.run_step(loss, batch, lr=rate)
    for name, param in m.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=0, atol=0)
    assert sorted(g["lr"] for g in strategy.optimizer.param_groups) == pytest.approx(
        [0.025, 0.1, 0.25])


def test_mirrored_replicas_train_each_group_with_its_rate() -> None:
    from towerflow.strategies.mirrored import Mirrored

    expected = plain_pytorch()
    m = model()
    strategy = Mirrored(device="cpu", env={}, timeout_s=30)
    try:
        strategy.prepare(m, adagrad(m))
        for rate, batch in zip(RATES, batches(), strict=True):
            strategy.run_step(loss, batch, lr=rate)
    finally:
        strategy.shutdown()
    for name, param in m.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=1e-6, atol=1e-7)


def test_a_single_rate_would_train_otherwise() -> None:
    """The check above can fail: one rate for all groups moves the parameters elsewhere."""
    expected = plain_pytorch()
    m = model()
    strategy = SingleDevice("cpu")
    strategy.prepare(m, OptimizerConfig("adagrad", lr=0.05, eps=1e-10))
    for rate, batch in zip(RATES, batches(), strict=True):
        strategy.run_step(loss, batch, lr=rate)
    assert not torch.allclose(m.emb.weight.detach(), expected["emb.weight"], atol=1e-4)
    assert not torch.allclose(m.head.weight.detach(), expected["head.weight"], atol=1e-4)


def test_ps_table_rows_and_dense_variables_take_their_groups_rates(start_ps_tasks) -> None:
    expected = plain_pytorch()
    spec = start_ps_tasks(SECRET)
    m = model()
    strategy = ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET, device="cpu",
                               server=False, mode="sync")
    try:
        strategy.prepare(m, adagrad(m))
        tables = strategy._tables
        assert [path for path, _ in tables.modules] == ["emb"]  # the row path, by default
        assert tables.lr_scales == {tables.modules[0][1].config.name: pytest.approx(10.0)}
        for rate, batch in zip(RATES, batches(), strict=True):
            strategy.run_step(loss, batch, lr=rate)
        table = tables.modules[0][1]
        rows = table.client.pull(table.config, torch.arange(40))
        torch.testing.assert_close(rows, expected["emb.weight"], rtol=1e-5, atol=1e-6)
        strategy._pull()  # the dense variables as the ps tasks hold them
        for name in ("head.weight", "head.bias"):
            torch.testing.assert_close(dict(m.named_parameters())[name].detach(),
                                       expected[name], rtol=1e-5, atol=1e-6)
    finally:
        strategy.shutdown()


def _ps_prepare(spec, m: nn.Module, optimizer) -> None:
    strategy = ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET, device="cpu",
                               server=False)
    try:
        strategy.prepare(m, optimizer)
    finally:
        strategy.shutdown()


def test_momentum_on_a_tables_group_is_refused_under_a_ps(start_ps_tasks) -> None:
    m = model()
    sgd = torch.optim.SGD([{"params": m.emb.parameters(), "momentum": 0.9},
                           {"params": m.head.parameters()}], lr=0.1)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "A sparse table has no row-wise counterpart of optimizer 'momentum' with "
            "momentum=0.9 weight_decay=0 (the parameter group of 'emb.weight'); give the "
            "table its own, e.g. ShardedEmbedding(..., optimizer=SparseAdagrad()), or put its "
            "weight in a parameter group without them.")):
        _ps_prepare(start_ps_tasks(SECRET), m, sgd)


def test_a_dense_group_setting_other_than_lr_is_refused_under_a_ps(start_ps_tasks) -> None:
    m = model()
    opt = torch.optim.Adagrad([{"params": m.emb.parameters()},
                               {"params": m.head.parameters(), "eps": 1e-3}], lr=0.05)
    with pytest.raises(InvalidArgumentError, match=r"Parameter 'head\.weight' trains with "
                       r"\{'eps': 0\.001\} in its parameter group, but a ps task applies the "
                       r"optimizer's \{'eps': 1e-10\} to every dense variable it holds .*; give "
                       r"its group the optimizer's settings, or train with Mirrored replicas\."):
        _ps_prepare(start_ps_tasks(SECRET), m, opt)


@pytest.mark.parametrize(("build", "message"), [
    (lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01),
     r"torch\.optim\.RMSprop has no counterpart in towerflow \(the ps tasks and the sparse "
     r"tables apply the update themselves\); use torch\.optim\.SGD, Adagrad or Adam"),
    (lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
     r"torch\.optim\.AdamW has no counterpart in towerflow"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
     r"torch\.optim\.SGD's parameter group 0 sets nesterov=True, which towerflow's sgd update "
     r".* does not have; build the optimizer with nesterov=False\."),
    (lambda m: torch.optim.Adam(m.head.parameters(), lr=0.01, amsgrad=True),
     r"parameter group 0 sets amsgrad=True"),
    (lambda m: torch.optim.Adagrad(m.head.parameters(), lr=0.01),
     r"Parameters \['emb\.weight'\] of Rec are in no parameter group of torch\.optim\.Adagrad; "
     r"add them to a group, or set requires_grad=False"),
    (lambda m: torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1),
     r"parameter group 0 holds a parameter of shape \[1, 4\] that is not Rec's"),
    (lambda m: "adagrad", r"The optimizer must be a towerflow OptimizerConfig or a torch\.optim "
     r"SGD, Adagrad or Adam, got str"),
    (lambda m: OptimizerConfig(param_settings={"nope.weight": {"lr": 0.1}}),
     r"param_settings names \['nope\.weight'\], which are no parameters of Rec"),
])
def test_an_optimizer_with_no_counterpart_is_refused_before_anything_moves(build,
                                                                           message) -> None:
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    strategy = SingleDevice("cpu")
    with pytest.raises(InvalidArgumentError, match=message):
        strategy.prepare(m, build(m))
    for name, param in m.named_parameters():
        assert torch.equal(param, before[name])


def test_group_settings_are_checked_when_the_config_is_built() -> None:
    with pytest.raises(InvalidArgumentError, match=r"param_settings\['a'\] sets \['nesterov'\]; "
                       r"a parameter group may set lr, momentum"):
        OptimizerConfig(param_settings={"a": {"nesterov": True}})
    with pytest.raises(InvalidArgumentError, match=r"The learning rate of parameter 'a' must be "
                       r"positive, got 0; give its group lr > 0\."):
        OptimizerConfig(param_settings={"a": {"lr": 0}})


# ------------------------------------------------------------------- the ps task's side
def _init(factors: dict[str, float]):
    from towerflow.ps.wire import ps_pb2 as pb

    return pb.InitRequest(
        shard=0, optimizer=pb.OptimizerSpec(name="sgd", lr_factors=factors),
        aggregation=pb.AggregationSpec(mode="async", total_num_replicas=1),
        segments=[pb.Segment(name="a", shape=[3], var_shape=[3], numel=3, num_parts=1),
                  pb.Segment(name="b", shape=[2], var_shape=[2], numel=2, num_parts=1)])


def test_a_ps_shard_applies_each_variables_rate_even_split_across_pieces() -> None:
    import numpy as np

    from towerflow.ps.server.dense.initspec import check_init
    from towerflow.ps.server.dense.optimizers import make_optimizer

    plan = check_init(_init({"b": 4.0}), 0)
    assert plan.optimizer["lr_ranges"] == ((3, 2, 4.0),)
    opt = make_optimizer("sgd", 5, lr_ranges=plan.optimizer["lr_ranges"])
    whole, pieces = np.zeros(5, np.float32), np.zeros(5, np.float32)
    grad = np.ones(5, np.float32)
    opt.apply(whole, grad, lr=0.5)
    step = opt.begin()
    for first, stop in ((0, 2), (2, 4), (4, 5)):  # a piece across the boundary of a and b
        opt.apply_range(pieces, first, grad[first:stop], 0.5, step)
    assert whole.tolist() == pieces.tolist() == [-0.5, -0.5, -0.5, -2.0, -2.0]


@pytest.mark.parametrize(("factors", "message"), [
    ({"c": 2.0}, r"Init field optimizer\.lr_factors = 'c' is invalid: a variable of this shard"),
    ({"a": 0.0}, r"Init field optimizer\.lr_factors\['a'\] = 0\.0 is invalid: a number > 0"),
    ({"a": float("inf")}, r"optimizer\.lr_factors\['a'\] = inf is invalid: it must be a finite"),
])
def test_a_ps_shard_refuses_a_bad_rate_factor(factors, message) -> None:
    from towerflow.ps.server.dense.initspec import check_init

    with pytest.raises(InvalidArgumentError, match=message):
        check_init(_init(factors), 0)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
       factors=st.lists(st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_size=6, max_size=6),
       cuts=st.lists(st.integers(0, 36), max_size=5))
def test_rates_per_range_match_element_by_element_however_the_gradient_is_cut(
        sizes, factors, cuts) -> None:
    import numpy as np

    from towerflow.ps.server.dense.optimizers import make_optimizer

    offsets = np.cumsum([0, *sizes])
    numel = int(offsets[-1])
    ranges = [(int(offsets[i]), n, factors[i]) for i, n in enumerate(sizes) if factors[i] != 1]
    rate = np.ones(numel, np.float32)
    for start, count, factor in ranges:
        rate[start:start + count] = factor
    grad = np.arange(1, numel + 1, dtype=np.float32)
    opt = make_optimizer("sgd", numel, lr_ranges=ranges)
    params = np.zeros(numel, np.float32)
    step = opt.begin()
    bounds = sorted({0, numel, *(c for c in cuts if c < numel)})
    for first, stop in zip(bounds, bounds[1:], strict=False):
        opt.apply_range(params, first, grad[first:stop], 0.5, step)
    np.testing.assert_array_equal(params, -(np.float32(0.5) * rate) * grad)
