"""launch.local end to end on CPU: an uninterrupted 2-rank run, and one that is
preempted (SIGUSR1 to a single rank: the ranks must agree on the step), then
crashes (a rank SIGKILLed), then stalls (a rank SIGSTOPped: launch.watchdog
dumps stacks and kills it), restarts from its checkpoints each time and ends
with the same losses. A signal to every rank at once (SLURM's B:USR1 through
srun and torchrun) is tests/launch/test_launch_slurm.py's preemption test."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch.attempts import checkpoint_step, history
from launch.slurm import status
from launch.watchdog import Limits, stalled
from rundir import REPO
from tests.conftest import STEPS, env, kill_tree, local_command, losses, metrics, reference_run
from health.alerts import read_alerts
from health.heartbeat import read_beats
from report.page import embedded_data
from tests.launch.conftest import logged_steps, wait_for

def started_at(log: str) -> list[int]:
    """The step each start of training began at, as torchtitan logs it after loading a checkpoint
    (every rank logs it: one entry per start)."""
    steps = [int(n) for n in re.findall(r"Training starts at step (\d+)", log)]
    return [n for i, n in enumerate(steps) if i == 0 or n != steps[i - 1]]


def rank_pid(root: int, rank: int) -> int | None:
    """The pid of training rank ``rank`` among the descendants of ``root``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


@pytest.mark.slow
def test_an_uninterrupted_run_finishes_in_one_start_and_names_no_straggler(reference, tmp_path_factory):
    assert sorted(reference) == list(range(1, STEPS + 1))
    run = reference_run(tmp_path_factory)
    events = history(run)
    assert [(e["event"], e.get("action")) for e in events] == [("start", None), ("end", "done")]
    # two balanced ranks: compared at every logging step, neither is flagged
    assert len([r for r in metrics(run).values() if "straggler/compute_median_s" in r]) == STEPS
    assert read_alerts(run) == [] and "slow hosts" not in status(run)


STRAGGLER_WINDOWS = 2
STRAGGLER_THRESHOLD = 0.5


def first_straggler(rows: dict[int, dict], threshold: float, windows: int) -> tuple[int, int] | None:
    """(rank, step) of the first alert health.straggler's rule gives on 3 ranks' logged numbers.
    With 3 ranks only the slowest can exceed the median of the other two (the upper one: the middle
    rank's), which is the logged median of all three; the streak is per rank."""
    streak: dict[int, int] = {}
    for step in sorted(s for s in rows if "straggler/slowest_rank" in rows[s]):
        r = rows[step]
        slow = r["straggler/compute_max_s"] > (1 + threshold) * r["straggler/compute_median_s"]
        streak = {r["straggler/slowest_rank"]: streak.get(r["straggler/slowest_rank"], 0) + 1} if slow else {}
        if windows in streak.values():
            return r["straggler/slowest_rank"], step
    return None


