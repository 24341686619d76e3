"""launch.sweep end to end: the tiny sweep (2 variants x 2 seeds, through launch.local) compared by
``python -m report`` against each run's own metrics.jsonl, a rerun that starts nothing, an
invalid variant refused with nothing written, the dry run's grid and plan, dtp.toml's variants (union,
de-duplication, names), the metric a sweep file names checked and recorded, and a one-run sweep
submitted through launch.slurm on the emulated cluster."""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.attempts import history
from launch.sweep.__main__ import main as sweep_main
from launch.sweep.runs import RunSpec, write_record
from launch.sweep.spec import SweepError, Variant, read_sweep, variants
from rundir import REPO
from tests.conftest import env
from report.__main__ import main as report_main

TINY_SWEEP = REPO / "recipes" / "sweeps" / "tiny-dtp.toml"
# The tiny sweep, as short as a comparison can be: 4 steps, validation at the end only.
SHORT = ("training.steps=4", "training.seq_len=64", "training.global_batch=8", "training.micro_batch=4",
         "schedule.warmup_steps=1", "logging.interval=2", "checkpoint.interval=4", "eval.every=0",
         "eval.val_samples=8", "logging.tensorboard=false", "logging.report=false")  # the sweep's report is drawn
RUNS = ["delay=0-seed1", "delay=2-seed1", "delay=0-seed2", "delay=2-seed2"]


def sweep_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.sweep", *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep") / "tiny-dtp"
    args = (str(TINY_SWEEP), f"--root={root}", *(f"--set={s}" for s in SHORT))
    first = sweep_cli(*args, "--parallel=2")
    assert first.returncode == 0, first.stdout + first.stderr
    return root, args, first


