"""Spike rollback (health/rollback.py, train/callbacks/rollback.py) on CPU, with planted spikes.

Steps 4 and 5 of a 6-step tiny run go NaN (one micro batch each, planted in the loss as
tests/train/test_train.py plants one); its checkpoints at 2, 4 and 6 straddle the spikes: the step-4
one is saved after the first spike (its update skipped). With ``spike_rollbacks = 2`` the run rolls
back, after step 5, to the checkpoint saved before the first spike, step 2 (not step 4: the latest
before the last spike, or one saved at the first spike's step), skips the global samples steps 3 to
5 read (16 to 39) and trains steps 3 to 6 again on samples 40 to 71. The data accounting is checked against the
sources of the loader's own batches (``Mixture.batch``'s ``source`` field), not against
``consumed_tokens``, the function the trainer logs with.
"""

from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest

from rundir import REPO
from tests.conftest import env, metrics, poisoned_command, short, train_command

SPIKES = (4, 5)
MICRO_BATCHES = 2  # global batch 8, micro batch 4, one rank (tests.conftest.short)


def source_tokens(indices) -> dict[str, int]:
    """Label tokens per source of global samples ``indices``, from the batches the loader reads."""
    from data.loader import build_mixture
    from data.tokenizer import Tokenizer
    from train import recipe as R

    recipe = R.load("tiny.toml", ["training.seq_len=64", "training.global_batch=8", "training.steps=6",
                                    "schedule.warmup_steps=2"])
    tokenizer = Tokenizer(recipe.data.tokenizer)
    mixture = build_mixture(recipe.data.sources, tokenizer, 64, recipe.run.seed, tokenizer.vocab_size, None)
    sources = mixture.batch(np.asarray(indices))["source"]
    return {s.name: int((sources == i).sum()) * 64 for i, s in enumerate(mixture.sources)}


def test_the_checkpoint_before_is_the_latest_complete_one_saved_before_the_first_spike(tmp_path):
    from health.rollback import checkpoint_before

    for step in (2, 4, 6):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / ".metadata").touch()
    (tmp_path / "step-3").mkdir()  # half-written: no .metadata
    assert checkpoint_before(tmp_path, 4) == 2  # the step-4 checkpoint holds the first spike's step
    assert checkpoint_before(tmp_path, 5) == 4
    assert checkpoint_before(tmp_path, 2) is None


@pytest.mark.slow
def test_spikes_that_come_back_are_rolled_back_and_their_data_skipped(tmp_path):
    calls = [MICRO_BATCHES * (step - 1) + 1 for step in SPIKES]
    cmd = poisoned_command(tmp_path, "tiny.toml", *short(tmp_path, 6, "checkpoint.interval=2", "checkpoint.keep_last=10",
                                                         "training.spike_rollbacks=2"), calls=set(calls))
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    assert "ROLLBACK at step 5: 2 spikes within 100 steps (at steps 4, 5); back to the checkpoint of step 2" in (
        result.stdout + result.stderr)

    [record] = [json.loads(line) for line in (run / "rollbacks.jsonl").read_text().splitlines()]
    assert (record["at_step"], record["to_step"], record["spikes"]) == (5, 2, [4, 5])
    assert record["skipped_samples"] == [16, 40]  # what steps 3 to 5 read: 8 samples a step
    assert record["skipped_tokens"] == source_tokens(range(16, 40))
    checkpoints = run / "checkpoints"
    assert (checkpoints / "step-4.rolled-back").is_dir()  # saved after the first spike: never resumed from
    assert {p.name for p in checkpoints.glob("step-*")} >= {"step-2", "step-4", "step-6"}

    rows = metrics(run)  # a replayed step: its latest values
    assert all(math.isfinite(rows[s]["loss_metrics/global_avg_loss"]) for s in range(1, 7))
    assert rows[6]["skipped_steps"] == 0  # the guard as it was at step 2
    # What the run logged as consumed is what it trained on: samples 0-15 and 40-71, none of 16-39.
    consumed = {k.removeprefix("data/tokens/"): v for k, v in rows[6].items() if k.startswith("data/tokens/")}
    assert consumed == source_tokens([*range(16), *range(40, 72)])

    from plan.data import realized_mix  # train.py --dry-run --run's mix

    skipped = ", ".join(f"{k} {v:,}" for k, v in record["skipped_tokens"].items())
    assert f"rolled back at step 5 to step 2: skipped 1,536 tokens ({skipped})" in realized_mix(run, {})

    from report.runs import read_run  # the run report marks it (throughput and data mix figures)

    assert ("rollback", 2) in [(r.cause, r.step) for r in read_run(run).restarts]
    # The load was beaten under its own phase: the checkpoint allowance, booked as rollbacks in goodput.
    from health.heartbeat import read_beats

    (beat,) = read_beats(run)
    assert beat["phase_s"].get("rollback", 0) > 0, beat["phase_s"]


