"""The straggler rule (health/straggler.py) on compute times given by hand and recorded from a
real 3-rank run, and ``[launch] straggler_threshold``'s validation. The real run that makes a rank
slow (a shared core) is tests/launch/test_launch_local.py's."""

from __future__ import annotations

import pytest

from rundir import REPO
from train import recipe as R
from health.straggler import Streaks, others_median


def named(threshold: float, windows: int, steps: list[list[float]]) -> list[tuple[int, int]]:
    """(logging step index, rank) of every alert over ``steps`` (each: one compute time a rank)."""
    streaks = Streaks(threshold, windows)
    return [(i, rank) for i, compute in enumerate(steps) for rank in streaks.judge(compute)]


def test_a_rank_is_compared_with_the_others_not_with_a_median_that_holds_itself():
    # 2 ranks: 30% slower than the other is over a 20% threshold (the median of both, 1.15, would
    # have needed 1.38); and a threshold of 1 names a rank 2.5x slower (over all ranks: never)
    assert named(0.2, 1, [[1.0, 1.3]]) == [(0, 1)]
    assert named(0.2, 1, [[1.0, 1.19]]) == []
    assert named(1.0, 1, [[2.5, 1.0]]) == [(0, 0)]
    # 4 ranks: the others' median is 1.0, the median of all 1.1 (1.32 with the threshold)
    assert named(0.2, 1, [[1.0, 1.3, 1.0, 1.2]]) == [(0, 1)]
    assert others_median([1.0, 1.3, 1.0, 1.2], 1) == 1.0


def test_one_fast_rank_does_not_make_a_normal_one_a_straggler():
    # 3 ranks, one much faster: the upper median of the other two (1.05), not their mean (0.575)
    assert others_median([0.1, 1.0, 1.05], 1) == 1.05
    assert named(0.2, 1, [[0.1, 1.0, 1.05]]) == []


# Recorded from a 3-rank run with rank 1's core shared (tests/launch/test_launch_local.py, threshold 0.5,
# 2 windows: named at step 2): the compute check (s) at its logging steps 1, 2, 4, 6, 8, 9, rank 1 the
# logged max, ranks 0 and 2 the min and median (which is which does not change the rule).
RECORDED = [
    [0.08681, 0.2305, 0.09715],
    [0.1028, 0.2514, 0.1098],
    [0.09349, 0.2100, 0.1055],
    [0.07896, 0.2151, 0.09091],
    [0.1017, 0.1862, 0.1070],
    [0.05344, 0.2294, 0.09896],
]


def test_the_threshold_is_the_configured_one():
    """On the recorded run rank 1 is 1.7 to 2.4 times the others' median: the threshold decides which steps count."""
    ratios = [c[1] / others_median(c, 1) for c in RECORDED]
    assert [round(r, 2) for r in ratios] == [2.37, 2.29, 1.99, 2.37, 1.74, 2.32]
    assert named(0.2, 1, RECORDED) == [(0, 1)]  # every step slow: one streak, named once
    assert named(1.3, 1, RECORDED) == [(0, 1), (3, 1), (5, 1)]  # over 2.3x at steps 1, 6 and 9 only
    assert named(0.9, 1, RECORDED) == [(0, 1), (5, 1)]  # under 1.9x at step 8: a second streak at step 9
    assert named(0.9, 3, RECORDED) == [(2, 1)]
    assert named(1.3, 2, RECORDED) == []  # never two in a row
    assert named(1.5, 1, RECORDED) == []


def test_a_rank_is_named_after_its_windows_in_a_row_and_once_a_streak():
    assert [named(0.5, w, RECORDED) for w in range(1, 8)] == [[(w - 1, 1)] for w in range(1, 7)] + [[]]
    # a streak broken one step short starts again
    slow, fast = [1.0, 1.5, 1.0], [1.0, 1.0, 1.0]
    assert named(0.2, 3, [slow, slow, fast, slow, slow, slow, slow]) == [(5, 1)]


def test_the_streaks_go_on_after_a_restart():
    first = Streaks(0.2, 3)
    assert first.judge(RECORDED[0]) == first.judge(RECORDED[1]) == []
    resumed = Streaks(0.2, 3)
    resumed.load_state_dict(first.state_dict())
    assert resumed.judge(RECORDED[2]) == [1]


@pytest.mark.parametrize("value, why", [
    ("inf", "straggler_threshold: must be a finite number > 0"),
    ("nan", "straggler_threshold: must be a finite number > 0"),
    ("0", "straggler_threshold: must be a finite number > 0"),
    ("-0.1", "straggler_threshold: must be a finite number > 0"),
])
def test_a_threshold_that_can_never_name_a_rank_is_refused(tmp_path, value, why):
    path = tmp_path / "r.toml"
    path.write_text((REPO / "recipes" / "tiny.toml").read_text() + f"\n[launch]\nstraggler_threshold = {value}\n")
    with pytest.raises(R.RecipeError) as err:
        R.load(str(path))
    assert str(err.value).startswith(f"{path}: [launch] {why}"), err.value
    assert f"got {float(value)}" in str(err.value)


def test_a_large_threshold_is_accepted():
    """Leave-one-out: any finite threshold can name a rank (3 times slower than the others at 2)."""
    assert R.load("tiny.toml", ["launch.straggler_threshold=2.0"]).launch.straggler_threshold == 2.0
