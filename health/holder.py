"""One live writer per run dir: a rank dies with its torchrun agent, and a launch refuses a run dir that
another launch's live ranks hold.

Why both. torchrun starts its workers with ``start_new_session=True`` (pytorch PR #113231), so a SIGKILL
of torchrun's process group (``kill -9 -- -PGID`` of a ``setsid torchrun ...``, a node agent's cleanup,
a killed srun step under ``proctrack/linuxproc``) leaves every rank training, in sessions of their own.
The same command started again then trained *beside* them: both wrote ``checkpoints/step-N`` (DCP
overwrote it), both appended to ``metrics.jsonl``, and the orphan's closing summary read the other's
lines. So:

- ``die_with_parent``: a rank started by torchrun asks the kernel for SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``, as sglang's ``kill_itself_when_parent_died`` does). The signal comes
  when the parent *thread* that forked the rank exits: torchrun's agent starts its workers from its
  main thread (``SubprocessContext._start`` called by ``LocalElasticAgent._start_workers``, torch
  2.14), which lives as long as the agent, so no rank is killed early. A parent that died before the
  ``prctl`` is caught by comparing ``os.getppid()`` with the parent seen first. Plain ``python
  train.py`` (train.py's ``as_one_rank``) is its own single rank: its parent is a shell or a test, and
  outliving it is fine, so nothing is set there.
- ``claim``: before anything is written, a launch reads the run dir's heartbeats
  (``health.heartbeat``: every rank's pid, host, launch id, step, phase, time). Beats of another
  launch whose ranks are alive mean the run dir is held: the launch is refused (train.py and
  launch.local exit 2, ``health.exits.Exit.BAD_INPUT``), naming the holder (host, pids, launch number,
  the age of its last beat). A holder whose ranks are gone (its pids no longer exist on this host, or,
  on another host, no beat for as long as the stall watchdog allows it: ``[launch] stall_timeout``,
  longer in a first step, a save or an eval) is stale: the launch takes the run dir over and says so.

Alive, on this host, means the pid exists, is not a zombie, and started when the beat says it did
(``marks.process``): a reused pid is not the rank. On another host only the beat's age can tell, so
the allowance is the watchdog's (launch.watchdog ends a launch silent for longer, so one that is
silent longer is not training). Every rank of a launch checks the same files and so decides alike;
a rank's own launch (``heartbeat.launch_id()``) is never its holder, nor, on this host, a rank that
has another parent than this one's agent (torchrun's default port and run id repeat across launches).

Torch-free: launch.local calls ``claim`` before it records a start.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import rundir
from health.heartbeat import LAUNCH_ENV, launch_id, launch_owner, process_start_time, read_beats
from health.stall import Limits, allowance

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def started_by_torchrun() -> bool:
    """torchrun sets TORCHELASTIC_RUN_ID for its workers; ``python train.py`` (as_one_rank) does not."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_parent(parent: int | None = None) -> bool:
    """Under torchrun, have the kernel SIGKILL this process when its agent dies; False where nothing was
    set (not under torchrun, not Linux). ``parent``: the agent's pid as seen earlier (default: now).

    A parent that died before the ``prctl`` sends nothing: this process was already handed to a reaper,
    so its parent is no longer the one seen (or, seen only now, it is init while no torchrun is init)."""
    if not started_by_torchrun() or not sys.platform.startswith("linux"):
        return False
    expected = os.getppid() if parent is None else parent
    if not killed_with_parent():
        print(f"warning: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(ctypes.get_errno())}): this rank will "
              "outlive its torchrun agent if the agent is killed", file=sys.stderr)
        return False
    if os.getppid() != expected or (expected == 1 and not _init_is_a_launcher()):
        print(f"error: torchrun agent (pid {expected}) is gone before this rank started: exiting",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def killed_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies; False where it cannot (not Linux).
    Also the ``preexec_fn`` of a rank's own children that write into the run dir (the report's drawing):
    they end with the rank."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def _init_is_a_launcher() -> bool:
    """Whether PID 1 is torchrun itself (a container whose entry point it is), not a reaper."""
    try:
        return b"torch" in Path("/proc/1/cmdline").read_bytes()
    except OSError:
        return True  # cannot tell: do not kill a rank on a guess


