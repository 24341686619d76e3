"""The RL objective's loss (train.objectives.rl) against torchtitan 0.3.0's own losses, loaded by file path
(``import torchtitan.experiments.rl`` imports vLLM), and against a direct per-sequence GRPO; its normalisation
over the step (one big batch = k accumulated micro batches), padding, and zero-variance groups.

verl #593's worked numbers (3.3333 vs 6.0) could not be found in the stored issue threads (searched "verl 593
loss_agg_mode token-mean seq-mean"): they are not used here rather than invented.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import torchtitan
from torchtitan.components.loss import IGNORE_INDEX

from train.objectives.rl import ADVANTAGES, GENERATOR_LOGPROBS, LOSS_MASK, Rl, advantages, dapo_module, rows
from train.recipe.schema import Rl as RlTable
from models.laneformer.sample import Sample

B, S, V, MAX_NEW = 6, 10, 11, 8
LOSSES = ("dapo", "dr_grpo", "grpo")


def objective(loss: str, clip_low: float = 0.2, clip_high: float = 0.28) -> Rl:
    return Rl(Rl.Config(rl=RlTable(loss=loss, clip_low=clip_low, clip_high=clip_high, max_new_tokens=MAX_NEW)))


def batch(seed: int = 0):
    """Logits (a leaf), labels and the loss's inputs: rows with 2..MAX_NEW completion tokens after a prompt,
    generator log-probs off the policy's by up to +-0.5 (so that both clips bind), one advantage per row."""
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(B, S, V, generator=g).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for i in range(B):
        start, n = int(torch.randint(0, 2, (1,), generator=g)), int(torch.randint(2, MAX_NEW + 1, (1,), generator=g))
        mask[i, start:start + n] = True
    labels[~mask] = IGNORE_INDEX
    policy = -torch.nn.functional.cross_entropy(pred.detach().flatten(0, 1), labels.flatten(), reduction="none",
                                                ignore_index=IGNORE_INDEX).view(B, S)
    old = torch.where(mask, policy + (torch.rand(B, S, generator=g) - 0.5), torch.zeros(B, S))
    adv = (torch.randn(B, 1, generator=g) * mask)
    return pred, labels, {GENERATOR_LOGPROBS: old, ADVANTAGES: adv, LOSS_MASK: mask}


def grpo_file():
    """torchtitan's losses/grpo.py, by path; its ``from torchtitan.experiments.rl.losses.dapo import DAPOLoss``
    finds the dapo module already loaded by path (sys.modules), not the vLLM-importing package."""
    name = "torchtitan.experiments.rl.losses.dapo"
    saved = sys.modules.get(name)
    sys.modules[name] = dapo_module()
    try:
        path = Path(torchtitan.__file__).parent / "experiments" / "rl" / "losses" / "grpo.py"
        spec = importlib.util.spec_from_file_location("_torchtitan_rl_grpo", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved


def run(obj: Rl, pred, labels, inputs, denominator=None):
    """The loss of one call and the gradient on the logits."""
    if pred.grad is not None:
        pred.grad = None
    weight = obj.weight(inputs, labels) if denominator is None else denominator
    loss, _ = obj(pred, labels, weight, **inputs)
    loss.backward()
    return loss.detach(), pred.grad.clone()


def test_dapo_is_torchtitans_dapoloss_over_the_steps_response_tokens():
    pred, labels, inputs = batch()
    loss, grad = run(objective("dapo"), pred, labels, inputs)
    dapo = dapo_module()
    theirs = dapo.DAPOLoss(dapo.DAPOLoss.Config(ratio_clip_low=0.2, ratio_clip_high=0.28))
    pred.grad = None
    ref, _ = theirs(pred, labels, inputs[LOSS_MASK].sum(), generator_logprobs=inputs[GENERATOR_LOGPROBS],
                    advantages=inputs[ADVANTAGES], loss_mask=inputs[LOSS_MASK])
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grad, pred.grad, rtol=0, atol=0)


def test_dr_grpo_is_torchtitans_grpoloss_over_sequences_times_max_new_tokens():
    pred, labels, inputs = batch(1)
    loss, grad = run(objective("dr_grpo", 0.2, 0.2), pred, labels, inputs)
    grpo = grpo_file()
    pred.grad = None
    ref, _ = grpo.GRPOLoss(grpo.GRPOLoss.Config(clip_eps=0.2))(
        pred, labels, B * MAX_NEW, generator_logprobs=inputs[GENERATOR_LOGPROBS], advantages=inputs[ADVANTAGES],
        loss_mask=inputs[LOSS_MASK])
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grad, pred.grad, rtol=0, atol=0)


