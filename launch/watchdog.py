"""End a job that is up but makes no progress: read the ranks' heartbeats, dump stacks, kill.

The ranks beat as they enter each phase of a step (health/heartbeat.py). A job
is stalled when the newest beat of any rank is older than the allowance of the
most lenient phase a rank is in (``[launch]`` keys):

- ``stall_timeout_first_step`` until every rank has finished its first step of
  this launch (agent rendezvous, imports, build, checkpoint load, compile);
- ``stall_timeout_checkpoint`` while a rank saves or loads a checkpoint (a save, a rollback);
- ``stall_timeout_eval`` while a rank is in an eval, export or report;
- ``stall_timeout`` otherwise.

Which phase gets which is ``health.phases.Phase.allowance``, declared once.

The newest beat of any rank, because in synchronous training one stuck rank
soon stops all the others in their next collective, and a rank legitimately
alone in a long phase (rank 0 drawing the report) holds the others at the
next step: the most lenient phase covers them all.

On a stall: the exit note (``health.exits``, first writer wins) says ``stall``
so that ``launch.attempts.decide`` records that cause and restarts as after a
crash (a new checkpoint since the start, within ``crashes_per_day``); every
rank is sent ``STACKS_SIGNAL`` and its stacks go to ``<run>/stalls/<attempt>/
rank-<R>.txt``, with ``stall.json`` saying who was where; a rank that cannot
dump (stopped: SIGSTOP, or in the kernel's uninterruptible sleep on a dead
filesystem) is named as such. Then the ranks are killed with SIGKILL, which
ends stopped ones too.

launch.local calls ``Watchdog.check`` while torchrun runs; the SLURM batch
script runs ``python -m launch.watchdog RUN --job ID`` beside srun. Ranks on
other hosts are signalled through ``srun --overlap`` into the job.
This module imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rundir import STALL_FILE, STALL_STACKS_FILE, attempts_file, exit_file, read_jsonl, stacks_file, stall_dir
from health.exits import Exit, note_exit
from health.heartbeat import read_beats
from health.stacks import STACKS_SIGNAL
from health.stall import Limits, allowance

STATES = {"T": "stopped", "D": "in uninterruptible sleep"}  # /proc/<pid>/stat states that cannot dump
DUMP_WAIT_S = 5.0  # how long the ranks get to write their stacks


def stalled(beats: list[dict], started: float, limits: Limits, now: float) -> dict | None:
    """The stall record, or None while the job makes progress (``started``: the launch's start)."""
    if not limits.stall:
        return None
    last = max([started, *(b["time"] for b in beats)])
    limit, why = allowance(beats, limits)
    if now - last <= limit:
        return None
    return {"idle_s": round(now - last, 1), "limit_s": limit, "allowance": why,
            "ranks": [{**{k: b[k] for k in ("rank", "host", "pid", "step", "phase")},
                       "idle_s": round(now - b["time"], 1)}
                      for b in sorted(beats, key=lambda b: b["rank"])]}


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of a local process (``T``: stopped), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Watchdog:
    """One launch's stall detector; ``attempt`` names its folder under ``<run>/stalls/``."""

    def __init__(self, run: Path, limits: Limits, attempt: str, job: str | None = None):
        self.run, self.limits, self.attempt, self.job = Path(run), limits, attempt, job
        self.started = time.time()  # launch.attempts.begin removed the last start's beats

    def check(self) -> dict | None:
        return stalled(read_beats(self.run), self.started, self.limits, time.time())

    def handle(self, stall: dict) -> Path:
        """Note the cause, dump every rank's stacks, kill the ranks; returns the stall folder."""
        where = stall_dir(self.run, self.attempt)
        where.mkdir(parents=True, exist_ok=True)
        local = socket.gethostname()
        for r in stall["ranks"]:
            r["state"] = proc_state(r["pid"]) if r["host"] == local else None
        message = f"no progress for {stall['idle_s']:.1f} s (allowed {stall['limit_s']:g} s: {stall['allowance']})"
        stuck = [r for r in stall["ranks"] if r["state"] in ("T", "D")]
        behind = min(stall["ranks"], key=lambda r: r["step"], default=None)
        if stuck:
            message += "; " + ", ".join(f"rank {r['rank']} on {r['host']} {STATES[r['state']]} in {r['phase']} of step "
                                        f"{r['step']}" for r in stuck)
        elif behind:
            message += f"; rank {behind['rank']} on {behind['host']} in {behind['phase']} of step {behind['step']}"
        self._note(message, where)
        for r in stall["ranks"]:
            if r["state"] == "T":
                continue  # a stopped process runs no handler: it would dump only after SIGCONT
            self._signal(r, STACKS_SIGNAL)
        stacks = {r["rank"]: stacks_file(self.run, r["rank"]) for r in stall["ranks"]}
        end = time.monotonic() + DUMP_WAIT_S
        waiting = {r["rank"] for r in stall["ranks"] if r["state"] != "T"}
        while waiting and time.monotonic() < end:
            waiting = {n for n in waiting if not _size(stacks[n])}
            time.sleep(0.2)
        time.sleep(0.5)  # a dump that began finishes: faulthandler writes it in one go
        for r in stall["ranks"]:
            text = stacks[r["rank"]].read_text() if stacks[r["rank"]].exists() else ""
            if r["state"] == "T":
                why = "it is stopped (SIGSTOP or a debugger): a stopped process cannot dump itself"
            elif r["state"] == "D":
                why = "it is in uninterruptible sleep (I/O on a dead filesystem?)"
            else:
                why = f"it did not answer {STACKS_SIGNAL.name} within {DUMP_WAIT_S:.0f} s"
            head = (f"# rank {r['rank']} pid {r['pid']} on {r['host']}: step {r['step']}, phase {r['phase']}, "
                    f"silent {r['idle_s']} s, process state {r['state'] or '?'}\n")
            r["stacks"] = bool(text.strip())
            (where / STALL_STACKS_FILE.format(rank=r["rank"])).write_text(head + (text or f"# no stacks: {why}\n"))
        (where / STALL_FILE).write_text(json.dumps({**stall, "message": message}, indent=1) + "\n")
        for r in stall["ranks"]:
            self._signal(r, signal.SIGKILL)
        return where

    def _note(self, message: str, where: Path) -> None:
        """The exit note (``health.exits.note_exit``, first writer wins): a crash whose reason is ``stall``."""
        note_exit(Exit.CRASH, exit_file(self.run), why="stall", stall=str(where), message=message)

    def _signal(self, rank: dict, sig: signal.Signals) -> None:
        if rank["host"] == socket.gethostname():
            try:
                os.kill(rank["pid"], sig)
            except ProcessLookupError:
                pass
        elif self.job:  # another node of the job: a step that overlaps the running one
            subprocess.run(["srun", "--overlap", f"--jobid={self.job}", "--nodes=1", "--ntasks=1",
                            f"--nodelist={rank['host']}", "kill", f"-{sig.name.removeprefix('SIG')}",
                            str(rank["pid"])], capture_output=True, timeout=60)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def attempt_name(run: Path) -> str:
    """This launch's folder name under stalls/: the number of its start in attempts.jsonl."""
    starts = sum(e.get("event") == "start" for e in read_jsonl(attempts_file(run)))
    return f"{starts:03d}"


def main(argv=None) -> int:
    """For the SLURM batch script: watch until ``--pid`` (srun) ends; on a stall handle it."""
    p = argparse.ArgumentParser(description="Watch a running job's heartbeats; end it on a stall.")
    p.add_argument("run", type=Path)
    p.add_argument("--job", required=True, help="the SLURM job id")
    p.add_argument("--pid", type=int, required=True, help="the process whose end ends the watch (srun)")
    p.add_argument("--recipe", type=Path, required=True, help="the frozen recipe: its [launch] stall keys")
    p.add_argument("--poll", type=float, default=1.0)
    args = p.parse_args(argv)
    from train import recipe as R  # torch-free: the recipe schema

    dog = Watchdog(args.run, Limits.of(R.load(str(args.recipe)).launch), attempt_name(args.run), args.job)
    while proc_state(args.pid) is not None:
        if stall := dog.check():
            where = dog.handle(stall)
            print(f"launch.watchdog: STALL: {json.loads((where / STALL_FILE).read_text())['message']}; "
                  f"stacks in {where}; killed the ranks", file=sys.stderr, flush=True)
            return 0
        time.sleep(args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
