"""Stop cleanly when the scheduler says so: a signal becomes a flag, the flag a checkpoint at a step boundary.

SLURM (``--signal``), a launcher or a person sends SIGUSR1 some time before a
job is preempted or hits its time limit. The signal lands on each rank at a
different moment, possibly in the middle of a collective, an eval or a
checkpoint save, so the handler only sets a flag. After every step all ranks
agree on it (``anyone_requested``: an all-reduce MAX over a CPU (gloo) group,
read as host memory, so it never waits for the GPU): they save at the same step
and leave (``train.callbacks.preemption``). A flag set during an eval or a save
stays set until the next boundary. train.py notes the exit for the launcher
(``health.exits``).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from health.exits import Exit


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


def anyone_requested(group) -> bool:
    """Whether any rank got the signal (every rank calls it at the same step; ``group``: a gloo group,
    None with one rank)."""
    if group is None:
        return _requested
    flag = torch.tensor([int(_requested)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.numpy()[0])
