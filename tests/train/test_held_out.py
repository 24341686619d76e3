"""Held-out sets in a run (data.held_out): the preflight refuses a source whose held-out set is missing
or split otherwise, naming the command that splits it; the dry run lists every set with its size; the
in-loop validation scores each set's first val_samples samples (the same on any number of ranks and any
micro batch) and weights their mean by tokens."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data import held_out as H
from data.mixture import IGNORE_INDEX, Mixture, SourceSpec
from data.tokenizer import Tokenizer
from eval.spec import EvalSpec
from tests.conftest import metrics, short, train
from tests.data.test_held_out_split import random_docs, write_source
from rundir import REPO
from train import data as train_data
from train import recipe as R
from train.build import preflight
from train.callbacks.eval import Eval, token_bytes, validation_rows
from train.metric_names import VAL_BPB, VAL_LOSS, per_set
from plan.data import data_report


def with_source(tmp_path, path, *sets):
    return ["run.output_dir=" + str(tmp_path / "run"), "training.steps=2", "schedule.warmup_steps=1",
            f'data.sources=[{{name = "a", path = "{path}", weight = 1.0, max_epochs = 1000}}]', *sets]


def test_a_source_without_its_held_out_set_is_refused_with_the_command_that_splits_it(tmp_path):
    source = write_source(tmp_path / "a", [random_docs(100, seed=1)])
    sets = with_source(tmp_path, source, "data.held_out=0.2")
    recipe = R.load("tiny.toml", sets)
    (problem,) = preflight(recipe, world_size=1).problems
    command = f"python -m train.data held-out --recipe {recipe.path} --source a"
    assert problem == (f"{recipe.path}: [data.sources[0]] held_out: source 'a' has no held-out set ({source / 'held_out'}); "
                       f"split it off without re-tokenizing: {command}")
    # the command it names, with the same --set values, splits it; then the recipe passes
    args = ["held-out", "--recipe", "tiny.toml", *(f"--set={s}" for s in sets), "--source", "a"]
    assert train_data.main(args) == 0
    assert preflight(R.load("tiny.toml", sets), world_size=1).problems == []

    other = R.load("tiny.toml", with_source(tmp_path, source, "data.held_out=0.3"))
    (problem,) = preflight(other, world_size=1).problems
    assert problem == (f"{other.path}: [data.sources[0]] held_out: source 'a' is 0.3, but "
                       f"{source / 'held_out' / 'manifest.json'} records held_out 0.2: give that, or tokenize the source again")

    (source / "held_out" / "00000_unshuffled.ds").write_bytes(b"\0")  # a damaged held-out set, named
    (problem,) = preflight(R.load("tiny.toml", sets), world_size=1).problems
    assert problem.startswith(f"{recipe.path}: [data.sources[0]] held_out: source 'a': ") and "00000_unshuffled.ds" in problem


def as_before_0_2(source):
    """A source split before laneformer 0.2: ``heldout/``, the rule recorded under ``holdout``."""
    (source / H.HELD_OUT_DIR).rename(source / H.OLD_DIR)
    for manifest in (source / "manifest.json", source / H.OLD_DIR / "manifest.json"):
        m = json.loads(manifest.read_text())
        entry = m.pop("held_out")
        m[H.OLD_KEY] = {(H.OLD_KEY if k == "held_out" else k): v for k, v in entry.items()}
        manifest.write_text(json.dumps(m, indent=2))


def test_names_from_before_0_2_are_read_with_a_message_and_nothing_is_rewritten(tmp_path, capsys):
    source = write_source(tmp_path / "a", [random_docs(100, seed=1)])
    H.split(source, 0.2)
    as_before_0_2(source)
    manifest = (source / "manifest.json").read_bytes()
    recipe = tmp_path / "old.toml"  # the old keys, in a file (a --set takes the new names only)
    recipe.write_text((REPO / "recipes" / "tiny.toml").read_text().replace("held_out = 0.1", "holdout = 0.2"))
    sets = with_source(tmp_path, source)
    r = R.load(str(recipe), sets)
    assert r.data.held_out == 0.2 and r.data.sources[0].held_out == 0.2
    assert r.validation_sets == {"a": str(source / H.OLD_DIR)}
    assert preflight(r, world_size=1).problems == []
    err = capsys.readouterr().err
    assert (f"{recipe}: [data] holdout: renamed 'held_out' in laneformer 0.2; read as held_out = 0.2 (the old name "
            "is read until the next release)") in err
    assert f"{source / H.OLD_DIR}: split before laneformer 0.2, read as its held_out set" in err

    # the old command and flag still split (here: find the split done), each saying so
    assert train_data.main(["holdout", "--recipe", str(recipe), *(f"--set={s}" for s in sets)]) == 0
    assert H.main([str(source), "--holdout", "0.2"]) == 0
    err = capsys.readouterr().err
    assert "holdout: renamed held-out in laneformer 0.2; run as held-out" in err
    assert "--holdout: renamed --held-out in laneformer 0.2; read as --held-out 0.2" in err
    assert (source / "manifest.json").read_bytes() == manifest and not (source / H.HELD_OUT_DIR).exists()

    dpo = tmp_path / "old-dpo.toml"
    dpo.write_text((REPO / "recipes" / "tiny-dpo.toml").read_text().replace("held_out = [", "heldout = ["))
    assert R.load(str(dpo)).preference.held_out == R.load("tiny-dpo").preference.held_out != []
    assert f"{dpo}: [preference] heldout: renamed 'held_out' in laneformer 0.2" in capsys.readouterr().err

    recipe.write_text(recipe.read_text().replace("holdout = 0.2", "holdout = 0.2\nheld_out = 0.1"))
    with pytest.raises(R.RecipeError, match=r"old.toml: \[data\] has both 'holdout' and 'held_out'"):
        R.load(str(recipe), sets)


def test_a_source_may_hold_out_otherwise_or_nothing():
    recipe = R.load("sft.toml", ["checkpoint.init_from=null"])
    assert {s.name: s.held_out for s in recipe.data.sources} == {
        "tulu3-mixture": 500, "self-oss-instruct": 500, "identity": 0, "code": 0.0001}
    assert list(recipe.validation_sets) == ["tulu3-mixture", "self-oss-instruct", "code"]


def test_the_dry_run_lists_each_held_out_set_with_what_its_shards_hold(tmp_path):
    recipe = R.load("tiny.toml", [f"run.output_dir={tmp_path / 'run'}"])
    report = data_report(recipe)
    for s in recipe.data.sources:  # counted from the shards' bytes, not read from a manifest
        held = H.held_out_dir(s.path)
        documents = sum(p.stat().st_size // 8 for p in held.glob("*.ds.index"))
        tokens = sum(p.stat().st_size // 2 for p in held.glob("*.ds"))
        assert f"  {s.name}: {documents:,} documents, {tokens:,} tokens; held_out 0.1: {held}\n" in report + "\n"
    assert "held-out sets (never trained on; validated every 100 steps and at the end, on the first 16 sequences " \
           "of 128 tokens of each, on any number of GPUs): eval/val_loss/<name>, eval/val_bpb/<name>" in report


class Unigram(torch.nn.Module):
    """Logits that ignore the context: every position scores the vocabulary with one fixed vector."""

    def __init__(self, vocab: int):
        super().__init__()
        self.bias = torch.randn(vocab, generator=torch.Generator().manual_seed(0))

    def forward(self, ids, positions=None):
        return self.bias.expand(*ids.shape, -1)


def test_validation_scores_every_set_and_weights_their_mean_by_tokens(tmp_path):
    """Two sets of different sizes in tokens (one keeps only odd ids as labels, a chat mask), scored
    by hand from the unigram's log-softmax over the same samples."""
    sets = {"plain": str(write_source(tmp_path / "plain", [random_docs(40, seed=1)])),
            "masked": str(write_source(tmp_path / "masked", [random_docs(40, seed=2)], loss=True))}
    tok, model, seq_len, micro = Tokenizer(), Unigram(4096), 16, 2
    hook = Eval(Eval.Config(spec=EvalSpec(val_samples=3), val_sets=sets), trainer=None)
    trainer = SimpleNamespace(config=SimpleNamespace(training=SimpleNamespace(seq_len=seq_len, local_batch_size=micro)),
                              tokenizer=SimpleNamespace(tokenizer=tok), model_parts=[model], device="cpu")
    got = hook.validation(trainer)

    logp, nbytes = torch.log_softmax(model.bias, -1).numpy(), token_bytes(tok.sp)
    totals = {}
    for name, path in sets.items():  # samples 0-2 of each set: the second batch's second row is padding
        labels = Mixture([SourceSpec(name, path, weight=1.0, max_epochs=1e9)], seq_len).batch(np.arange(3))["labels"]
        kept = labels[labels != IGNORE_INDEX]
        totals[name] = (-logp[kept].sum(), len(kept), nbytes[kept].sum())
        assert abs(got[per_set(VAL_LOSS, name)] - totals[name][0] / totals[name][1]) < 1e-5
        assert abs(got[per_set(VAL_BPB, name)] - totals[name][0] / math.log(2) / totals[name][2]) < 1e-5
    (n1, t1, b1), (n2, t2, b2) = totals.values()
    assert t2 < t1 * 0.8  # the mask keeps fewer labels: a plain average of the two would differ
    assert abs(got[VAL_LOSS] - (n1 + n2) / (t1 + t2)) < 1e-5
    assert abs(got[VAL_LOSS] - (n1 / t1 + n2 / t2) / 2) > 1e-3
    assert abs(got[VAL_BPB] - (n1 + n2) / math.log(2) / (b1 + b2)) < 1e-5


