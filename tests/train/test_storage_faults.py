"""A run dir on a disk that really fills up (a 40 MiB tmpfs): the preflight refuses a dir that
cannot hold the checkpoints the run keeps, a save that runs out of space stops with its own exit
code naming the dir, the bytes free and the bytes a checkpoint needs, a restart on the full
disk says the same before writing anything, and the launchers do not restart it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import rundir
from launch import attempts
from rundir import REPO
from tests.train.test_faults import train_rank0
from train import recipe as R
from train.build import preflight
from health.exits import Exit
from health.storage import checkpoint_bytes, free_bytes

TINY_PARAMS = 2_098_304  # the tiny flavor (test_model pins the flavors' sizes)
MiB = 2**20


@pytest.fixture
def small_disk(tmp_path):
    """A 40 MiB tmpfs mounted for the test; skipped, with the reason, where mounting is refused."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def fill(disk, leave: int) -> None:
    """Take the disk's free space down to about ``leave`` bytes."""
    subprocess.run(["fallocate", "-l", str(free_bytes(disk) - leave), str(disk / "filler")], check=True)


def test_the_preflight_refuses_a_run_dir_that_cannot_hold_keep_last_plus_one_checkpoints(small_disk):
    per = checkpoint_bytes(TINY_PARAMS)
    assert per == TINY_PARAMS * 12 and 24 * MiB < per < 25 * MiB
    run = small_disk / "run"

    def check(*sets):
        return preflight(R.load("tiny.toml", [f"run.output_dir={run}", *sets]), 1)

    checked = check("checkpoint.keep_last=2")  # 3 x 24 MiB on a 40 MiB disk
    free = free_bytes(small_disk)
    assert checked.no_space and checked.problems == [
        f"{R.RECIPES / 'tiny.toml'}: [run] output_dir: {run} has {free:,} bytes ({free / MiB:,.1f} MiB) free; "
        f"3 more checkpoints of about {per:,} bytes ({per / MiB:,.1f} MiB) ({TINY_PARAMS:,} parameters x 12 "
        f"bytes: fp32 weights and AdamW moments) need {3 * per:,} bytes ({3 * per / MiB:,.1f} MiB) "
        "([checkpoint] keep_last 2, 0 there)"]
    assert not run.exists()
    ok = check("checkpoint.keep_last=0")  # keep all: the next one must fit, and does
    assert not ok.no_space and ok.problems == []
    fill(small_disk, leave=per - MiB)
    assert check("checkpoint.keep_last=0").no_space


def test_a_save_on_a_full_disk_stops_with_no_space_and_a_restart_says_the_same(small_disk, tmp_path):
    run, note = small_disk / "run", tmp_path / "exit.json"
    # keep all: one checkpoint (~25 MiB) fits on the 40 MiB disk, the second does not.
    sets = ("checkpoint.interval=1", "checkpoint.keep_last=0", "logging.tensorboard=false")
    result = train_rank0(run, "training.steps=2", *sets, exit_file=note)
    assert result.returncode == Exit.NO_SPACE, result.stderr[-3000:]
    record = json.loads(note.read_text())
    assert (record["code"], record["reason"], record["step"]) == (5, "no space for a checkpoint", 2)
    folder, free, per = record["folder"], record["free_bytes"], record["checkpoint_bytes"]
    assert folder == str(rundir.checkpoints_dir(run)) and per == checkpoint_bytes(TINY_PARAMS)
    assert 0 < free < per and abs(free - free_bytes(small_disk)) < MiB  # the partial step-2 was removed
    said = (f"no space for the checkpoint of step 2 in {folder}: {free:,} bytes ({free / MiB:,.1f} MiB) free, "
            f"a checkpoint needs about {per:,} bytes")
    assert record["message"].startswith(said) and f"error: {said}" in result.stderr
    # the cause in one line: the failing rank's own error (ENOSPC where the write reached the disk, or
    # torch's writer's "unexpected pos" where it failed first), not DCP's CheckpointException with
    # every rank's traceback in its text
    assert re.search(r"\((OSError: \[Errno 28\]|RuntimeError: )", record["message"]), record["message"]
    assert "CheckpointException" not in record["message"]
    assert "\n" not in record["message"] and "Traceback" not in record["message"], record["message"]
    assert rundir.complete_steps(run) == [1]
    assert sorted(p.name for p in rundir.checkpoints_dir(run).iterdir()) == ["step-1"]
    action, cause, why = attempts.decide(1, record, 1, 1, 0, 0)  # as torchrun reports it: the note decides
    assert (action, cause) == ("fail", "no space") and said in why

    # A restart on the same full disk: the preflight names the dir, free and needed bytes; nothing is written.
    note.unlink()
    launches = sorted((run / rundir.LAUNCHES_DIR).iterdir())
    again = train_rank0(run, "training.steps=3", *sets, exit_file=note)
    assert again.returncode == Exit.NO_SPACE, again.stderr[-3000:]
    assert f"[run] output_dir: {run} has " in again.stderr
    assert f"1 more checkpoint of about {per:,} bytes" in again.stderr and "0 there" not in again.stderr
    assert json.loads(note.read_text())["code"] == Exit.NO_SPACE
    assert sorted((run / rundir.LAUNCHES_DIR).iterdir()) == launches
    assert attempts.decide(Exit.NO_SPACE, {}, 1, 1, 0, 0)[0] == "fail"

    # Not a byte left: the SLURM batch script's record of a start says why and stops, no traceback.
    fill(small_disk, leave=0)
    begin = subprocess.run([sys.executable, "-m", "launch.attempts", "begin", str(run), "--job", "7"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert begin.returncode == Exit.NO_SPACE, begin.stderr
    step1 = rundir.step_dir(run, 1)
    assert begin.stderr == (f"error: no space to record the start of job 7 in {run / 'launcher'}: "
                            f"{free_bytes(run):,} bytes free; the latest checkpoint ({step1}) takes "
                            f"{attempts.checkpoint_size(step1):,} bytes. Free space or move the run dir\n")
