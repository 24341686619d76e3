"""Each rank's heartbeat: the step and phase it is in, for a launcher to tell a stall from progress.

A job can stay up and make no progress outside any collective (a checkpoint
write to a stuck filesystem, a data read that never returns, a deadlock in an
eval), where the NCCL watchdog (``[parallel] comm_train_timeout``) never fires.
So every rank overwrites one small file, ``rundir.heartbeat_dir(run)/rank-<R>.json``,
as it enters each phase (``health.phases.Phase``: the step's own, and each
callback's). A beat reads no tensor, so it adds no host sync; a write is a
``pwrite`` of one padded JSON line, at once when the phase or the step changes (so
a rank that blocks right after entering a phase is seen in that phase), else at
most once a second (192 ranks share one filesystem). ``launch.watchdog`` reads the files.

The record also carries what goodput accounting (``health.goodput``) needs
from this process: the marks of its way to the first step (``process`` start,
``trainer`` init, ``rendezvous`` done, ``built``, checkpoint ``loaded``,
``first_step`` done: wall-clock seconds), and after the first step the seconds
spent in each phase (``phase_s``), summed at each beat; ``launch``, the id its
launch's ranks share (``health.holder`` tells another launch's ranks by it); and ``owner``,
who claimed the run dir for them (``launch_owner``: the holder frees the run dir of an owner whose
end the launcher recorded).

Torch-free: ``launch.watchdog`` shares the reader.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from rundir import BEAT_FILE, beat_file, heartbeat_dir
from health.phases import Phase
from health.stacks import catch_stack_dumps

RECORD_BYTES = 2048  # every beat overwrites the same bytes: no truncate, no torn length
WRITE_EVERY_S = 1.0  # same-phase beats of the same step: at most one write a second


def launch_id() -> str:
    """What the ranks of one launch share and another launch's do not: torchrun's run id (random per
    ``--standalone`` start, the job's under SLURM), the SLURM restart count and the rendezvous address."""
    env = os.environ
    return "/".join([env.get("TORCHELASTIC_RUN_ID", "none"), env.get("SLURM_RESTART_COUNT", "0"),
                     f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"])


# Set by launch.local and the SLURM batch script for the ranks they start: the job that claimed the run dir.
LAUNCH_ENV = "LANEFORMER_LAUNCH"


def launch_owner() -> str:
    """Who holds the run dir for this process (health.holder's claim): the launcher's job where a
    launcher started it (``LAUNCH_ENV``), else this launch's id."""
    return os.environ.get(LAUNCH_ENV) or launch_id()


def process_start_time(pid: int | str = "self") -> float | None:
    """A process's start, wall clock (Linux: /proc): this one's for time to the first step (falls back
    to now), another's for health.holder (None when it is gone)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return time.time() if pid == "self" else None


class Heartbeat:
    """One rank's heartbeat file (and, through ``health.stacks``, its stack-dump file)."""

    def __init__(self, run: Path):
        self.rank = int(os.environ.get("RANK", 0))
        folder = heartbeat_dir(run)
        folder.mkdir(parents=True, exist_ok=True)
        catch_stack_dumps(run, self.rank)  # before the first beat names this pid to a launcher
        self.fd = os.open(beat_file(run, self.rank), os.O_WRONLY | os.O_CREAT, 0o644)
        self.record: dict[str, Any] = {"rank": self.rank, "world": int(os.environ.get("WORLD_SIZE", 1)), "pid": os.getpid(),
                       "host": socket.gethostname(), "launch": launch_id(), "owner": launch_owner(), "step": 0,
                       "phase": Phase.BUILD.value, "done": 0, "marks": {"process": process_start_time(), "trainer": time.time()}, "phase_s": {}}
        self.written: tuple[tuple, float] = ((), 0.0)  # ((phase, step, done), time) of the last write
        self.beat(Phase.BUILD)

    def beat(self, phase: Phase, step: int | None = None) -> None:
        """Entering ``phase`` (of ``step``, when given): written at once when the phase, the step or the
        count of finished steps changed since the last write, else at most every WRITE_EVERY_S."""
        r, now = self.record, time.time()
        if "first_step" in r["marks"] and "time" in r:  # the time since the last beat was the last phase's
            r["phase_s"][r["phase"]] = round(r["phase_s"].get(r["phase"], 0.0) + now - r["time"], 3)
        r["phase"], r["time"] = Phase(phase).value, now
        if step is not None:
            r["step"] = step
        what = (r["phase"], r["step"], r["done"])
        if what != self.written[0] or now - self.written[1] >= WRITE_EVERY_S:
            os.pwrite(self.fd, json.dumps(r).encode().ljust(RECORD_BYTES - 1) + b"\n", 0)
            self.written = (what, now)

    def mark(self, name: str) -> None:
        """A point on the way to the first step (once per process), written with the next beat."""
        self.record["marks"].setdefault(name, time.time())

    def step_done(self) -> None:
        self.record["done"] += 1


def read_beats(run: Path) -> list[dict]:
    """Every rank's latest beat (a file caught mid-write is skipped until the next read)."""
    beats = []
    for path in sorted(heartbeat_dir(run).glob(BEAT_FILE.format(rank="*"))):
        try:
            beats.append(json.loads(path.read_bytes().strip() or b"null"))
        except (OSError, ValueError):
            continue
    return [b for b in beats if b]


def summary(beats: list[dict]) -> dict:
    """What launch.attempts.end records of a launch's heartbeats (health.goodput reads it): rank 0's
    marks and phase times, the last step every rank finished, the last beat of any rank."""
    if not beats:
        return {}
    zero = min(beats, key=lambda b: b["rank"])
    finished = [b["step"] - bool((p := Phase.of(b["phase"])) and p.in_step) for b in beats]
    return {"marks": zero["marks"], "phase_s": zero.get("phase_s", {}), "done": zero["done"],
            "reached": min(finished), "last_beat": max(b["time"] for b in beats)}
