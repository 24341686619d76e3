"""A source's ``loss_weight`` (data.mixture, train.objectives.weighted_cross_entropy): the step's loss is
sum(w x ce) / sum(w), each trained token weighted by its source's weight, checked against torch's
per-token losses and, for a real run's first step, against the loss recomputed from the weights it
started from; refused where it would be ignored (pairs). Under context parallelism the weights are cut
with the tokens: tests/models/test_context_parallel.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.mixture import IGNORE_INDEX, LOSS_WEIGHTS, Mixture, MixtureError, SourceSpec
from eval.load import load_checkpoint
from rundir import REPO
from tests.conftest import losses, short, train
from torchtitan.components.loss import cross_entropy_loss
from train import recipe as R
from train.objectives.weighted_cross_entropy import weighted_cross_entropy
from train.recipe.objective import CROSS_ENTROPY, WEIGHTED_CROSS_ENTROPY

PROSE, CODE = REPO / "assets/sample_data/prose", REPO / "assets/sample_data/code"


def test_the_weighted_loss_is_torchs_per_token_losses_weighted():
    torch.manual_seed(0)
    pred, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    labels[0, :2] = IGNORE_INDEX
    weights = torch.where(labels != IGNORE_INDEX, torch.tensor([[3.0], [0.5]]), 0.0)
    by_token = [weights[b, t] * -torch.log_softmax(pred[b, t], -1)[labels[b, t]]
                for b in range(2) for t in range(5) if labels[b, t] != IGNORE_INDEX]
    assert torch.allclose(weighted_cross_entropy(pred, labels, weights), torch.stack(by_token).sum())
    # weights of 1: torchtitan's own summed cross-entropy
    ones = (labels != IGNORE_INDEX).float()
    assert torch.allclose(weighted_cross_entropy(pred, labels, ones), cross_entropy_loss(pred, labels))


def test_a_batch_carries_each_sources_weight_on_its_trained_tokens_and_none_without_weights():
    plain = Mixture([SourceSpec("prose", PROSE, weight=1), SourceSpec("code", CODE, weight=1)], seq_len=32)
    assert LOSS_WEIGHTS not in plain.batch(range(8))
    mixture = Mixture([SourceSpec("prose", PROSE, weight=1), SourceSpec("code", CODE, weight=1, loss_weight=4)],
                      seq_len=32)
    batch = mixture.batch(range(8))
    assert set(batch["source"]) == {0, 1}
    expected = np.where(batch["source"] == 1, 4.0, 1.0)[:, None] * (batch["labels"] != IGNORE_INDEX)
    assert batch[LOSS_WEIGHTS].dtype == np.float32 and np.array_equal(batch[LOSS_WEIGHTS], expected)
    for key in ("input_ids", "labels", "positions"):  # the weights change nothing else
        assert np.array_equal(batch[key], plain.batch(range(8))[key])


@pytest.mark.parametrize("kwargs, message", [
    ({"loss_weight": 0.0}, "loss_weight must be finite and > 0, got 0.0"),
    ({"loss_weight": math.nan}, "loss_weight must be finite and > 0, got nan"),
    ({"loss_weight": 2.0, "pairs": True}, "loss_weight: not for pairs"),
])
def test_a_loss_weight_that_would_be_ignored_or_undefined_is_refused(kwargs, message):
    with pytest.raises(MixtureError, match=message):
        SourceSpec("a", PROSE, weight=1, **kwargs)


def test_a_loss_weight_makes_the_run_weighted_and_context_parallelism_takes_it():
    """The objective is a property of the recipe (train.recipe.objective): a source's loss weight other than 1
    makes it weighted cross-entropy, under CP too (its slicing cuts the weights with the tokens)."""
    cp2 = ["parallel.context_parallel=2", "training.seq_len=256", "eval.every=0", "eval.at_end=false"]
    assert R.load("tiny.toml", []).objective == CROSS_ENTROPY
    assert R.load("tiny.toml", ["data.sources.code.loss_weight=1.0"]).objective == CROSS_ENTROPY
    weighted = R.load("tiny.toml", [*cp2, "data.sources.code.loss_weight=5.0"])
    assert weighted.objective == WEIGHTED_CROSS_ENTROPY and weighted.data.sources[1].loss_weight == 5.0


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_runs_first_loss_is_the_weighted_loss_of_the_weights_it_started_from(tmp_path, nproc):
    """A run starting from a checkpoint's weights logs, at step 1, sum(w x ce) / sum(w) over its first global
    batch, recomputed here from those weights; it is not the token mean (the weights are used). On 2 ranks
    each holds half the batch: sum(w) is the global one, not each rank's (a mean of the ranks' weighted
    means is another number, as the ranks' sums of weights differ)."""
    start = tmp_path / "start"
    assert train("tiny.toml", *short(start, 3), "eval.every=0").returncode == 0
    recipe = tmp_path / "weighted.toml"
    recipe.write_text((REPO / "recipes/tiny.toml").read_text()
                      .replace('prose"\nweight = 0.5\n', 'prose"\nweight = 0.6\n')
                      .replace('code"\nweight = 0.5\n', 'code"\nweight = 0.4\nloss_weight = 5.0\n'))
    result = train(str(recipe), *short(tmp_path, 3), "eval.every=0", f"checkpoint.init_from={start / 'run'}",
                   "checkpoint.init_weights_only=true", nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = losses(tmp_path / "run")[1]

    r = R.load(str(recipe), [f"checkpoint.init_from={start / 'run'}", *short(tmp_path, 3)])
    mixture = Mixture(r.data.sources, seq_len=r.training.seq_len, seed=r.run.seed)
    batch = mixture.batch(range(r.training.global_batch))
    model = load_checkpoint(start / "run", device="cpu").model_fn
    with torch.no_grad():
        logits = model(torch.from_numpy(batch["input_ids"]), positions=torch.from_numpy(batch["positions"]))
    labels = torch.from_numpy(batch["labels"])
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    rank_weights = torch.from_numpy(batch[LOSS_WEIGHTS]).view(nproc, -1).sum(1)
    assert len(set(rank_weights.tolist())) == nproc  # the ranks' sums of weights differ (2 and 1 code samples)
    weights = torch.from_numpy(batch[LOSS_WEIGHTS]).flatten()
    weighted, mean = float((ce * weights).sum() / weights.sum()), float(ce[labels.flatten() != IGNORE_INDEX].mean())
    assert logged == pytest.approx(weighted, rel=1e-4)
    assert abs(weighted - mean) > 1e-2  # the two differ by more than the tolerance: the weights are used
