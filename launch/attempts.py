"""Every start of a run, how it ended, and the one rule both launchers follow next.

A run is started many times: after preemption, a time limit, a crash. Each
start appends to ``<run>/launcher/attempts.jsonl`` the latest checkpoint step it
began from; each end appends what train.py said about why it stopped
(``$LANEFORMER_EXIT_FILE``), the checkpoint step reached and the decision:

- ``done``: training finished;
- ``restart``: preempted (always, it checkpointed), or crashed after writing a
  new checkpoint, at most ``max_restarts`` crash restarts per job;
- ``fail``: a recipe error, no new checkpoint since the start (a restart would
  only repeat the failure), or the crash budget is spent.

The SLURM batch script calls ``python -m launch.attempts begin|end`` (this
module imports no torch, so it costs little in the job); launch.local calls
the functions.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

# train.preemption.note_exit writes there; not imported from it, that would pull torch into the job script.
EXIT_FILE_ENV = "LANEFORMER_EXIT_FILE"


def launcher_dir(run: Path) -> Path:
    return Path(run) / "launcher"


def exit_file(run: Path) -> Path:
    """Where train.py writes why it stopped (the launchers set ``$LANEFORMER_EXIT_FILE`` to it)."""
    return launcher_dir(run) / "exit.json"


def latest_step(run: Path) -> int:
    """The step of the newest complete checkpoint (``.metadata`` written), 0 if none."""
    steps = [int(m.group(1)) for p in (Path(run) / "checkpoints").glob("step-*")
             if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / ".metadata").exists()]
    return max(steps, default=0)


def history(run: Path) -> list[dict]:
    path = launcher_dir(run) / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _append(run: Path, event: dict) -> dict:
    event = {**event, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    launcher_dir(run).mkdir(parents=True, exist_ok=True)
    with open(launcher_dir(run) / "attempts.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
    return event


def begin(run: Path, job: str, **info) -> dict:
    """Record a start; clear the previous start's exit note."""
    exit_file(run).unlink(missing_ok=True)
    return _append(run, {"event": "start", "job": job, "step": latest_step(run), **info})


def end(run: Path, job: str, rc: int, max_restarts: int) -> dict:
    """Record how the last start of ``job`` ended and decide what comes next."""
    events = [e for e in history(run) if e["job"] == job]
    starts = [e for e in events if e["event"] == "start"]
    crashes = sum(1 for e in events if e["event"] == "end" and e["cause"] == "crash")
    try:
        note = json.loads(exit_file(run).read_text())
    except (OSError, ValueError):
        note = {}
    before, after = (starts[-1]["step"] if starts else 0), latest_step(run)
    action, cause, why = decide(rc, note, before, after, crashes, max_restarts)
    return _append(run, {"event": "end", "job": job, "rc": rc, "step": after, "action": action,
                         "cause": cause, "why": why})


def decide(rc: int, note: dict, before: int, after: int, crashes: int, max_restarts: int) -> tuple[str, str, str]:
    """(action, cause, why) for a start that began at checkpoint ``before`` and left ``after``."""
    reason = note.get("reason")  # train.py's note_exit
    if reason == "finished" or (rc == 0 and reason is None):
        return "done", "finished", f"finished at step {note.get('step', after)}"
    if reason == "recipe error":
        return "fail", "recipe", f"recipe error: {_short(note['message'])}"
    if reason == "preempted":
        cause, why = "preempted", f"preempted; checkpointed at step {note.get('step', after)}"
    else:
        cause = "crash"
        why = f"crashed (rank {note['rank']}: {_short(note['message'])})" if "message" in note \
            else f"crashed (exit code {rc})"
    if after <= before:
        return "fail", cause, f"{why}, with no new checkpoint since step {before}: not restarting"
    if cause == "crash" and crashes >= max_restarts:
        return "fail", cause, f"{why}; {crashes} crash restarts already, the limit: not restarting"
    return "restart", cause, f"{why}; restarting from step {after}"


def _short(message: str, limit: int = 300) -> str:
    """The first line of an error, cut to fit a status line."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Record a start or end of a run (used by the SLURM batch script).")
    p.add_argument("what", choices=["begin", "end"])
    p.add_argument("run", type=Path)
    p.add_argument("--job", required=True)
    p.add_argument("--restart", type=int, default=0, help="begin: the scheduler's restart count")
    p.add_argument("--nodes", default="", help="begin: the job's nodes")
    p.add_argument("--rc", type=int, help="end: the exit status of the training processes")
    p.add_argument("--max-restarts", type=int, default=3, help="end: crash restarts allowed per job")
    args = p.parse_args(argv)
    if args.what == "begin":
        event = begin(args.run, args.job, restart=args.restart, nodes=args.nodes)
        print(f"start {args.restart} of job {args.job} from step {event['step']}", file=sys.stderr)
        return 0
    event = end(args.run, args.job, args.rc, args.max_restarts)
    print(event["why"], file=sys.stderr)
    print(event["action"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