# --- the holder of a run dir ---------------------------------------------------------------------


@dataclass
class Holder:
    """Another launch's ranks in the run dir, as their heartbeats tell."""
    launch: str  # its launch id (heartbeat.launch_id)
    beats: list[dict]
    alive: bool
    why: str  # why alive, or why stale
    number: int | None = None  # its launches/NNN, where it can be told
    hosts: list[str] = field(init=False)
    pids: list[int] = field(init=False)
    last_beat: float = field(init=False)

    def __post_init__(self):
        self.hosts = sorted({b.get("host", "?") for b in self.beats})
        self.pids = [b.get("pid") for b in sorted(self.beats, key=lambda b: b.get("rank", 0))]
        self.last_beat = max(b.get("time", 0.0) for b in self.beats)

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        number = f"launch {self.number:03d}" if self.number else "a launch"
        ranks = ", ".join(f"rank {b.get('rank')} pid {b.get('pid')} on {b.get('host')} (step {b.get('step')}, "
                          f"{b.get('phase')})" for b in sorted(self.beats, key=lambda b: b.get("rank", 0)))
        return (f"{number} (id {self.launch}) on {', '.join(self.hosts)}: {ranks}; last beat "
                f"{max(0.0, now - self.last_beat):.1f} s ago; {self.why}")


def holders(run: Path, limits, *, now: float | None = None, host: str | None = None,
            own: str | None = None, job: str | None = None) -> list[Holder]:
    """Every other launch whose heartbeats are in ``run``, alive or stale (``limits``: the recipe's
    ``[launch]``; ``own``: this launch's id, default ``launch_id()``; ``job``: a SLURM job id whose
    every start is this one's own: a requeued job starts again only once its last start has ended,
    while that start's ranks on other nodes beat until a moment ago)."""
    now = time.time() if now is None else now
    host = socket.gethostname() if host is None else host
    own = launch_id() if own is None else own
    groups: dict[str, list[dict]] = {}
    for b in read_beats(run):
        if not _ours(b, own, host) and not (job and str(b.get("launch", "")).split("/")[0] == str(job)):
            groups.setdefault(str(b.get("launch", "?")), []).append(b)
    found = []
    ends = ended(run)
    for launch, beats in groups.items():
        if any(_ended_after(ends, b.get("owner"), b.get("time", 0.0)) for b in beats):
            continue  # its launcher recorded its end: its ranks are gone from every host
        local = [b for b in beats if b.get("host") == host]
        remote = [b for b in beats if b.get("host") != host]
        alive = [b for b in local if pid_alive(b.get("pid"), b.get("marks", {}).get("process"))]
        silence, allowed = now - max(b.get("time", 0.0) for b in beats), allowed_silence(beats, limits)
        if alive:
            why = f"alive: pid {', '.join(str(b['pid']) for b in alive)} on {host}"
        elif remote and silence <= allowed:
            why = f"alive: beating on {', '.join(sorted({b['host'] for b in remote}))} (allowed silence {allowed:g} s)"
        else:
            gone = [f"pids {', '.join(str(b.get('pid')) for b in local)} gone from {host}"] if local else []
            quiet = [f"no beat from {', '.join(sorted({b.get('host', '?') for b in remote}))} for {silence:.0f} s "
                     f"(allowed {allowed:g} s)"] if remote else []
            found.append(Holder(launch, beats, False, "stale: " + "; ".join(gone + quiet)))
            continue
        found.append(Holder(launch, beats, True, why))
    for h in found:
        h.number = launch_number(run, h.beats)
    return found


