"""launch.local end to end on CPU: an uninterrupted 2-rank run, and one that is
preempted (SIGUSR1 to a single rank: the ranks must agree on the step), then
crashes (a rank SIGKILLed), restarts from its checkpoints each time and ends
with the same losses. A signal to every rank at once (SLURM's B:USR1 through
srun and torchrun) is tests/launch/test_launch_slurm.py's preemption test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.attempts import checkpoint_step, history
from rundir import REPO
from tests.conftest import STEPS, env, kill_tree, local_command, losses, reference_run
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
def test_an_uninterrupted_run_finishes_in_one_start(reference, tmp_path_factory):
    assert sorted(reference) == list(range(1, STEPS + 1))
    events = history(reference_run(tmp_path_factory))
    assert [(e["event"], e.get("action")) for e in events] == [("start", None), ("end", "done")]


@pytest.mark.slow
def test_preemption_and_a_crash_restart_from_checkpoints_with_the_same_losses(reference, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(local_command(run), cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def preempted() -> list[dict]:
        return [e for e in history(run) if e.get("cause") == "preempted"]

    try:
        wait_for(lambda: logged_steps(run) >= 3, "step 3")
        os.kill(wait_for(lambda: rank_pid(proc.pid, 1), "rank 1"), signal.SIGUSR1)  # rank 0 gets nothing
        first = wait_for(preempted, "the preemption")[0]["step"]
        wait_for(lambda: checkpoint_step(run) > first, "a checkpoint after the restart")
        os.kill(wait_for(lambda: rank_pid(proc.pid, 0), "rank 0"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, out[-3000:]
    ends = [e for e in history(run) if e["event"] == "end"]
    assert [(e["action"], e["cause"]) for e in ends] == [
        ("restart", "preempted"), ("restart", "crash"), ("done", "finished")], ends
    # Each restart loaded the checkpoint the launcher recorded: the preemption's, then the newest
    # one before the kill (a restart from step 1 would end with the same losses too).
    starts = [e["step"] for e in history(run) if e["event"] == "start"]
    assert starts[0] == 0 and starts[1] == first and starts[2] > first, starts
    assert started_at(out) == [step + 1 for step in starts], out[-3000:]
    assert losses(run) == reference


def test_a_recipe_that_does_not_fit_the_ranks_starts_nothing(tmp_path):
    result = subprocess.run([sys.executable, "-m", "launch.local", "--recipe", "tiny.toml", "--nproc", "3",
                             f"--set=run.output_dir={tmp_path / 'run'}"],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "not divisible by micro_batch (8) x data-parallel size (3)" in result.stderr
    assert not (tmp_path / "run").exists()
