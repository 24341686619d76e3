"""The data plan of a dry run, from the recipe alone: every source's planned tokens against its
expected size, checked before anything is downloaded or tokenized."""

from __future__ import annotations

import numpy as np
import pytest

from data.mixture import MixtureLoader, needs
from train import recipe as R
from train.build import check_data, preflight
from train.recipe import model_config
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


def test_the_dry_run_counts_the_tokens_of_long_documents_in_each_source(tmp_path):
    """Independent reference: every document's length from the shards' indexes, counted here."""
    from data.shards import LONG_DOCUMENTS, open_source

    recipe = tiny(tmp_path)
    report = data_report(recipe)
    assert "long documents (the run's seq_len: 128):" in report
    for s in recipe.data.sources:
        lengths = np.concatenate([np.diff(np.asarray(shard.doc_ends, np.int64), prepend=0)
                                  for shard in open_source(s.path).shards])
        total = int(lengths.sum())
        counts = [int(lengths[lengths >= n].sum()) for n in LONG_DOCUMENTS]
        assert counts[0] > counts[-1] == 0  # the bundled sample holds documents past 4k, none past 32k
        expected = ", ".join(f"{n // 1024}k: {c:,} ({c / total:.1%})" for n, c in zip(LONG_DOCUMENTS, counts))
        assert f"  {s.name}: tokens in documents of at least {expected}" in report.splitlines()


def test_a_source_tokenized_before_the_counts_says_so(tmp_path):
    import json
    import shutil

    source = shutil.copytree(R.REPO / "assets" / "sample_data" / "prose", tmp_path / "prose")
    manifest = json.loads((source / "manifest.json").read_text())
    del manifest["long_documents"]
    (source / "manifest.json").write_text(json.dumps(manifest))
    report = data_report(tiny(tmp_path, f'data.sources=[{{name = "prose", path = "{source}", weight = 1.0, max_epochs = 4}}]'))
    assert ("  prose: long documents not counted (tokenized before laneformer 0.2: tokenize again to count them)"
            in report.splitlines())
