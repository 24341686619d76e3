"""Two ranks agree on a damaged latest checkpoint: rank 0 moves it aside, both resume from the
previous one, and the replayed steps give the losses of the first time."""

from __future__ import annotations

import os

import pytest

import rundir
from tests.conftest import losses, train

SETS = ("training.seq_len=64", "training.global_batch=8", "training.micro_batch=4", "schedule.warmup_steps=2",
        "logging.interval=1", "logging.tensorboard=false", 'logging.wandb_mode="disabled"',
        "run.deterministic=true", "checkpoint.keep_last=10", "checkpoint.interval=2")


@pytest.mark.slow
def test_two_ranks_move_a_damaged_checkpoint_aside_and_replay_exactly(tmp_path):
    run = tmp_path / "run"
    result = train("tiny.toml", f"run.output_dir={run}", "training.steps=4", *SETS, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    first = losses(run)
    for f in rundir.step_dir(run, 4).glob("*.distcp"):  # every rank's shard file
        os.truncate(f, f.stat().st_size // 2)

    result = train("tiny.toml", f"run.output_dir={run}", "training.steps=6", *SETS, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert out.count(f"DAMAGED CHECKPOINT {rundir.step_dir(run, 4)}") == 1  # one loud line, from rank 0
    assert (rundir.checkpoints_dir(run) / "step-4.damaged").is_dir()
    assert "Training starts at step 3" in out
    again = losses(run)
    assert {s: again[s] for s in (3, 4)} == {s: first[s] for s in (3, 4)}
    assert rundir.complete_steps(run) == [2, 4, 6]
