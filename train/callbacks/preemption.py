"""Preemption at a step boundary: after every step (and its save) the ranks agree on the signal flag
(``health.preemption``); if any rank got it, the step is checkpointed and every rank leaves
with ``Preempted`` (train.py exits ``Exit.PREEMPTED``: run the same command again to resume)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from train.callbacks.callback import Callback, TrainerView, bookkeeping_group
from health.phases import Phase
from health.preemption import Preempted, anyone_requested, catch_signals


class Preemption(Callback[TrainerView], Configurable):
    name = "preemption"
    priority = -100  # after the step's evals: an eval due at the preempted step runs first
    phase = Phase.PREEMPTION

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config, trainer: TrainerView):
        catch_signals()

    def post_step(self, trainer: TrainerView) -> None:
        if not anyone_requested(bookkeeping_group()) or trainer.step >= trainer.config.training.steps:
            return  # on the last step the loop's own final save follows
        checkpointer = trainer.checkpointer
        if checkpointer.last_saved_step == trainer.step:  # the loop saved this step: the same on every rank
            logger.warning(f"preemption requested: step {trainer.step} is checkpointed; exiting")
            trainer.enter(Phase.CHECKPOINT)
            checkpointer.maybe_wait_for_saving()  # an async save: until it is on disk
        else:
            logger.warning(f"preemption requested: saving a checkpoint at step {trainer.step} and exiting")
            # last_step=True is torchtitan's forced save: any interval, full state (the recipe
            # never saves model-only), synchronous after waiting for an async save in flight; the
            # trainer's save brackets it with pre_checkpoint and post_checkpoint_saved, as the loop's.
            trainer.save_checkpoint(last_step=True)
        raise Preempted(trainer.step)
