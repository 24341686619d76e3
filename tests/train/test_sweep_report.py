"""The sweep comparison and the scaling fit on run dirs written by hand (no training): the token count
compared and each run's value there against numbers worked out by hand (runs of different batch,
length and seed count, one seed, no validation), the verdicts against Welch's statistics by hand, the
fit against the law that made the losses (its error bars against a Monte-Carlo of that law), and a
preference sweep (tiny-dpo.toml's variants) compared on held-out accuracy, never on its losses."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from launch.sweep.runs import runs_of, write_record
from launch.sweep.spec import read_sweep, variants
from models.laneformer import laneformer_configs, native_fields
from rundir import COMPARISON_FILE, METRICS_FILE, MODEL_CONFIG_FILE, RECIPE_FILE, REPO, SUMMARY_FILE, SWEEP_FILE
from train import recipe as R
from train.preference.loss import LOSSES
from train.preference.metrics import EVAL_ACCURACY, EVAL_LOSS
from report.__main__ import main as report_main
from report.comparable import TRAIN
from report.runs import ReportError, read_run
from report.scaling import fit_power_law, flops_per_token, recipe_flops
from report.comparable import METRICS
from report.sweep import SweepRun, compared_tokens, summarize, write_sweep_report

SEQ, BATCH, STEPS = 64, 8, 10
TINY = laneformer_configs["tiny"]()
VAL = METRICS["eval/val_loss"]


def val_at(val: float, step: int) -> float:
    """The validation loss a fake run logs at ``step``: ``val`` at step 10, 0.1 more per step before."""
    return val + 0.1 * (STEPS - step)


def train_at(train: float, step: int) -> float:
    return train + 1 / step


def fake_run(folder: Path, config, val: float, train: float, batch: int = BATCH, steps: int = STEPS,
             evals: tuple[int, ...] = (5, STEPS)) -> None:
    """A run dir as train.py leaves it, as far as the report reads: recipe, model config, metrics
    (training loss every step, validation at ``evals``)."""
    folder.mkdir(parents=True)
    (folder / RECIPE_FILE).write_text(f"# resolved from test\n[run]\nname = \"{folder.name}\"\n"
                                      f"[training]\nglobal_batch = {batch}\nseq_len = {SEQ}\nsteps = {STEPS}\n"
                                      "[data]\nsources = []\n")
    (folder / MODEL_CONFIG_FILE).write_text(json.dumps(native_fields(config)))
    rows = [{"step": s, "loss_metrics/global_avg_loss": train_at(train, s), "throughput(tps)": 1000.0 + s}
            for s in range(1, steps + 1)]
    rows += [{"step": s, "eval/val_loss": val_at(val, s), "eval/val_bpb": val_at(val, s) / math.log(2)}
             for s in evals if s <= steps]
    (folder / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))


def fake_sweep(root: Path, runs: dict[tuple[str, int], tuple | dict], baseline: str) -> Path:
    """``runs``: (variant, seed) -> (config, val), or fake_run's keyword arguments (train: val + 0.1)."""
    variants = list(dict.fromkeys(v for v, _ in runs))
    for (variant, seed), spec in runs.items():
        spec = spec if isinstance(spec, dict) else {"config": spec[0], "val": spec[1]}
        fake_run(root / f"{variant}-seed{seed}", **{"config": TINY, "train": spec["val"] + 0.1, **spec})
    (root / SWEEP_FILE).write_text(json.dumps({
        "name": root.name, "baseline": baseline, "variants": [{"name": v} for v in variants],
        "runs": [{"variant": v, "seed": s, "run_dir": f"{v}-seed{s}", "state": "done"} for v, s in runs]}))
    return root


TINY_DPO = REPO / "recipes" / "sweeps" / "tiny-dpo.toml"
# Held-out accuracy at step 10 per tiny-dpo variant: beta 5 helps dpo and dpo_norm and hurts simpo.
ACCURACY = {"loss=dpo,beta=0.1": 0.80, "beta=5.0": 0.85, "loss=dpo_norm": 0.70, "loss=dpo_norm,beta=5.0": 0.90,
            "loss=simpo": 0.75, "loss=simpo,beta=5.0": 0.60}


# Each loss type's values on a scale of its own, as in training: dpo_norm averages the log-probs dpo sums
# (~20 times smaller), simpo has no reference and a margin.
LOSS_SCALE = {"dpo": 1.0, "dpo_norm": 0.05, "simpo": 3.0}