def throttle(pid: int, done: threading.Event, share: float = 0.1, run_s: float = 0.002) -> None:
    """Let ``pid`` run ``share`` of the wall time (SIGCONT, SIGSTOP), as a noisy neighbour or a throttled
    device leaves it, with no core burnt to take the rest (a busy process pinned beside it took a whole
    core of the suite's two). Each stop lasts as long as the run before it really lasted, times
    (1 - share) / share: on a loaded machine this thread wakes late and the rank runs longer than
    ``run_s``, so the stop grows with it and the share holds. ``run_s`` is shorter than a chunk of the
    GEMM check (~10 ms on one core), so every chunk is stopped several times."""
    try:
        while not done.is_set():
            start = time.monotonic()
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
            os.kill(pid, signal.SIGSTOP)
            time.sleep((time.monotonic() - start) * (1 - share) / share)
    except ProcessLookupError:  # the run ended
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_rank_held_to_a_tenth_of_a_core_is_named_the_straggler(tmp_path):
    """3 ranks; from its first heartbeat on, rank 1 runs a tenth of the time (``throttle``). The alert
    must be where the rule, replayed on the logged numbers with the configured threshold and windows,
    puts it: a streak of 1 would name it a logging step early (the rule itself, thresholds and streaks
    on recorded numbers: tests/train/test_straggler.py)."""
    run = tmp_path / "run"
    steps = ("--set=training.steps=9", "--set=logging.interval=2", "--set=checkpoint.interval=100",
             "--set=training.global_batch=12", f"--set=launch.straggler_windows={STRAGGLER_WINDOWS}",
             f"--set=launch.straggler_threshold={STRAGGLER_THRESHOLD}")
    proc = subprocess.Popen([*local_command(run, nproc=3, report=True), *steps], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()
    throttler = None
    try:
        beat = wait_for(lambda: {b["rank"]: b for b in read_beats(run)}.get(1), "rank 1's heartbeat", 300)  # ~18 s idle
        throttler = threading.Thread(target=throttle, args=(beat["pid"], done), daemon=True)
        throttler.start()
        out, _ = proc.communicate(timeout=480)  # ~30 s on an idle machine
    finally:
        done.set()
        if throttler:
            throttler.join()
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, out[-3000:]
    rows, logged = metrics(run), sorted(losses(run))
    assert logged == [1, 2, 4, 6, 8, 9]  # every 2 steps, and the last step whatever the interval
    # named where the rule puts it on the logged numbers: at logging step 4 on a quiet machine (step 1
    # may have begun before the pin); later when a second suite beside it slows the other ranks too
    first = read_alerts(run)[0]
    expected = first_straggler(rows, STRAGGLER_THRESHOLD, STRAGGLER_WINDOWS)
    assert expected and expected[0] == 1, {s: rows[s] for s in logged}
    assert (first["kind"], first["rank"], first["step"]) == ("straggler", *expected), (first, rows)
    assert first["median_s"] == rows[first["step"]]["straggler/compute_median_s"]  # the other two's upper median
    assert first["compute_s"] == rows[first["step"]]["straggler/compute_max_s"]
    assert "STRAGGLER: rank 1 on" in out and f"straggler_threshold {STRAGGLER_THRESHOLD:g})" in out
    assert f"slow hosts: {first['host']} (rank 1 at step" in status(run)
    figure = embedded_data((run / "report" / "report.html").read_text())["stragglers"]  # compute per host
    assert figure[first["host"]]["steps"] == logged


STALL_TIMEOUT = 10  # seconds; the watchdog looks once a second
# launch.watchdog ends a launch once its silence is > STALL_TIMEOUT and writes it rounded to 0.1 s, so
# 10.04 s of silence reads 10.0: the lower bound is STALL_TIMEOUT itself, not above it. The upper bound:
# its 1 s poll, plus a late poll of launch.local (a process among a loaded 2-core machine's many) at
# twice the load CI sees.
STALL_MARGIN = 10


def stall_in_time(stall: dict) -> bool:
    """Whether the watchdog ended a stalled launch as soon as its limit and poll allow (stall.json)."""
    return STALL_TIMEOUT <= stall["idle_s"] <= STALL_TIMEOUT + STALL_MARGIN


def test_the_stall_bound_holds_at_the_rounding_the_watchdog_writes():
    """The CI failure of issue 35, replayed: the first poll past the limit wrote ``idle_s: 10.0``."""
    beat = {"rank": 0, "world": 1, "host": "h", "pid": 1, "step": 5, "phase": "data", "done": 5, "time": 1000.0}
    limits = Limits(STALL_TIMEOUT, 1800, STALL_TIMEOUT, 3600)
    assert stalled([beat], 0.0, limits, 1000.0 + STALL_TIMEOUT) is None  # at the limit: not yet
    first = stalled([beat], 0.0, limits, 1000.0 + STALL_TIMEOUT + 0.04)
    assert first["idle_s"] == STALL_TIMEOUT and stall_in_time(first), first
    assert not stall_in_time(stalled([beat], 0.0, limits, 1000.0 + STALL_TIMEOUT + STALL_MARGIN + 0.1))


@pytest.mark.slow
def test_preemption_a_crash_and_a_stall_restart_from_checkpoints_with_the_same_losses(reference, tmp_path):
    run = tmp_path / "run"
    # A rank stopped while its checkpoint save is still its phase would wait out that allowance.
    limits = (f"--set=launch.stall_timeout={STALL_TIMEOUT}", f"--set=launch.stall_timeout_checkpoint={STALL_TIMEOUT}")
    # The output goes to a file: a pipe read only at the end would fill and block the launcher mid-run.
    log = tmp_path / "launch.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([*local_command(run), *limits], cwd=REPO, env=env(), stdout=sink,
                                stderr=subprocess.STDOUT, text=True)

    def ended(cause: str) -> list[dict]:
        return [e for e in history(run) if e["event"] == "end" and e.get("cause") == cause]

    # Each wait is for an event the run writes (a logged step, an end in attempts.jsonl, a complete
    # checkpoint), never a state seen in passing; the limits are several times what each takes on an
    # idle 2-core machine (a start to its first steps ~15 s, a restart to its next checkpoint ~20 s).
    try:
        wait_for(lambda: logged_steps(run) >= 3, "step 3", timeout=300, detail=lambda: history(run))
        os.kill(wait_for(lambda: rank_pid(proc.pid, 1), "rank 1"), signal.SIGUSR1)  # rank 0 gets nothing
        first = wait_for(lambda: ended("preempted"), "the preemption's end", 180, lambda: history(run))[0]["step"]
        wait_for(lambda: checkpoint_step(run) > first, "a checkpoint after the restart", 300, lambda: history(run))
        os.kill(wait_for(lambda: rank_pid(proc.pid, 0), "rank 0"), signal.SIGKILL)
        crashed = wait_for(lambda: ended("crash"), "the crash's end", 180, lambda: history(run))[0]["step"]
        wait_for(lambda: checkpoint_step(run) > crashed, "a checkpoint after the crash's restart", 300,
                 lambda: history(run))
        os.kill(wait_for(lambda: rank_pid(proc.pid, 1), "rank 1"), signal.SIGSTOP)  # it can answer nothing
        proc.wait(timeout=600)  # the stall's end, a restart and the rest of the run
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    ends = [e for e in history(run) if e["event"] == "end"]
    assert [(e["action"], e["cause"]) for e in ends] == [
        ("restart", "preempted"), ("restart", "crash"), ("restart", "stall"), ("done", "finished")], ends
    # Each restart loaded the checkpoint the launcher recorded: the preemption's, then the newest
    # one before the kill (a restart from step 1 would end with the same losses too).
    starts = [e["step"] for e in history(run) if e["event"] == "start"]
    assert starts[0] == 0 and starts[1] == first and starts[2] > first, starts
    assert started_at(out) == [step + 1 for step in starts], out[-3000:]
    assert losses(run) == reference
    # The stall: seen within the timeout plus the margin, every rank's stacks on disk but the stopped one's.
    stall = json.loads((run / "stalls" / "003" / "stall.json").read_text())
    assert stall_in_time(stall), stall
    assert [(r["rank"], r["state"] == "T", r["stacks"]) for r in stall["ranks"]] == [(0, False, True), (1, True, False)]
    assert "Current thread" in (run / "stalls" / "003" / "rank-0.txt").read_text()
    assert "it is stopped" in (run / "stalls" / "003" / "rank-1.txt").read_text()
    # The terminal shows rank 0; each rank's output is in its own file.
    assert "[default0]:" in out and "[default1]:" not in out
    assert len(list((run / "launcher" / "logs" / "local").rglob("1/stdout.log"))) == len(starts)
    text = status(run)  # a launch.local run: its recipe's total, its starts and ends
    assert f"latest checkpoint: step {STEPS} of {STEPS}" in text and "launch.local: 4 starts" in text, text
    assert "restart: stalled: no progress" in text and "done: finished at step" in text, text
    assert re.search(r"^goodput: \d+\.\d%.*\n  lost to: first start .*restarts .*stalls", text, re.M), text


def test_a_recipe_that_does_not_fit_the_ranks_starts_nothing(tmp_path):
    result = subprocess.run([sys.executable, "-m", "launch.local", "--recipe", "tiny.toml", "--nproc", "3",
                             f"--set=run.output_dir={tmp_path / 'run'}"],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "not divisible by micro_batch (8) x data-parallel size (3)" in result.stderr
    assert not (tmp_path / "run").exists()
