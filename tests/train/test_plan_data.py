"""The data plan of a dry run, from the recipe alone: every source's planned tokens against its
expected size, checked before anything is downloaded or tokenized."""

from __future__ import annotations

import numpy as np
import pytest

from data.mixture import MixtureLoader, needs
from train import recipe as R
from train.build import check_data, model_config, preflight
from train.recipe import check_needs
from plan.data import data_report


def tiny(tmp_path, *sets):
    return R.load("tiny.toml", [f"run.output_dir={tmp_path / 'run'}", *sets])


def test_needs_equal_what_the_loader_reads_over_the_whole_run(tmp_path):
    """Independent reference: run the loader over every sample of the run and count per source."""
    recipe = tiny(tmp_path, "training.steps=40")
    t = recipe.training
    rows = needs(recipe.data.sources, t.seq_len, t.steps * t.global_batch)
    mixture = check_data(recipe, model_config(recipe))
    loader = MixtureLoader(mixture, t.global_batch)
    seen = np.bincount(np.concatenate([next(loader)["source"] for _ in range(t.steps)]), minlength=2)
    assert [n.planned_tokens for n in rows] == [int(c) * t.seq_len + 1 for c in seen]
    assert [n.needs for n in rows] == [-(-n.planned_tokens // 4) for n in rows]  # max_epochs 4 in tiny.toml


def test_a_budget_the_expected_size_cannot_meet_is_refused_naming_the_source(tmp_path):
    sources = ('data.sources=[{name = "prose", path = "assets/sample_data/prose", weight = 0.5, max_epochs = 4}, '
               '{name = "code", path = "assets/sample_data/code", weight = 0.5, max_epochs = 4, expected_tokens = 100}]')
    recipe = tiny(tmp_path, "training.steps=40", sources)
    # tiny.toml's second source: ~half of 40 x 16 x 128 tokens, at most 4 epochs of 100 tokens
    (found,) = check_needs(recipe)
    assert found.startswith(f"{recipe.path}: [data.sources[1]] expected_tokens: source 'code' holds ~100 tokens by "
                            "its card but the plan reads ")
    assert "lower its weight, raise max_epochs or add data" in found
    assert found in preflight(recipe, world_size=1).problems
    report = data_report(recipe)
    assert "code: plan " in report and "SHORT by " in report and "data plan: SHORT: code" in report


@pytest.mark.parametrize("name", ["phase1", "phase2", "sft"])
def test_every_real_source_is_size_checked_and_fits(name, monkeypatch):
    monkeypatch.delenv(R.DATA_ROOT_ENV, raising=False)
    recipe = R.load(name)
    t = recipe.training
    rows = needs(recipe.data.sources, t.seq_len, t.steps * t.global_batch)
    assert rows and all(n.fits for n in rows), [n.line() for n in rows if not n.fits]
    assert check_needs(recipe) == []
    report = data_report(recipe)
    for n in rows:
        assert f"  {n.name}: plan {n.planned_tokens:,} tokens, needs >= {n.needs:,} tokens; expected " in report
    assert "data plan: every expected size covers its needs" in report


def test_two_sources_reading_the_same_rows_are_refused(tmp_path):
    twice = ('data.sources=[{name = "a", hub_id = "org/x", subset = "s", path = "a", weight = 1.0}, '
             '{name = "b", hub_id = "org/x", subset = "s", path = "b", weight = 1.0}]')
    with pytest.raises(R.RecipeError, match=r"\[data\] sources: sources 'a' and 'b' read the same rows"):
        tiny(tmp_path, twice)
    filtered = twice.replace('path = "b",', 'path = "b", exclude = {source = ["x"]},')
    assert [s.name for s in tiny(tmp_path, filtered).data.sources] == ["a", "b"]  # another filter: other rows