def claim(run: Path, limits, *, say=None, now: float | None = None, host: str | None = None,
          own: str | None = None, job: str | None = None, pid: int | None = None) -> str | None:
    """Why this launch may not write into ``run`` (another launch holds it), or None once this launch
    holds it. A stale holder is taken over: ``say`` (default: print to stderr) is told which. ``own``,
    ``job``: as for ``holders``; ``job`` is also the claim's owner (default ``launch_owner()``); ``pid``:
    the process whose life is the launch's (default this one; the SLURM batch script's shell for
    ``launch.attempts begin``, a process that exits at once).

    Heartbeats tell a launch that trains; the claim files tell one that is starting (no beat yet):
    the next claim file is made with link(2), which one launch alone can do, so two launches started
    in the same instant cannot both pass."""
    now = time.time() if now is None else now
    host = socket.gethostname() if host is None else host
    owner = str(job) if job else launch_owner()
    while True:
        found = holders(run, limits, now=now, host=host, own=own, job=job)
        if live := [h for h in found if h.alive]:
            return refusal(run, "held by another launch whose ranks are alive: "
                           + "; and ".join(h.describe(now) for h in live))
        number, latest = latest_claim(run)
        if _mine(latest, owner, host, by_launcher=bool(job) or LAUNCH_ENV in os.environ):
            return None  # this launch's launcher or another of its ranks claimed it, or an earlier start of its job
        holding, why = claim_holds(run, latest, limits, now, host) if latest else (False, "")
        if holding:
            return refusal(run, f"claimed by another launch that is starting: {why}")
        record = {"owner": owner, "host": host, "pid": pid or os.getpid(), "agent": os.getppid(), "time": now,
                  "process": process_start_time(pid or os.getpid())}
        if not _create(rundir.claim_file(run, number + 1), record):
            continue  # another launch made that claim first: judge it
        stale = [h.describe(now) for h in found] + ([why] if why.startswith("stale") else [])
        if stale:
            (say or (lambda line: print(line, file=sys.stderr, flush=True)))(
                f"run dir {run}: took over from a stale holder: {'; '.join(stale)}")
        return None


def _mine(record: dict, owner: str, host: str, by_launcher: bool) -> bool:
    """Whether the claim ``record`` was made for this launch: its owner is this one's and, where the owner
    is only a launch id (no launcher: plain torchrun repeats its id with its default run id and port),
    it was made on another host of the launch or under this process's torchrun agent."""
    if record.get("owner") != owner:
        return False
    return (by_launcher or record.get("host") != host or record.get("agent") == os.getppid()
            or record.get("pid") == os.getpid())


def refusal(run: Path, why: str) -> str:
    return (f"run dir {run} is {why}. One live writer per run dir: stop it (its torchrun and ranks) "
            "or train into another run dir")


def latest_claim(run: Path) -> tuple[int, dict]:
    """(number, record) of the run dir's newest claim; (0, {}) if none."""
    numbers = rundir.claim_numbers(run)
    for number in numbers:
        try:
            return number, json.loads(rundir.claim_file(run, number).read_text())
        except (OSError, ValueError):
            continue  # unreadable: an older claim decides
    return max(numbers, default=0), {}


def claim_holds(run: Path, record: dict, limits, now: float, host: str) -> tuple[bool, str]:
    """Whether the launch that made the claim ``record`` may still write into ``run``, and why. Its end,
    recorded by its launcher, frees the run dir at once; else, on this host, its process must be alive;
    on another host, its ranks' beats decide (``holders`` found them stale, or they would hold the run
    dir), or, before any beat, the first step's allowance since the claim."""
    who = (f"{record.get('owner')} (claimed from pid {record.get('pid')} on {record.get('host')} "
           f"{max(0.0, now - record.get('time', 0.0)):.1f} s ago)")
    if _ended_after(ended(run), record.get("owner"), record.get("time", 0.0)):
        return False, f"ended: {who}"
    if record.get("host") == host:
        if pid_alive(record.get("pid"), record.get("process")):
            return True, f"{who}; alive: pid {record.get('pid')}"
        return False, f"stale: {who}; pid {record.get('pid')} gone from {host}"
    if any(b.get("owner") == record.get("owner") for b in read_beats(run)):
        return False, f"stale: {who}; its ranks' beats are stale"
    allowed = allowed_silence([], limits)
    if now - record.get("time", 0.0) <= allowed:
        return True, f"{who}; no beat yet, within the first step's allowance ({allowed:g} s)"
    return False, f"stale: {who}; no beat in the first step's allowance ({allowed:g} s)"