@pytest.fixture(scope="module")
def report(tiny_sweep):
    """What ``python -m report SWEEP_DIR`` prints: its main, in this process (torch is imported already)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert report_main([str(tiny_sweep[0])]) == 0
    return out.getvalue()


@pytest.mark.slow
def test_the_comparison_holds_each_runs_own_metrics(tiny_sweep, report):
    root = tiny_sweep[0]
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "logs") == sorted(RUNS)
    record = json.loads((root / "sweep.json").read_text())
    assert [(r["run_dir"], r["state"]) for r in record["runs"]] == [(r, "done") for r in RUNS]
    rows = list(csv.DictReader(open(root / "comparison.csv")))
    assert [f"{r['variant']}-seed{r['seed']}" for r in rows] == RUNS
    for row in rows:
        run = Path(row["run_dir"])
        logged = {}
        for line in (run / "metrics.jsonl").read_text().splitlines():
            logged.setdefault(json.loads(line)["step"], {}).update(json.loads(line))
        at = logged[4]  # the last step: every run reached it, with its validation
        assert int(row["tokens"]) == 4 * 8 * 64
        assert float(row["train_loss"]) == at["loss_metrics/global_avg_loss"]
        assert float(row["val_loss"]) == at["eval/val_loss"]
        assert float(row["val_bpb"]) == at["eval/val_bpb"]
        assert float(row["tokens_per_s"]) == at["throughput(tps)"]
        assert json.loads((run / "launcher" / "attempts.jsonl").read_text().splitlines()[-1])["action"] == "done"
        seed = int(row["seed"])
        assert f"seed = {seed}" in (run / "recipe.toml").read_text()
    summary = list(csv.DictReader(open(root / "summary.csv")))
    assert [(r["variant"], r["n"], r["verdict"]) for r in summary][0] == ("delay=0", "2", "baseline")
    mean = sum(float(r["val_loss"]) for r in rows if r["variant"] == "delay=2") / 2
    assert summary[1]["metric"] == "eval/val_loss" and float(summary[1]["mean"]) == pytest.approx(mean)
    assert "validation loss at 2,048 tokens" in report
    assert summary[1]["verdict"] in report
    assert (root / "report.html").is_file()


@pytest.mark.slow
def test_a_rerun_starts_nothing(tiny_sweep, capsys):
    """The same command again (its main, in this process: the first run was the command itself)."""
    root, args, first = tiny_sweep
    assert "starting 4:" in first.stdout
    before = {r: len(history(root / r)) for r in RUNS}
    assert sweep_main(list(args)) == 0
    out = capsys.readouterr().out
    assert "starting 0: nothing" in out and "runs: 4 done, 0 running, 0 left" in out
    assert {r: len(history(root / r)) for r in RUNS} == before


def test_an_invalid_variant_is_refused_by_name_and_key_with_nothing_written(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('recipe = "tiny.toml"\nseeds = [1, 2]\nbaseline = { "model.n_lanes" = 8 }\n'
                   '[vary]\nmodel.n_lanes = [8, 3]\n')
    root = tmp_path / "out"
    assert sweep_main([str(bad), f"--root={root}"]) == 2
    err = capsys.readouterr().err
    assert "variant model.n_lanes=3:" in err and "model.n_heads must be divisible by n_lanes=3" in err
    assert "variant model.n_lanes=8" not in err
    assert not root.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]


def test_the_dry_run_prints_the_grid_and_each_runs_plan(tmp_path, capsys):
    root = tmp_path / "out"
    assert sweep_main([str(TINY_SWEEP), f"--root={root}", "--dry-run", "--gpus=2", "--gpu=h100",
                       *(f"--set={s}" for s in SHORT)]) == 0
    out = capsys.readouterr().out
    assert "2 variants x 2 seeds = 4 runs" in out and "baseline delay=0" in out
    assert all(f"  {r}: left" in out for r in RUNS)
    plan = out[out.index("plan per run on 2 x H100"):].splitlines()
    rows = {line.split()[0]: line.split() for line in plan[2:4]}
    assert set(rows) == {"delay=0", "delay=2"} and all(r[3] == "yes" for r in rows.values())
    hours = sum(float(r[-1]) for r in rows.values()) * 2
    assert f"sweep total: 4 runs, {hours:,.1f} GPU-hours" in out
    assert not root.exists()


def test_the_metric_a_sweep_names_is_checked_and_recorded_for_the_report(tmp_path):
    sweep = read_sweep(REPO / "recipes" / "sweeps" / "tiny-dpo.toml")
    assert sweep.metric == "eval/pref_accuracy"
    v, run = Variant({"preference.loss": "dpo"}, name="loss=dpo"), tmp_path / "loss=dpo-seed1"
    write_record(tmp_path, sweep, [v], [RunSpec(v, 1, run)], {run: "left"}, "local")
    assert json.loads((tmp_path / "sweep.json").read_text())["metric"] == "eval/pref_accuracy"
    assert read_sweep(TINY_SWEEP).metric is None  # the report's default: validation loss
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY_SWEEP.read_text().replace("seeds = [1, 2]", 'seeds = [1, 2]\nmetric = "eval/pref_acc"'))
    with pytest.raises(SweepError, match=f"{bad}: metric: 'eval/pref_acc' is not one a sweep is compared on; one "
                                         "of: eval/val_loss, eval/val_bpb, eval/pref_accuracy"):
        read_sweep(bad)


def test_dtp_toml_makes_the_union_of_its_grids_once_each_named_against_the_baseline(tmp_path):
    """recipes/sweeps/dtp.toml: five [[vary]] tables of 3, 2, 3, 2 and 2 values, each at the base
    values of the other keys (phase1.toml's 100M flavor: delay 2, early_mode present, late_mode drop,
    final_agg mean_of_norms, 8 lanes). The base setting is in every grid: 12 combinations, 8 runs."""
    sweep = read_sweep(REPO / "recipes" / "sweeps" / "dtp.toml")
    assert [len(list(itertools.product(*g.values()))) for g in sweep.grids] == [3, 2, 3, 2, 2]
    found, _ = variants(sweep, 8, tmp_path)  # the phase-1 data is not here: problems, but every variant loads
    assert [v.name for v in found] == [
        "delay=0", "delay=1", "delay=2", "delay=2,early_mode=scaled", "delay=2,late_mode=flush",
        "delay=2,late_mode=present", "delay=2,final_agg=norm_of_sum", "delay=2,n_lanes=1"]
    base = {"model.delay": 2, "model.early_mode": "present", "model.late_mode": "drop",
            "model.final_agg": "mean_of_norms", "model.n_lanes": 8}
    expected = [{**base, "model.delay": 0}, {**base, "model.delay": 1}, base,
                {**base, "model.early_mode": "scaled"}, {**base, "model.late_mode": "flush"},
                {**base, "model.late_mode": "present"}, {**base, "model.final_agg": "norm_of_sum"},
                {**base, "model.n_lanes": 1}]
    assert [v.values for v in found] == expected
    assert sweep.seeds == [1, 2, 3] and len(found) * len(sweep.seeds) == 24  # the file's "24 runs"


def test_a_mixture_ablation_varies_a_source_by_name(tmp_path):
    """A sweep axis on one source (``data.sources.<name>.<key>``, the --set grammar): each variant's recipe
    has that source changed and no other, and a grid that does not vary the key reads it from the recipe."""
    mix = tmp_path / "mix.toml"
    mix.write_text('recipe = "tiny.toml"\nseeds = [1]\n'
                   'baseline = { "data.sources.code.weight" = 0.5, "data.sources[0].max_epochs" = 4 }\n'
                   '[[vary]]\ndata.sources.code.weight = [0.5, 0.25]\n'
                   '[[vary]]\n"data.sources[0].max_epochs" = [8]\n')
    found, _ = variants(read_sweep(mix), 1, tmp_path)
    assert [v.name for v in found] == ["weight=0.5,max_epochs=4.0", "weight=0.25", "max_epochs=8.0"]
    assert [[(s.name, s.weight, s.max_epochs) for s in v.recipe.data.sources] for v in found] == [
        [("prose", 0.5, 4), ("code", 0.5, 4)], [("prose", 0.5, 4), ("code", 0.25, 4)],
        [("prose", 0.5, 8), ("code", 0.5, 4)]]
