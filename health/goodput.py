"""Goodput: productive training time over wall time since the first launch, and what each cause cost.

Every end in ``attempts.jsonl`` carries the ranks' last heartbeat summary
(``summary``, written by ``launch.attempts.end`` from health/heartbeat.py): the
marks on the way to the first step, the seconds per phase after it, the last
step every rank finished and the last beat. From those and the start/end
times of each launch:

- **first start** and **restarts**: from a launch's start to its first
  trained step, split into ``process`` (scheduler/agent rendezvous and the
  interpreter), ``imports``, ``rendezvous`` (the process group), ``build``
  (model, data index, optimizer), ``checkpoint load`` and ``first step``
  (compile);
- **replays**: steps trained after the checkpoint a restart resumed from,
  done again, at that launch's mean step time;
- **checkpoints** (every save, a preemption's too), **rollbacks** (their checkpoint load),
  **evals** (eval, report and export), **preemptions** (the per-step agreement on a preemption
  request): time in those phases after the first step, each phase booked where
  ``health.phases.Phase.bucket`` says;
- per end cause (**stalls**, **preemptions**, **crashes**): the time from the
  launch's last beat to its end (the stall allowance ran out, a crashed job
  wound down, the preemption save) plus the wait until the next start (requeue,
  queue);
- **productive**: time in the productive phases (data, forward/backward,
  optimizer, the per-step metrics and checks) minus the replayed steps'.

Torch-free, in train's layer so that the report (report) can use it; ``launch.slurm
status`` and the report print ``lines``.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rundir import attempts_file, read_jsonl
from health.heartbeat import read_beats, summary
from health.phases import bucket

STARTUP = (("process", "process"), ("imports", "trainer"), ("rendezvous", "rendezvous"), ("build", "built"),
           ("checkpoint load", "loaded"), ("first step", "first_step"))
COSTS = ("first start", "restarts", "replays", "checkpoints", "rollbacks", "evals", "stalls", "preemptions",
         "crashes")
TAIL_CAUSE = {"stall": "stalls", "preempted": "preemptions", "crash": "crashes"}


def _t(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def startup_split(start: float, marks: dict) -> dict[str, float]:
    """Seconds from a launch's start to each mark, as consecutive parts (only the marks reached)."""
    parts, last = {}, start
    for name, mark in STARTUP:
        if mark in marks:
            parts[name] = max(0.0, marks[mark] - last)
            last = marks[mark]
    return parts


def account(run: Path, now: float | None = None) -> dict | None:
    """Wall time since the first launch, productive time and the cost of each cause (seconds),
    per launch startup splits; None before the first launch."""
    events = read_jsonl(attempts_file(run))  # launch.attempts writes it
    starts = [e for e in events if e["event"] == "start"]
    if not starts:
        return None
    launches: list[list[Any]] = []  # [start event, end event or None]
    for e in events:
        if e["event"] == "start":
            launches.append([e, None])
        elif launches and launches[-1][1] is None:
            launches[-1][1] = e
    running = launches[-1][1] is None
    now = now or time.time()
    end_time = now if running else _t(launches[-1][1]["time"])
    costs = dict.fromkeys(COSTS, 0.0)
    productive, splits, replayed = 0.0, [], 0
    for i, (start, end) in enumerate(launches):
        s = (end or {}).get("summary") or (summary(read_beats(run)) if end is None else {})
        t0 = _t(start["time"])
        t1 = _t(end["time"]) if end else now
        marks = s.get("marks", {})
        split = startup_split(t0, marks)
        splits.append(split)
        up = (marks["first_step"] - t0) if "first_step" in marks else (t1 - t0 if end else sum(split.values()))
        costs["restarts" if i else "first start"] += up
        train = 0.0
        for phase, seconds in s.get("phase_s", {}).items():
            where = bucket(phase)
            if where == "productive":
                train += seconds
            elif where in costs:  # "startup" phases are timed by the marks
                costs[where] += seconds
        productive += train
        if i + 1 < len(launches) and s.get("done"):  # steps after the checkpoint the next launch resumed from
            again = max(0, s["reached"] - launches[i + 1][0]["step"])
            replayed += again
            cost = again * train / s["done"]
            costs["replays"] += cost
            productive -= cost
        if end:
            tail = t1 - s["last_beat"] if s.get("last_beat") and "first_step" in marks else 0.0
            gap = (_t(launches[i + 1][0]["time"]) - t1) if i + 1 < len(launches) else 0.0
            cause = TAIL_CAUSE.get(end.get("cause"))
            if cause:
                costs[cause] += max(0.0, tail) + max(0.0, gap)
    wall = end_time - _t(starts[0]["time"])
    return {"wall_s": wall, "productive_s": productive, "goodput": productive / wall if wall > 0 else 0.0,
            "costs": costs, "other_s": wall - productive - sum(costs.values()), "startups": splits,
            "replayed_steps": replayed, "launches": len(launches), "running": running}


def _d(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def lines(run: Path) -> list[str]:
    """The status/report lines: goodput, each cause's cost, the last launch's way to its first step."""
    a = account(run)
    if a is None:
        return []
    out = [f"goodput: {a['goodput']:.1%} ({_d(a['productive_s'])} training of {_d(a['wall_s'])} since the first "
           f"launch, {a['launches']} launch{'es' if a['launches'] > 1 else ''})"]
    replays = f" ({a['replayed_steps']} steps)" if a["replayed_steps"] else ""
    costs = [f"{k} {_d(v)}" + (replays if k == "replays" else "") for k, v in a["costs"].items() if v >= 0.05]
    other = f"other {_d(a['other_s'])}"
    out.append(f"  lost to: {', '.join([*costs, other])}")
    for n, split in enumerate(a["startups"], 1):
        if split:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in split.items())
            out.append(f"  launch {n} to its first step: {sum(split.values()):.1f} s ({parts})")
    return out
