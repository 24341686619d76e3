"""The pieces of preemption and restart that need no processes: the restart rule,
the attempts record, the exit note, and the Preemption callback's step-boundary agreement."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from launch import attempts
from health import exits
from health.exits import Exit, note_exit
from train.callbacks.preemption import Preemption
from health import preemption
from health.preemption import Preempted


@pytest.mark.parametrize("rc, note, before, after, crashes, expected", [
    (0, {}, 0, 12, 0, ("done", "finished")),
    (1, {"code": Exit.DONE, "step": 12}, 8, 12, 0, ("done", "finished")),  # torchrun itself was signalled
    (1, {"code": Exit.BAD_INPUT, "message": "bad key"}, 0, 0, 0, ("fail", "recipe")),
    (Exit.BAD_INPUT, {}, 0, 0, 0, ("fail", "recipe")),  # train.py alone: its own status
    (1, {"code": Exit.PREEMPTED, "step": 7}, 4, 7, 9, ("restart", "preempted")),  # not counted as a crash
    (1, {"code": Exit.CRASH, "message": "boom", "rank": 1}, 4, 8, 0, ("restart", "crash")),
    (1, {"reason": "finished"}, 4, 8, 0, ("restart", "crash")),  # the words decide nothing, the code does
    (1, {}, 4, 8, 2, ("restart", "crash")),
    (1, {}, 4, 8, 3, ("fail", "crash")),  # 3 crash restarts in the last 24 h: the rate is spent
    (1, {"code": Exit.CRASH, "message": "boom", "rank": 0}, 8, 8, 0, ("fail", "crash")),  # no progress
    # train.py's "training complete, export failed", "too many skipped steps" and "no space for a
    # checkpoint": never requeued, even with progress and budget left (torchrun hides the code:
    # the note carries it)
    (1, {"code": Exit.EXPORT_FAILED, "message": "disk full"}, 8, 12, 0, ("fail", "export failed")),
    (Exit.EXPORT_FAILED, {}, 8, 12, 0, ("fail", "export failed")),
    (1, {"code": Exit.SKIPPED_OUT, "message": "100 skipped"}, 4, 8, 0, ("fail", "skipped out")),
    (1, {"code": Exit.NO_SPACE, "message": "runs/x: 1 MB free"}, 4, 8, 0, ("fail", "no space")),
    (Exit.NO_SPACE, {}, 4, 8, 0, ("fail", "no space")),
])
def test_the_restart_rule(rc, note, before, after, crashes, expected):
    action, cause, why = attempts.decide(rc, note, before, after, crashes, crashes_per_day=3)
    assert (action, cause) == expected, why


def test_without_a_rate_crashes_after_progress_always_restart():
    assert attempts.decide(1, {}, 4, 8, 1000, crashes_per_day=0)[0] == "restart"
    assert attempts.decide(1, {}, 8, 8, 0, crashes_per_day=0)[0] == "fail"  # but never without progress


def test_stop_reasons_say_why():
    assert attempts.decide(1, {"code": Exit.BAD_INPUT, "message": "x.toml: [data] nope\nmore"},
                           0, 0, 0, 3)[2] == "recipe error: x.toml: [data] nope"
    assert "no new checkpoint since step 8" in attempts.decide(1, {}, 8, 8, 0, 3)[2]
    # the details train.py's StopRun notes: ExportFailed(message, command), SkippedOut(step, checkpoint)
    why = attempts.decide(1, {"code": Exit.EXPORT_FAILED, "message": "OSError: disk full",
                              "command": "python -m models.laneformer.convert to-hf runs/x runs/x/hf"}, 8, 12, 0, 3)[2]
    assert why == ("training complete, export failed: OSError: disk full; retry with: "
                   "python -m models.laneformer.convert to-hf runs/x runs/x/hf; not restarting")
    why = attempts.decide(1, {"code": Exit.SKIPPED_OUT, "step": 9, "checkpoint": "runs/x/checkpoints/step-8"},
                          4, 8, 0, 3)[2]
    assert why == ("too many consecutive skipped steps up to step 9; last complete checkpoint: "
                   "runs/x/checkpoints/step-8; not restarting")
    assert "[launch] crashes_per_day" in attempts.decide(1, {}, 4, 8, 3, 3)[2]


def checkpoint(run, step, complete=True):
    d = run / "checkpoints" / f"step-{step}"
    d.mkdir(parents=True)
    if complete:
        (d / ".metadata").write_text("")


def test_begin_and_end_record_steps_and_count_crashes_in_the_last_day_across_jobs(tmp_path):
    checkpoint(tmp_path, 4)
    checkpoint(tmp_path, 8, complete=False)  # a save cut short does not count
    assert attempts.checkpoint_step(tmp_path) == 4
    for n, job in enumerate(["7", "7", "8"]):
        attempts.begin(tmp_path, job)
        checkpoint(tmp_path, 12 + 4 * n)
        event = attempts.end(tmp_path, job, rc=1, crashes_per_day=2)
        assert event["action"] == ["restart", "restart", "fail"][n], event
    attempts.begin(tmp_path, "9")  # no new checkpoint
    assert "no new checkpoint" in attempts.end(tmp_path, "9", rc=1, crashes_per_day=0)["why"]
    starts = [e for e in attempts.history(tmp_path) if e["event"] == "start"]
    assert [e["step"] for e in starts] == [4, 12, 16, 20]
    # crashes older than a day no longer count against the rate
    lines = (tmp_path / "launcher" / "attempts.jsonl").read_text().splitlines()
    old = [json.dumps({**json.loads(x), "time": "2020-01-01T00:00:00+00:00"}) for x in lines]
    (tmp_path / "launcher" / "attempts.jsonl").write_text("\n".join(old) + "\n")
    attempts.begin(tmp_path, "10")
    checkpoint(tmp_path, 40)
    assert attempts.end(tmp_path, "10", rc=1, crashes_per_day=2)["action"] == "restart"


# What torchrun prints when a worker dies (torch.distributed.elastic.multiprocessing.api).
TORCHRUN_FAILURE = ("E1201 03:53:42.339000 11873 torch/distributed/elastic/multiprocessing/api.py:1002] "
                    "failed (exitcode: {code}) local_rank: 1 (pid: 11910) of binary: /venv/bin/python\n")


def test_a_crash_is_pinned_to_the_node_whose_rank_died_of_a_fault_signal(tmp_path):
    logs = tmp_path / "launcher" / "logs"
    logs.mkdir(parents=True)
    checkpoint(tmp_path, 4)
    # an earlier start's SIGKILL on lfnode1 is history: only what this start logged counts
    (logs / "node0-lfnode1.log").write_text(TORCHRUN_FAILURE.format(code=-9))
    attempts.begin(tmp_path, "local-5")
    checkpoint(tmp_path, 8)
    with open(logs / "node0-lfnode1.log", "a") as f:
        f.write(TORCHRUN_FAILURE.format(code=-15))  # SIGTERM: told to stop when the other node failed
    (logs / "node1-lfnode2.log").write_text("step 5\n" + TORCHRUN_FAILURE.format(code=-9))
    event = attempts.end(tmp_path, "local-5", rc=1, crashes_per_day=0)
    assert event["action"] == "restart" and event["pinned"] == ["lfnode2"], event
    assert event["exclude"] == "lfnode2" and "excluding lfnode2" in event["why"]
    assert attempts.fault_nodes(tmp_path, {}) == {"lfnode1", "lfnode2"}  # from the beginning of the logs
    assert attempts.fault_nodes(tmp_path, {"node0-lfnode1.log": 10**6, "node1-lfnode2.log": 10**6}) == set()
    # emulated nodes share one host (srun's %N): task t ran on the t-th node of the job
    (logs / "node0-lfnode1.log").rename(logs / "node0-vm.log")
    (logs / "node1-lfnode2.log").rename(logs / "node1-vm.log")
    assert attempts.fault_nodes(tmp_path, {"node0-vm.log": 10**6}, ["gpu7", "gpu9"]) == {"gpu9"}


def test_a_python_error_pins_no_node(tmp_path):
    checkpoint(tmp_path, 4)
    attempts.begin(tmp_path, "local-5")
    checkpoint(tmp_path, 8)
    (tmp_path / "launcher" / "logs").mkdir(parents=True)
    (tmp_path / "launcher" / "logs" / "node0-lfnode1.log").write_text(TORCHRUN_FAILURE.format(code=1))
    event = attempts.end(tmp_path, "local-5", rc=1, crashes_per_day=0)
    assert event["action"] == "restart" and "exclude" not in event


def test_begin_clears_the_previous_exit_note(tmp_path, monkeypatch):
    monkeypatch.setenv(exits.EXIT_FILE_ENV, str(attempts.exit_file(tmp_path)))
    attempts.begin(tmp_path, "1")
    note_exit(Exit.PREEMPTED, step=3)
    note_exit(Exit.CRASH, message="a later rank's symptom")  # first writer wins
    note = json.loads(attempts.exit_file(tmp_path).read_text())
    assert (note["code"], note["reason"], note["step"]) == (75, "preempted", 3)  # the reason follows the code
    attempts.begin(tmp_path, "1")
    assert not attempts.exit_file(tmp_path).exists()


class FakeTrainer:
    """The slice of LaneformerTrainer the callback uses; saves are recorded."""

    def __init__(self, steps=10, on_save=None, interval=1000):
        self._step, self.device, self.saves, self.waits, self.phases = 0, torch.device("cpu"), [], 0, []
        self.config = SimpleNamespace(training=SimpleNamespace(steps=steps))
        self.enter = self.phases.append  # the phases the callback enters itself (a save enters its own)

        def save(step, last_step=False):
            self.saves.append((step, last_step))
            if on_save:
                on_save()

        def wait():
            self.waits += 1

        self.checkpointer = SimpleNamespace(save=save, maybe_wait_for_saving=wait)
        self.save_checkpoint = lambda last_step=False: save(self.step, last_step)
        self.interval = interval

    @property
    def step(self):
        return self._step

    @step.setter
    def step(self, step):  # the loop's interval save of this step, if due, ran before the post_step callbacks
        self._step = step
        if hasattr(self, "checkpointer"):
            self.checkpointer.last_saved_step = step if step % self.interval == 0 else -1


@pytest.fixture
def hook(monkeypatch):
    old = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(preemption, "_requested", False)
    yield Preemption.Config().build(trainer=FakeTrainer())
    signal.signal(signal.SIGUSR1, old)


def sigusr1():
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_signal_during_the_step_saves_at_that_step_and_exits_75(hook):
    trainer = FakeTrainer()
    trainer.step = 3
    hook.post_step(trainer)
    assert trainer.saves == []
    trainer.step = 4
    sigusr1()  # e.g. during this step's eval, which runs before the hook
    with pytest.raises(Preempted) as stop:
        hook.post_step(trainer)
    assert trainer.saves == [(4, True)]  # last_step=True: torchtitan's forced, synchronous save
    assert trainer.phases == []  # the agreement keeps its own phase; the save enters a checkpoint's itself
    assert stop.value.code == Exit.PREEMPTED == 75 and stop.value.step == 4


def test_a_signal_during_a_checkpoint_save_is_kept_for_the_next_boundary(hook):
    trainer = FakeTrainer(on_save=sigusr1)
    trainer.step = 5
    hook.post_step(trainer)
    trainer.checkpointer.save(5)  # the loop's interval save; the signal lands in it
    trainer.step = 6
    with pytest.raises(Preempted):
        hook.post_step(trainer)
    assert trainer.saves == [(5, False), (6, True)]


def test_a_signal_at_the_last_step_lets_the_run_finish(hook):
    trainer = FakeTrainer(steps=10)
    trainer.step = 10
    sigusr1()
    hook.post_step(trainer)  # the loop's final save follows; nothing to requeue
    assert trainer.saves == []


def test_a_step_the_loop_already_checkpointed_is_not_saved_again(hook):
    trainer = FakeTrainer(interval=4)  # the loop's interval save of step 4 ran before the hooks
    trainer.step = 4
    sigusr1()
    with pytest.raises(Preempted):
        hook.post_step(trainer)
    assert trainer.saves == [] and trainer.waits == 1  # an async save in flight is waited for
    assert trainer.phases == ["checkpoint"]  # ... with a checkpoint's allowance


def test_a_replica_mismatch_excludes_the_node_the_check_named():
    """health.consistency's exit note names the odd rank's host; the requeue leaves that node out
    (with 2 replicas, where no majority exists, both holders)."""
    from launch.attempts import mismatch_nodes

    assert mismatch_nodes({"code": 6, "hosts": ["gpu042"]}, ["gpu017", "gpu042", "gpu101"]) == {"gpu042"}
    assert mismatch_nodes({"code": 6, "hosts": ["gpu017", "gpu042"]}, ["gpu017", "gpu042"]) == {"gpu017", "gpu042"}
    assert mismatch_nodes({"code": 6, "hosts": ["laptop"]}, ["lfnode1", "lfnode2"]) == set()  # emulated nodes
    assert attempts.decide(6, {"code": 6, "step": 3, "hosts": ["gpu042"]}, 0, 2, 0, 8)[:2] == ("restart", "replica mismatch")
