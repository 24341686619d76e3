"""The planner's checkpoint interval (plan/interval.py) against Young's formula by hand, and the
property that makes it the optimum: the expected waste is least there; Daly's correction by hand where
it is large; ``checkpoint_interval`` on phase 1 against the README's row."""

import math
import re

import pytest
import torch

from rundir import REPO
from plan.interval import Interval, checkpoint_interval


def test_the_interval_is_youngs_by_hand_and_wastes_least():
    mtbf = 6330 * 3600 / 24  # Llama 3's rate per 8-GPU node, 24 nodes
    iv = Interval(stall_s=0.78, stall_how="", mtbf_s=mtbf, restart_s=600, step_s=1.23, interval_steps=1000)
    assert iv.young_s == pytest.approx(math.sqrt(2 * 0.78 * 949_500), rel=1e-9)  # 1,217 s
    assert iv.daly_s == pytest.approx(iv.young_s - 0.78, rel=1e-3)  # the stall is tiny against the MTBF
    assert iv.best_steps == round(iv.daly_s / 1.23) == 989
    best = iv.waste(iv.daly_s)
    assert best < iv.waste(0.8 * iv.daly_s) and best < iv.waste(1.25 * iv.daly_s)
    # first order by hand: the stall per interval, half an interval lost and a restart per failure
    assert best == pytest.approx(0.78 / iv.daly_s + (iv.daly_s / 2 + 600) / mtbf, rel=1e-12)
    assert Interval(2 * mtbf, "", mtbf, 600, 1.23, 1000).daly_s == mtbf  # Daly: a stall of 2 MTBFs or more


def test_daly_corrects_young_where_the_stall_is_not_small():
    """A 10-minute stall against a 10-hour MTBF: Daly's terms move the optimum by 6%. By hand:
    sqrt(2 x 600 x 36,000) = 6,572.67 s; x (1 + sqrt(600 / 72,000) / 3 + 600 / 648,000) = x 1.031355;
    minus the stall: 6,178.76 s."""
    iv = Interval(stall_s=600, stall_how="", mtbf_s=36_000, restart_s=0, step_s=1.0, interval_steps=1000)
    assert iv.young_s == pytest.approx(6572.67, abs=0.01)
    assert iv.daly_s == pytest.approx(6178.76, abs=0.01)
    assert iv.best_steps == 6179


README_ROW = re.compile(
    r"\| checkpoint interval \(Young 1974 / Daly 2006\) \| ([\d,]+) steps = (\d+) min for an async stall of "
    r"([\d.]+) s .*?a job MTBF of ([\d.]+) h .*? on (\d+) nodes\) and a (\d+) s restart: the recipes save every "
    r"([\d,]+) steps \(([\d.]+)% expected loss; ([\d.]+)% at the former ([\d,]+)\)")


def test_the_readme_row_is_what_the_planner_computes_for_phase1():
    """``checkpoint_interval`` on phase 1 as committed, 192 H100s (train.py --plan's call), against the
    README's row, every number of it."""
    from train import recipe as R
    from train.recipe import model_config
    from plan.gpus import GPUS
    from plan.report import Layout, Shape, _accumulation, cluster_for
    from plan.roofline import roofline

    [row] = README_ROW.findall((REPO / "README.md").read_text())
    steps, minutes, stall, mtbf_h, nodes, restart, every, loss, former_loss, former = row
    recipe, gpus = R.load("phase1.toml"), 192
    config, shape = model_config(recipe), Shape.of(recipe, Layout.of(recipe, gpus).shard)
    speed = roofline(config, shape, GPUS["h100"], accumulation=_accumulation(recipe, shape.micro_batch, gpus))
    with torch.device("meta"):
        nparams = sum(p.numel() for p in config.build().parameters())
    gpus_per_node = cluster_for("h100").gpus_per_node
    iv = checkpoint_interval(recipe, speed, gpus, gpus_per_node, nparams)
    assert gpus // gpus_per_node == int(nodes)
    assert (f"{iv.best_steps:,}", f"{iv.daly_s / 60:.0f}") == (steps, minutes)
    assert (iv.stall_s, f"{iv.mtbf_s / 3600:.1f}", iv.restart_s) == (float(stall), mtbf_h, float(restart))
    assert f"{iv.interval_steps:,}" == every
    assert f"{iv.waste(iv.interval_steps * iv.step_s):.2%}" == f"{loss}%"
    assert f"{iv.waste(int(former.replace(',', '')) * iv.step_s):.2%}" == f"{former_loss}%"