def pref_train_loss(loss: str, beta: float, step: int) -> float:
    """A fake preference run's training loss: each loss type and beta on a scale of its own (its LOSS_SCALE
    x ln 2 at step 0, falling faster with beta; dpo_norm's and simpo's mean log-probs ~20 times flatter
    than dpo's sums)."""
    return LOSS_SCALE[loss] * math.log(2) * math.exp(-beta * step / (10 if loss == "dpo" else 200))


def pref_eval_loss(loss: str, accuracy: float) -> float:
    """A fake preference run's held-out loss: its LOSS_SCALE x ln 2 at accuracy 0.5 (ties), lower as it rises."""
    return LOSS_SCALE[loss] * math.log(2) * (1.5 - accuracy)


def write_pref_metrics(folder: Path, loss: str, beta: float, final: float | None) -> None:
    """metrics.jsonl of a fake preference run: the training loss every step and the held-out pairs'
    metrics at steps 0, 5 and 10: accuracy 0.5 (ties), halfway, then ``final``; none when ``final`` is
    None (as simpo logged none before it evaluated its held-out pairs)."""
    rows = [{"step": s, TRAIN: pref_train_loss(loss, beta, s)} for s in range(1, STEPS + 1)]
    if final is not None:
        rows += [{"step": s, EVAL_ACCURACY: acc, EVAL_LOSS: pref_eval_loss(loss, acc)}
                 for s, acc in ((0, 0.5), (5, (0.5 + final) / 2), (STEPS, final))]
    (folder / METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))


def fake_preference_sweep(root: Path, accuracy: dict[str, float], sweep_file: Path = TINY_DPO) -> Path:
    """A preference sweep's dir (tiny-dpo.toml's by default) as launch.sweep and its runs leave it, without
    training: the variants resolved and sweep.json written by launch.sweep's own code, each run's
    recipe.toml its variant's resolved recipe, and its metrics (write_pref_metrics) reaching held-out
    accuracy ``accuracy[variant]`` + 0.01 x (seed - 1); a variant not in ``accuracy`` logs none."""
    sweep = read_sweep(sweep_file)
    found, _ = variants(sweep, 1, root)  # runs/tiny-sft is not here: every variant loads, none passes preflight
    runs = runs_of(found, sweep, root)
    write_record(root, sweep, found, runs, {r.dir: "done" for r in runs}, "local")
    for r in runs:
        pref, final = r.variant.recipe.preference, accuracy.get(r.variant.name)
        r.dir.mkdir()
        (r.dir / RECIPE_FILE).write_text(R.to_toml(r.variant.recipe))
        write_pref_metrics(r.dir, pref.loss, pref.beta, None if final is None else final + 0.01 * (r.seed - 1))
    return root


def report(root: Path, capsys) -> tuple[str, dict[str, dict], dict[str, dict]]:
    """(what it printed, summary.csv by variant, comparison.csv by run dir name)."""
    assert report_main([str(root)]) == 0
    printed = capsys.readouterr().out
    summary = {r["variant"]: r for r in csv.DictReader(open(root / SUMMARY_FILE))}
    rows = {Path(r["run_dir"]).name: r for r in csv.DictReader(open(root / COMPARISON_FILE))}
    return printed, summary, rows