def _create(path: Path, record: dict) -> bool:
    """Make ``path`` holding ``record`` unless it exists: link(2) of a written file, atomic on NFS too
    (where a lost reply can make a link that worked fail: then the file's link count says it worked)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}")
    tmp.write_text(json.dumps(record) + "\n")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        return tmp.stat().st_nlink == 2
    finally:
        tmp.unlink(missing_ok=True)


def ended(run: Path) -> dict[str, float]:
    """Each job's latest end, as its launcher recorded it (``launch.attempts``): job -> time."""
    ends: dict[str, float] = {}
    for event in rundir.read_jsonl(rundir.attempts_file(run)):
        if event.get("event") == "end":
            when = datetime.fromisoformat(event["time"]).timestamp()
            ends[str(event["job"])] = max(when, ends.get(str(event["job"]), 0.0))
    return ends


def _ended_after(ends: dict[str, float], owner, since: float) -> bool:
    """Whether the job ``owner`` ended after ``since`` (the end's time is cut to the second)."""
    return owner is not None and str(owner) in ends and ends[str(owner)] >= since - 1.0


def _ours(beat: dict, own: str, host: str) -> bool:
    """A beat of this launch: its id, and on this host, this process or a rank under a live torchrun agent:
    this one's, or another agent of the same launch (several nodes' agents on one host, as SLURM's
    emulated nodes are). A killed torchrun's orphan (its id repeats with torchrun's default port and run
    id) has a reaper for a parent, not an agent."""
    if beat.get("launch") != own:
        return False
    if beat.get("host") != host:
        return True
    pid = beat.get("pid")
    parent = _parent(pid)
    return pid == os.getpid() or parent == os.getppid() or _is_torchrun(parent)


def _is_torchrun(pid) -> bool:
    """Whether ``pid`` is a torchrun agent (its command line runs torchrun or torch.distributed.run)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, TypeError):
        return False
    return b"torchrun" in command or b"torch.distributed.run" in command


def allowed_silence(beats: list[dict], launch) -> float:
    """Seconds a launch may be silent before launch.watchdog ends it as stalled (``health.stall``,
    the watchdog's own rule; ``launch``: the recipe's ``[launch]``). With stall detection off
    (``stall_timeout = 0``) the table's defaults stand in (its class built bare: ``train.recipe.Launch``'s):
    a holder must go stale some time."""
    limits, default = Limits.of(launch), Limits.of(type(launch)())
    for kind in ("stall", "first_step", "checkpoint", "eval"):
        setattr(limits, kind, getattr(limits, kind) or getattr(default, kind))
    return float(allowance(beats, limits)[0])


def pid_alive(pid, started: float | None = None) -> bool:
    """Whether ``pid`` is a live process on this host (not a zombie) that started at ``started``
    (heartbeat.process_start_time, same clock and rounding) where that is known."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    stat = _stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    if started is None:
        return True
    start = process_start_time(pid)
    return start is not None and abs(start - started) < 1.0


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parent(pid) -> int | None:
    stat = _stat(pid) if isinstance(pid, int) else None
    return int(stat[1]) if stat else None


def launch_number(run: Path, beats: list[dict]) -> int | None:
    """The holder's ``launches/NNN`` (train.snapshot.record_launch: written by its rank 0 before the
    trainer starts): the newest one started before its ranks' trainers did."""
    # rank 0 records the launch before its own trainer starts; other ranks may start theirs earlier (load)
    zero = [b for b in beats if b.get("rank") == 0] or beats
    began = max((b.get("marks", {}).get("trainer", float("inf")) for b in zero), default=float("inf"))
    best = None
    for folder in (Path(run) / rundir.LAUNCHES_DIR).glob("[0-9]*"):
        try:
            started = datetime.fromisoformat((folder / rundir.STARTED_FILE).read_text().strip()).timestamp()
        except (OSError, ValueError):
            continue
        if started <= began + 1.0 and (best is None or int(folder.name) > best):
            best = int(folder.name)
    return best
