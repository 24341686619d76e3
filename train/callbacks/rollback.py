"""Spike rollback: decided at a logging step, done after that step's save (``health.rollback``).

After a logging step's save, when ``[training] spike_rollbacks`` skipped steps came within
``spike_window`` steps (the spike guard's counters, read at that step anyway), the run loads the latest complete checkpoint
saved before the first of them, sets aside the checkpoints saved after it, and the data loader
goes on from the sample it had reached (``MixtureLoader.skip_to``): those batches are never
trained on again. The load is beaten under its own phase (``Phase.ROLLBACK``: the checkpoint
allowance, booked as rollbacks in goodput). The count of rollbacks is checkpointed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from rundir import checkpoint_of, rollbacks_file
from train.callbacks.callback import Callback, TrainerView, at_logging_steps
from train.callbacks.spike_guard import SpikeGuard
from health import rollback
from health.phases import Phase


class Rollback(Callback[TrainerView], Configurable):
    name = "rollback"
    priority = -200  # last after the step: after its save, evals and a preemption's exit
    phase = Phase.ROLLBACK

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        spikes: int = 0  # [training] spike_rollbacks; 0: never
        window: int = 100  # [training] spike_window

    def __init__(self, config: Config, trainer: TrainerView):
        self.config = config
        self.count = 0  # rollbacks so far in this run

    @at_logging_steps
    def post_step(self, trainer: TrainerView) -> None:
        c = self.config
        if not c.spikes:
            return
        guard = trainer.callbacks.get(SpikeGuard.name)
        assert isinstance(guard, SpikeGuard) and guard.reading is not None  # read at this step's post_train_batch
        recent = guard.reading.recent
        if rollback.due(recent, c.spikes, c.window):
            count = self.count  # the load below restores the count the checkpoint had
            if self.roll_back(trainer, recent[-c.spikes:]) is not None:
                self.count = count + 1

    def roll_back(self, trainer: TrainerView, spikes: tuple[int, ...]) -> dict | None:
        """Roll the run back to the checkpoint before ``spikes`` (skipped steps), skipping the data since;
        every rank calls it at the same step (the guard decides alike on every rank). Returns the record."""
        run, folder = Path(trainer.config.dump_folder), Path(trainer.checkpointer.folder)
        at, loader, window = trainer.step, trainer.dataloader, self.config.window
        steps = ", ".join(map(str, spikes))
        to = rollback.checkpoint_before(folder, spikes[0])
        if to is None:
            logger.warning(f"step {at}: {len(spikes)} spikes within {window} steps (at steps {steps}) but no "
                           f"complete checkpoint before step {spikes[0]} in {folder}: not rolled back, the spiking "
                           "steps stay skipped")
            return None
        reached = loader.loader.next_index
        trainer.checkpointer.maybe_wait_for_saving()
        trainer.checkpointer.load(step=to)
        first, last = loader.skip_to(reached)
        mixture = loader.mixture
        skipped = {name: mixture.consumed_tokens(last)[name] - n for name, n in mixture.consumed_tokens(first).items()}
        record = {"time": datetime.now(timezone.utc).isoformat(), "at_step": at, "to_step": to, "spikes": list(spikes),
                  "checkpoint": str(checkpoint_of(folder, to)), "skipped_samples": [first, last],
                  "skipped_tokens": skipped}
        if trainer.rank0:
            rollback.set_aside_after(folder, to)
            rollback.record(run, record)
        if dist.is_initialized():
            dist.barrier()
        logger.warning(f"ROLLBACK at step {at}: {len(spikes)} spikes within {window} steps (at steps {steps}); back "
                       f"to the checkpoint of step {to}, skipping global samples {first:,} to {last - 1:,} "
                       f"({sum(skipped.values()):,} tokens: " + ", ".join(f"{k} {v:,}" for k, v in skipped.items())
                       + f"); recorded in {rollbacks_file(run)}")
        return record

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state.get("count", 0))
