"""The ParameterServer strategy: workers training through real gRPC ps tasks on 127.0.0.1.

Workers run as threads of this process (each with its own model and strategy)
against ps tasks served here too, so the modes are exercised quickly; the
end-to-end runs with real processes are in test_example_linear_regression.py
and test_supervisor.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from towerflow.cluster import ClusterSpec, Server, TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.errors import DeadlineExceededError, InvalidArgumentError
from towerflow.models.linear import (
    TRUE_BIAS,
    TRUE_WEIGHT,
    LinearRegression,
    mse_loss,
    regression_data,
)
from towerflow.ps import PSService
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

SECRET = Credentials(secret=b"training-secret")
DATA = regression_data(64, noise=0.0)


@pytest.fixture
def cluster(free_ports):
    """A cluster of 1 ps (served in this process) and 3 worker slots."""
    ports = free_ports(4)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                        "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})
    service = PSService(0)
    server = Server(spec, "ps", 0, credentials=SECRET, start=False)
    server.add_handlers([service.handlers()])
    server.start()
    try:
        yield spec, service
    finally:
        server.stop()


def worker(spec, index: int, **kw) -> ParameterServer:
    kw.setdefault("step_timeout", 30.0)
    return ParameterServer(spec, TaskInfo("worker", index), credentials=SECRET, device="cpu", **kw)


def train(strategy: ParameterServer, steps_until: int, model=None, lr: float = 0.1,
          gate: threading.Event | None = None,
          start: threading.Barrier | None = None) -> list[int]:
    """Prepare a fresh model and train until the global step reaches ``steps_until``.

    ``start``: wait there, once prepared with the initial parameters pulled
    (the chief initialises the ps first), before the first step.
    """
    model = model or LinearRegression(torch.Generator().manual_seed(strategy.rank))
    strategy.prepare(model, OptimizerConfig("sgd", lr=lr))
    seen = []
    try:
        if start is not None:
            assert strategy.global_step == 0  # the chief's first read initialises the ps
            start.wait()
        while strategy.global_step < steps_until:
            if gate is not None:
                gate.wait(30)
            result = strategy.run_step(mse_loss, DATA)
            seen.append(result.global_step)
    finally:
        strategy.shutdown()
    return seen


def test_a_global_step_counts_one_worker_batch_async_and_the_aggregated_ones_sync() -> None:
    spec = ClusterSpec({"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]})

    def strategy(**kw) -> ParameterServer:
        return ParameterServer(spec, TaskInfo("worker", 0), device="cpu", server=False, **kw)

    # examples/sec and epochs-per-decay multiply the batch by this, not by the worker count
    assert strategy(mode="async").batches_per_step == 1
    assert strategy(mode="ssp").batches_per_step == 1
    assert strategy(mode="sync").batches_per_step == 3
    backups = strategy(mode="sync", replicas_to_aggregate=2)
    assert (backups.world_size, backups.batches_per_step) == (3, 2)


def test_parameters_are_views_of_the_flat_buffers(cluster) -> None:
    spec, service = cluster
    strategy = worker(ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:1]}), 0)
    model = torch.nn.Linear(3, 2)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.1))
        strategy.run_step(lambda m, b: m(b).sum(), torch.ones(4, 3))
        flat = strategy._buffers.flat[0]
        assert model.weight.data_ptr() == flat.data_ptr()
        assert model.weight.grad.data_ptr() == strategy._buffers.grad[0].data_ptr()
        assert torch.equal(torch.from_numpy(service.shard.state.params.copy()), flat)
    finally:
        strategy.shutdown()


def test_async_two_workers_fit_the_true_weights_with_non_consecutive_steps(cluster) -> None:
    spec, service = cluster
    two = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:2]})
    chief, other = worker(two, 0), worker(two, 1)
    models = [LinearRegression(torch.Generator().manual_seed(i)) for i in range(2)]
    start = threading.Barrier(2, timeout=60)  # both step at once: neither finishes alone
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(train, s, 300, m, start=start)
                for s, m in zip((chief, other), models, strict=True)]
        seen = [r.result(timeout=120) for r in runs]
    state = service.shard.state
    weight, bias = state.params.tolist()
    assert abs(weight - TRUE_WEIGHT) < 1e-2 and abs(bias - TRUE_BIAS) < 1e-2
    assert state.step == len(seen[0]) + len(seen[1])  # every push applied
    gaps = [b - a for steps in seen for a, b in zip(steps, steps[1:], strict=False)]
    assert max(gaps) > 1  # the other worker advanced the shared step in between


def test_sync_global_step_counts_applied_updates_and_drops_stale(cluster) -> None:
    spec, service = cluster
    slow_gate = threading.Event()
    # every worker starts from the step-0 parameters: the straggler's gradient is computed
    # on step 0 and pushed only after the others reached step 20
    start = threading.Barrier(3, timeout=60)
    three = [worker(spec, i, mode="sync", replicas_to_aggregate=2) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        fast = [pool.submit(train, s, 20, start=start) for s in three[:2]]
        slow = pool.submit(train, three[2], 20, gate=slow_gate, start=start)
        fast_seen = [f.result(timeout=120) for f in fast]  # backups: the straggler holds nothing
        slow_gate.set()
        slow_seen = slow.result(timeout=120)
    state = service.shard.state
    assert state.step == state.stats.updates == 20
    assert state.stats.stale == 1 and state.stats.applied == 2 * 20
    for steps in fast_seen:  # each step of a fast worker is one applied, averaged update
        assert steps == list(range(1, 21))
    assert slow_seen == [20]  # its one push was stale: dropped, and it caught up


def test_ssp_keeps_every_worker_within_the_staleness_bound(cluster) -> None:
    spec, service = cluster
    two = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:2]})
    gate = threading.Event()
    fast, slow = worker(two, 0, mode="ssp", staleness=3), worker(two, 1, mode="ssp", staleness=3)
    with ThreadPoolExecutor(2) as pool:
        fast_run = pool.submit(train, fast, 40)
        slow_run = pool.submit(train, slow, 40, gate=gate)
        with pytest.raises(TimeoutError):
            fast_run.result(timeout=1.0)  # held: it may not run more than 3 pushes ahead
        gate.set()
        fast_run.result(timeout=120)
        slow_run.result(timeout=120)
    assert service.shard.state.stats.max_lead == 3


def test_non_chief_waits_until_the_chief_initialises(cluster) -> None:
    spec, service = cluster
    two = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:2]})
    other = worker(two, 1, init_timeout=30)
    prepared = threading.Event()

    def prepare_other() -> None:
        other.prepare(LinearRegression(), OptimizerConfig("sgd", lr=0.1))
        prepared.set()

    thread = threading.Thread(target=prepare_other)
    thread.start()
    chief = worker(two, 0)
    try:
        assert not prepared.wait(0.5) and service._shard is None
        chief_model = LinearRegression(torch.Generator().manual_seed(5))
        chief.prepare(chief_model, OptimizerConfig("sgd", lr=0.1))
        assert chief.global_step == 0  # initialises the ps
        assert prepared.wait(30)
        assert torch.equal(other.model.weight.detach(), chief_model.weight.detach())
    finally:
        thread.join(30)
        chief.shutdown()
        other.shutdown()


def test_non_chief_gives_up_after_its_init_timeout(cluster) -> None:
    spec, _ = cluster
    other = worker(spec, 1, init_timeout=0.3)
    try:
        with pytest.raises(DeadlineExceededError, match=r"waited 0 s for the chief"):
            other.prepare(LinearRegression(), OptimizerConfig())
    finally:
        other.shutdown()


def nan_loss(model, batch):
    return (model(batch[0]) * float("nan")).sum()


def test_nan_gradient_raises_by_default_and_skip_policy_skips(cluster) -> None:
    spec, service = cluster
    one = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:1]})
    strict = worker(one, 0)
    try:
        strict.prepare(LinearRegression(), OptimizerConfig())
        before = strict.model.weight.detach().clone()
        with pytest.raises(InvalidArgumentError, match=r"Gradient of 'weight' on worker 0 contains NaN"):
            strict.run_step(nan_loss, DATA)
        assert torch.equal(strict.model.weight.detach(), before)
    finally:
        strict.shutdown()
    lenient = worker(one, 0, on_bad_gradient="skip")
    try:
        lenient.prepare(LinearRegression(), OptimizerConfig())
        result = lenient.run_step(nan_loss, DATA)
        assert not result.applied
        assert lenient.run_step(mse_loss, DATA).applied
    finally:
        lenient.shutdown()
    assert service.shard.state.step == 1


def test_checkpoint_state_round_trips_through_the_ps(cluster) -> None:
    spec, service = cluster
    one = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:1]})
    first = worker(one, 0)
    try:
        first.prepare(LinearRegression(), OptimizerConfig("momentum", lr=0.1, momentum=0.9))
        for _ in range(3):
            first.run_step(mse_loss, DATA)
        groups, meta = first.state_dict(), first.state_metadata()
    finally:
        first.shutdown()
    assert meta["global_step"] == 3 and set(groups["optimizer"]) == {
        "weight/momentum_buffer", "bias/momentum_buffer"}
    again = worker(one, 0)
    try:
        model = LinearRegression(torch.Generator().manual_seed(9))
        again.prepare(model, OptimizerConfig("momentum", lr=0.1, momentum=0.9))
        again.load_state(groups, meta)
        assert again.global_step == 3
        assert torch.equal(model.weight.detach(), groups["model"]["weight"])
        momentum = service.shard.state.optimizer.slots["momentum_buffer"]
        assert momentum.tolist() == [float(groups["optimizer"]["weight/momentum_buffer"]),
                                     float(groups["optimizer"]["bias/momentum_buffer"])]
    finally:
        again.shutdown()


def test_prefetch_overlaps_the_push_with_the_next_batch_and_still_fits(cluster) -> None:
    spec, service = cluster
    one = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:1]})
    strategy = worker(one, 0, prefetch=True)
    seen = train(strategy, 200)
    assert seen == list(range(1, len(seen) + 1)) and service.shard.state.step == len(seen)
    weight, bias = service.shard.state.params.tolist()
    assert abs(weight - TRUE_WEIGHT) < 1e-2 and abs(bias - TRUE_BIAS) < 1e-2




class _OneBigManySmall(torch.nn.Module):
    """One big parameter, then eight small ones whose bytes add up to the big one's."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(32, 32))
        self.small = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(128)) for _ in range(8))


