"""The stall rule (launch.watchdog) and the goodput account (health.goodput) on hand-written
heartbeats and attempt records, against sums done by hand. The real faults that produce such
records are tests/launch/test_launch_local.py's and test_launch_slurm.py's."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from launch.attempts import decide
from health.goodput import account
from launch.watchdog import Limits, stalled

LIMITS = Limits(stall=10, first_step=100, checkpoint=50, eval=200)


def beat(rank, step, phase, time, done=5, world=2):
    return {"rank": rank, "world": world, "pid": 1, "host": "h", "step": step, "phase": phase, "done": done,
            "time": time}


@pytest.mark.parametrize("beats, now, stall", [
    ([], 99, False),  # nothing yet: the first-step allowance from the launch's start (0)
    ([], 101, True),
    ([beat(0, 1, "forward_backward", 0, done=0)], 99, False),  # rank 1 not yet beating: first step
    ([beat(0, 7, "data", 0), beat(1, 7, "forward_backward", 5)], 14, False),  # the newest beat counts
    ([beat(0, 7, "data", 0), beat(1, 7, "forward_backward", 5)], 16, True),
    ([beat(0, 8, "checkpoint", 0), beat(1, 9, "forward_backward", 1)], 40, False),  # a rank still saving
    ([beat(0, 8, "report", 0), beat(1, 9, "forward_backward", 1)], 150, False),  # rank 0 drawing the report
    ([beat(0, 8, "preemption", 0), beat(1, 9, "forward_backward", 1)], 12, True),  # a per-step hook: steady
])
def test_a_stall_is_no_beat_for_the_most_lenient_allowance(beats, now, stall):
    assert (stalled(beats, 0, LIMITS, now) is not None) == stall


def test_stall_timeout_zero_turns_it_off():
    assert stalled([], 0, Limits(0, 0, 0, 0), 10**6) is None


def test_a_stall_note_is_restarted_as_a_crash_and_counts_against_the_budget():
    note = {"code": 1, "reason": "stall", "stall": "/run/stalls/002", "message": "no progress for 12 s"}
    assert decide(-9, note, 4, 8, 0, 8)[:2] == ("restart", "stall")
    assert decide(-9, note, 8, 8, 0, 8)[:2] == ("fail", "stall")  # no new checkpoint: it would stall again
    assert decide(-9, note, 4, 8, 8, 8)[:2] == ("fail", "stall")  # the crash budget is spent


def iso(t: float) -> str:
    return datetime.fromtimestamp(T0 + t, timezone.utc).isoformat()


T0 = 1_700_000_000.0


def test_goodput_adds_up_by_hand(tmp_path):
    """Launch 1 (0-100 s) trains to step 12 and stalls (last beat at 80 s); the requeue starts at
    105 s from the step-8 checkpoint and finishes at 200 s."""
    marks1 = {k: T0 + v for k, v in dict(process=2, trainer=5, rendezvous=6, built=8, loaded=9, first_step=10).items()}
    marks2 = {k: T0 + v for k, v in dict(process=106, trainer=110, rendezvous=111, built=113, loaded=114,
                                          first_step=115).items()}
    events = [
        {"event": "start", "job": "1", "step": 0, "time": iso(0)},
        {"event": "end", "job": "1", "step": 8, "action": "restart", "cause": "stall", "time": iso(100),
         "summary": {"marks": marks1, "done": 12, "reached": 12, "last_beat": T0 + 80,
                     "phase_s": {"data": 6, "forward_backward": 48, "optimizer": 6, "checkpoint": 4, "eval": 5}}},
        {"event": "start", "job": "1", "step": 8, "time": iso(105)},
        {"event": "end", "job": "1", "step": 20, "action": "done", "cause": "finished", "time": iso(200),
         "summary": {"marks": marks2, "done": 12, "reached": 20, "last_beat": T0 + 195,
                     "phase_s": {"data": 5, "forward_backward": 60, "optimizer": 5, "preemption": 2, "rollback": 3}}},
    ]
    (tmp_path / "launcher").mkdir()
    (tmp_path / "launcher" / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    a = account(tmp_path)
    assert a["wall_s"] == 200
    assert a["startups"][0] == {"process": 2, "imports": 3, "rendezvous": 1, "build": 2, "checkpoint load": 1,
                                "first step": 1}
    # 4 of launch 1's 12 steps (9-12) were trained again, at its 60 s / 12 steps
    assert a["replayed_steps"] == 4
    costs = {k: round(v, 6) for k, v in a["costs"].items()}
    # a rollback's checkpoint load is its own cost (health.phases.Phase.ROLLBACK), not productive time
    assert costs == {"first start": 10, "restarts": 10, "replays": 20, "checkpoints": 4, "rollbacks": 3, "evals": 5,
                     "stalls": 20 + 5, "preemptions": 2, "crashes": 0}
    assert round(a["productive_s"], 6) == 60 - 20 + 70
    assert round(a["goodput"], 6) == 110 / 200


def test_exclude_stragglers_names_the_job_nodes_alerted_since_the_start(tmp_path):
    from launch.attempts import straggler_nodes

    alerts = [{"kind": "straggler", "host": "node7.cluster", "time": "2026-01-01T00:00:00+00:00"},  # before
              {"kind": "straggler", "host": "node2.cluster", "time": "2026-01-02T00:00:00+00:00"},
              {"kind": "straggler", "host": "elsewhere", "time": "2026-01-02T00:00:00+00:00"}]  # not the job's
    (tmp_path / "alerts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in alerts))
    assert straggler_nodes(tmp_path, "2026-01-01T12:00:00+00:00", ["node2", "node7"]) == {"node2"}
