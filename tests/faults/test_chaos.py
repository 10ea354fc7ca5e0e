"""A bounded chaos run: random worker kills and restarts lose no update and apply none twice."""

from __future__ import annotations

import numpy as np
import pytest

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
