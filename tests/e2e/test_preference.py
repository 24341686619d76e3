"""Preference runs end to end on CPU (train.preference).

On 1 rank (``dpo``): step 1's loss is ln 2 with zero rewards (the policy is the reference); the cached
reference log-probs equal a fresh forward of the init checkpoint on every pair; the held-out pairs
score ln 2 at step 0 and are learned by the end (accuracy over 0.5, loss under ln 2: scored against
the trained policy instead of the cached reference, trl#1148, they would stay at ln 2); kill -9 and
resume replays the same steps to the last digit and reuses the cache, saying so, even with
``init_from`` now naming other contents (a resumed run keys by the init it recorded at step 0); a
changed beta reuses it.

For every loss type (issue 43's table of what a recipe combines with a loss type: its rows held-out
evaluation, resume on another world size, and weights, whose refusals are tests/train/test_preference.py's):
a run on several ranks (``dpo``: 4 in HSDP 2 x 2) over two pair sources of equal weight logs the held-out
metrics at step 0, at the eval's steps and at the end, learns them, has a global step-1 loss (ln 2
where there is a reference: a loss normalised per rank would be the ranks' count times it), and
resumes on 1 rank at the next pair with the numbers the ranks had.
"""

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
from train.preference.loss import LOSSES, NEEDS_REFERENCE, PreferenceLoss
from train.preference.metrics import EVAL_ACCURACY, EVAL_LOSS, STEP_METRICS
from data.pairs_loader import PairSet

pytestmark = pytest.mark.slow

STEPS = 6
LN2 = math.log(2)
GLOBAL_LOSS = "loss_metrics/global_avg_loss"  # torchtitan's logged loss: the sum over ranks of what each returns
REUSED, COMPUTED = "pairs: reusing", "pairs: computing"  # what the trainer logs of each cache


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    model = tiny_random_model(seed=4)
    export_hf(model.state_dict(), model.config, root / "base", tokenizer_dir=TINY_TOKENIZER.parent)
    return {"model": model, "base": root / "base", "train": write_pair_source(root / "train", 16, seed=0),
            "more": write_pair_source(root / "more", 8, seed=2, shards=1),
            "held_out": write_pair_source(root / "held_out", 6, seed=1, shards=1)}


def sets(inputs, run, *extra, sources=("train",)):
    # 4 pairs a step: 1 pair a micro batch, on 1 rank 4 accumulated, on 4 ranks one each; the held-out
    # pairs are learned within the 6 steps at twice tiny-dpo's lr
    pairs = ", ".join(f'{{name = "{s}", path = "{inputs[s]}", pairs = true, weight = 1.0, max_epochs = 100}}'
                      for s in sources)
    return (f"run.output_dir={run}", f"data.sources=[{pairs}]", f'preference.held_out=["{inputs["held_out"]}"]',
            f"checkpoint.init_from={inputs['base']}", f"training.steps={STEPS}", "training.seq_len=64",
            "training.global_batch=8", "training.micro_batch=2", "optimizer.lr=1e-3", "schedule.warmup_steps=1",
            "schedule.decay_fraction=0.5", "logging.interval=1", "checkpoint.interval=3", "checkpoint.keep_last=10",
            "eval.every=3", "run.deterministic=true", "logging.tensorboard=false", *extra)


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / rundir.METRICS_FILE).read_text().splitlines()]


def pref(run) -> dict[int, dict]:
    """step -> the last logged preference metrics of the step (torchtitan's loss with them)."""
    out = {}
    for r in rows(run):
        if any(k in r for k in (*STEP_METRICS, EVAL_LOSS)):
            out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step"})
        elif GLOBAL_LOSS in r:
            out.setdefault(r["step"], {})[GLOBAL_LOSS] = r[GLOBAL_LOSS]
    return out


def caches(run) -> dict[str, np.ndarray]:
    return {role: np.load(p) for role in ("train", "held_out")
            for p in (run / rundir.REFERENCE_LOGPS_DIR).glob(rundir.REFERENCE_LOGPS_FILE.format(role=role, key="*"))}


def evaluated(got: dict[int, dict]) -> list[int]:
    """The steps with held-out metrics: 0 (the baseline), the eval's and the last."""
    return [s for s in sorted(got) if EVAL_LOSS in got[s] and EVAL_ACCURACY in got[s]]


def learned(got: dict[int, dict], baseline: float) -> None:
    """The held-out pairs are learned by the end: most won, the loss under its baseline and ln 2."""
    assert got[STEPS][EVAL_ACCURACY] > 0.5 and got[STEPS][EVAL_LOSS] < min(baseline, LN2), got[STEPS]


