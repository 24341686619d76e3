"""train.py end to end on CPU: recipes, runs, resume, phases, schedule, skipped steps, logs."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

import rundir
from rundir import REPO
from tests.conftest import assert_overfits, env, losses, metrics, poisoned_command, short, train
from tests.eval.conftest import write_tasks, write_toy_core_bundle
from tests.train.conftest import wandb_history


# ---- bad input never starts a run ---------------------------------------------------


def write_recipe(tmp_path, text_edit=None, name="bad.toml"):
    text = (REPO / "recipes" / "tiny.toml").read_text()
    if text_edit:
        text = text.replace(*text_edit)
    path = tmp_path / name
    path.write_text(text.replace('name = "tiny"', 'name = "bad"'))
    return str(path)


def problems(recipe: str, out, world_size: int = 1) -> str:
    """What train.py prints before it exits 2 (it runs exactly these checks, before writing
    anything: its exit code and the nothing-written rule are tests/train/test_validation.py's)."""
    from train import recipe as R
    from train.build import preflight

    try:
        return "\n".join(preflight(R.load(recipe, [f"run.output_dir={out}"]), world_size).problems)
    except R.RecipeError as e:
        return str(e)


@pytest.mark.parametrize("edit, world_size, message", [
    (("lr = 3e-3", "lrr = 3e-3"), 1, r"[optimizer] has unknown key 'lrr'; did you mean 'lr'?"),
    (("seq_len = 128", "seq_len = 12.5"), 1, "[training] seq_len: expected int, got 12.5"),
    (("lr = 3e-3", "lr = -3e-3"), 1, "[optimizer] lr: must be > 0"),
    (None, 3, "global_batch (16) is not divisible by micro_batch (8) x data-parallel size (3)"),
    (("assets/sample_data/code", "assets/sample_data/nope"), 1, "assets/sample_data/nope"),
    (("flavor = \"tiny\"", "flavor = \"tiny\"\nwindow_sise = 3"), 1, "did you mean 'window_size'"),
])
def test_bad_recipe_fails_with_clear_error_and_starts_nothing(tmp_path, edit, world_size, message):
    path = write_recipe(tmp_path, edit)
    assert message in problems(path, tmp_path / "run", world_size)
    assert not (tmp_path / "run").exists()


def test_missing_recipe_file(tmp_path):
    assert f"{tmp_path / 'nope.toml'}: recipe file not found" in problems(str(tmp_path / "nope.toml"), tmp_path)


def test_missing_shard_names_the_file(tmp_path):
    data = tmp_path / "code"
    data.mkdir()
    for f in glob.glob(str(REPO / "assets/sample_data/code/*")):
        if os.path.isdir(f):  # its held-out set (data.held_out)
            shutil.copytree(f, data / os.path.basename(f), copy_function=os.link)
        else:
            os.link(f, data / os.path.basename(f))
    (data / "00001_unshuffled.ds").unlink()
    path = write_recipe(tmp_path, ("assets/sample_data/code", str(data)))
    assert "00001_unshuffled.ds" in problems(path, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_dry_run_prints_the_2b_plan_and_what_a_launch_here_lacks():
    from data.tokenizer import LLAMA2_TOKENIZER

    environment = {k: v for k, v in env().items() if k != "LANEFORMER_DATA_ROOT"}
    result = subprocess.run([sys.executable, "train.py", "--recipe", "phase1.toml", "--dry-run"],
                            cwd=REPO, env=environment, capture_output=True, text=True, timeout=120)
    # The Nemotron shards are not on this machine: a launch would refuse, naming each.
    assert result.returncode == 2, result.stderr
    if not LLAMA2_TOKENIZER.is_file():
        assert "[data] tokenizer: " in result.stderr and "python -m data.tokenizer fetch" in result.stderr
    assert "[data.sources[0]] path: /data/laneformer/tokenized/nemotron-cc-v2/high-quality not found" in result.stderr
    assert "parameters: 2,320,069,632" in result.stdout
    assert "steps: 635,783" in result.stdout
    assert "FLOPs per token: 14,840,543,232" in result.stdout
    assert "expected wall time" in result.stdout
    assert "data plan: every expected size covers its needs" in result.stdout
    # every source's held-out set, sized from the recipe's numbers as the file spells them (no data here)
    import tomllib

    raw = tomllib.loads((REPO / "recipes" / "phase1.toml").read_text())
    for s in raw["data"]["sources"]:
        held = round(raw["data"]["held_out"] * s["expected_tokens"])
        assert (f"  {s['name']}: expected ~{held:,} tokens (of expected_tokens {s['expected_tokens']:,}); "
                f"held_out {raw['data']['held_out']!r}, not split yet: /data/laneformer/{s['path']}/held_out") in result.stdout


# ---- one short run: schedule, logs --------------------------------------------------


def wsd_lr(step, *, lr, warmup, total, decay_fraction, shape, min_ratio):
    """WSD written from its definition: linear warmup ending at lr on step `warmup`,
    flat, then a decay from lr to lr * min_ratio over round(decay_fraction * total)
    steps that end one step after the run (so the last step's lr is not the minimum)."""
    decay = round(decay_fraction * total)
    if step <= warmup:
        return lr * step / warmup
    if step <= total + 1 - decay:
        return lr
    progress = (step - (total + 1 - decay)) / decay
    drop = {"linear": progress, "sqrt": math.sqrt(progress),
            "cosine": 0.5 * (1 - math.cos(math.pi * progress))}[shape]
    return lr * (min_ratio + (1 - min_ratio) * (1 - drop))


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("short")
    # the CORE format with toy items, four task files left out: a partial CORE of 18 tasks
    core = write_toy_core_bundle(tmp / "core", skip=("hellaswag_zeroshot", "hellaswag", "squad", "coqa"))
    # lm-eval tasks whose data file goes missing after the launch's checks: each in-loop eval fails
    tasks = write_tasks(tmp)
    (tmp / "mc.jsonl").unlink()
    result = train("tiny.toml", *short(tmp, 20, "schedule.warmup_steps=5", "schedule.decay_fraction=0.4",
                                       "schedule.min_lr_ratio=0.1", "logging.wandb_mode=offline",
                                       "eval.every=10", f"eval.core_bundle={core}", "eval.core_max_per_task=1",
                                       f"eval.lm_eval_tasks={tasks}"))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run"


def test_lr_follows_the_wsd_formula(short_run):
    rows = metrics(short_run)
    for step in range(1, 21):
        expected = wsd_lr(step, lr=3e-3, warmup=5, total=20, decay_fraction=0.4, shape="sqrt", min_ratio=0.1)
        assert rows[step]["lr/AdamW/1"] == pytest.approx(expected, rel=1e-9), step


def test_run_dir_holds_recipe_snapshot_and_logs(short_run):
    assert (short_run / "recipe.toml").exists() and (short_run / "laneformer_config.json").exists()
    launch = short_run / "launches" / "001"
    assert (launch / "git-commit").read_text().strip()
    assert (launch / "code" / "models" / "laneformer" / "model.py").exists()
    assert "torch==2.14.1" in (launch / "packages.txt").read_text()
    assert sorted(p.name for p in (short_run / "checkpoints").iterdir())[-1] == "step-20"


def test_tensorboard_and_wandb_offline_hold_the_logged_losses(short_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = losses(short_run)
    events = glob.glob(str(short_run / "tensorboard" / "*" / "events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(events[0])
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("loss_metrics/global_avg_loss")}
    assert tb.keys() == logged.keys()
    assert all(tb[s] == pytest.approx(logged[s], rel=1e-6) for s in tb)
    runs = glob.glob(str(short_run / "tensorboard" / "*" / "wandb" / "offline-run-*"))
    assert runs, "no offline wandb run to `wandb sync`"
    history = wandb_history(glob.glob(os.path.join(runs[0], "run-*.wandb"))[0])
    wb = {s: r["loss_metrics/global_avg_loss"] for s, r in history.items() if "loss_metrics/global_avg_loss" in r}
    assert wb == pytest.approx(logged, rel=1e-6)


# ---- a NaN mid-run is skipped, not fatal ----------------------------------------------

def test_nan_batch_is_skipped_and_the_run_finishes(tmp_path):
    cmd = poisoned_command(tmp_path, "tiny.toml", *short(tmp_path, 10), calls={13})  # step 7, micro-batch 1 of 2
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 7: skipped (non-finite loss (nan))" in result.stdout + result.stderr
    rows = metrics(tmp_path / "run")
    assert rows[7]["skipped_steps"] == 1
    assert all(math.isfinite(rows[s]["loss_metrics/global_avg_loss"]) for s in (6, 8, 9, 10))
    from models.laneformer import read_native_config
    from models.laneformer.hf.checkpoint_io import load_dcp

    config = read_native_config(tmp_path / "run" / "laneformer_config.json")
    state = load_dcp(tmp_path / "run" / "checkpoints" / "step-10", config)
    assert all(bool(v.isfinite().all()) for v in state.values())


# ---- phase 1 then phase 2 ----------------------------------------------------------------


def test_phase2_starts_from_phase1_weights(short_run, tmp_path):
    p1 = short_run  # 20 steps of tiny
    result = train("tiny-phase2.toml", f"run.output_dir={tmp_path / 'p2'}", "training.steps=3",
                   "logging.interval=1", "schedule.warmup_steps=1", f"checkpoint.init_from={p1}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Loading the checkpoint from " + str(p1 / "checkpoints" / "step-20") in result.stdout
    first = losses(tmp_path / "p2")[1]
    assert first < losses(p1)[1] - 1.0  # phase 1 started from a fresh model (~ln 4096)
    assert min(losses(tmp_path / "p2")) == 1  # a fresh step counter

    # the report draws each held-out set's validation across phase 1 into phase 2 on one token axis
    from train.metric_names import VAL_LOSS, per_set
    from report import write_report
    from report.page import embedded_data

    drawn = embedded_data(write_report([p1, tmp_path / "p2"], tmp_path / "report").read_text())["validation_sets"]
    end_of_phase1 = 20 * 8 * 64  # short(): 20 steps of 8 x 64 tokens
    for name in ("prose", "code"):
        one, two = drawn[f"tiny: {per_set(VAL_LOSS, name)}"], drawn[f"tiny-phase2: {per_set(VAL_LOSS, name)}"]
        assert (one["steps"], one["tokens"]) == ([10, 20], [10 * 8 * 64, end_of_phase1])
        assert (two["steps"], two["tokens"]) == ([3], [end_of_phase1 + 3 * 16 * 128])  # tiny-phase2.toml's batch
        for run, line in ((p1, one), (tmp_path / "p2", two)):
            logged = [json.loads(rundir.eval_file(run, s).read_text())["metrics"][per_set(VAL_LOSS, name)]
                      for s in line["steps"]]
            assert line["values"] == logged


# ---- the model learns: a repeated batch is memorized -----------------------------------


def test_tiny_overfits_a_repeated_batch_with_full_activation_checkpointing(tmp_path):
    """One process; compiled FSDP on two ranks with selective checkpointing:
    tests/e2e/test_train_runs.py (every other run here has none)."""
    assert_overfits(tmp_path, 1, False, "full")


def test_evals_run_in_the_loop_and_a_failing_one_does_not_stop_training(short_run):
    for step in (10, 20):
        report = json.loads((short_run / "evals" / f"step-{step}.json").read_text())
        m = report["metrics"]
        assert 0 < m["eval/val_loss"] < 10 and 0 < m["eval/val_bpb"] < 10
        assert "core/partial_CORE_v2" in m and m["core/n_tasks"] == 18
        assert m["eval/wall_time_s"] > 0
        assert len(report["errors"]) == 1 and "mc.jsonl" in report["errors"][0], report["errors"]
    assert metrics(short_run)[20]["eval/val_loss"] == json.loads(
        (short_run / "evals" / "step-20.json").read_text())["metrics"]["eval/val_loss"]


def test_realized_source_shares_match_the_weights(short_run):
    """Tolerance: the mixture's schedule is exact per 65,536-sample block, so over n samples
    each source's share is within one sample (1/n) of its weight (plus 1/65,536)."""
    rows = metrics(short_run)
    consumed = {k.removeprefix("data/tokens/"): v for k, v in rows[20].items() if k.startswith("data/tokens/")}
    n_samples = 20 * 8
    assert sum(consumed.values()) == n_samples * 64
    for name, weight in (("prose", 0.5), ("code", 0.5)):
        assert abs(consumed[name] / sum(consumed.values()) - weight) <= 1 / n_samples + 1 / 65536
    result = subprocess.run([sys.executable, "train.py", "--recipe", "tiny.toml", "--dry-run", "--run", str(short_run)],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "realized mix at step 20" in result.stdout and "prose: 5,120 tokens, share 0.5000" in result.stdout


def test_end_of_run_export_loads_in_transformers_with_the_same_logits(tmp_path):
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from models.laneformer import read_native_config
    from models.laneformer.attention import DenseMaskFlexAttention
    from models.laneformer.hf.checkpoint_io import load_dcp

    result = train("tiny.toml", *short(tmp_path, 3, "checkpoint.export_hf=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    hf = AutoModelForCausalLM.from_pretrained(run / "hf", trust_remote_code=True, dtype=torch.float32)
    card = (run / "hf" / "README.md").read_text()
    assert "recipe: tiny.toml" in card and "tokens seen: 1,536" in card  # 3 steps x 8 x 64
    config = read_native_config(run / "laneformer_config.json")

    model = dataclasses.replace(config, inner_attention=DenseMaskFlexAttention.Config()).build()
    model.load_state_dict(load_dcp(run / "checkpoints" / "step-3", config))
    tokens = torch.randint(0, config.vocab_size, (1, 40))
    with torch.no_grad():
        expected = model(tokens)
        got = hf(tokens).logits
    assert (got - expected).abs().max() < 0.05  # the export is bf16, as released checkpoints are
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