def welch(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Welch's t and Welch-Satterthwaite degrees of freedom, by the textbook formulas."""
    vx, vy = np.var(xs, ddof=1) / len(xs), np.var(ys, ddof=1) / len(ys)
    return (np.mean(xs) - np.mean(ys)) / math.sqrt(vx + vy), (vx + vy) ** 2 / (vx ** 2 / (len(xs) - 1)
                                                                              + vy ** 2 / (len(ys) - 1))


def test_verdicts_follow_the_two_sample_statistics(tmp_path, capsys):
    root = fake_sweep(tmp_path / "s", {("base", 1): (TINY, 3.0), ("base", 2): (TINY, 3.2),
                                       ("close", 1): (TINY, 3.5), ("close", 2): (TINY, 3.7),
                                       ("far", 1): (TINY, 4.0), ("far", 2): (TINY, 4.1)}, "base")
    printed, summary, _ = report(root, capsys)
    assert f"validation loss at {STEPS * BATCH * SEQ:,} tokens" in printed
    # By hand: base std sqrt(0.02); close: delta 0.5, se = sqrt(0.02/2 + 0.02/2), 2 dof (equal spreads),
    # t = 3.54 < 4.303 (Student's 97.5% at 2 dof): noise. far: delta 0.95, se^2 = 0.02/2 + 0.005/2, t = 8.50.
    assert summary["base"]["verdict"] == "baseline"
    assert float(summary["base"]["std"]) == pytest.approx(math.sqrt(0.02))
    assert float(summary["close"]["sigmas"]) == pytest.approx(0.5 / math.sqrt(0.02))
    assert float(summary["close"]["dof"]) == pytest.approx(2.0)
    assert summary["close"]["verdict"] == "within seed noise"
    assert float(summary["far"]["delta_vs_baseline"]) == pytest.approx(0.95)
    assert float(summary["far"]["sigmas"]) == pytest.approx(0.95 / math.sqrt(0.0125))
    assert summary["far"]["verdict"] == "worse by 0.950 (8.5 sigma)"
    rows = list(csv.DictReader(open(root / COMPARISON_FILE)))
    assert [float(r["val_loss"]) for r in rows] == [3.0, 3.2, 3.5, 3.7, 4.0, 4.1]
    assert {r["at"] for r in rows} == {f"step {STEPS}"}
    assert {float(r["tokens_per_s"]) for r in rows} == {1000.0 + STEPS}
    assert (root / "report.html").is_file() and (root / "loss.png").is_file()
    assert "scaling fit" not in printed  # one model size: nothing to fit


def test_unequal_seed_counts_get_welchs_test_not_a_pooled_one(tmp_path, capsys):
    """4 tight baseline seeds against 2 scattered ones: pooling the spreads would call the difference
    real (t 5.4 at 4 dof against 2.78); Welch's t is 3.3 at ~1 dof, against ~12.6: seed noise."""
    base, wide, tight = [3.00, 3.01, 3.02, 3.03], [3.25, 3.45], [3.30, 3.31, 3.32]
    runs = {("base", i + 1): (TINY, v) for i, v in enumerate(base)}
    runs |= {("wide", i + 1): (TINY, v) for i, v in enumerate(wide)}
    runs |= {("tight", i + 1): (TINY, v) for i, v in enumerate(tight)}
    printed, summary, _ = report(fake_sweep(tmp_path / "s", runs, "base"), capsys)
    for name, xs in (("wide", wide), ("tight", tight)):
        t, dof = welch(xs, base)
        assert int(summary[name]["n"]) == len(xs)
        assert float(summary[name]["sigmas"]) == pytest.approx(t)
        assert float(summary[name]["dof"]) == pytest.approx(dof)
    assert float(summary["wide"]["dof"]) == pytest.approx(1.0, abs=0.02)
    assert summary["wide"]["verdict"] == "within seed noise"
    pooled = (0.335 / math.sqrt((np.var(wide, ddof=1) + 3 * np.var(base, ddof=1)) / 4 * (1 / 2 + 1 / 4)))
    assert pooled == pytest.approx(5.40, abs=0.01)  # what a pooled test would have called 5.4 sigma
    assert summary["tight"]["verdict"] == f"worse by 0.295 ({welch(tight, base)[0]:.1f} sigma)"
    assert "wide " in printed and "within seed noise" in printed


def test_one_seed_gives_a_delta_without_a_verdict(tmp_path, capsys):
    runs = {("base", 1): (TINY, 3.0), ("base", 2): (TINY, 3.2), ("single", 1): (TINY, 3.5)}
    _, summary, _ = report(fake_sweep(tmp_path / "a", runs, "base"), capsys)
    assert summary["single"]["n"] == "1" and summary["single"]["std"] == ""
    assert float(summary["single"]["delta_vs_baseline"]) == pytest.approx(0.4)
    assert summary["single"]["sigmas"] == summary["single"]["dof"] == ""
    assert summary["single"]["verdict"] == "worse by 0.400; no seed-noise estimate (single: one seed; run more seeds)"
    runs = {("base", 1): (TINY, 3.0), ("other", 1): (TINY, 2.9)}
    _, summary, _ = report(fake_sweep(tmp_path / "b", runs, "base"), capsys)
    assert summary["base"]["verdict"] == "baseline" and summary["base"]["std"] == ""
    assert summary["other"]["verdict"] == ("better by 0.100; no seed-noise estimate (other and the baseline: "
                                           "one seed; run more seeds)")


def test_seeds_without_any_spread_give_no_t():
    """Welch's t divides by the seeds' spread: none at all (identical losses) is said, not divided by."""
    assert summarize("v", [3.1, 3.1], [3.0, 3.0], False, VAL)["verdict"] == "worse by 0.100 (no seed spread)"
    assert summarize("v", [3.0, 3.0], [3.0, 3.0], False, VAL)["verdict"] == "within seed noise"


def test_variants_of_different_batch_are_read_at_the_same_tokens(tmp_path, capsys):
    """Batch 8 (512 tokens a step) against batch 12 (768): both validated at steps 5 and 10. The most
    tokens both reached is 5,120: the batch-8 runs' step 10, between the batch-12 runs' steps 5 (3,840
    tokens) and 10 (7,680), a third of the way."""
    runs = {("b8", s): {"val": 3.0 + s / 100} for s in (1, 2)}
    runs |= {("b12", s): {"val": 2.8 + s / 100, "batch": 12} for s in (1, 2)}
    printed, summary, rows = report(fake_sweep(tmp_path / "s", runs, "b8"), capsys)
    assert "validation loss at 5,120 tokens" in printed
    assert "the runs differ in tokens per step (512, 768)" in printed
    assert "b12-seed1 (steps 5-10)" in printed
    assert {int(r["tokens"]) for r in rows.values()} == {5120}
    for s in (1, 2):
        assert rows[f"b8-seed{s}"]["at"] == "step 10"
        assert float(rows[f"b8-seed{s}"]["val_loss"]) == pytest.approx(3.0 + s / 100)
        assert rows[f"b12-seed{s}"]["at"] == "steps 5-10, interpolated"
        at5, at10 = val_at(2.8 + s / 100, 5), val_at(2.8 + s / 100, 10)
        assert float(rows[f"b12-seed{s}"]["val_loss"]) == pytest.approx(at5 + (at10 - at5) / 3)
        # Training loss is read the same way: 5,120 / 768 = step 6 2/3, two thirds from step 6 to 7.
        t6, t7 = train_at(2.9 + s / 100, 6), train_at(2.9 + s / 100, 7)
        assert float(rows[f"b12-seed{s}"]["train_loss"]) == pytest.approx(t6 + (t7 - t6) * 2 / 3)
    # b12 at 5,120 tokens: 2.8 + s/100 + 0.5 - 0.5/3 = b8's value - 0.2 + 1/3.
    assert float(summary["b12"]["delta_vs_baseline"]) == pytest.approx(-0.2 + 0.5 - 0.5 / 3)


def test_runs_of_different_lengths_are_read_where_all_reached(tmp_path, capsys):
    """One run stopped at step 7 (validated at step 5 only): every run is read at step 5's 2,560 tokens."""
    runs = {("base", 1): {"val": 3.0}, ("base", 2): {"val": 3.2, "steps": 7},
            ("other", 1): {"val": 3.1}, ("other", 2): {"val": 3.3}}
    printed, summary, rows = report(fake_sweep(tmp_path / "s", runs, "base"), capsys)
    assert "validation loss at 2,560 tokens" in printed
    assert {r["at"] for r in rows.values()} == {"step 5"}
    assert [float(rows[f"{v}-seed{s}"]["val_loss"]) for v, s in runs] == pytest.approx([3.5, 3.7, 3.6, 3.8])
    assert [float(rows[f"{v}-seed{s}"]["train_loss"]) for v, s in runs] == pytest.approx(
        [3.1 + 1 / 5, 3.3 + 1 / 5, 3.2 + 1 / 5, 3.4 + 1 / 5])
    assert float(summary["other"]["delta_vs_baseline"]) == pytest.approx(0.1)


def test_without_validation_in_every_run_training_loss_is_compared(tmp_path, capsys):
    """One run has no validation, one stopped at step 8: training loss at step 8's 4,096 tokens."""
    runs = {("base", 1): {"val": 3.0}, ("base", 2): {"val": 3.2, "evals": ()},
            ("other", 1): {"val": 3.1, "steps": 8}, ("other", 2): {"val": 3.3}}
    printed, summary, rows = report(fake_sweep(tmp_path / "s", runs, "base"), capsys)
    assert "training loss at 4,096 tokens" in printed
    assert "compared on training loss, not validation loss: no eval/val_loss in base-seed2" in printed
    assert {r["at"] for r in rows.values()} == {"step 8"}
    trains = {"base-seed1": 3.1, "base-seed2": 3.3, "other-seed1": 3.2, "other-seed2": 3.4}  # val + 0.1
    assert {n: float(r["train_loss"]) for n, r in rows.items()} == pytest.approx({n: t + 1 / 8
                                                                                  for n, t in trains.items()})
    assert summary["base"]["metric"] == "loss_metrics/global_avg_loss"
    assert float(summary["base"]["mean"]) == pytest.approx(3.2 + 1 / 8)  # the training loss's mean
    assert float(summary["other"]["delta_vs_baseline"]) == pytest.approx(0.1)
    # The validated runs still show their validation at 4,096 tokens (between steps 5 and 10) where they have it.
    assert float(rows["base-seed1"]["val_loss"]) == pytest.approx(val_at(3.0, 8))
    assert rows["base-seed2"]["val_loss"] == ""


def test_validation_ranges_that_do_not_overlap_fall_back_to_training_loss(tmp_path):
    root = tmp_path / "s"
    fake_run(root / "a", TINY, 3.0, 3.1, evals=(2,))  # validated at 1,024 tokens only
    fake_run(root / "b", TINY, 3.0, 3.1, evals=(5, 10))  # from 2,560 tokens on
    runs = [SweepRun("a", 1, read_run(root / "a")), SweepRun("b", 1, read_run(root / "b"))]
    tokens, metric, compared, notes = compared_tokens(runs, VAL)
    assert (tokens, metric.key, compared) == (5120, "loss_metrics/global_avg_loss", runs)
    assert notes == ["compared on training loss, not validation loss: the runs' eval/val_loss token ranges do not "
                     "overlap: a 1,024-1,024, b 2,560-5,120"]
    (root / "a" / METRICS_FILE).write_text("")  # neither metric: a is left out, b compared on its own
    runs[0] = SweepRun("a", 1, read_run(root / "a"))
    assert compared_tokens(runs, VAL) == (5120, VAL, runs[1:], [
        "left out of the comparison: no eval/val_loss in a; training loss could not stand in: no "
        "loss_metrics/global_avg_loss in a"])


def test_the_fit_recovers_the_law_that_made_the_losses():
    a, b, c = 2.0e3, 0.16, 1.7
    flops = np.logspace(16, 20, 6)
    fit = fit_power_law(flops, a * flops ** -b + c)
    assert (fit.a, fit.b, fit.c) == pytest.approx((a, b, c), rel=1e-4)


def test_the_fits_error_bars_match_a_monte_carlo_of_the_law():
    """1,000 noisy draws of a known law at 8 sizes (5 degrees of freedom), each fitted: the spread of the
    estimates (and of the prediction 10x beyond the largest size) matches the reported standard errors
    within 7% (the spread's own sampling error is ~2%); the covariance without the ``/dof`` would be
    sqrt(5) = 2.2x too wide, the residual variance over n or n - 2 instead of n - 3 21% or 9% too narrow."""
    a, b, c, noise, draws = 2.0e3, 0.16, 1.7, 0.004, 1000
    flops = np.logspace(16, 20, 8)
    rng = np.random.default_rng(1)
    estimates, errors, predictions = [], [], []
    for _ in range(draws):
        fit = fit_power_law(flops, a * flops ** -b + c + rng.normal(0, noise, len(flops)))
        estimates.append((fit.a, fit.b, fit.c))
        errors.append(fit.errors)
        predictions.append(fit.predict(1e21))
    spread = np.std(estimates, axis=0, ddof=1)
    reported = np.sqrt(np.mean(np.square(errors), axis=0))  # the typical reported error
    assert reported / spread == pytest.approx([1, 1, 1], abs=0.07)
    predicted, se = np.array(predictions).T
    assert np.sqrt(np.mean(se ** 2)) / np.std(predicted, ddof=1) == pytest.approx(1, abs=0.07)
    assert abs(np.mean(predicted) - (a * 1e21 ** -b + c)) < 3 * np.std(predicted) / math.sqrt(draws)  # unbiased


def test_a_sweep_over_sizes_prints_the_fit_and_the_2b_prediction(tmp_path, capsys):
    a, b, c = 900.0, 0.12, 2.0
    runs = {}
    for dim in (64, 96, 128, 192, 256):
        config = laneformer_configs["tiny"]()
        config.dim = dim
        flops = flops_per_token(config, SEQ) * STEPS * BATCH * SEQ
        for seed in (1, 2):
            runs[(f"dim={dim}", seed)] = (config, a * flops ** -b + c)
    root = fake_sweep(tmp_path / "sizes", runs, "dim=64")
    _, lines = write_sweep_report(root)
    fit_line = next(line for line in lines if line.strip().startswith("a = "))
    assert f"b = {b:.4f}" in fit_line and f"c = {c:.4f}" in fit_line
    predicted = next(line for line in lines if "predicted at phase1.toml" in line)
    target = recipe_flops("phase1.toml")
    assert f"{target:.3g} FLOPs" in predicted
    assert f"{a * target ** -b + c:.4f} +-" in predicted


def test_a_preference_sweep_is_compared_on_held_out_accuracy_never_on_its_losses(tmp_path, capsys):
    """tiny-dpo's 6 variants (loss type x beta): on held-out accuracy, higher better; the training losses
    (beta 5's far below beta 0.1's whatever the accuracy) and eval/pref_loss are on each objective's own
    scale, so they are not compared, and the report says why."""
    printed, summary, rows = report(fake_preference_sweep(tmp_path / "tiny-dpo", ACCURACY), capsys)
    tokens = STEPS * 16 * 128  # tiny-dpo's 8 pairs a step (16 sequences) of 128 tokens
    assert f"held-out preference accuracy at {tokens:,} tokens (eval/pref_accuracy, higher is better;" in printed
    assert ("the runs' losses are not on one scale (preference.loss dpo, dpo_norm, simpo; preference.beta 0.1, 5; "
            "preference.gamma 0.03, 1.5): never compared on held-out preference loss (eval/pref_loss) or training "
            "loss (loss_metrics/global_avg_loss)") in printed
    assert {r["metric"] for r in summary.values()} == {EVAL_ACCURACY}
    base = ACCURACY["loss=dpo,beta=0.1"]
    for variant, acc in ACCURACY.items():
        assert float(summary[variant]["mean"]) == pytest.approx(acc)
        assert float(summary[variant]["delta_vs_baseline"]) == pytest.approx(acc - base)
        assert float(rows[f"{variant}-seed1"]["pref_accuracy"]) == pytest.approx(acc)
        assert rows[f"{variant}-seed1"]["at"] == f"step {STEPS}"
    # simpo at beta 5 has the lowest training loss of all and the worst accuracy: worse, not better.
    assert summary["loss=simpo,beta=5.0"]["verdict"].startswith("worse by 0.200; no seed-noise estimate")
    assert summary["loss=dpo_norm,beta=5.0"]["verdict"].startswith("better by 0.100; no seed-noise estimate")
    assert (tmp_path / "tiny-dpo" / "compared.png").is_file()


def test_a_preference_run_without_held_out_metrics_is_left_out_by_name(tmp_path, capsys):
    """simpo's runs logged no held-out pairs: training loss cannot stand in across loss types, so the
    others are compared on accuracy and the simpo runs are named as left out."""
    logged = {v: a for v, a in ACCURACY.items() if "simpo" not in v}
    printed, summary, rows = report(fake_preference_sweep(tmp_path / "tiny-dpo", logged), capsys)
    assert "held-out preference accuracy at 20,480 tokens" in printed
    assert ("left out of the comparison: no eval/pref_accuracy in loss=simpo-seed1, loss=simpo,beta=5.0-seed1"
            in printed)
    for variant in ("loss=simpo", "loss=simpo,beta=5.0"):
        assert summary[variant]["verdict"] == "not compared: no eval/pref_accuracy logged (left out)"
        assert summary[variant]["n"] == "0" and summary[variant]["mean"] == ""
        assert rows[f"{variant}-seed1"]["pref_accuracy"] == "" and rows[f"{variant}-seed1"]["train_loss"] != ""
    assert float(summary["beta=5.0"]["delta_vs_baseline"]) == pytest.approx(0.05)


def test_preference_losses_are_compared_only_on_one_scale(tmp_path):
    """eval/pref_loss across two betas is refused, naming them; across two seeds of one setting it is
    compared; without held-out metrics in one of those runs, their training loss stands in."""
    def run(name: str, beta: float, evals: bool = True) -> SweepRun:
        folder = tmp_path / name
        folder.mkdir()
        (folder / RECIPE_FILE).write_text(f"[training]\nglobal_batch = 16\nseq_len = 128\nsteps = {STEPS}\n"
                                          f'[data]\nsources = []\n[preference]\nloss = "dpo"\nbeta = {beta}\n')
        write_pref_metrics(folder, "dpo", beta, 0.9 if evals else None)
        return SweepRun(name, 1, read_run(folder))

    pref_loss = METRICS[EVAL_LOSS]
    with pytest.raises(ReportError, match=r"not on one scale \(preference.beta 0.1, 5\): never compared on held-out "
                                          r"preference loss \(eval/pref_loss\) or training loss"):
        compared_tokens([run("a", 0.1), run("b", 5.0)], pref_loss)
    same = [run("c", 0.1), run("d", 0.1)]
    assert compared_tokens(same, pref_loss) == (STEPS * 2048, pref_loss, same, [])
    same.append(run("e", 0.1, evals=False))
    tokens, metric, compared, notes = compared_tokens(same, pref_loss)
    assert (tokens, metric.key, compared) == (STEPS * 2048, TRAIN, same)
    assert notes == ["compared on training loss, not held-out preference loss: no eval/pref_loss in e"]


def test_the_metric_the_sweep_names_is_the_one_compared(tmp_path, capsys):
    """sweep.json's metric (the sweep file's): bits per byte here, where validation loss is the default."""
    root = fake_sweep(tmp_path / "s", {("base", 1): (TINY, 3.0), ("other", 1): (TINY, 3.1)}, "base")
    record = json.loads((root / SWEEP_FILE).read_text())
    (root / SWEEP_FILE).write_text(json.dumps({**record, "metric": "eval/val_bpb"}))
    printed, summary, _ = report(root, capsys)
    assert f"validation bits per byte at {STEPS * BATCH * SEQ:,} tokens (eval/val_bpb, lower is better;" in printed
    assert float(summary["other"]["delta_vs_baseline"]) == pytest.approx(0.1 / math.log(2))
    (root / SWEEP_FILE).write_text(json.dumps({**record, "metric": "eval/accuracy"}))
    assert report_main([str(root)]) == 2
    assert "metric 'eval/accuracy': not one a sweep is compared on" in capsys.readouterr().err


@pytest.mark.parametrize("loss", LOSSES)
def test_sweep_report_compares_each_loss_type_on_held_out_accuracy(tmp_path, capsys, loss):
    """Issue 43's table of what a recipe combines with each loss type, the sweep report's row: a sweep of
    one loss type over beta, 2 seeds, is compared on held-out accuracy with Welch's verdict, never on the
    losses, which beta scales and which each loss type logs on a scale of its own (LOSS_SCALE): the runs'
    losses differ from one loss type to the next, the verdict is the same for every one."""
    file = tmp_path / f"{loss}.toml"
    file.write_text(f'recipe = "tiny-dpo.toml"\nseeds = [1, 2]\nbaseline = {{ "preference.beta" = 0.1 }}\n'
                    f'[set]\npreference.loss = "{loss}"\n[vary]\npreference.beta = [0.1, 5.0]\n')
    root = fake_preference_sweep(tmp_path / loss, {"beta=0.1": 0.7, "beta=5.0": 0.9}, file)
    printed, summary, rows = report(root, capsys)
    assert "held-out preference accuracy at 20,480 tokens (eval/pref_accuracy, higher is better;" in printed
    assert "the runs' losses are not on one scale (preference.beta 0.1, 5" in printed
    for variant, acc in (("beta=0.1", 0.7), ("beta=5.0", 0.9)):  # each run's losses shown on its own scale
        assert float(rows[f"{variant}-seed1"]["pref_loss"]) == pytest.approx(pref_eval_loss(loss, acc))
        assert float(rows[f"{variant}-seed1"]["train_loss"]) == pytest.approx(
            pref_train_loss(loss, float(variant.removeprefix("beta=")), STEPS))
    t, _ = welch([0.9, 0.91], [0.7, 0.71])
    assert summary["beta=5.0"]["metric"] == EVAL_ACCURACY
    assert float(summary["beta=5.0"]["mean"]) == pytest.approx(0.905)
    assert summary["beta=5.0"]["verdict"] == f"better by 0.200 ({t:.1f} sigma)"
