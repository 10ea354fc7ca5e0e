"""A bounded chaos run: random worker kills and restarts, and a ps kill on a cluster whose
shards have live copies, lose no update and apply none twice."""

from __future__ import annotations

import numpy as np
import pytest

from towerflow.errors import InvalidArgumentError
from towerflow.testing import leftover_processes
from towerflow.testing.ledger import audit_ledger
from towerflow.testing.scenarios import chaos_run


def test_the_audit_catches_lost_twice_and_unexplained_updates():
    journals = {0: ["push 0", "applied 0", "push 1", "applied 1"], 1: ["push 0"]}
    good = np.array([-1, -1, 0, 0, -1, 0, 0, 0], np.float32)
    audit = audit_ledger(good, journals, slots=4)
    assert audit.consistent and (audit.updates, audit.in_flight_applied) == (3, 1)
    lost = audit_ledger(np.array([-1, 0, 0, 0, 0, 0, 0, 0], np.float32), journals, slots=4)
    assert (lost.lost, lost.consistent) == (1, False)
    twice = audit_ledger(np.array([-2, -1, 0, 0, 0, 0, 0, 0], np.float32), journals, slots=4)
    assert (twice.applied_twice, twice.consistent) == (1, False)
    stray = audit_ledger(np.array([-1, -1, -1, 0, 0, 0, 0, -0.5], np.float32), journals, slots=4)
    assert (stray.unexpected, stray.consistent) == (2, False)


def test_the_ps_ledger_is_replayed_through_the_journals_onto_the_parameters():
    journals = {0: ["incarnation 7", "push 0", "applied 0", "push 1"],
                1: ["incarnation 3", "push 0", "applied 0", "incarnation 4", "push 1"]}
    params = np.array([-1, -1, 0, 0, -1, -1, 0, 0], np.float32)
    ledger = [(0, 7, 1, 1), (1, 3, 1, 2), (0, 7, 2, 3), (1, 4, 1, 4)]
    audit = audit_ledger(params, journals, slots=4, ps_ledger=ledger)
    assert audit.replay_matches and audit.consistent and audit.ledger_entries == 4
    twice = audit_ledger(params, journals, slots=4, ps_ledger=[*ledger, (1, 4, 1, 5)])
    assert (twice.ledger_duplicates, twice.replay_matches, twice.consistent) == (1, False, False)
    unknown = audit_ledger(params, journals, slots=4, ps_ledger=[*ledger[:3], (1, 9, 1, 4)])
    assert (unknown.ledger_unknown, unknown.consistent) == (1, False)


def test_partial_ps_ledger_entries_replay_only_the_range_they_applied():
    journals = {0: ["incarnation 7", "push 0", "applied 0", "push 1"],
                1: ["incarnation 3", "push 0", "applied 0", "incarnation 4", "push 1"]}
    params = np.array([-1, 0, 0, 0, -1, -1, 0, 0], np.float32)
    # worker 0's push 1 (element 1) was cut off after element 0; worker 1's push 1
    # (element 5) after elements 0-6: only the second changed its element
    ledger = [(0, 7, 1, 1, False, 0, 8), (1, 3, 1, 2, False, 0, 8), (0, 7, 2, 2, True, 0, 1),
              (1, 4, 1, 2, True, 0, 7)]
    audit = audit_ledger(params, journals, slots=4, ps_ledger=ledger)
    assert audit.replay_matches and audit.consistent
    assert (audit.ledger_entries, audit.ledger_partial, audit.ledger_updates) == (4, 2, 3)
    assert audit.ledger_updates == audit.updates
    wider = [*ledger[:2], (0, 7, 2, 2, True, 0, 2), ledger[3]]  # it would have changed element 1
    assert audit_ledger(params, journals, slots=4, ps_ledger=wider).replay_matches is False


