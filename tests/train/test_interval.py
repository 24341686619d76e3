"""The planner's checkpoint interval (train/plan/interval.py) against Young's formula by hand, and the
property that makes it the optimum: the expected waste is least there."""

import math

import pytest

from train.plan.interval import Interval


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