def test_one_rank_ln2_held_out_cache_kill_and_resume_beta(inputs, tmp_path):
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
    assert abs(first["pref/loss"] - LN2) < 1e-6 and first[GLOBAL_LOSS] == first["pref/loss"]
    assert first["pref/rewards_chosen"] == first["pref/rewards_rejected"] == first["pref/rewards_margin"] == 0.0
    assert first["pref/logps_chosen"] < 0 and first["pref/logps_rejected"] < 0
    # Step 0, the held-out baseline: the same (no pair won: ties).
    assert evaluated(before) == [0, 3]
    assert abs(before[0][EVAL_LOSS] - LN2) < 1e-6 and before[0][EVAL_ACCURACY] == 0.0

    # The cache equals a fresh forward of the init checkpoint on every pair (train and held-out).
    cached = caches(run)
    for role, path in (("train", inputs["train"]), ("held_out", inputs["held_out"])):
        fresh = reference.pair_logps(inputs["model"], PairSet([path], 64), 1, False, torch.device("cpu"))
        np.testing.assert_allclose(cached[role], fresh, rtol=1e-5)

    # kill -9 after step 5, resume from step 3 with init_from naming other contents (an SFT run dir that
    # gained a step): steps 4 and 5 again, to the last digit; the cache reused, keyed by the recorded init.
    newer = shutil.copytree(inputs["base"], tmp_path / "newer")
    (newer / "trained-on.txt").write_text("a step more")
    result = train("tiny-dpo.toml", *sets(inputs, run, f"checkpoint.init_from={newer}"))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "Training starts at step 4" in out
    assert out.count(REUSED) == 2 and COMPUTED not in out  # train and held-out: not recomputed
    after = pref(run)
    for step in (4, 5):
        assert {k: v for k, v in after[step].items() if k in STEP_METRICS} == \
               {k: v for k, v in before[step].items() if k in STEP_METRICS}, step
    assert evaluated(after) == [0, 3, STEPS]
    learned(after, LN2)

    # beta is not in the cache's key: a longer run with another beta reuses the files.
    result = train("tiny-dpo.toml", *sets(inputs, run, f"training.steps={STEPS + 1}", "preference.beta=0.5"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count(REUSED) == 2 and len(caches(run)) == 2


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_type_evaluates_held_out_pairs_and_resumes_on_another_world_size(inputs, tmp_path, loss):
    ranks, layout = (4, ("parallel.replicate=2", "parallel.shard=2")) if loss == "dpo" else (2, ())
    beta = 2.0 if loss == "simpo" else 0.1  # SimPO's scale (its paper tunes beta in 2-10); gamma 0.3 x beta
    run = tmp_path / "run"
    given = (f'preference.loss="{loss}"', f"preference.beta={beta}")
    result = train("tiny-dpo.toml", *sets(inputs, run, *given, *layout, sources=("train", "more")), nproc=ranks)
    assert result.returncode == 0, result.stderr[-3000:]
    ran = pref(run)
    assert evaluated(ran) == [0, 3, STEPS]

    # Step 1's loss is global: torchtitan sums the ranks' returns, so each is its share of the step's pairs.
    assert ran[1][GLOBAL_LOSS] == pytest.approx(ran[1]["pref/loss"], rel=1e-6)
    if NEEDS_REFERENCE[loss]:
        assert abs(ran[1][GLOBAL_LOSS] - LN2) < 1e-6 and abs(ran[0][EVAL_LOSS] - LN2) < 1e-6
        assert ran[1]["pref/rewards_margin"] == 0.0 and ran[0][EVAL_ACCURACY] == 0.0
        # the ranks hashed their shares of the init checkpoint: the digest one process makes
        record = json.loads(reference.inputs_file(run).read_text())
        assert record["init"]["digest"] == reference.checkpoint_identity(inputs["base"])["digest"]
        baseline = LN2
    else:  # no reference: SimPO's baseline is the init's own held-out margin, less gamma
        simpo = PreferenceLoss(loss, beta, label_smoothing=0.0, gamma=0.3 * beta)
        logps = torch.from_numpy(reference.pair_logps(inputs["model"], PairSet([inputs["held_out"]], 64), 1,
                                                      simpo.average, torch.device("cpu"))).double()
        baseline = float(simpo(logps[:, 0], logps[:, 1])[0].mean())
        assert ran[0][EVAL_LOSS] == pytest.approx(baseline, rel=1e-5)
    learned(ran, baseline)

    # Resume on 1 rank from step 3 (the last checkpoint gone): step 4 reads the next pairs, and the steps
    # and the final eval come out as the ranks had them.
    shutil.rmtree(run / rundir.CHECKPOINTS_DIR / f"step-{STEPS}")
    result = train("tiny-dpo.toml", *sets(inputs, run, *given, sources=("train", "more")))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "Training starts at step 4" in out and COMPUTED not in out
    assert out.count(REUSED) == (2 if NEEDS_REFERENCE[loss] else 0)
    resumed = pref(run)
    for step in range(4, STEPS + 1):
        for key in (*STEP_METRICS, GLOBAL_LOSS, EVAL_LOSS, EVAL_ACCURACY):
            if key in ran[step]:
                assert resumed[step][key] == pytest.approx(ran[step][key], rel=1e-4, abs=1e-6), (step, key)
