"""train.titan changes torchtitan 0.3.0 in a few places; each relies on a signature of torchtitan's
or on a line of its loop. When torchtitan's side changes, this fails, before a run silently loses
the spike guard's norm, the last step's log or the points around a save."""

from __future__ import annotations

import inspect

from torchtitan.trainer import Trainer

from train.titan import TORCHTITAN_API


def test_every_torchtitan_signature_train_titan_relies_on_is_unchanged():
    changed = {f"{getattr(owner, '__name__', owner)}.{name}": str(inspect.signature(getattr(owner, name)))
               for (owner, name), expected in TORCHTITAN_API.items()
               if expected is not None and str(inspect.signature(getattr(owner, name))) != expected}
    assert changed == {}
    for owner, name in TORCHTITAN_API:  # the ones any signature will do for must still exist
        assert callable(getattr(owner, name)), (owner, name)


def test_torchtitans_loop_still_calls_what_the_trainer_fills_in():
    """LaneformerTrainer's step relies on these lines of torchtitan's loop and step."""
    step, loop = inspect.getsource(Trainer.train_step), inspect.getsource(Trainer.train)
    assert "dist_utils.clip_grad_norm_(" in step  # grad_norm_to swaps the module attribute
    assert step.index("clip_grad_norm_(") < step.index("self.optimizers.step()")  # the norm comes before the update
    assert "self.forward_backward_step(" in step
    assert "while self.should_continue_training():" in loop  # post_step and pre_train run there
    assert loop.index("self.train_step(") < loop.index("self.checkpointer.save(")  # post_step sees the step saved


def test_the_check_sees_a_changed_signature(monkeypatch):
    from torchtitan.components.checkpointer import CheckpointManager

    monkeypatch.setattr(CheckpointManager, "_should_save", lambda self, step: True)
    expected = TORCHTITAN_API[(CheckpointManager, "_should_save")]
    assert str(inspect.signature(CheckpointManager._should_save)) != expected


def test_torchtitans_closing_sleep_is_its_only_one_and_the_trainer_skips_it(caplog):
    """``sleep_as_barrier`` relies on Trainer.train's only ``time.sleep`` being the 2 s after ``SLEEP_LOG``;
    inside it neither the sleep nor its line happens, and both are back after it."""
    import time

    import torchtitan.trainer as titan_trainer

    from train.titan import SLEEP_LOG, sleep_as_barrier

    source = inspect.getsource(titan_trainer)
    assert source.count("time.sleep(") == 1 and "time.sleep(2)" in inspect.getsource(Trainer.train)
    assert f'logger.info("{SLEEP_LOG}")' in inspect.getsource(Trainer.train)
    with caplog.at_level("INFO"), sleep_as_barrier():
        start = time.perf_counter()
        titan_trainer.time.sleep(2)
        titan_trainer.logger.info(SLEEP_LOG)
        titan_trainer.logger.info("Training completed")
        assert time.perf_counter() - start < 1.5  # not slept
        assert titan_trainer.time.perf_counter is time.perf_counter  # the clock its loop reads, unchanged
    assert titan_trainer.time is time
    assert [r.getMessage() for r in caplog.records] == ["Training completed"]
    with caplog.at_level("INFO"):
        titan_trainer.logger.info(SLEEP_LOG)
    assert caplog.records[-1].getMessage() == SLEEP_LOG