def test_the_default_placement_balances_bytes_over_the_ps_tasks(free_ports) -> None:
    """Greedy by bytes: the big one alone on a ps, the small ones on the other (round robin
    would put 1536 floats on one and 512 on the other)."""
    ports = free_ports(3)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{p}" for p in ports[:2]],
                        "worker": [f"127.0.0.1:{ports[2]}"]})
    servers = []
    for index in range(2):
        server = Server(spec, "ps", index, credentials=SECRET, start=False)
        server.add_handlers([PSService(index).handlers()])
        server.start()
        servers.append(server)
    strategy = worker(spec, 0, server=False)
    try:
        strategy.prepare(_OneBigManySmall(), OptimizerConfig("sgd", lr=0.1))
        shards = strategy.client.placement.shards
        assert [[g.name for g in s.segments] for s in shards] == [
            ["big"], [f"small.{i}" for i in range(8)]]
        assert [s.numel for s in shards] == [1024, 1024]
    finally:
        strategy.shutdown()
        for server in servers:
            server.stop()


def test_an_async_chief_waits_for_the_other_workers_done_before_its_final_checkpoint(
        cluster) -> None:
    spec, service = cluster
    two = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:2]})
    chief, other = worker(two, 0), worker(two, 1)
    chief.prepare(LinearRegression(torch.Generator().manual_seed(0)), OptimizerConfig("sgd"))
    try:
        for _ in range(5):
            chief.run_step(mse_loss, DATA)
        with ThreadPoolExecutor(1) as pool:
            pushes = pool.submit(train, other, 30)  # Done at its shutdown, after its pushes
            assert chief.wait_for_peers(timeout=60) is True
            assert len(pushes.result(timeout=60)) > 0
        chief.state_dict()  # the final checkpoint's snapshot, pulled now
        assert chief.state_metadata()["global_step"] == service.shard.state.step >= 30
        assert chief.wait_for_peers(timeout=60) is False  # nobody left to wait for
    finally:
        chief.shutdown()
