"""The sweep comparison and the scaling fit on run dirs written by hand (no training): the verdicts
against the two-sample statistics worked out by hand, the fit against the law that made the losses."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from models.laneformer import laneformer_configs, native_fields
from train.report.__main__ import main as report_main
from train.report.scaling import fit_power_law, flops_per_token, recipe_flops
from train.report.sweep import T_975, write_sweep_report

SEQ, BATCH, STEPS = 64, 8, 10


def fake_run(folder: Path, config, val: float, train: float) -> None:
    """A run dir as train.py leaves it, as far as the report reads: recipe, model config, metrics."""
    folder.mkdir(parents=True)
    (folder / "recipe.toml").write_text(f"# resolved from test\n[run]\nname = \"{folder.name}\"\n"
                                        f"[training]\nglobal_batch = {BATCH}\nseq_len = {SEQ}\nsteps = {STEPS}\n"
                                        "[data]\nsources = []\n")
    (folder / "laneformer_config.json").write_text(json.dumps(native_fields(config)))
    rows = [{"step": s, "loss_metrics/global_avg_loss": train + 1 / s, "throughput(tps)": 1000.0 + s}
            for s in range(1, STEPS + 1)]
    rows += [{"step": 5, "eval/val_loss": val + 0.5, "eval/val_bpb": (val + 0.5) / math.log(2)},
             {"step": STEPS, "eval/val_loss": val, "eval/val_bpb": val / math.log(2)}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def fake_sweep(root: Path, runs: dict[tuple[str, int], tuple], baseline: str) -> Path:
    variants = list(dict.fromkeys(v for v, _ in runs))
    for (variant, seed), (config, val) in runs.items():
        fake_run(root / f"{variant}-seed{seed}", config, val, train=val + 0.1)
    (root / "sweep.json").write_text(json.dumps({
        "name": root.name, "baseline": baseline, "variants": [{"name": v} for v in variants],
        "runs": [{"variant": v, "seed": s, "run_dir": f"{v}-seed{s}", "state": "done"} for v, s in runs]}))
    return root


def test_verdicts_follow_the_two_sample_statistics(tmp_path, capsys):
    tiny = laneformer_configs["tiny"]()
    root = fake_sweep(tmp_path / "s", {("base", 1): (tiny, 3.0), ("base", 2): (tiny, 3.2),
                                       ("close", 1): (tiny, 3.5), ("close", 2): (tiny, 3.7),
                                       ("far", 1): (tiny, 4.0), ("far", 2): (tiny, 4.1)}, "base")
    assert report_main([str(root)]) == 0
    printed = capsys.readouterr().out
    assert f"validation loss at step {STEPS} = {STEPS * BATCH * SEQ:,} tokens" in printed
    summary = {r["variant"]: r for r in csv.DictReader(open(root / "summary.csv"))}
    # By hand: base std sqrt(0.02); close: delta 0.5, pooled sd sqrt(0.02), se = sd * sqrt(1/2 + 1/2),
    # t = 3.54 < 4.303 (2 dof): noise. far: delta 0.95, pooled var (0.005 + 0.02) / 2, t = 8.50.
    assert summary["base"]["verdict"] == "baseline"
    assert float(summary["base"]["val_loss_std"]) == pytest.approx(math.sqrt(0.02))
    assert float(summary["close"]["sigmas"]) == pytest.approx(0.5 / math.sqrt(0.02))
    assert summary["close"]["verdict"] == "within seed noise"
    assert float(summary["far"]["delta_vs_baseline"]) == pytest.approx(0.95)
    assert float(summary["far"]["sigmas"]) == pytest.approx(0.95 / math.sqrt(0.0125))
    assert summary["far"]["verdict"] == "worse by 0.950 (8.5 sigma)"
    rows = list(csv.DictReader(open(root / "comparison.csv")))
    assert [float(r["val_loss"]) for r in rows] == [3.0, 3.2, 3.5, 3.7, 4.0, 4.1]
    assert {float(r["tokens_per_s"]) for r in rows} == {1000.0 + STEPS}
    assert (root / "report.html").is_file() and (root / "loss.png").is_file()
    assert "scaling fit" not in printed  # one model size: nothing to fit


def test_the_t_table_is_students():
    stats = pytest.importorskip("scipy.stats")
    for dof, value in T_975.items():
        assert value == pytest.approx(stats.t.ppf(0.975, dof), abs=1e-3)


def test_the_fit_recovers_the_law_that_made_the_losses():
    a, b, c = 2.0e3, 0.16, 1.7
    flops = np.logspace(16, 20, 6)
    fit = fit_power_law(flops, a * flops ** -b + c)
    assert (fit.a, fit.b, fit.c) == pytest.approx((a, b, c), rel=1e-4)
    rng = np.random.default_rng(0)
    noisy = a * flops ** -b + c + rng.normal(0, 0.003, len(flops))
    fit = fit_power_law(flops, noisy)
    for got, want, err in zip((fit.a, fit.b, fit.c), (a, b, c), fit.errors):
        assert abs(got - want) < 4 * err
    loss, se = fit.predict(1e22)
    assert abs(loss - (a * 1e22 ** -b + c)) < 4 * se


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
