"""An RL run end to end on CPU (train.objectives.rl, recipes/tiny-rl.toml) on 1 rank, from a random tiny model a
test makes (the tiny SFT chain is minutes): the metrics under TRL's names and the held-out pass@1 at step 0 and
at each eval land in metrics.jsonl; kill -9 after a checkpoint and resume replays the same steps bit for bit
(the same completions: each sample's generator is seeded by the run's seed, the step, the task and its index).
The reward is a ``module:function`` one (tests/train/rl_rewards.py) a random model varies on, and truncated
completions are scored (a random model never stops), so that there is a gradient."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import rundir
from data.tokenizer import TINY_TOKENIZER
from models.laneformer.hf.export import export_hf
from rundir import REPO
from tests.conftest import env, kill_tree, metrics, tiny_random_model, train, train_command

pytestmark = pytest.mark.slow

STEPS = 4
TRL_NAMES = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/max_length",
             "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy")
TIMED = ("time", "tps", "tflops", "memory", "sampling_s", "tokens_per_s", "progress", "launch")


def sets(init, run):
    return (f"run.output_dir={run}", f"checkpoint.init_from={init}", f"training.steps={STEPS}",
            "checkpoint.interval=2", "eval.every=2", "run.deterministic=true", "rl.max_new_tokens=12",
            'rl.reward="tests.train.rl_rewards:digits"', 'rl.truncated="score"')


def untimed(rows: dict[int, dict]) -> dict[int, dict]:
    return {s: {k: v for k, v in r.items() if not any(t in k for t in TIMED)} for s, r in rows.items()}


def test_tiny_rl_logs_trl_metrics_and_pass_at_1_and_resumes_bit_equal(tmp_path):
    model = tiny_random_model(seed=5)
    export_hf(model.state_dict(), model.config, tmp_path / "init", tokenizer_dir=TINY_TOKENIZER.parent)
    done = train("tiny-rl", *sets(tmp_path / "init", tmp_path / "ref"))
    assert done.returncode == 0, done.stderr[-3000:]
    ref = metrics(tmp_path / "ref")
    assert ref[0]["eval/rl_pass@1"] == 0.0  # step 0's baseline; a random model passes nothing
    assert all("eval/rl_pass@1" in ref[s] for s in (2, 4))
    for step in range(1, STEPS + 1):
        assert all(name in ref[step] for name in TRL_NAMES), ref[step]
        assert ref[step]["rl/reward_failures"] == 0
        assert (ref[step]["grad_norm"] > 0) == (ref[step]["frac_reward_zero_std"] < 1)  # no varied group: no gradient
    assert 0 < ref[1]["reward"] < 1 and ref[1]["frac_reward_zero_std"] < 1

    run = tmp_path / "run"
    cmd = train_command("tiny-rl", *sets(tmp_path / "init", run))
    cmd = [sys.executable, *cmd[cmd.index(str(REPO / "train.py")):]]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    end = time.monotonic() + 300
    while not (run / rundir.METRICS_FILE).is_file() or 3 not in metrics(run):  # after step 2's save
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step 3"
        assert time.monotonic() < end, "timed out waiting for step 3"
        time.sleep(0.05)
    kill_tree(proc.pid)
    proc.wait()
    resumed = train("tiny-rl", *sets(tmp_path / "init", run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert untimed(metrics(run)) == untimed(ref)
