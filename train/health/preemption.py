"""Stop cleanly when the scheduler says so: checkpoint at a step boundary, exit with ``PREEMPTED``.

SLURM (``--signal``), a launcher or a person sends SIGUSR1 some time before a
job is preempted or hits its time limit. The signal lands on each rank at a
different moment, possibly in the middle of a collective, an eval or a
checkpoint save, so the handler only sets a flag. After every step all ranks
all-reduce the flag (MAX): they agree on the same step, save there together and
leave. A flag set during an eval or a save stays set until the next boundary.

train.py notes the exit for the launcher (``train.exits``).

The flag is agreed on over a CPU (gloo) group and read as host memory, so the
check after every step never waits for the GPU.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from train.exits import Exit
from train.hooks import Hook

if TYPE_CHECKING:
    from train.trainer import LaneformerTrainer

class Preempted(SystemExit):
    """Raised after the preemption checkpoint is on disk. A SystemExit, so no
    ``except Exception`` on the way out swallows it, and torchelastic does not
    record it as an error."""

    def __init__(self, step: int):
        super().__init__(Exit.PREEMPTED)
        self.step = step


SIGNALS = (signal.SIGUSR1,)
_requested = False  # set by the handler; signal handlers are process-wide, so is the flag


def _on_signal(signum, frame) -> None:
    global _requested
    _requested = True


def catch_signals() -> None:
    """Turn SIGUSR1 into the flag. train.py calls this first thing: before it, the
    signal's default action would kill the process without a checkpoint."""
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
        # Restart interrupted system calls: a signal mid-collective must not
        # surface as EINTR inside a communication library.
        signal.siginterrupt(sig, False)


class PreemptionHook(Hook, Configurable):
    priority = -100  # last: an eval due at the preempted step runs first
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config):
        catch_signals()
        self._group = None

    def _anyone_requested(self) -> bool:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return _requested
        if self._group is None:  # a host-side group: agreeing needs no device sync
            self._group = dist.new_group(backend="gloo")
        flag = torch.tensor([int(_requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.numpy()[0])

    def after_step(self, trainer: LaneformerTrainer) -> None:
        if not self._anyone_requested() or trainer.step >= trainer.config.training.steps:
            return  # on the last step the loop's own final save follows
        checkpointer = trainer.checkpointer
        # only now a checkpoint phase, with its longer allowance (train.health.heartbeat): the per-step agreement
        # above stays this hook's own phase, so a heartbeat is not rewritten at every step
        trainer.heartbeat.beat("checkpoint")
        if checkpointer._should_save(trainer.step):  # the loop saved this step: the same answer on every rank
            logger.warning(f"preemption requested: step {trainer.step} is checkpointed; exiting")
            checkpointer.maybe_wait_for_saving()  # an async save: until it is on disk
        else:
            logger.warning(f"preemption requested: saving a checkpoint at step {trainer.step} and exiting")
            # last_step=True is torchtitan's forced save: any interval, full state (the recipe
            # never saves model-only), synchronous after waiting for an async save in flight.
            checkpointer.save(trainer.step, last_step=True)
        raise Preempted(trainer.step)
