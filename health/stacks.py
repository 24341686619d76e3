"""A stalled rank's stacks, on request: ``STACKS_SIGNAL`` makes every thread's Python stack go to a file.

``faulthandler`` is registered on SIGUSR2 and writes into ``rank-<R>.stacks`` beside the rank's
heartbeat. It is C code that runs even while the main thread is blocked inside a collective or I/O.
SIGUSR2 because torchrun neither handles nor forwards it (``launch.sbatch.SIGNALS_TO_HANDLE``) and
SIGUSR1 is the preemption signal (``health.preemption``). The heartbeat registers it before its
first beat names this pid, so a launcher never signals a rank that would die of it. A rank stopped by
SIGSTOP cannot run it. Torch-free: ``launch.watchdog`` sends the signal and reads the files.
"""

from __future__ import annotations

import faulthandler
import signal
from pathlib import Path
from typing import TextIO

from rundir import stacks_file

STACKS_SIGNAL = signal.SIGUSR2
_open: list[TextIO] = []  # the stacks file stays open for the process's life: faulthandler writes to its descriptor


def catch_stack_dumps(run: Path, rank: int) -> None:
    """From now on, ``STACKS_SIGNAL`` writes this process's stacks to ``stacks_file(run, rank)``."""
    f = open(stacks_file(run, rank), "w")
    _open.append(f)
    faulthandler.register(STACKS_SIGNAL, file=f, all_threads=True)
