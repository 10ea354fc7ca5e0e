"""Hybrid training (``ParameterServer(dense="allreduce")``): tables on real ps tasks, dense
layers all-reduced by Gloo among real worker processes on 127.0.0.1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials, new_secret, write_secret_file
from towerflow.errors import InvalidArgumentError
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks
from towerflow.testing.processes import stop_processes

PROGRAM = Path(__file__).resolve().parents[1] / "support" / "programs" / "hybrid_worker.py"


def run_workers(tmp_path: Path, subprocess_env: dict, *extra: str, steps: int = 12,
                timeout: float = 120.0, num_ps: int = 2,
                only: dict[int, list[str]] | None = None,
                waited: tuple[int, ...] = (0, 1)) -> list[subprocess.CompletedProcess]:
    """``num_ps`` ps tasks served here and 2 hybrid worker processes (``extra`` arguments to
    both, ``only[i]`` to worker ``i``); each worker's exit status and output (a worker not
    ``waited`` for is stopped once the others ended)."""
    secret = new_secret()
    env = {**subprocess_env,
           "TOWERFLOW_SECRET_FILE": str(write_secret_file(tmp_path / "secret", secret))}
    with ps_tasks(Credentials(secret=secret), num_ps=num_ps, num_workers=2) as spec:
        cluster = json.dumps(spec.as_dict())
        procs = [subprocess.Popen(
            [sys.executable, str(PROGRAM), cluster, str(i), str(tmp_path), "--steps", str(steps),
             *extra, *(only or {}).get(i, [])],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]
        try:
            for i in waited:
                procs[i].wait(timeout=timeout)
        finally:
            stop_processes(procs, grace=5)
        outs = [p.communicate()[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in
            zip(procs, outs, strict=True)]


def records(tmp_path: Path) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    return [(json.loads((tmp_path / f"worker-{i}.json").read_text()),
             load_file(str(tmp_path / f"worker-{i}.safetensors"))) for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("staleness, ahead", [(0, ()), (2, ()), (1, ("--ahead",))])
def test_dense_layers_are_bit_identical_on_every_worker_and_each_push_applies_once(
        tmp_path, subprocess_env, staleness, ahead) -> None:
    done = run_workers(tmp_path, subprocess_env, "--staleness", str(staleness), *ahead)
    assert [d.returncode for d in done] == [0, 0], "\n".join(d.stdout[-3000:] for d in done)
    (first, tensors0), (second, tensors1) = records(tmp_path)
    assert first["global_step"] == second["global_step"] == 12
    # worker 1's hidden layer started apart: from the first step on they are one model
    assert first["digests"] == second["digests"] and len(set(first["digests"])) == 12
    owed = tensors0["owed"] + tensors1["owed"]  # every row gradient pushed, times the rate
    assert owed.abs().sum() > 0 and tensors1["owed"].abs().sum() > 0
    moved = tensors0["start"] - tensors0["rows"]  # what the ps tasks applied to the table
    torch.testing.assert_close(moved, owed, rtol=0, atol=1e-5)  # none lost, none twice


@pytest.mark.slow
@pytest.mark.parametrize("staleness, ahead", [(0, ()), (2, ()), (2, ("--ahead",))])
def test_a_checkpoint_holds_every_workers_pushes_up_to_its_step_and_none_after(
        tmp_path, subprocess_env, staleness, ahead) -> None:
    slow = ["--slow-push", "0.3", "--slow-forward", "0.6"] if staleness else \
        ["--slow-forward", "0.2"]  # worker 1's pushes come late
    done = run_workers(tmp_path, subprocess_env, "--staleness", str(staleness), *ahead,
                       "--checkpoint-at", "5", *slow, steps=8)
    assert [d.returncode for d in done] == [0, 0], "\n".join(d.stdout[-3000:] for d in done)
    (first, tensors0), (second, tensors1) = records(tmp_path)
    owed = tensors0["owed_at"] + tensors1["owed_at"]  # both workers' pushes of steps 1..5
    torch.testing.assert_close(tensors0["start"] - tensors0["rows_at"], owed, rtol=0, atol=1e-5)
    # the paused step went on as any other: one model on every worker, every push once
    assert first["digests"] == second["digests"] and len(set(first["digests"])) == 8
    torch.testing.assert_close(tensors0["start"] - tensors0["rows"],
                               tensors0["owed"] + tensors1["owed"], rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [(), ("--staleness", "1", "--ahead")])
def test_gpu_workers_keep_their_dense_layers_equal_and_each_push_applies_once(
        tmp_path, subprocess_env, ahead) -> None:
    # rows in pinned memory, copied without waiting; with --ahead pulled a step early
    done = run_workers(tmp_path, subprocess_env, "--device", "cuda", *ahead)
    assert [d.returncode for d in done] == [0, 0], "\n".join(d.stdout[-3000:] for d in done)
    (first, tensors0), (second, tensors1) = records(tmp_path)
    gpus = torch.cuda.device_count()
    assert first["device"].startswith("cuda") and second["device"].startswith("cuda")
    assert first["backend"] == ("nccl" if gpus >= 2 else "gloo")  # NCCL: one rank per GPU
    assert first["digests"] == second["digests"] and len(set(first["digests"])) == 12
    torch.testing.assert_close(tensors0["start"] - tensors0["rows"],
                               tensors0["owed"] + tensors1["owed"], rtol=0, atol=1e-5)
    if ahead:
        assert [early for _, early, _ in first["pulls"]] == [False] + [True] * 10


@pytest.mark.slow
def test_the_staleness_bound_holds_under_a_worker_whose_pushes_are_slow(
        tmp_path, subprocess_env) -> None:
    bound = 1
    done = run_workers(tmp_path, subprocess_env, "--staleness", str(bound),
                       "--slow-push", "0.25", steps=8)
    assert [d.returncode for d in done] == [0, 0], "\n".join(d.stdout[-3000:] for d in done)
    for record, _ in records(tmp_path):
        began, pushed = record["began"], sorted(record["pushed"])
        for step, start in enumerate(began, 1):  # step's forward: its rows pulled from here
            applied = sum(end <= start for end in pushed)
            assert applied >= step - 1 - bound, (step, applied, began, pushed)
    # the bound is what held the slowed worker back: a push was still out at a later step
    began, pushed = records(tmp_path)[1][0]["began"], records(tmp_path)[1][0]["pushed"]
    assert any(sum(end <= start for end in pushed) < step - 1
               for step, start in enumerate(began, 1))


@pytest.mark.slow
def test_the_next_steps_rows_are_pulled_during_this_step_after_the_pushes_before_it(
        tmp_path, subprocess_env) -> None:
    steps = 8
    done = run_workers(tmp_path, subprocess_env, "--staleness", "1", "--ahead",
                       "--slow-push", "0.25", steps=steps)
    assert [d.returncode for d in done] == [0, 0], "\n".join(d.stdout[-3000:] for d in done)
    (first, tensors0), (second, tensors1) = records(tmp_path)
    assert first["digests"] == second["digests"]
    for record, _ in ((first, tensors0), (second, tensors1)):
        assert record["reads_ahead"]
        # step 1 records how the ids are made, step 2 pulls at its start: every later step's
        # rows were pulled during the step before
        assert [early for _, early, _ in record["pulls"]] == [False] + [True] * (steps - 2)
        for step, (_, _, applied) in enumerate(record["pulls"][1:], 3):
            # the rows of step s, pulled during step s - 1, hold its pushes up to step s - 2
            assert set(range(1, step - 1)) <= set(applied), (step, applied)
    moved = tensors0["start"] - tensors0["rows"]
    torch.testing.assert_close(moved, tensors0["owed"] + tensors1["owed"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_worker_that_dies_stops_the_others_within_the_step_timeout_naming_it(
        tmp_path, subprocess_env) -> None:
    done = run_workers(tmp_path, subprocess_env, "--step-timeout", "8", steps=400, timeout=90,
                       num_ps=1, only={1: ["--die-after", "5"]})
    assert done[1].returncode == 9 and done[0].returncode != 0, done[0].stdout[-3000:]
    message = done[0].stdout
    assert "UnavailableError" in message and "dense all-reduce of step" in message, message[-3000:]
    assert "/job:worker/replica:0/task:1" in message, message[-3000:]
    assert "every worker stops here" in message


@pytest.mark.slow
def test_a_stalled_worker_stops_the_others_within_the_step_timeout_naming_it(
        tmp_path, subprocess_env) -> None:
    # waited for 120 s at most: the step timeout (8 s) ends it, not the init timeout (300 s)
    done = run_workers(tmp_path, subprocess_env, "--step-timeout", "8", steps=400, timeout=120,
                       num_ps=1, only={1: ["--stall-after", "5"]}, waited=(0,))
    message = done[0].stdout
    assert done[0].returncode not in (0, None), message[-3000:]
    # torch's words for the timeout differ by version ("Operation timed out!", Gloo's "Timed out
    # waiting 8000ms ..."): the sentence is ours, the cause a timeout, the stalled worker named
    assert re.search(r"the dense all-reduce of step \d+ failed \(.*[Tt]imed out.*\): "
                     r"/job:worker/replica:0/task:1", message), message[-3000:]


@pytest.mark.slow
def test_a_worker_lost_while_the_chief_waits_in_the_store_stops_it_naming_the_worker(
        tmp_path, subprocess_env) -> None:
    # worker 1 dies once the chief paused it for a checkpoint: the chief waits in the store
    # for its word (up to an hour), not in a collective; it stops within seconds, naming it
    done = run_workers(tmp_path, subprocess_env, "--checkpoint-at", "5", steps=12, timeout=60,
                       num_ps=1, only={1: ["--die-in-pause"]})
    message = done[0].stdout
    assert done[1].returncode == 9 and done[0].returncode != 0, message[-3000:]
    assert re.search(r"UnavailableError: Worker 0: the wait for the other workers' pushes before "
                     r"the checkpoint of step 5 failed \(a peer worker's process is gone\): "
                     r"/job:worker/replica:0/task:1 at \S+ \(no connection: it is not running\)\. "
                     r"The workers' all-reduce group cannot go on without it, so every worker "
                     r"stops here\.", message), message[-3000:]
    assert not re.search(r"torch\.distributed\.Dist\w*Error", message), message[-3000:]


@pytest.mark.slow
def test_a_chief_lost_while_a_worker_waits_in_its_store_stops_the_worker_naming_it(
        tmp_path, subprocess_env) -> None:
    # the chief dies in its checkpoint's pause: worker 1 waits for its go in the chief's store,
    # whose server died with it; the store's error becomes the sentence naming the chief
    done = run_workers(tmp_path, subprocess_env, "--checkpoint-at", "5", steps=12, timeout=60,
                       num_ps=1, only={0: ["--die-in-pause"]})
    message = done[1].stdout
    assert done[0].returncode == 9 and done[1].returncode != 0, message[-3000:]
    assert re.search(r"UnavailableError: Worker 1: the wait for the chief's checkpoint of step 5 "
                     r"failed \([^)]*\): /job:worker/replica:0/task:0 at \S+ \(no connection: it "
                     r"is not running\)\. The workers' all-reduce group cannot go on without it",
                     message), message[-3000:]
    # (c10d logs the broken connection itself; the error that ends the worker is ours)
    assert not re.search(r"torch\.distributed\.Dist\w*Error", message), message[-3000:]


@pytest.mark.slow
def test_a_worker_that_finds_a_dead_chiefs_store_reads_the_new_chiefs_address(
        tmp_path, subprocess_env, free_ports) -> None:
    import queue
    import threading

    import numpy as np

    from towerflow.ps.placement import plan_placement
    from towerflow.ps.wire.messages import AggregationConfig
    from towerflow.ps.worker.dense.client import PSClient

    secret = new_secret()
    env = {**subprocess_env,
           "TOWERFLOW_SECRET_FILE": str(write_secret_file(tmp_path / "secret", secret))}
    with ps_tasks(Credentials(secret=secret), num_ps=1, num_workers=2) as spec:
        stale = PSClient(spec, plan_placement([], 1), worker_id=0,
                         credentials=Credentials(secret=secret))
        stale.initialize(  # the Init of a chief that died: nothing listens at its store
            [np.empty(0, np.float32)], optimizer=OptimizerConfig("sgd", lr=0.5),
            aggregation=AggregationConfig(total_num_replicas=2,
                                          rendezvous=f"127.0.0.1:{free_ports(1)[0]}"))
        stale.close(done=False)
        cluster = json.dumps(spec.as_dict())
        command = [sys.executable, str(PROGRAM), cluster, "{}", str(tmp_path), "--steps", "4"]
        late = subprocess.Popen([a.replace("{}", "1") for a in command], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x) for x in late.stdout], daemon=True)
        reader.start()
        procs = [late]
        try:
            while "does not answer; reading its address again" not in lines.get(timeout=60):
                pass
            procs.append(subprocess.Popen([a.replace("{}", "0") for a in command], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
            chief_out = procs[1].communicate(timeout=90)[0]
            assert late.wait(timeout=90) == 0 and procs[1].returncode == 0, chief_out[-3000:]
        finally:
            stop_processes(procs, grace=5)
            reader.join(timeout=10)
    (first, _), (second, _) = records(tmp_path)
    assert first["digests"] == second["digests"] and first["global_step"] == 4


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_workers_sharing_fewer_gpus_than_they_are_all_reduce_over_gloo(caplog) -> None:
    from towerflow.strategies.hybrid import worker_device

    assert worker_device(0, 2, None, 2, None) == (torch.device("cuda", 0), "nccl")
    assert worker_device(3, 4, None, 2, None) == (torch.device("cuda", 1), "gloo")
    assert "4 workers share 2 GPU(s) on this machine" not in caplog.text  # worker 3 is quiet
    assert worker_device(0, 4, None, 2, None)[1] == "gloo"
    assert "4 workers share 2 GPU(s) on this machine" in caplog.text
    assert worker_device(1, 2, torch.device("cpu"), 2, None) == (torch.device("cpu"), "gloo")
    assert worker_device(0, 1, None, 0, None) == (torch.device("cpu"), "gloo")


def test_a_model_without_tables_is_pointed_to_replicas() -> None:
    with ps_tasks(Credentials(secret=b"s" * 32), num_ps=1, num_workers=1) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), dense="allreduce",
                                   credentials=Credentials(secret=b"s" * 32), device="cpu",
                                   server=False)
        with pytest.raises(InvalidArgumentError, match=r"needs sparse tables.*--replicas N"):
            strategy.prepare(Dense(), OptimizerConfig("sgd", lr=0.1))
        strategy.shutdown()


@pytest.mark.parametrize(("options", "pattern"), [
    ({"dense": "allreduce", "embedding_staleness": -1}, r"embedding_staleness=-1 must be .*>= 0"),
    ({"dense": "allreduce", "embedding_staleness": 1.5}, r"embedding_staleness=1.5"),
    ({"dense": "allreduce", "mode": "sync"}, r"mode='sync'.*already averaged synchronously"),
    ({"dense": "allreduce", "mode": "ssp"}, r"mode='ssp'"),
    ({"dense": "allreduce", "join": True}, r"join=True.*elastic worker"),
    ({"dense": "ps", "embedding_staleness": 2}, r"applies to hybrid training only"),
    ({"dense": "gather"}, r"dense='gather'; use 'ps'.*'allreduce'"),
])
def test_bad_hybrid_options_are_refused_with_a_sentence(options, pattern) -> None:
    with ps_tasks(Credentials(secret=b"s" * 32), num_ps=1, num_workers=1) as spec:
        with pytest.raises(InvalidArgumentError, match=pattern):
            ParameterServer(spec, TaskInfo("worker", 0), credentials=Credentials(secret=b"s" * 32),
                            device="cpu", server=False, **options)


def test_dense_allreduce_makes_the_hybrid_strategy_with_parameter_servers_signature() -> None:
    import inspect

    from towerflow.strategies.hybrid import HybridParameterServer

    with ps_tasks(Credentials(secret=b"s" * 32), num_ps=1, num_workers=2) as spec:
        made = ParameterServer(spec, TaskInfo("worker", 0), dense="allreduce",
                               credentials=Credentials(secret=b"s" * 32), device="cpu",
                               server=False)
        plain = ParameterServer(spec, TaskInfo("worker", 0), credentials=Credentials(
            secret=b"s" * 32), device="cpu", server=False)
    assert type(made) is HybridParameterServer and type(plain) is ParameterServer
    assert made.batches_per_step == 2 and made.lockstep and made.embedding_staleness == 0
    assert {"dense", "embedding_staleness", "backend", "mode"} <= set(
        inspect.signature(ParameterServer).parameters)


def test_a_worker_training_through_the_ps_under_a_hybrid_chief_is_told_to_match_dense() -> None:
    import numpy as np

    from towerflow.ps.placement import plan_placement
    from towerflow.ps.wire.messages import AggregationConfig
    from towerflow.ps.worker.dense.client import PSClient

    secret = Credentials(secret=b"s" * 32)
    with ps_tasks(secret, num_ps=1, num_workers=2) as spec:
        chief = PSClient(spec, plan_placement([], 1), worker_id=0, credentials=secret)
        chief.initialize([np.empty(0, np.float32)], optimizer=OptimizerConfig("sgd", lr=0.1),
                         aggregation=AggregationConfig(total_num_replicas=2,
                                                       rendezvous="127.0.0.1:1"))
        chief.close(done=False)
        worker = ParameterServer(spec, TaskInfo("worker", 1), credentials=secret, device="cpu",
                                 server=False, init_timeout=10)
        try:
            with pytest.raises(InvalidArgumentError, match=r"hybrid training, --dense allreduce"
                               r"\), and this worker trains them through the ps"):
                worker.prepare(Dense(), OptimizerConfig("sgd", lr=0.1))
        finally:
            worker.shutdown()


@pytest.mark.parametrize("replicas", [0, 1])
def test_the_trainer_reads_a_batch_ahead_for_the_rows_of_the_next_step(replicas) -> None:
    """Under the Trainer (one worker, its group alone) with embedding_staleness=1: every step's
    rows after the second are pulled during the step before; also with live replicas."""
    import torch.nn.functional as F  # noqa: N812

    from towerflow.training.loop import Trainer
    from towerflow.training.pipeline import ReadAhead

    class Click(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.EmbeddingBag(1000, 8, sparse=True), nn.Linear(8, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(ids)).squeeze(-1)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(batch[0]), batch[1])

    gen = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 1000, (32, 4), generator=gen), torch.rand(32, generator=gen).round())
            for _ in range(6)]
    secret = Credentials(secret=b"s" * 32)
    with ps_tasks(secret, num_ps=2, num_workers=1) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), dense="allreduce",
                                   embedding_staleness=1, credentials=secret, device="cpu",
                                   replicas=replicas, server=False)
        trainer = Trainer(Click(), loss_fn, data, strategy=strategy, max_steps=10)
        try:
            trainer._setup()
            assert isinstance(trainer._pipeline, ReadAhead) and strategy.reads_ahead
            tables, pulls = strategy._tables, []
            later, now = tables.pull_later, tables.prefetcher._pull
            tables.pull_later = lambda *a: (pulls.append("ahead"), later(*a))[1]
            tables.prefetcher._pull = lambda *a: (pulls.append("now"), now(*a))[1]
            assert trainer.fit().step == 10
            assert pulls == ["now"] + ["ahead"] * 8  # step 1 records the recipe
        finally:
            trainer.close()
            strategy.shutdown()
