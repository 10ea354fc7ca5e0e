"""Reliability and security figures of a towerflow cluster, every task a real process.

In one run on this machine:

1. Bad inputs: a ps task (``towerflow server``) is sent a gradient of the
   wrong shape, of the wrong dtype, with NaN, with inf, calls without
   credentials and with the wrong secret, an oversized message, a malformed
   push header, a payload disagreeing with its header, three Inits whose
   tensor header lies, and a corrupt checkpoint is read: how many were
   tried and refused (with the parameters left unchanged).
2. Detection: heartbeats (interval 0.5 s, 3 missed beats) against a task
   killed with SIGKILL and one suspended with SIGSTOP: seconds to declare each
   dead.
3. Chaos: async training of the ledger model with 3 workers while random
   workers are SIGKILLed and restarted: faults injected and survived, updates
   lost (must be 0) and applied twice (must be 0) according to the audit of
   the final parameters against the workers' journals and the ps's ledger of
   applied pushes, whose replay must give the final parameters exactly. With
   ``--ps-kills 1`` the parameter is split over 2 ps tasks, each shard with a
   live copy on the other task (``replicas=1``), and one ps task is SIGKILLed
   for good among the worker kills: its shard goes on from its copy without a
   restart (the killed task's ledger goes with it: its shard's elements are
   audited by the parameters alone).
4. Authentication cost: push-and-pull round trips of a large fp32 model
   (100 MB by default) to two ps tasks, one with a cluster secret and one
   without, alternated round trip by round trip: GB/s of push + pull each,
   the cost of the secret (target < 5%), the median of the paired ratios,
   and the CPU time of making and checking one auth token.

Commands::

    python benchmarks/reliability.py                 # ~1-2 minutes on 2 cores
    python benchmarks/reliability.py --mb 20 --pairs 10 --kills 2   # quicker
    python benchmarks/reliability.py --ps-kills 1    # and a ps task killed in the chaos run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from towerflow.cluster.heartbeat import HeartbeatOptions
from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster
from towerflow.testing.probes import probe_bad_inputs
from towerflow.testing.scenarios import chaos_run, detection_times

SERVER = [sys.executable, "-m", "towerflow", "server"]


def bad_inputs(workdir: Path) -> tuple[int, int, list[str]]:
    """(tried, refused, names of those not refused)."""
    spec = loopback_cluster(num_ps=1, num_workers=1)
    with LocalCluster(spec, SERVER) as lc:
        lc.start("ps", 0).wait_for_line(r"ps task 0 serving at", timeout=120)
        results = probe_bad_inputs(spec, lc.credentials, workdir=workdir)
    for r in results:
        print(f"  {'refused' if r.refused else 'ACCEPTED'}: {r.name}: {r.detail[:110]}")
    return len(results), sum(r.refused for r in results), [r.name for r in results if not r.refused]


def _ps_client(spec, lc: LocalCluster, numel: int):
    from towerflow.ps import AggregationConfig, PSClient, plan_placement
    from towerflow.ps.wire import ps_pb2 as pb

    client = PSClient(spec, plan_placement({"w": (numel,)}, 1), worker_id=0,
                      credentials=lc.credentials, timeout=120.0)
    client.initialize([np.zeros(numel, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                      aggregation=AggregationConfig())
    return client


def auth_cost(mb: int, pairs: int) -> tuple[float, float, float]:
    """(median GB/s with, without the secret, median of the per-pair cost ratios).

    Round trips to the two ps tasks alternate (with, without, without, with, ...),
    so that machine noise hits both alike; each adjacent pair gives one ratio.
    """
    numel = mb * 1_000_000 // 4
    grads, params = [np.zeros(numel, np.float32)], [np.empty(numel, np.float32)]
    seconds: dict[bool, list[float]] = {True: [], False: []}
    with LocalCluster(loopback_cluster(1, 1), SERVER, secret=True) as with_secret, \
            LocalCluster(loopback_cluster(1, 1), SERVER, secret=False) as without:
        clients = {}
        try:
            for secret, lc in ((True, with_secret), (False, without)):
                lc.start("ps", 0).wait_for_line(r"ps task 0 serving at", timeout=120)
                clients[secret] = _ps_client(lc.cluster, lc, numel)
                clients[secret].push(grads, lr=0.1, pull_into=params)  # warm up
            for pair in range(pairs):
                for secret in ((True, False) if pair % 2 == 0 else (False, True)):
                    start = time.perf_counter()
                    clients[secret].push(grads, lr=0.1, pull_into=params)
                    seconds[secret].append(time.perf_counter() - start)
        finally:
            for client in clients.values():
                client.close(done=False)
    gbps = {k: 2 * numel * 4 / statistics.median(v) / 1e9 for k, v in seconds.items()}
    ratios = [a / b - 1 for a, b in zip(seconds[True], seconds[False], strict=True)]
    return gbps[True], gbps[False], statistics.median(ratios)


def auth_cpu_cost(calls: int = 20000) -> float:
    """Microseconds of CPU per call to make and check an auth token (both ends)."""
    from towerflow.cluster.auth import AuthInterceptor, make_token

    secret, method = b"s" * 64, "/towerflow.ps.PS/PushPull"
    interceptor = AuthInterceptor(secret, task="/job:ps/replica:0/task:0")
    check, server, header = interceptor.check, interceptor.identity, b"h" * 64
    start = time.perf_counter()
    for _ in range(calls):
        check(method, make_token(secret, method, server, header))
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100, help="model size for the auth cost")
    parser.add_argument("--pairs", type=int, default=30,
                        help="alternated pairs of round trips for the auth cost")
    parser.add_argument("--kills", type=int, default=4, help="worker kills in the chaos run")
    parser.add_argument("--steps", type=int, default=1000, help="global steps of the chaos run")
    parser.add_argument("--ps-kills", type=int, default=0, choices=(0, 1),
                        help="ps tasks killed in the chaos run (1: 2 ps tasks with copies)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    options = HeartbeatOptions(interval=0.5, max_missed=3, startup_grace=0.0)
    with tempfile.TemporaryDirectory(prefix="towerflow-reliability-") as tmp:
        tmp_path = Path(tmp)
        print("1. bad inputs against a real ps task")
        tried, refused, accepted = bad_inputs(tmp_path)
        print("2. heartbeat detection")
        dead_s, suspended_s = detection_times(options)
        print(f"3. chaos run: {args.kills} random worker kills during async training"
              + (f", {args.ps_kills} ps task killed (2 ps tasks, replicas=1)"
                 if args.ps_kills else ""))
        (tmp_path / "chaos").mkdir()
        ps = {"ps_tasks": 2, "ps_replicas": 1, "ps_kills": args.ps_kills} if args.ps_kills \
            else {}
        report = chaos_run(tmp_path / "chaos", kills=args.kills, steps=args.steps,
                           seed=args.seed, **ps)
        print(f"  {report}")
        print(f"4. authentication cost: {args.mb} MB model, {args.pairs} alternated pairs of "
              "push-and-pull round trips")
        secured, plain, paired = auth_cost(args.mb, args.pairs)
        token_us = auth_cpu_cost()
    bound = options.detection_bound
    ps_kills = len(report.ps_killed)
    switched = sum(task != shard for shard, task in enumerate(report.served_by))
    injected = report.kills + ps_kills + 2
    # a ps kill is survived when its shard went on from its copy and every worker finished
    ps_survived = ps_kills if switched and all(c == 0 for c in report.exit_codes) else 0
    survived = report.survived + ps_survived + int(dead_s <= bound + 1) \
        + int(suspended_s <= bound + 1)
    audit = report.audit
    print("\nresults")
    print(f"faults injected: {injected} ({report.kills} worker SIGKILLs + restarts"
          + (f" and {ps_kills} ps SIGKILL" if ps_kills else "")
          + " in the chaos run, 1 task SIGKILLed, 1 task SIGSTOPped)")
    if ps_kills:
        print(f"ps kill: ps task(s) {report.ps_killed} killed; shards served at the end by ps "
              f"tasks {report.served_by} at terms {report.terms}; {report.found_switched} "
              "worker restart(s) found the shard on its copy at once; "
              f"{report.audit.ledger_uncovered} elements audited by the parameters alone")
    print(f"faults survived: {survived} (chaos: restarted workers finished, exit codes "
          f"{report.exit_codes}; heartbeats named the dead and the suspended task)")
    print(f"updates lost: {audit.lost}")
    print(f"updates applied twice: {audit.applied_twice}")
    print(f"ledger: {audit.acknowledged} acknowledged + {audit.in_flight_applied} of "
          f"{audit.in_flight} in-flight pushes applied = {audit.updates} updates; ps global "
          f"step {report.global_step}; ps ledger {audit.ledger_entries} entries, "
          f"{audit.ledger_duplicates} duplicated, {audit.ledger_unknown} unknown; replay of the "
          f"ps ledger equals the final parameters"
          + (" (on the elements of the shards whose ledger survived)" if audit.ledger_uncovered
             else "") + f": {audit.replay_matches}; unexplained changes "
          f"{audit.unexpected}")
    print(f"bad inputs tried: {tried}, refused: {refused}"
          + (f" (ACCEPTED: {', '.join(accepted)})" if accepted else ""))
    print(f"time to detect a dead task: {dead_s:.2f} s; a suspended task: {suspended_s:.2f} s "
          f"(interval {options.interval} s, {options.max_missed} missed beats, bound "
          f"~{bound:.1f} s)")
    cost = (plain - secured) / plain * 100
    trip_us = 2 * args.mb * 1e6 / (plain * 1e9) * 1e6
    print(f"parameter traffic (push + pull): {secured:.3f} GB/s with the secret, {plain:.3f} GB/s "
          f"without; authentication costs {cost:+.1f}% (median of paired round trips "
          f"{paired * 100:+.1f}%; target < 5%)")
    print(f"auth token made and checked: {token_us:.1f} us of CPU per call, one call per "
          f"push-and-pull round trip of {trip_us / 1e3:.0f} ms = {token_us / trip_us * 100:.4f}%")
    left = leftover_processes()
    print(f"processes left after shutdown: {len(left)}")


if __name__ == "__main__":
    main()
