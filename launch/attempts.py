"""Every start of a run, how it ended, and the one rule both launchers follow next.

A run is started many times: after preemption, a time limit, a crash. Each
start appends to ``<run>/launcher/attempts.jsonl`` the latest checkpoint step it
began from; each end appends what train.py said about why it stopped
(``$LANEFORMER_EXIT_FILE``), the checkpoint step reached and the decision:

- ``done``: training finished;
- ``restart``: preempted (it checkpointed), or crashed or stalled (ended by
  ``launch.watchdog``) after writing a new checkpoint, while the run's crash
  and stall restarts in the last 24 hours stay under
  the recipe's ``[launch] crashes_per_day`` (0: no limit). A three-week run
  meets more node failures than any fixed total; a crash loop does not pass;
- ``fail``: a recipe error, no new checkpoint since the start (a restart would
  only repeat the failure), the crash rate is exceeded, training finished but
  its export failed, it stopped on too many consecutive skipped steps, or the
  run dir's disk cannot hold a checkpoint (``health.exits.Exit`` BAD_INPUT,
  EXPORT_FAILED, SKIPPED_OUT, NO_SPACE: restarting would not help). The
  decision reads exit codes only; the note's words are for people.

A crash is pinned to a node when that node's torchrun reported, among all
the failures it lists, a rank that died of a fault signal (SIGKILL from the
OOM killer, SIGSEGV, SIGBUS...: not a signal torchrun sent itself while
closing the group), or when SLURM reports the node down or not responding. The SLURM batch script then requeues the job with those nodes
excluded, so spare nodes take over; the end event records them.

The SLURM batch script calls ``python -m launch.attempts begin|end`` (this
module imports no torch, so it costs little in the job); launch.local calls
the functions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import rundir
from rundir import NODE_LOG_RE, attempts_file, exit_file, heartbeat_dir, latest_complete_step, launcher_dir, logs_dir
from train import recipe as R
from health.exits import Exit
from health.alerts import read_alerts
from health.heartbeat import read_beats, summary
from health.holder import claim
from health.storage import NoSpace, free_bytes, is_out_of_space

# A rank that died of one of these was killed by the node (OOM killer, bad memory, a crash
# in native code), not told to stop.
FAULT_SIGNALS = {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}
# torchrun (torch.distributed.elastic.multiprocessing.api) reports a failed worker group twice: one line for
# the failure with the earliest timestamp ("failed (exitcode: -N) local_rank: R (pid: P)"), then a table of
# every worker that failed ("exitcode  : -N (pid: P)"). The killed rank's peers fail in their collectives at
# nearly the same moment, so which one the line names is a race: every report counts.
_TORCHRUN_FAILED = (re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)"),
                    re.compile(r"exitcode\s*: (-?\d+) \(pid: (\d+)\)"))
# The workers torchrun itself signalled while closing the group (SIGTERM, then SIGKILL for one that does not
# stop within its timeout): how they died says nothing about the node.
_TORCHRUN_SIGNALLED = re.compile(r"(?:Sending process|Unable to shutdown process) (\d+)")
FAULTS = ("crash", "stall")  # the causes [launch] crashes_per_day counts


def node_logs(run: Path) -> dict[Path, re.Match]:
    """Each node's log of a SLURM launch (``rundir.NODE_LOG`` as srun named it: task, host)."""
    return {p: m for p in logs_dir(run).glob("*.log") if (m := NODE_LOG_RE.fullmatch(p.name))}


def checkpoint_step(run: Path) -> int:
    """The step of the newest complete checkpoint, 0 if none."""
    return latest_complete_step(run) or 0


def history(run: Path) -> list[dict]:
    path = attempts_file(run)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict; empty once the controller has forgotten the job
    (MinJobAge, 300 s by default, after it ends) or where there is no SLURM."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}


