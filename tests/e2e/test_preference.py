"""A preference run end to end on CPU (train.preference): step 1's loss is ln 2 with zero rewards (the
policy is the reference); the cached reference log-probs equal a fresh forward of the init checkpoint on
every pair; kill -9 and resume replays the same steps to the last digit and reuses the cache, saying so;
a changed beta reuses it, a changed loss type computes another; 4 gloo ranks in HSDP (2 x 2) train as
one process does, their merged reference pass included."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch

import rundir
from models.laneformer.hf.export import export_hf
from data.tokenizer import TINY_TOKENIZER
from rundir import REPO
from tests.conftest import env, kill_tree, tiny_random_model, train, train_command
from tests.train.pair_sources import write_pair_source
from train.preference import reference
from train.preference.metrics import EVAL_ACCURACY, EVAL_LOSS, STEP_METRICS
from train.preference.pairs import PairSet

pytestmark = pytest.mark.slow

STEPS = 6
REUSED, COMPUTED = "pairs: reusing", "pairs: computing"  # what the trainer logs of each cache


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    model = tiny_random_model(seed=4)
    export_hf(model.state_dict(), model.config, root / "base", tokenizer_dir=TINY_TOKENIZER.parent)
    return {"model": model, "base": root / "base", "train": write_pair_source(root / "train", 16, seed=0),
            "heldout": write_pair_source(root / "heldout", 6, seed=1, shards=1)}


def sets(inputs, run, *extra):
    # 4 pairs a step: 1 pair a micro batch, on 1 rank 4 accumulated, on 4 ranks one each
    return (f"run.output_dir={run}", f'data.sources=[{{name = "pairs", path = "{inputs["train"]}", pairs = true, '
            'weight = 1.0, max_epochs = 100}]', f'preference.heldout=["{inputs["heldout"]}"]', f"checkpoint.init_from={inputs['base']}",
            f"training.steps={STEPS}", "training.seq_len=64", "training.global_batch=8", "training.micro_batch=2",
            "schedule.warmup_steps=1", "schedule.decay_fraction=0.5", "logging.interval=1", "checkpoint.interval=3",
            "checkpoint.keep_last=10", "eval.every=3", "run.deterministic=true", "logging.tensorboard=false", *extra)


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / rundir.METRICS_FILE).read_text().splitlines()]


def pref(run) -> dict[int, dict]:
    """step -> the last logged preference metrics of the step."""
    out = {}
    for r in rows(run):
        if any(k in r for k in (*STEP_METRICS, EVAL_LOSS)):
            out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step"})
    return out


def caches(run) -> dict[str, np.ndarray]:
    return {p.name.split("-")[0]: np.load(p) for p in (run / rundir.REFERENCE_LOGPS_DIR).glob("*.npy")}


def test_one_rank_ln2_cache_kill_and_resume_beta_and_loss_type(inputs, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(train_command("tiny-dpo.toml", *sets(inputs, run), nproc=1), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    end = time.monotonic() + 600
    while not (run / rundir.METRICS_FILE).is_file() or 5 not in pref(run):  # step 5 logged: after step 3's save
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step 5"
        assert time.monotonic() < end, "timed out waiting for step 5"
        time.sleep(0.05)
    kill_tree(proc.pid)
    proc.wait()
    before = pref(run)
    assert (run / rundir.CHECKPOINTS_DIR / "step-3" / ".metadata").is_file()

    # Step 1: the policy is the reference, so the loss is ln 2 and every reward 0 (fp32 on CPU).
    first = before[1]
    assert abs(first["pref/loss"] - math.log(2)) < 1e-6
    assert first["pref/rewards_chosen"] == first["pref/rewards_rejected"] == first["pref/rewards_margin"] == 0.0
    assert first["pref/logps_chosen"] < 0 and first["pref/logps_rejected"] < 0
    loss_line = next(r for r in rows(run) if r["step"] == 1 and "loss_metrics/global_avg_loss" in r)
    assert loss_line["loss_metrics/global_avg_loss"] == first["pref/loss"]  # torchtitan's loss is the pair loss

    # The cache equals a fresh forward of the init checkpoint on every pair (train and held-out).
    cached = caches(run)
    for role, path in (("train", inputs["train"]), ("heldout", inputs["heldout"])):
        fresh = reference.pair_logps(inputs["model"], PairSet([path], 64), 1, False, torch.device("cpu"))
        np.testing.assert_allclose(cached[role], fresh, rtol=1e-5)

    # kill -9 after step 5, resume from step 3: steps 4 and 5 again, to the last digit; the cache reused.
    result = train("tiny-dpo.toml", *sets(inputs, run))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "Training starts at step 4" in out
    assert out.count(REUSED) == 2 and COMPUTED not in out  # train and held-out: not recomputed
    after = pref(run)
    for step in (4, 5):
        assert {k: v for k, v in after[step].items() if k in STEP_METRICS} == \
               {k: v for k, v in before[step].items() if k in STEP_METRICS}, step
    assert after[STEPS][EVAL_ACCURACY] >= 0 and after[3][EVAL_LOSS] > 0

    # beta is not in the cache's key: a longer run with another beta reuses the files.
    result = train("tiny-dpo.toml", *sets(inputs, run, f"training.steps={STEPS + 1}", "preference.beta=0.5"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count(REUSED) == 2 and len(caches(run)) == 2

    # Another loss type (mean log-probs): another key, computed before step 1 of a run with the files beside it.
    other = tmp_path / "other"
    shutil.copytree(run / rundir.REFERENCE_LOGPS_DIR, other / rundir.REFERENCE_LOGPS_DIR)
    result = train("tiny-dpo.toml", *sets(inputs, other, 'preference.loss="dpo_norm"', "training.steps=1",
                                          "eval.at_end=false"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count(COMPUTED) == 2  # train and held-out
    assert len(list((other / rundir.REFERENCE_LOGPS_DIR).glob("train-*.npy"))) == 2
    assert abs(pref(other)[1]["pref/loss"] - math.log(2)) < 1e-6

    # 4 gloo ranks, HSDP 2 replicas x 2 shards: the same pairs each step, merged reference pass included.
    four = tmp_path / "four"
    result = train("tiny-dpo.toml", *sets(inputs, four, "parallel.replicate=2", "parallel.shard=2"), nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dp_replicate=2, dp_shard=2" in result.stdout + result.stderr
    for role, logps in caches(four).items():
        np.testing.assert_allclose(logps, cached[role], rtol=1e-5)
    got = pref(four)
    assert abs(got[1]["pref/loss"] - math.log(2)) < 1e-6 and got[1]["pref/rewards_margin"] == 0.0
    for step in range(1, STEPS + 1):
        for key in (*STEP_METRICS, EVAL_LOSS, EVAL_ACCURACY):
            if key in after[step]:
                assert got[step][key] == pytest.approx(after[step][key], rel=1e-4, abs=1e-6), (step, key)
