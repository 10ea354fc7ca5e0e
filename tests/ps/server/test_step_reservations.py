"""An asynchronous run ends at its last step exactly: ps task 0 keeps a step of the run's end
for each worker's next push, and no push is sent without one.

The rule alone (:class:`StepReservations`) under every interleaving a random scheduler draws
of workers that push, are answered and stop; then the strategy's workers against real ps
tasks on 127.0.0.1, in threads, racing for the last steps.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.ps.server.dense.reservations import StepReservations
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks


def test_a_step_is_kept_while_the_run_has_room_and_released_by_done_and_restart() -> None:
    step = [0]
    kept = StepReservations(lambda: step[0])
    assert kept.reserve(0, 11, last_step=2) and kept.reserve(1, 22, last_step=2)
    assert kept.reserve(0, 11, last_step=2)  # held already: still True, no second step
    assert not kept.reserve(2, 33, last_step=2)  # 0 + 2 kept: no room for a third worker
    step[0] = 1  # worker 0's push applied
    assert not kept.after_push(0, 11, last_step=2)  # 1 applied + worker 1's kept = 2
    kept.release(1)  # worker 1 said Done without pushing
    assert kept.reserve(2, 33, last_step=2) and len(kept) == 1
    assert kept.reserve(2, 44, last_step=2)  # a new incarnation voids the old one's step
    assert len(kept) == 1
    assert not kept.reserve(3, 1, last_step=0)  # no last step: nothing is kept


def test_the_step_a_dead_worker_held_is_pushed_by_the_workers_left() -> None:
    step = [8]
    dead: set[int] = set()
    kept = StepReservations(lambda: step[0], alive=lambda worker: worker not in dead)
    assert kept.reserve(0, 1, last_step=10) and kept.reserve(1, 1, last_step=10)
    step[0] = 9  # worker 0's push applied; worker 1 holds the last step, then dies
    assert not kept.after_push(0, 1, last_step=10)
    dead.add(1)  # the heartbeats declare it dead
    assert kept.reserve(0, 1, last_step=10)  # its step is free: worker 0 pushes it
    assert len(kept) == 1


@pytest.mark.parametrize("workers,last_step", [(2, 30), (3, 17), (5, 9), (4, 1)])
def test_any_interleaving_ends_at_the_last_step_exactly(workers: int, last_step: int) -> None:
    """Workers push only with a kept step; a push is applied, then answered (the answer
    may keep a step for the next). Whatever the order, the run ends at ``last_step``."""
    for seed in range(200):
        rng = random.Random(seed)
        step = [0]
        kept = StepReservations(lambda step=step: step[0])
        # a worker: "ask" (needs a step), "sent" (push in flight), "applied" (not answered
        # yet), "ready" (holds a kept step), "stopped"
        state = {w: "ask" for w in range(workers)}
        while any(s != "stopped" for s in state.values()):
            worker = rng.choice([w for w, s in state.items() if s != "stopped"])
            now = state[worker]
            if now == "ask":
                state[worker] = "ready" if kept.reserve(worker, 1, last_step) else "stopped"
            elif now == "ready":
                state[worker] = "sent"
            elif now == "sent":
                step[0] += 1
                assert step[0] <= last_step
                state[worker] = "applied"
            else:  # the answer to its push
                state[worker] = "ready" if kept.after_push(worker, 1, last_step) else "stopped"
        assert step[0] == last_step, f"seed {seed}"


SECRET = Credentials(secret=b"last-step")


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(1), y)


@pytest.mark.parametrize("last_step", [40, 41])
def test_two_async_workers_racing_for_the_last_steps_stop_there(last_step: int) -> None:
    """Two workers of one async job in threads, each looping as the training loop does (until
    its step reaches ``last_step`` or it is told the steps left are the other's): ps task 0's
    ledger holds exactly ``last_step`` pushes, and a second run to a later step goes on."""
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 4, generator=g), torch.randn(16, generator=g))
    with ps_tasks(SECRET, num_ps=2, num_workers=2) as spec:
        strategies = [ParameterServer(spec, TaskInfo("worker", i), credentials=SECRET,
                                      device="cpu", server=False) for i in range(2)]
        ready = threading.Barrier(2, timeout=60)
        stops: dict[int, bool] = {}
        errors: list[BaseException] = []

        def work(index: int, until: int) -> None:
            strategy = strategies[index]
            try:
                if until == last_step:
                    torch.manual_seed(0)
                    strategy.prepare(nn.Linear(4, 1), OptimizerConfig("sgd", lr=0.01))
                strategy.stop_at(until)
                step = strategy.global_step
                ready.wait()
                stopped = False
                while step < until:
                    result = strategy.run_step(_loss, batch)
                    if result.stopped:
                        stopped = True
                        break
                    step = result.global_step
                strategy.settle()
                stops[index] = stopped
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(exc)

        try:
            for until in (last_step, last_step + 7):  # then a later end on the same strategies
                threads = [threading.Thread(target=work, args=(i, until)) for i in range(2)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(timeout=120)
                assert not errors, errors
                assert not any(thread.is_alive() for thread in threads)
                client = strategies[0].client
                assert client.global_step() == until
                assert client.shards[0].ledger().total == until  # the pushes applied: no more
                assert client.shards[1].ledger().total == until  # and the same on ps task 1
        finally:
            for strategy in strategies:
                strategy.shutdown()


def test_a_worker_left_no_step_waits_for_the_holder_to_push_it_or_to_leave() -> None:
    """Worker 1 holds the run's last step: worker 0 waits until it is pushed (then stops);
    with one more step, worker 1 leaving (Done) frees its step for worker 0."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 4), torch.randn(8))
    with ps_tasks(SECRET, num_ps=2, num_workers=2) as spec:
        strategies = [ParameterServer(spec, TaskInfo("worker", i), credentials=SECRET,
                                      device="cpu", server=False) for i in range(2)]
        try:
            strategies[0].prepare(nn.Linear(4, 1), OptimizerConfig("sgd", lr=0.01))
            strategies[0].run_step(_loss, batch)  # initialised, step 1
            holder = threading.Thread(  # worker 1 prepares while worker 0 waits for the Init
                target=strategies[1].prepare, args=(nn.Linear(4, 1),
                                                    OptimizerConfig("sgd", lr=0.01)))
            holder.start()
            holder.join(timeout=60)
            first, second = (s.client for s in strategies)
            for client in (first, second):
                client.stop_at(2)
            assert second.reserve()  # the last step is worker 1's
            answer: list[bool] = []
            waiter = threading.Thread(target=lambda: answer.append(first.reserve(wait=30)))
            waiter.start()
            waiter.join(timeout=0.3)
            assert waiter.is_alive() and not answer  # it waits: the step is held
            assert not strategies[1].run_step(_loss, batch).stopped  # worker 1 pushes it
            strategies[1].settle()
            waiter.join(timeout=30)
            assert answer == [False] and first.global_step() == 2  # the run is at its end
            for client in (first, second):
                client.stop_at(3)
            assert second.reserve()
            waiter = threading.Thread(target=lambda: answer.append(first.reserve(wait=30)))
            waiter.start()
            strategies[1].shutdown()  # worker 1 leaves holding step 3: Done frees it
            waiter.join(timeout=30)
            assert answer == [False, True]
        finally:
            for strategy in strategies:
                strategy.shutdown()
