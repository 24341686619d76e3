"""The pieces of preemption and restart that need no processes: the restart rule,
the attempts record, the exit note, and PreemptionHook's step-boundary agreement."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from launch import attempts
from train import preemption
from train.preemption import PREEMPTED, Preempted, PreemptionHook, note_exit


@pytest.mark.parametrize("rc, note, before, after, crashes, expected", [
    (0, {}, 0, 12, 0, ("done", "finished")),
    (1, {"reason": "finished", "step": 12}, 8, 12, 0, ("done", "finished")),  # torchrun itself was signalled
    (1, {"reason": "recipe error", "message": "bad key"}, 0, 0, 0, ("fail", "recipe")),
    (1, {"reason": "preempted", "step": 7}, 4, 7, 9, ("restart", "preempted")),  # not counted as a crash
    (1, {"reason": "error", "message": "boom", "rank": 1}, 4, 8, 0, ("restart", "crash")),
    (1, {}, 4, 8, 2, ("restart", "crash")),
    (1, {}, 4, 8, 3, ("fail", "crash")),  # the crash budget is spent
    (1, {"reason": "error", "message": "boom", "rank": 0}, 8, 8, 0, ("fail", "crash")),  # no progress
])
def test_the_restart_rule(rc, note, before, after, crashes, expected):
    action, cause, why = attempts.decide(rc, note, before, after, crashes, max_restarts=3)
    assert (action, cause) == expected, why


def test_recipe_errors_and_no_progress_say_why():
    assert attempts.decide(1, {"reason": "recipe error", "message": "x.toml: [data] nope\nmore"},
                           0, 0, 0, 3)[2] == "recipe error: x.toml: [data] nope"
    assert "no new checkpoint since step 8" in attempts.decide(1, {}, 8, 8, 0, 3)[2]


def checkpoint(run, step, complete=True):
    d = run / "checkpoints" / f"step-{step}"
    d.mkdir(parents=True)
    if complete:
        (d / ".metadata").write_text("")


def test_begin_and_end_record_steps_and_count_crashes_per_job(tmp_path):
    checkpoint(tmp_path, 4)
    checkpoint(tmp_path, 8, complete=False)  # a save cut short does not count
    assert attempts.latest_step(tmp_path) == 4
    for n in range(2):
        attempts.begin(tmp_path, "7")
        checkpoint(tmp_path, 12 + 4 * n)
        event = attempts.end(tmp_path, "7", rc=1, max_restarts=1)
        assert event["action"] == ["restart", "fail"][n], event
    attempts.begin(tmp_path, "8")  # another job: its own crash budget, but no new checkpoint
    assert "no new checkpoint" in attempts.end(tmp_path, "8", rc=1, max_restarts=1)["why"]
    starts = [e for e in attempts.history(tmp_path) if e["event"] == "start"]
    assert [e["step"] for e in starts] == [4, 12, 16]


def test_begin_clears_the_previous_exit_note(tmp_path, monkeypatch):
    assert attempts.EXIT_FILE_ENV == preemption.EXIT_FILE_ENV  # one protocol, written down twice
    monkeypatch.setenv(preemption.EXIT_FILE_ENV, str(attempts.exit_file(tmp_path)))
    attempts.begin(tmp_path, "1")
    note_exit(PREEMPTED, "preempted", step=3)
    note_exit(1, "error", message="a later rank's symptom")  # first writer wins
    assert json.loads(attempts.exit_file(tmp_path).read_text())["reason"] == "preempted"
    attempts.begin(tmp_path, "1")
    assert not attempts.exit_file(tmp_path).exists()


class FakeTrainer:
    """The slice of LaneformerTrainer the hook uses; saves are recorded."""

    def __init__(self, steps=10, on_save=None):
        self.step, self.device, self.saves = 0, torch.device("cpu"), []
        self.config = SimpleNamespace(training=SimpleNamespace(steps=steps))

        def save(step, last_step=False):
            self.saves.append((step, last_step))
            if on_save:
                on_save()

        self.checkpointer = SimpleNamespace(save=save)


@pytest.fixture
def hook(monkeypatch):
    old = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(preemption, "_requested", False)
    yield PreemptionHook.Config().build()
    signal.signal(signal.SIGUSR1, old)


def sigusr1():
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_signal_during_the_step_saves_at_that_step_and_exits_75(hook):
    trainer = FakeTrainer()
    trainer.step = 3
    hook.after_step(trainer)
    assert trainer.saves == []
    trainer.step = 4
    sigusr1()  # e.g. during this step's eval, which runs before the hook
    with pytest.raises(Preempted) as stop:
        hook.after_step(trainer)
    assert trainer.saves == [(4, True)]  # last_step=True: torchtitan's forced, synchronous save
    assert stop.value.code == PREEMPTED and stop.value.step == 4


def test_a_signal_during_a_checkpoint_save_is_kept_for_the_next_boundary(hook):
    trainer = FakeTrainer(on_save=sigusr1)
    trainer.step = 5
    hook.after_step(trainer)
    trainer.checkpointer.save(5)  # the loop's interval save; the signal lands in it
    trainer.step = 6
    with pytest.raises(Preempted):
        hook.after_step(trainer)
    assert trainer.saves == [(5, False), (6, True)]


def test_a_signal_at_the_last_step_lets_the_run_finish(hook):
    trainer = FakeTrainer(steps=10)
    trainer.step = 10
    sigusr1()
    hook.after_step(trainer)  # the loop's final save follows; nothing to requeue
    assert trainer.saves == []