# A kill in the middle of two counts: a spike window (one spike seen of the two that roll back) and a
# straggler streak (rank 1 slow at 3 of the 4 logging steps in a row that name it). The checkpoint of
# step 4 holds both, so the resumed run rolls back at the next spike and names rank 1 at its next slow
# step; a run that started its counts again would do neither. Rank 1's compute check is made slow by
# this script (its timing, times 10): the check's own detection is tests/launch/test_launch_local.py's.
KILL_AND_RESUME = """
import os, signal, sys
sys.path.insert(0, "REPO_DIR")
from train.titan import use_cpu_if_no_gpu
use_cpu_if_no_gpu()
import torch.distributed as dist
from torchtitan.components.loss import CrossEntropyLoss
import train.callbacks.straggler as straggler
from train.titan import MilestoneCheckpointManager
calls = {"n": 0}
forward = CrossEntropyLoss.__call__
def poisoned(self, pred, *args, **kwargs):
    calls["n"] += 1
    if calls["n"] in POISONED and dist.get_rank() == 0:  # rank 0's only micro batch of that step
        pred = pred * float("nan")
    return forward(self, pred, *args, **kwargs)
CrossEntropyLoss.__call__ = poisoned
gemm = straggler.gemm_seconds
straggler.gemm_seconds = lambda *a, **k: gemm(*a, **k) * (10 if dist.get_rank() == 1 else 1)
save = MilestoneCheckpointManager._save
def save_then_die(self, step, last_step=False):
    saved = save(self, step, last_step)
    if step == KILL_AT:
        dist.barrier()  # every rank's part of the checkpoint is on disk
        os.kill(os.getpid(), signal.SIGKILL)
    return saved
MilestoneCheckpointManager._save = save_then_die
sys.argv[0] = "train.py"
import runpy
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_a_kill_during_a_spike_window_and_a_straggler_streak_resumes_both_counts(tmp_path):
    from health.alerts import read_alerts

    def launch(poisoned: set[int], kill_at: int):
        script = tmp_path / f"inject-{kill_at}.py"
        script.write_text(KILL_AND_RESUME.replace("POISONED", repr(poisoned)).replace("KILL_AT", str(kill_at))
                          .replace("REPO_DIR", str(REPO)))
        cmd = train_command("tiny.toml", *short(tmp_path, 8, "checkpoint.interval=2", "checkpoint.keep_last=10",
                                                "training.spike_rollbacks=2", "launch.straggler_windows=4",
                                                "eval.at_end=false"), nproc=2)
        cmd[cmd.index(str(REPO / "train.py"))] = str(script)
        return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)

    # One micro batch a rank a step (global batch 8, micro batch 4, 2 ranks): call n is step n of a process.
    first = launch({3}, kill_at=4)  # a spike at step 3; rank 1 slow at steps 1-3; killed after step 4's save
    run = tmp_path / "run"
    assert first.returncode != 0 and rundir_steps(run) == [2, 4], first.stderr[-3000:]
    assert not (run / "rollbacks.jsonl").exists() and read_alerts(run) == []
    second = launch({2}, kill_at=-1)  # resumed at step 5: a spike at step 6 (its second call)
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout + second.stderr
    assert "ROLLBACK at step 6: 2 spikes within 100 steps (at steps 3, 6); back to the checkpoint of step 2" in out
    (alert, *_) = read_alerts(run)
    assert (alert["kind"], alert["rank"], alert["step"]) == ("straggler", 1, 5)  # streak 3 before the kill, 4 at 5


def rundir_steps(run) -> list[int]:
    from rundir import complete_steps

    return complete_steps(run)
