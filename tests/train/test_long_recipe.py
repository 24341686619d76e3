"""recipes/long.toml, phase 3 of the 2B (issue 44): what the recipe promises, checked from the recipe alone
(no data, no GPU): it starts from phase 2's weights at 16,384 tokens, the model is the 2B with only its
full layers' RoPE changed, short-context data keeps >= 40% of the mix, every source's size covers its plan,
and it validates at 4k and 16k on held-out sets that include phase 2's own."""

from __future__ import annotations

import pytest
import torch

from data.mixture import DEFAULT_PERIOD, needs
from models.laneformer import laneformer_configs
from train import recipe as R
from train.recipe import model_config

SEQ_LEN = 16_384
SHORT_SHARE = 0.40  # ProLong's 40% short data (train_64K.sh), the floor issue 44 sets


@pytest.fixture(scope="module")
def long():
    return R.load("long.toml")


@pytest.fixture(scope="module")
def phase2():
    return R.load("phase2.toml")


def is_long(source) -> bool:
    """A long source keeps only its long documents (min_doc_tokens); every other source is short-context data."""
    return source.min_doc_tokens is not None


def test_it_starts_from_phase_2s_final_weights_at_16k(long, phase2):
    assert long.checkpoint.init_from == str(phase2.output_dir)
    assert long.checkpoint.init_weights_only  # a fresh AdamW and schedule, as phase 2 from phase 1
    assert long.training.seq_len == SEQ_LEN
    assert long.model.flavor == phase2.model.flavor == "2B"
    assert long.training.global_batch_tokens == phase2.training.global_batch_tokens  # 384 x 16k = 1,536 x 4k


def test_the_model_is_the_2b_at_16k_with_its_parameter_count_unchanged(long):
    config = model_config(long)  # the recipe's [model] overrides, checked as a launch checks them
    assert config.max_seq_len == SEQ_LEN
    with torch.device("meta"):
        model = config.build()
        base = laneformer_configs["2B"]().build()
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in base.parameters()) == 2_320_069_632
    # RoPE has no parameters: the same tensors, so phase 2's checkpoint loads as is
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in base.named_parameters()}


def test_window_layers_keep_their_theta_and_the_full_layers_get_a_larger_one(long, phase2):
    config, before = model_config(long), model_config(phase2)
    window, full = config.window_layers, [i for i in range(config.n_layers) if i not in config.window_layers]
    assert window == before.window_layers == list(range(10)) and full == [10, 11, 12, 13, 14]
    for i in window:
        assert config.rope_of(i).theta == before.rope_of(i).theta == laneformer_configs["2B"]().rope_theta
    for i in full:
        rope = config.rope_of(i)
        assert rope.theta == config.rope_theta_global > before.rope_of(i).theta
        assert rope.scaling == "none"  # ABF only: the base changes, positions are not interpolated


def test_short_context_data_keeps_at_least_40_percent_by_weight_and_by_tokens(long):
    sources, t = long.data.sources, long.training
    short = [s for s in sources if not is_long(s)]
    assert short and len(short) < len(sources)
    assert sum(s.weight for s in short) / sum(s.weight for s in sources) >= SHORT_SHARE - 1e-12
    # the tokens the run reads: samples are allocated per period by largest remainder (data.mixture), so each
    # source's realized share may differ from its weight by under one sample per period
    rows = needs(sources, t.seq_len, t.samples)
    planned = sum(n.planned_tokens for n in rows)
    short_tokens = sum(n.planned_tokens for n, s in zip(rows, sources) if not is_long(s))
    assert short_tokens / planned >= SHORT_SHARE - len(sources) / DEFAULT_PERIOD


def test_long_sources_keep_documents_of_the_training_length_and_concatenate_repositories(long):
    long_sources = [s for s in long.data.sources if is_long(s)]
    assert long_sources and all(s.min_doc_tokens == SEQ_LEN for s in long_sources)
    assert all(s.hub_id for s in long_sources)
    repos = [s for s in long_sources if s.concat_by]
    assert [(s.concat_by, s.concat_order, s.text_key) for s in repos] == [
        ("max_stars_repo_name", "max_stars_repo_path", "content")]  # The Stack v1's columns (ProLong's code)


def test_every_source_has_an_expected_size_that_covers_its_plan(long):
    assert all(s.expected_tokens for s in long.data.sources)
    assert R.check_needs(long) == []  # the dry run's size check: plan <= expected_tokens x max_epochs


def test_it_validates_at_4k_and_16k_on_held_out_sets_including_phase_2s(long, phase2):
    assert long.eval.lengths(long.training.seq_len) == [4096, SEQ_LEN]
    assert long.eval.position_buckets > 0
    sets = long.validation_sets
    assert set(sets) == {s.name for s in long.data.sources}  # every source holds documents out
    # at 16k every held-out set must hold one eval: val_samples rows of seq_len tokens (long sources: by count)
    for s in long.data.sources:
        if is_long(s):
            assert isinstance(s.held_out, int) and s.held_out * s.min_doc_tokens >= long.eval.val_samples * SEQ_LEN
    # the short sources are phase 2's own, split the same way: their 4k losses compare across the phases
    before = {s.name: s for s in phase2.data.sources}
    for s in long.data.sources:
        if not is_long(s):
            assert (s.path, s.hub_id, s.subset, s.held_out) == (before[s.name].path, before[s.name].hub_id,
                                                               before[s.name].subset, before[s.name].held_out)
            assert sets[s.name] == phase2.validation_sets[s.name]
