"""Multi-process training runs (torchrun, gloo FSDP on CPU): kill -9 and resume, resume on
another number of ranks, and compiled FSDP with selective checkpointing overfitting a repeated batch."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest

from rundir import REPO
from tests.conftest import SHORT, STEPS, assert_overfits, env, kill_tree, losses, train, train_command

pytestmark = pytest.mark.slow


# ---- kill -9 and resume: the same losses to the last digit -----------------------------


def wait_for(path, proc, timeout=300):
    """Until ``path`` exists (an event the run writes: DCP's ``.metadata`` of a complete checkpoint)."""
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {path} was written"
        assert time.monotonic() < end, f"timed out waiting for {path} ({timeout} s)"
        time.sleep(0.05)


def test_kill_all_ranks_resume_on_two_then_on_one(reference, tmp_path):
    """kill -9 of torchrun and every rank, a half-written newer checkpoint beside the
    last complete one: the resumed run's losses equal the uninterrupted run's
    (``reference``, the same recipe and settings) to the last digit. Then, from
    its step-8 checkpoint, the same run resumed on one rank continues the same
    global samples: only the summation order differs."""
    sets = ("tiny.toml", f"run.output_dir={tmp_path / 'run'}", *SHORT, "checkpoint.keep_last=10")
    proc = subprocess.Popen(train_command(*sets, nproc=2), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(tmp_path / "run" / "checkpoints" / "step-4" / ".metadata", proc)
    kill_tree(proc.pid)  # torchrun and every rank at once
    proc.wait()
    killed_at = max(losses(tmp_path / "run"))
    assert killed_at < STEPS
    half_written = tmp_path / "run" / "checkpoints" / f"step-{STEPS - 1}"  # no DCP .metadata
    half_written.mkdir(exist_ok=True)
    (half_written / "__0_0.distcp").write_bytes(b"partial")

    result = train(*sets, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed_at = int(re.search(r"Training starts at step (\d+)", result.stdout).group(1))
    assert 5 <= resumed_at <= killed_at + 1
    assert losses(tmp_path / "run") == reference  # exact, every step

    one = tmp_path / "one"
    shutil.copytree(tmp_path / "run", one / "run")
    for later in (one / "run" / "checkpoints").glob("step-*"):
        if int(later.name.split("-")[1]) > 8:
            shutil.rmtree(later)
    result = train("tiny.toml", f"run.output_dir={one / 'run'}", *SHORT, "checkpoint.keep_last=10", nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training starts at step 9" in result.stdout
    b = losses(one / "run")
    assert all(b[s] == pytest.approx(reference[s], rel=1e-5) for s in range(9, STEPS + 1))


# ---- FSDP on two ranks learns -------------------------------------------------------------


def test_compiled_fsdp_with_selective_checkpointing_overfits_a_repeated_batch(tmp_path):
    """Eager FSDP on two ranks is held to the uninterrupted run's losses above."""
    assert_overfits(tmp_path, 2, True, "selective")
