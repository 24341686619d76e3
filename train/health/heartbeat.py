"""Each rank's heartbeat: the step and phase it is in, for a launcher to tell a stall from progress.

A job can stay up and make no progress outside any collective (a checkpoint
write to a stuck filesystem, a data read that never returns, a deadlock in an
eval hook), where the NCCL watchdog (``[parallel] comm_train_timeout``) never
fires. So every rank overwrites one small file, ``<run>/launcher/heartbeat/
rank-<R>.json``, as it enters phases: ``build``, ``load``, ``data``,
``forward_backward``, ``optimizer``, ``checkpoint``, then one per hook that
runs after the step (``eval``, ``export``, ``report``, ...). A beat reads no
tensor, so it adds no host sync; a write is a ``pwrite`` of one padded JSON
line, at once when the phase changes what a launcher allows, else at most
once a second (192 ranks share one filesystem). ``launch.watchdog`` reads the files.

The record also carries what goodput accounting (train.health.goodput) needs from
this process: the marks of its way to the first step (``process`` start,
``trainer`` init, ``rendezvous`` done, ``built``, checkpoint ``loaded``,
``first_step`` done: wall-clock seconds), and after the first step the seconds
spent in each phase (``phase_s``), summed at each beat.

For the stacks of a stalled rank, ``faulthandler`` is registered on
``STACKS_SIGNAL`` (SIGUSR2) and writes every thread's Python stack into
``rank-<R>.stacks`` beside the heartbeat. It is C code that runs even while the
main thread is blocked inside a collective or I/O. SIGUSR2 because torchrun
neither handles nor forwards it (``launch.sbatch.SIGNALS_TO_HANDLE``) and
SIGUSR1 is the preemption signal (``train.health.preemption``); the handler is in
place before the first beat names this pid, so a launcher never signals a rank
that would die of it. A rank stopped by SIGSTOP cannot run it.

Torch-free: ``launch.watchdog`` shares the names and the reader.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import time
from pathlib import Path

from rundir import launcher_dir, read_jsonl

STACKS_SIGNAL = signal.SIGUSR2
RECORD_BYTES = 2048  # every beat overwrites the same bytes: no truncate, no torn length
# Phases a launcher allows longer (launch.watchdog), by allowance; every other phase is "steady".
LONG_PHASES = {"checkpoint": "checkpoint", "eval": "eval", "export": "eval", "report": "eval"}
WRITE_EVERY_S = 1.0  # at most one write a second, unless the allowance changes: 192 ranks on a shared filesystem
ALERTS_FILE = "alerts.jsonl"  # <run>/alerts.jsonl: what the ranks flag for people (train.health.straggler)


def heartbeat_dir(run: Path) -> Path:
    return launcher_dir(Path(run)) / "heartbeat"


def launch_id() -> str:
    """What the ranks of one launch share and another launch's do not: torchrun's run id (random per
    ``--standalone`` start, the job's under SLURM), the SLURM restart count and the rendezvous address."""
    env = os.environ
    return "/".join([env.get("TORCHELASTIC_RUN_ID", "none"), env.get("SLURM_RESTART_COUNT", "0"),
                     f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"])


def process_start_time() -> float:
    """This process's start, wall clock (Linux: /proc), for time to the first step."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return time.time()


class Heartbeat:
    """One rank's heartbeat file and stack-dump file."""

    def __init__(self, run: Path):
        self.rank = int(os.environ.get("RANK", 0))
        folder = heartbeat_dir(run)
        folder.mkdir(parents=True, exist_ok=True)
        self.stacks = open(folder / f"rank-{self.rank}.stacks", "w")
        faulthandler.register(STACKS_SIGNAL, file=self.stacks, all_threads=True)
        self.fd = os.open(folder / f"rank-{self.rank}.json", os.O_WRONLY | os.O_CREAT, 0o644)
        self.record = {"rank": self.rank, "world": int(os.environ.get("WORLD_SIZE", 1)), "pid": os.getpid(),
                       "host": socket.gethostname(), "launch": launch_id(), "step": 0, "phase": "build", "done": 0,
                       "marks": {"process": process_start_time(), "trainer": time.time()}, "phase_s": {}}
        self.written: tuple[tuple, float] = ((), 0.0)  # (allowance, time) of the last write
        self.beat("build")

    def beat(self, phase: str, step: int | None = None) -> None:
        """Entering ``phase`` (of ``step``, when given). Written at once when it changes what a launcher
        allows (a long phase begins or ends, the first step is done), else at most every WRITE_EVERY_S."""
        r, now = self.record, time.time()
        if "first_step" in r["marks"] and "time" in r:  # the time since the last beat was the last phase's
            r["phase_s"][r["phase"]] = round(r["phase_s"].get(r["phase"], 0.0) + now - r["time"], 3)
        r["phase"], r["time"] = phase, now
        if step is not None:
            r["step"] = step
        allowance = (LONG_PHASES.get(phase), r["done"] == 0)
        if allowance != self.written[0] or now - self.written[1] >= WRITE_EVERY_S:
            os.pwrite(self.fd, json.dumps(r).encode().ljust(RECORD_BYTES - 1) + b"\n", 0)
            self.written = (allowance, now)

    def mark(self, name: str) -> None:
        """A point on the way to the first step (once per process), written with the next beat."""
        self.record["marks"].setdefault(name, time.time())

    def step_done(self) -> None:
        self.record["done"] += 1


def read_beats(run: Path) -> list[dict]:
    """Every rank's latest beat (a file caught mid-write is skipped until the next read)."""
    beats = []
    for path in sorted(heartbeat_dir(run).glob("rank-*.json")):
        try:
            beats.append(json.loads(path.read_bytes().strip() or b"null"))
        except (OSError, ValueError):
            continue
    return [b for b in beats if b]


def summary(beats: list[dict]) -> dict:
    """What launch.attempts.end records of a launch's heartbeats (train.health.goodput reads it): rank 0's
    marks and phase times, the last step every rank finished, the last beat of any rank."""
    if not beats:
        return {}
    zero = min(beats, key=lambda b: b["rank"])
    finished = [b["step"] - (b["phase"] in ("data", "forward_backward", "optimizer")) for b in beats]
    return {"marks": zero["marks"], "phase_s": zero.get("phase_s", {}), "done": zero["done"],
            "reached": min(finished), "last_beat": max(b["time"] for b in beats)}


def read_alerts(run: Path) -> list[dict]:
    """``<run>/alerts.jsonl``, oldest first (a line rank 0 is still appending is left out)."""
    return read_jsonl(Path(run) / ALERTS_FILE)
