"""How train.py tells a launcher why it stopped: exit codes, ``StopRun`` and the exit note.

torchrun hides its workers' exit codes, so train.py also writes why it stopped
to the file ``$LANEFORMER_EXIT_FILE`` names (``<run>/launcher/exit.json``, set
by the launchers): ``{"code", "reason", ...details, "rank", "time"}``. The
reason is derived from the code, so the code alone decides what a launcher does
next (``launch.attempts.decide``); the reason and details are for people.

This module imports no torch: the SLURM batch script reads it through
``launch.attempts``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from enum import IntEnum
from pathlib import Path

EXIT_FILE_ENV = "LANEFORMER_EXIT_FILE"


class Exit(IntEnum):
    """train.py's exit codes. Only ``PREEMPTED``, a replica mismatch and a crash after progress are restarted."""

    DONE = 0
    CRASH = 1  # an uncaught error
    BAD_INPUT = 2  # a recipe or input error: nothing was started
    EXPORT_FAILED = 3  # training complete and checkpointed; the end-of-run export failed
    SKIPPED_OUT = 4  # too many consecutive skipped steps
    NO_SPACE = 5  # the run dir's disk cannot hold the next checkpoint
    REPLICA_MISMATCH = 6  # HSDP replicas of a shard differ (health.consistency): nothing saved
    PREEMPTED = 75  # sysexits' EX_TEMPFAIL: checkpointed on a signal, run me again


REASONS = {
    Exit.DONE: "finished",
    Exit.CRASH: "error",
    Exit.BAD_INPUT: "recipe error",
    Exit.EXPORT_FAILED: "training complete, export failed",
    Exit.SKIPPED_OUT: "too many consecutive skipped steps",
    Exit.NO_SPACE: "no space for a checkpoint",
    Exit.REPLICA_MISMATCH: "replica mismatch",
    Exit.PREEMPTED: "preempted",
}


def reason(code: int) -> str:
    """The words for an exit code; an unknown code (a signal, torchrun's own) is a crash."""
    try:
        return REASONS[Exit(code)]
    except ValueError:
        return REASONS[Exit.CRASH]


class StopRun(Exception):
    """Training ended on purpose but not as planned: train.py prints the message, notes the
    subclass's ``code`` with ``details`` and exits with that code."""

    code: Exit = Exit.CRASH

    def __init__(self, text: str, /, **details):
        super().__init__(text)
        self.details = details


def note_exit(code: Exit, path: str | Path | None = None, why: str | None = None, **details) -> None:
    """Tell the launcher why this process stops (first writer wins: the first rank to fail, or the
    stall watchdog, usually names the cause). ``path``: the note's file, by default the one
    ``$LANEFORMER_EXIT_FILE`` names (without either nothing is written); ``why``: a finer reason
    than the code's (the watchdog's ``stall``, a crash to ``launch.attempts.decide``)."""
    path = path or os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    record = {"code": int(code), "reason": why or reason(code), **details,
              **({"rank": int(os.environ["RANK"])} if "RANK" in os.environ else {}),  # the watchdog is no rank
              "time": datetime.now(timezone.utc).isoformat()}
    try:
        with open(path, "x") as f:
            f.write(json.dumps(record) + "\n")
    except FileExistsError:
        pass
    except OSError as e:  # e.g. a full disk: the exit status and stderr still say why
        print(f"warning: could not write the exit note {path}: {e}", file=sys.stderr)
