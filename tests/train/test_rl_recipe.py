"""The [rl] table (train.recipe.schema.Rl): an RL run is the ``rl`` objective; bad values are refused at load
naming the file and key; beta != 0 is refused as not built; the preflight asks what needs two tables; the
bundled tasks are what data.make_rl_tasks makes, byte for byte, and split by data.held_out's rule."""

from __future__ import annotations

import pytest

from data import make_rl_tasks
from data.rl_tasks import read_tasks, split
from data.tokenizer import Tokenizer
from rundir import REPO
from train import recipe as R
from train.objectives import OBJECTIVES


def test_tiny_rl_is_the_rl_objective():
    recipe = R.load("tiny-rl")
    assert recipe.objective == "rl" and OBJECTIVES["rl"].__module__ == "train.objectives.rl"
    assert recipe.rl.tasks == str(REPO / "assets/rl/tasks.jsonl")


@pytest.mark.parametrize("key, value, why", [
    ("rl.beta", "0.1", r"tiny-rl\.toml: \[rl\] beta: 0\.1: a KL to the reference is not built yet"),
    ("rl.loss", '"ppo"', r"\[rl\].*loss"),
    ("rl.truncated", '"drop"', r"\[rl\].*truncated"),
    ("rl.samples_per_prompt", "1", r"\[rl\] samples_per_prompt: 1"),
    ("rl.top_p", "0.0", r"\[rl\] top_p"),
    ("rl.reward", '"not a reward"', r"\[rl\] reward"),
    ("rl.temperature", "0.0", r"\[rl\] temperature"),
])
def test_bad_values_are_refused_at_load(key, value, why):
    with pytest.raises(R.RecipeError, match=why):
        R.load("tiny-rl", [f"{key}={value}"])


def test_the_preflight_asks_what_needs_two_tables(tmp_path):
    recipe = R.load("tiny-rl", ["training.global_batch=8", "training.micro_batch=8", "rl.max_new_tokens=60",
                                'rl.reward="tests.train.rl_rewards:nothing"'])
    problems = OBJECTIVES["rl"].check(recipe, None, Tokenizer(recipe.data.tokenizer))
    text = "\n".join(problems)
    assert "[training] global_batch: 8, but an RL step is prompts_per_step x samples_per_prompt = 16" in text
    assert "[training] seq_len: 64 < the longest prompt" in text
    assert "[rl] reward: tests.train.rl_rewards has no function 'nothing'" in text


def test_bundled_assets_are_what_the_script_makes(tmp_path):
    made = make_rl_tasks.build(tmp_path)
    assert made.read_bytes() == (REPO / "assets/rl/tasks.jsonl").read_bytes()


def test_held_out_by_the_hash_rule_and_every_solution_passes():
    from eval.rewards import score_all

    tasks = read_tasks(REPO / "assets/rl/tasks.jsonl", Tokenizer())
    train, held_out = split(tasks, 0.2)
    assert len(train) + len(held_out) == len(tasks) and 0 < len(held_out) < len(tasks) / 2
    assert split(tasks, 0.2) == (train, held_out)
    solutions = {t["id"]: t["solution"] for t in make_rl_tasks.tasks()}
    scored = score_all("pass_fail", [(t.prompt, solutions[t.id], {"tests": list(t.tests)}) for t in held_out])
    assert all(s.reward == 1.0 for s in scored)
