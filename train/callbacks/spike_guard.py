"""The spike guard at its two points: it decides before the update, and is read at logging steps.

Before the optimizer update the step's global loss and pre-clip gradient norm go to the
``StepGuard`` (``health.guard``), whose 0/1 answer the fused AdamW takes as ``found_inf``:
nothing is read on the host. At logging steps (where the loss is read anyway) its counters are:
skips since the last log are logged, and too many consecutive skips stop the run (``SkippedOut``).
Its history is checkpointed, so a resumed run decides exactly as the uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from rundir import latest_complete_checkpoint
from train.callbacks.callback import Callback, TrainerView, at_logging_steps
from health.exits import Exit, StopRun
from health.guard import GuardReading, StepGuard
from health.phases import Phase


class SkippedOut(StopRun):
    code = Exit.SKIPPED_OUT


class SpikeGuard(Callback[TrainerView], Configurable):
    name = "spike_guard"
    priority = 100  # at a logging step, before the rollback that reads it
    phase = Phase.OPTIMIZER

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enabled: bool = True  # [training] skip_spikes
        sigmas: float = 6.0  # [training] spike_sigmas
        window: int = 100  # [training] spike_window
        max_consecutive_skips: int = 100  # [training] max_consecutive_skips
        remember: int = 0  # skipped steps to remember ([training] spike_rollbacks, for train.callbacks.rollback)

    def __init__(self, config: Config, trainer: TrainerView):
        self.config = config
        self.guard = StepGuard(config.sigmas, config.window, config.enabled, trainer.device, remember=config.remember)
        self.reading: GuardReading | None = None  # the counters as read at the latest logging step
        self.skipped_logged = 0  # skips already reported in the log
        self.step = 0  # of the latest check: the guard's state is its state after that step

    def pre_optim_step(self, trainer: TrainerView) -> None:
        assert trainer.step_loss is not None and trainer.grad_norm is not None  # set before this point
        trainer.optimizers.skip = self.guard.check(trainer.step_loss, trainer.grad_norm)
        self.step = trainer.step

    @at_logging_steps
    def post_train_batch(self, trainer: TrainerView) -> None:
        g = self.reading = self.guard.read()
        if g.skipped > self.skipped_logged:
            more = g.skipped - self.skipped_logged
            logger.warning(f"step {g.last_step}: skipped ({g.last_reason}); {g.skipped} skipped so far"
                           + (f", {more} since the last log" if more > 1 else ""))
        self.skipped_logged = g.skipped
        trainer.metrics_processor.logger.log({"skipped_steps": g.skipped}, trainer.step)
        limit = self.config.max_consecutive_skips
        if g.consecutive >= limit:
            last = latest_complete_checkpoint(Path(trainer.config.dump_folder))
            raise SkippedOut(
                f"{g.consecutive} consecutive steps skipped up to step {trainer.step} (max_consecutive_skips "
                f"{limit}; the latest: {g.last_reason}). The last complete checkpoint is {last or 'none'}; the "
                "weights have not changed since the last applied step. Look at the data and the learning rate "
                "before restarting from it.", step=trainer.step, checkpoint=str(last) if last else None)

    def state_dict(self) -> dict:
        return {**self.guard.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.guard.load_state_dict(state, self.step)
        self.skipped_logged = int(state["skipped"])