@pytest.mark.slow
def test_random_worker_kills_and_restarts_lose_no_update_and_apply_none_twice(
        tmp_path, subprocess_env):
    report = chaos_run(tmp_path, kills=3, workers=3, steps=600, step_time=0.02, seed=5,
                       env=subprocess_env)
    audit = report.audit
    summary = f"{report}"
    assert report.kills == 3, summary
    assert report.exit_codes == (0, 0, 0), summary
    assert report.survived == report.kills
    assert audit.lost == 0 and audit.applied_twice == 0 and audit.unexpected == 0, summary
    # the parameters are exactly the replay of the ledger: every acknowledged push once,
    # plus the in-flight pushes of killed workers that the ps had applied (at most one a kill)
    assert audit.updates == audit.acknowledged + audit.in_flight_applied, summary
    assert audit.in_flight <= report.kills and audit.in_flight_applied <= audit.in_flight
    assert report.global_step == report.ps_applied == audit.updates >= 600, summary
    # the ps's own ledger lists each applied push once and replays onto the parameters
    assert audit.ledger_updates == audit.updates and audit.ledger_duplicates == 0, summary
    assert audit.ledger_unknown == 0 and audit.replay_matches is True, summary
    assert audit.consistent
    assert leftover_processes() == []


def test_a_ledger_split_over_shards_is_replayed_shard_by_shard_and_a_lost_one_skipped():
    journals = {0: ["incarnation 7", "push 0", "applied 0", "push 1", "applied 1"],
                1: ["incarnation 3", "push 0", "applied 0"]}
    params = np.array([-1, -1, 0, 0, -1, 0, 0, 0], np.float32)
    every = [(0, 7, 1, 1), (0, 7, 2, 2), (1, 3, 1, 3)]  # each push reaches both shards
    whole = audit_ledger(params, journals, slots=4, shard_ledgers=[(0, 3, every), (3, 8, every)])
    assert whole.replay_matches and whole.consistent and whole.ledger_uncovered == 0
    assert (whole.ledger_entries, whole.ledger_updates) == (6, 3)
    # shard 0's ledger went with its ps task: its elements are left to the parameters
    lost = audit_ledger(params, journals, slots=4, shard_ledgers=[(3, 8, every)])
    assert lost.replay_matches and lost.consistent and lost.ledger_uncovered == 3
    assert lost.ledger_updates == 1
    twice = audit_ledger(params, journals, slots=4, shard_ledgers=[(3, 8, [*every, every[2]])])
    assert (twice.ledger_duplicates, twice.replay_matches, twice.consistent) == (1, False, False)


def test_ps_kills_need_a_replicated_cluster():
    with pytest.raises(InvalidArgumentError, match="only with ps_replicas=1"):
        chaos_run("unused", ps_tasks=2, ps_kills=1)
    with pytest.raises(InvalidArgumentError, match="ps_replicas 0, or 1 with ps_tasks >= 2"):
        chaos_run("unused", ps_tasks=1, ps_replicas=1)


@pytest.mark.slow
def test_a_ps_kill_among_worker_kills_loses_no_update_and_applies_none_twice(
        tmp_path, subprocess_env):
    report = chaos_run(tmp_path, kills=3, workers=3, steps=400, step_time=0.02, seed=5,
                       env=subprocess_env, ps_tasks=2, ps_replicas=1, ps_kills=1)
    audit = report.audit
    summary = f"{report}"
    (killed,) = report.ps_killed
    survivor = 1 - killed
    assert report.exit_codes == (0, 0, 0) and report.survived == report.kills == 3, summary
    # the killed task's shard is served by its copy on the other task, at the next term
    assert report.served_by == (survivor, survivor), summary
    assert report.terms[killed] == 2, summary
    # workers restarted after the kill found the shard there at once
    assert report.found_switched >= 1, summary
    # nothing lost, nothing doubled: every acknowledged push is in the parameters once
    assert audit.lost == 0 and audit.applied_twice == 0 and audit.unexpected == 0, summary
    assert audit.updates == audit.acknowledged + audit.in_flight_applied, summary
    assert audit.in_flight <= report.kills and audit.updates >= 400, summary
    assert report.global_step >= 400, summary
    # the surviving primary's ledger replays onto its elements; the killed task's
    # ledger went with it, so its shard's elements rest on the parameters' audit
    # (the killed shard's elements: half of 3 workers x 467 slots, 400 steps + 3 kills + 64)
    assert audit.ledger_uncovered == (701 if killed == 0 else 700), summary
    assert audit.ledger_duplicates == 0 and audit.ledger_unknown == 0, summary
    assert audit.replay_matches is True and audit.consistent, summary
    assert leftover_processes() == []
