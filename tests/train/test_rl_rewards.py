"""Rewards for RL on code (eval.rewards): tests run in the sandbox, a pass rate or pass/fail; a reward that
crashes, hangs or reports garbage scores 0 and is counted, and never raises."""

from __future__ import annotations

import pytest

from eval.rewards import check_reward, score, score_all

TASK = {"id": "add", "prompt": "def add(a, b):\n", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0",
                                                          "assert add(2, 2) == 5"]}


def test_pass_rate_and_pass_fail():
    assert score("pass_rate", TASK["prompt"], "    return a + b\n", TASK).reward == pytest.approx(2 / 3)
    assert score("pass_fail", TASK["prompt"], "    return a + b\n", TASK).reward == 0.0
    ok = {**TASK, "tests": TASK["tests"][:2]}
    assert score("pass_fail", ok["prompt"], "    return a + b\n\ndef other():\n    raise SystemExit(1)\n", ok).reward \
        == 1.0  # cut at the stop string
    wrong = score("pass_rate", TASK["prompt"], " )))", TASK)
    assert (wrong.reward, wrong.failure) == (0.0, "")  # a wrong answer is a 0, not a failure


def test_a_completion_that_prints_the_passes_or_exits_gets_no_credit():
    forged = score("pass_rate", TASK["prompt"], "    return -1\nprint('pass 0')\nprint('pass 1')\n", TASK)
    assert forged.reward == 0.0
    exited = score("pass_rate", TASK["prompt"], "    return a + b\nimport os\nos._exit(0)\n", TASK)
    assert (exited.reward, exited.failure) == (0.0, "crash")


@pytest.mark.parametrize("fn, failure", [("crash", "crash"), ("hang", "timeout"), ("garbage", "garbage"),
                                         ("text", "crash")])
def test_a_reward_that_crashes_hangs_or_reports_garbage_scores_0_and_is_counted(fn, failure):
    scored = score(f"tests.train.rl_rewards:{fn}", TASK["prompt"], "    return 12\n", TASK, timeout_s=1.0)
    assert (scored.reward, scored.failure) == (0.0, failure)


def test_a_function_reward_and_a_batch():
    out = score_all("tests.train.rl_rewards:digits", [(TASK["prompt"], "12ab", TASK), (TASK["prompt"], "x", TASK)])
    assert [s.reward for s in out] == [0.5, 0.0] and not any(s.failure for s in out)
    assert check_reward("tests.train.rl_rewards:digits") is None
    assert "no function" in check_reward("tests.train.rl_rewards:nothing")
    assert "does not import" in check_reward("no_such_module_here:f")
