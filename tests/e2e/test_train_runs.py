"""Multi-process training runs (torchrun, gloo FSDP on CPU): kill -9 and resume, resume on
another number of ranks, and FSDP overfitting a repeated batch, eager and compiled."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.helpers import REPO, assert_overfits, env, kill_tree, losses, short, train, train_command

pytestmark = pytest.mark.slow


# ---- kill -9 and resume: the same losses to the last digit -----------------------------


def wait_for(path, proc, timeout=300):
    start = time.time()
    while not path.exists():
        assert proc.poll() is None, "the run ended before the checkpoint"
        assert time.time() - start < timeout
        time.sleep(0.05)


def test_kill_all_ranks_then_resume_gives_identical_losses(tmp_path):
    steps = 16
    common = ("run.deterministic=true", "checkpoint.interval=4", "checkpoint.keep_last=10")
    whole = tmp_path / "whole"
    result = train("tiny.toml", *short(whole, steps, *common), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]

    broken = tmp_path / "broken"
    proc = subprocess.Popen(train_command("tiny.toml", *short(broken, steps, *common), nproc=2),
                            cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for(broken / "run" / "checkpoints" / "step-4" / ".metadata", proc)
    kill_tree(proc.pid)  # torchrun and every rank at once
    proc.wait()
    killed_at = max(losses(broken / "run"))
    assert killed_at < steps
    half_written = broken / "run" / "checkpoints" / f"step-{steps - 1}"  # no DCP .metadata
    half_written.mkdir(exist_ok=True)
    (half_written / "__0_0.distcp").write_bytes(b"partial")

    result = train("tiny.toml", *short(broken, steps, *common), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed_at = int(re.search(r"Training starts at step (\d+)", result.stdout).group(1))
    assert 5 <= resumed_at <= killed_at + 1
    assert losses(broken / "run") == losses(whole / "run")  # exact, every step


def test_resume_on_another_number_of_ranks_continues_the_same_samples(tmp_path):
    steps = 8
    common = ("checkpoint.interval=4", "checkpoint.keep_last=10")
    whole = tmp_path / "whole"
    assert train("tiny.toml", *short(whole, steps, *common), nproc=2).returncode == 0
    part = tmp_path / "part"
    assert train("tiny.toml", *short(part, 4, *common), nproc=2).returncode == 0
    result = train("tiny.toml", *short(part, steps, *common), nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training starts at step 5" in result.stdout
    a, b = losses(whole / "run"), losses(part / "run")
    # Same global samples on 1 rank as on 2: only the summation order differs.
    assert all(b[s] == pytest.approx(a[s], rel=1e-5) for s in range(5, steps + 1))


# ---- FSDP on two ranks learns -------------------------------------------------------------


@pytest.mark.parametrize("compile", [False, True])
def test_tiny_overfits_a_repeated_batch_on_two_ranks(tmp_path, compile):
    assert_overfits(tmp_path, 2, compile, "none")