def per_sequence_grpo(pred, labels, inputs, low=0.2, high=0.28):
    """GRPO as DeepSeekMath writes it: each sequence's mean of the clipped surrogate, then the mean over them."""
    logp = -torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="none",
                                              ignore_index=IGNORE_INDEX).view(labels.shape)
    total = 0
    for i in range(labels.shape[0]):
        m = inputs[LOSS_MASK][i]
        ratio = torch.exp(logp[i][m] - inputs[GENERATOR_LOGPROBS][i][m])
        a = inputs[ADVANTAGES][i][m]
        total = total + (-torch.min(ratio * a, ratio.clamp(1 - low, 1 + high) * a)).mean()
    return total / labels.shape[0]


def test_grpo_is_the_mean_over_sequences_of_each_sequences_token_mean():
    """DAPOLoss with A_i / |o_i| over the sequences = the per-sequence form: the clipped surrogate is positively
    homogeneous in the advantage."""
    pred, labels, inputs = batch(2)
    loss, grad = run(objective("grpo"), pred, labels, inputs)
    pred.grad = None
    ref = per_sequence_grpo(pred, labels, inputs)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, pred.grad, rtol=1e-5, atol=1e-7)


def accumulated(obj, pred, labels, inputs, k, per_micro_batch=False):
    """k micro batches' losses and gradient, each over the step's denominator (as LaneformerTrainer.forward_backward
    sums ``weight``), or, ``per_micro_batch``, over its own: the bug of open-instruct PR #1161."""
    pred.grad = None
    parts = [(slice(i, i + B // k)) for i in range(0, B, B // k)]
    total_weight = sum(obj.weight({n: v[p] for n, v in inputs.items()}, labels[p]) for p in parts)
    loss = torch.zeros(())
    for p in parts:
        mb = {n: v[p] for n, v in inputs.items()}
        weight = obj.weight(mb, labels[p]) if per_micro_batch else total_weight
        part, _ = obj(pred[p], labels[p], weight, **mb)
        part.backward()
        loss += part.detach()
    return loss, pred.grad.clone()


@pytest.mark.parametrize("loss_type", LOSSES)
def test_one_big_batch_equals_k_accumulated_micro_batches(loss_type):
    obj = objective(loss_type)
    pred, labels, inputs = batch(3)
    loss, grad = run(obj, pred, labels, inputs)
    for k in (2, 3):
        acc_loss, acc_grad = accumulated(obj, pred, labels, inputs, k)
        torch.testing.assert_close(acc_loss, loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(acc_grad, grad, rtol=1e-5, atol=1e-7)
    if loss_type != "dr_grpo":  # the planted bug is caught (dr_grpo's constant is per sequence: no token count)
        bad_loss, bad_grad = accumulated(obj, pred, labels, inputs, 2, per_micro_batch=True)
        assert not torch.allclose(bad_grad, grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", LOSSES)
def test_padding_changes_nothing(loss_type):
    obj = objective(loss_type)
    pred, labels, inputs = batch(4)
    loss, grad = run(obj, pred, labels, inputs)
    extra = 5
    padded = torch.cat([pred.detach(), torch.randn(B, extra, V)], dim=1).requires_grad_()
    pad_labels = torch.cat([labels, torch.full((B, extra), IGNORE_INDEX)], dim=1)
    pad_inputs = {k: torch.cat([v, torch.zeros(B, extra, dtype=v.dtype)], dim=1) for k, v in inputs.items()}
    pad_loss, pad_grad = run(obj, padded, pad_labels, pad_inputs)
    torch.testing.assert_close(pad_loss, loss, rtol=1e-6, atol=1e-9)  # the same terms, summed over a longer row
    torch.testing.assert_close(pad_grad[:, :S], grad, rtol=0, atol=0)
    assert not pad_grad[:, S:].any()


@pytest.mark.parametrize("std_scale", [False, True])
def test_a_group_that_scores_the_same_gives_zero_gradient_and_leaves_the_denominator(std_scale):
    """rows() of a zero-variance group (kept out, as make_batches does) and of a scored one: the first's
    rows get no gradient and add nothing to the denominator; the advantage of equal rewards is 0 anyway."""
    assert advantages([0.5] * 4, std_scale) == [0.0] * 4
    prompt = [1, 5, 6]
    samples = [Sample([7, 8, 2], [-1.0, -2.0, -0.5], False), Sample([9, 2], [-1.5, -0.1], False)]
    same, same_labels = rows(prompt, samples, advantages([1.0, 1.0], std_scale), [False, False], 8, 0)
    varied, varied_labels = rows(prompt, samples, advantages([1.0, 0.0], std_scale), [True, True], 8, 0)
    inputs = {k: torch.cat([same[k], varied[k]]) for k in same if k != "input"}
    labels = torch.cat([same_labels, varied_labels])
    assert labels[2, 2:5].tolist() == [7, 8, 2] and inputs[LOSS_MASK][2].sum() == 3  # shifted by one
    for loss_type in LOSSES:
        obj = objective(loss_type)
        pred = torch.randn(4, 8, 12).requires_grad_()
        _, grad = run(obj, pred, labels, inputs)
        assert not grad[:2].any() and grad[2:].any()
        assert obj.weight(inputs, labels) == obj.weight({k: v[2:] for k, v in inputs.items()}, labels[2:])