@pytest.mark.parametrize("val_samples", [1, 5, 8, 13])
def test_validation_scores_exactly_val_samples_on_any_ranks_and_micro_batch(val_samples):
    """Samples 0 .. val_samples - 1, each on one rank once, whatever the ranks and micro batch; every
    rank runs as many forwards as the others, of micro rows each (the rest padding)."""
    for world, micro in itertools.product((1, 2, 3, 8), (1, 2, 4)):
        ranks = [validation_rows(val_samples, micro, world, rank) for rank in range(world)]
        assert len({len(batches) for batches in ranks}) == 1
        assert all(rows.shape == (micro,) for batches in ranks for rows in batches)
        scored = np.concatenate([rows for batches in ranks for rows in batches])
        assert sorted(scored[scored >= 0]) == list(range(val_samples)), (world, micro)


@pytest.mark.slow
def test_two_ranks_validate_as_one_with_another_micro_batch(tmp_path):
    """A 2-rank run's eval at step 2, and the same run resumed from its step-1 checkpoint on 1 rank with
    half the micro batch: val_samples 3 is a multiple of neither world x micro (8, 2), and the losses are
    equal (the weights differ by the summation order of one step). Rounded up to whole batches, 2 ranks
    read 8 samples a set and 1 rank 4."""
    sets = ("schedule.warmup_steps=1", "run.deterministic=true", "checkpoint.interval=1", "eval.every=0",
            "eval.val_samples=3")
    result = train("tiny.toml", *short(tmp_path / "two", 2, *sets), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(tmp_path / "two" / "run", tmp_path / "one" / "run")
    shutil.rmtree(tmp_path / "one" / "run" / "checkpoints" / "step-2")
    result = train("tiny.toml", *short(tmp_path / "one", 2, *sets, "training.micro_batch=2"), nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training starts at step 2" in result.stdout
    two, one = (metrics(tmp_path / d / "run")[2] for d in ("two", "one"))
    keys = [k for k in two if k.startswith((VAL_LOSS, VAL_BPB))]
    assert len(keys) == 6  # over all sets, and per set (prose, code)
    assert {k: one[k] for k in keys} == pytest.approx({k: two[k] for k in keys}, abs=1e-5)


def test_a_bad_held_out_is_refused_naming_the_file_and_key(tmp_path):
    text = (R.RECIPES / "tiny.toml").read_text().replace('max_epochs = 4\n', 'max_epochs = 4\nheld_out = 1.5\n', 1)
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(R.RecipeError) as e:
        R.load(str(tmp_path / "bad.toml"))
    assert str(e.value) == (f"{tmp_path / 'bad.toml'}: [data.sources[0]] source 'prose' (assets/sample_data/prose): "
                            "held_out: a fraction must be in (0, 1) (a document count is an integer), got 1.5")
    with pytest.raises(R.RecipeError, match=r"^--set data.held_out=-3 \(over .*tiny.toml\): \[data\] held_out: "
                                            r"a document count must be >= 1 \(0: no held_out\), got -3$"):
        R.load("tiny.toml", ["data.held_out=-3"])