def _append(run: Path, event: dict) -> dict:
    event = {**event, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        launcher_dir(run).mkdir(parents=True, exist_ok=True)
        with open(attempts_file(run), "a") as f:
            f.write(json.dumps(event) + "\n")
    except OSError as e:
        if not is_out_of_space(e):
            raise
        latest = rundir.latest_complete_checkpoint(run)
        size = f"; the latest checkpoint ({latest}) takes {checkpoint_size(latest):,} bytes" if latest else ""
        raise NoSpace(f"no space to record the {event['event']} of job {event['job']} in {launcher_dir(run)}: "
                      f"{free_bytes(run):,} bytes free{size}. Free space or move the run dir") from e
    return event


def checkpoint_size(step_dir: Path) -> int:
    """Bytes of a checkpoint on disk."""
    return sum(f.stat().st_size for f in Path(step_dir).rglob("*") if f.is_file())


def begin(run: Path, job: str, **info) -> dict:
    """Record a start (and where each node log ends now); clear the previous start's exit note
    and heartbeats (launch.watchdog reads this start's only)."""
    exit_file(run).unlink(missing_ok=True)
    logs = {p.name: p.stat().st_size for p in node_logs(run)}
    event = _append(run, {"event": "start", "job": job, "step": checkpoint_step(run), **info, "logs": logs})
    shutil.rmtree(heartbeat_dir(run), ignore_errors=True)  # after the record: on a full disk, it says so
    return event


def end(run: Path, job: str, rc: int, crashes_per_day: int = 0, nodes: str = "",
        exclude_stragglers: bool = False) -> dict:
    """Record how the last start of ``job`` ended, decide what comes next, and which nodes
    to exclude from a requeue (those the crash is pinned to, with ``exclude_stragglers`` the
    nodes health.straggler named during the start, plus the job's earlier exclusions)."""
    events = history(run)
    starts = [e for e in events if e["event"] == "start" and e["job"] == job]
    day_ago = datetime.now(timezone.utc) - timedelta(days=1)
    recent = sum(1 for e in events if e["event"] == "end" and e["cause"] in FAULTS and e["action"] == "restart"
                 and datetime.fromisoformat(e["time"]) > day_ago)
    try:
        note = json.loads(exit_file(run).read_text())
    except (OSError, ValueError):
        note = {}
    before, after = (starts[-1]["step"] if starts else 0), checkpoint_step(run)
    action, cause, why = decide(rc, note, before, after, recent, crashes_per_day)
    event = {"event": "end", "job": job, "rc": rc, "step": after, "action": action, "cause": cause, "why": why,
             "summary": summary(read_beats(run))}  # for health.goodput: begin() removes the beats
    pinned = set()
    if action == "restart" and cause == "crash":
        pinned = fault_nodes(run, starts[-1].get("logs", {}) if starts else {}, hostnames(nodes)) | down_nodes(nodes)
    if action == "restart" and cause == "replica mismatch":
        pinned |= mismatch_nodes(note, hostnames(nodes))
    if action == "restart" and exclude_stragglers:
        pinned |= straggler_nodes(run, starts[-1]["time"] if starts else "", hostnames(nodes))
    if pinned:
        earlier = job_info(job).get("ExcNodeList", "(null)")
        event["pinned"] = sorted(pinned)
        event["exclude"] = ",".join([*([earlier] if earlier not in ("", "(null)") else []), *sorted(pinned)])
        event["why"] += f"; excluding {', '.join(sorted(pinned))} from the requeue"
    return _append(run, event)


def decide(rc: int, note: dict, before: int, after: int, recent_crashes: int,
           crashes_per_day: int) -> tuple[str, str, str]:
    """(action, cause, why) for a start that began at checkpoint ``before`` and left ``after``;
    ``recent_crashes``: crash restarts of the run in the last 24 hours."""
    code = note.get("code", rc)  # torchrun hides a rank's code: health.exits.note_exit carries it
    message = f": {_short(note['message'])}" if note.get("message") else ""
    match code:
        case Exit.DONE:
            return "done", "finished", f"finished at step {note.get('step', after)}"
        case Exit.BAD_INPUT:
            return "fail", "recipe", f"recipe error{message}"
        case Exit.EXPORT_FAILED:
            retry = f"; retry with: {note['command']}" if note.get("command") else ""
            return "fail", "export failed", f"training complete, export failed{message}{retry}; not restarting"
        case Exit.SKIPPED_OUT:
            at = f" up to step {note['step']}" if "step" in note else ""
            last = f"; last complete checkpoint: {note['checkpoint']}" if note.get("checkpoint") else ""
            return "fail", "skipped out", f"too many consecutive skipped steps{at}{last}; not restarting"
        case Exit.NO_SPACE:
            return "fail", "no space", f"no space for a checkpoint{message}; not restarting"
        case Exit.PREEMPTED:
            cause, why = "preempted", f"preempted; checkpointed at step {note.get('step', after)}"
        case Exit.REPLICA_MISMATCH:  # health.consistency: nothing saved; resumed from the latest verified checkpoint
            hosts = f" on {', '.join(note['hosts'])}" if note.get("hosts") else ""
            cause, why = "replica mismatch", f"replicas differed after step {note.get('step', '?')}{hosts}"
        case Exit.CRASH if note.get("reason") == "stall":  # launch.watchdog's note
            cause, why = "stall", f"stalled{message}; stacks in {note.get('stall')}"
        case _:
            cause = "crash"
            why = f"crashed (rank {note.get('rank', '?')}{message})" if message else f"crashed (exit code {rc})"
    if after <= before:
        return "fail", cause, f"{why}, with no new checkpoint since step {before}: not restarting"
    if cause in FAULTS and crashes_per_day and recent_crashes >= crashes_per_day:
        return "fail", cause, (f"{why}; {recent_crashes} crash and stall restarts in the last 24 hours, the recipe's "
                               f"[launch] crashes_per_day: not restarting")
    return "restart", cause, f"{why}; restarting from step {after}"


def mismatch_nodes(note: dict, nodes: list[str]) -> set[str]:
    """The job's nodes health.consistency named as holding a replica that differs (its exit note's
    ``hosts``): a cluster names a node by its host name; emulated nodes sharing one host match none."""
    return set(note.get("hosts", ())) & set(nodes)


def hostnames(nodelist: str) -> list[str]:
    """A SLURM node list expanded (``lfnode[1-2]`` -> lfnode1, lfnode2), in task order; [] without SLURM."""
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def fault_nodes(run: Path, offsets: dict[str, int], nodes: list[str] = ()) -> set[str]:
    """Nodes whose torchrun logged, since the start (``offsets``: log sizes then), a rank
    that died of a fault signal. Log ``node<t>-<host>.log`` is srun task t's, on ``nodes[t]``
    (one task per node, in node-list order); the host part names the node only where
    hosts and nodes are one (not for emulated nodes sharing a host)."""
    found = set()
    for path, m in node_logs(run).items():
        task = int(m.group(1))
        node = nodes[task] if task < len(nodes) else m.group(2)
        with open(path, "rb") as f:
            f.seek(offsets.get(path.name, 0))
            text = f.read().decode("utf-8", "replace")
        if fault_pids(text):
            found.add(node)
    return found


def fault_pids(torchrun_log: str) -> set[int]:
    """The workers that, by one torchrun's log, died of a fault signal before torchrun stopped them."""
    signalled = {int(pid) for pid in _TORCHRUN_SIGNALLED.findall(torchrun_log)}
    died = {(int(code), int(pid)) for pattern in _TORCHRUN_FAILED for code, pid in pattern.findall(torchrun_log)}
    return {pid for code, pid in died if code < 0 and -code in FAULT_SIGNALS and pid not in signalled}


def straggler_nodes(run: Path, since: str, nodes: list[str]) -> set[str]:
    """Nodes of the job that health.straggler named since ``since`` (ISO time): an alert's host is the
    rank's host name, a node's name where hosts and nodes are one (not for emulated nodes on one host)."""
    named = {a["host"].split(".")[0] for a in read_alerts(run) if a.get("kind") == "straggler" and a["time"] >= since}
    return named & set(nodes)


def down_nodes(nodelist: str) -> set[str]:
    """Nodes of ``nodelist`` that SLURM reports down, failing or not responding (``*``)."""
    if not nodelist:
        return set()
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N %T"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return set()
    return {name for name, state in (line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            if state.endswith("*") or state.startswith(("down", "fail", "not_responding"))}


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
    p.add_argument("--nodes", default="", help="the job's nodes")
    p.add_argument("--recipe", type=Path, help="begin: the frozen recipe; a run dir another launch's live ranks "
                   "hold is refused (exit 2, health.holder) before anything is written")
    p.add_argument("--rc", type=int, help="end: the exit status of the training processes")
    p.add_argument("--crashes-per-day", type=int, default=0, help="end: crash restarts allowed per 24 h (0: any)")
    p.add_argument("--exclude-stragglers", action="store_true", help="end: a requeue excludes named stragglers")
    args = p.parse_args(argv)
    try:
        if args.what == "begin":
            # the batch shell (this process's parent) lives as long as the job: the claim's process
            if args.recipe and (held := claim(args.run, R.load(str(args.recipe)).launch, job=args.job,
                                              pid=os.getppid())):
                print(f"error: {held}", file=sys.stderr)
                return Exit.BAD_INPUT
            event = begin(args.run, args.job, restart=args.restart, nodes=args.nodes)
            print(f"start {args.restart} of job {args.job} from step {event['step']}", file=sys.stderr)
            return 0
        event = end(args.run, args.job, args.rc, args.crashes_per_day, args.nodes, args.exclude_stragglers)
    except NoSpace as e:  # the batch script stops: nothing is requeued onto a full disk
        print(f"error: {e}", file=sys.stderr)
        return e.code
    print(event["why"], file=sys.stderr)
    print(event["action"], event.get("exclude", ""))  # the batch script reads: action [nodes to exclude]
    return 0


if __name__ == "__main__":
    sys.exit(main())
