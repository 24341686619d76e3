"""Disk space for checkpoints: what one needs, what is free, and a stop that says so.

A save that runs out of space fails deep inside DCP (``RuntimeError: [enforce
fail at inline_container.cc] unexpected pos ...``), and a restart on the full
disk fails wherever it first writes. Neither says why. So the preflight
refuses a run dir that cannot hold the checkpoints the run keeps, and a save
that fails with the disk full stops with ``Exit.NO_SPACE`` naming the dir, the
bytes free and the bytes a checkpoint needs; the launchers do not restart it.

Torch-free: ``launch.attempts`` (the SLURM batch script) uses it too.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Sequence
from pathlib import Path

import rundir
from health.exits import Exit, StopRun

# What a DCP checkpoint holds per parameter: the fp32 weights (FSDP keeps them in fp32 whatever
# the compute dtype) and AdamW's two fp32 moments. Loader, scheduler and guard states are small.
BYTES_PER_PARAM = 4 + 2 * 4


def checkpoint_bytes(nparams: int) -> int:
    """About how many bytes one checkpoint of a model with ``nparams`` parameters takes."""
    return nparams * BYTES_PER_PARAM


def free_bytes(folder: Path) -> int:
    """Bytes free to an unprivileged writer on the filesystem that holds (or will hold) ``folder``."""
    folder = Path(folder)
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def causes(error: BaseException):
    """``error``, what it was raised from, and for DCP's CheckpointException each rank's own error."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__ or e.__context__, *(exc for exc, _ in getattr(e, "failures", {}).values())]


def out_of_space_error(error: BaseException) -> OSError | None:
    """``error`` or one behind it (``causes``) that is ENOSPC or EDQUOT, if any."""
    return next((e for e in causes(error) if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)), None)


def is_out_of_space(error: BaseException) -> bool:
    return out_of_space_error(error) is not None


def cause_line(error: BaseException) -> str:
    """The one line that says why: the out-of-space OSError where there is one, else the innermost
    error's first line (DCP's CheckpointException embeds every rank's traceback in its text)."""
    root = out_of_space_error(error) or list(causes(error))[-1]
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0] if lines else ''}"


def _mb(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:,.1f} MiB)"


def run_dir_problem(run: Path, nparams: int, keep_last: int, milestones: Sequence[int] = ()) -> str | None:
    """Why ``run`` cannot hold the checkpoints the run will keep, or None. torchtitan writes the
    next checkpoint before it purges the oldest, so ``keep_last`` + 1 must fit, less the purgeable
    ones already there (a restart); ``keep_last`` 0 keeps all: at least the next must fit."""
    per = checkpoint_bytes(nparams)
    kept = [s for s in rundir.complete_steps(run) if s not in set(milestones)]
    count = max(1, keep_last + 1 - len(kept))
    free = free_bytes(run)
    if free >= count * per:
        return None
    return (f"{run} has {_mb(free)} free; {count} more checkpoint{'s' * (count != 1)} of about "
            f"{_mb(per)} ({nparams:,} parameters x {BYTES_PER_PARAM} bytes: fp32 weights and AdamW moments) "
            f"need {_mb(count * per)} ([checkpoint] keep_last {keep_last}, {len(kept)} there)")


class NoSpace(StopRun):
    """The run dir's disk cannot hold the next checkpoint: freeing space (or another
    output_dir) is up to a person, so the launchers do not restart."""

    code = Exit.NO_SPACE

    @classmethod
    def at(cls, folder: Path, per_checkpoint: int, cause: BaseException, step: int) -> NoSpace:
        free = free_bytes(folder)
        text = (f"no space for the checkpoint of step {step} in {folder}: {_mb(free)} free, a checkpoint "
                f"needs about {_mb(per_checkpoint)} ({cause_line(cause)}). "
                "Free space or move the run dir, then run the same command again: it resumes from the "
                "latest complete checkpoint")
        return cls(text, step=step, folder=str(folder), free_bytes=free, checkpoint_bytes=per_checkpoint,
                   message=text)
