"""The preference objectives and the per-sequence log-probs they compare.

The losses follow open-instruct's ``open_instruct/dpo_utils.py`` (``dpo_loss``, ``simpo_loss``,
``_get_batch_logps``), itself after Rafailov et al. 2023 (DPO, eq. 7) and Mitchell's conservative
DPO (label smoothing, https://ericmitchell.ai/cdpo.pdf); torchtune's ``DPOLoss`` is the same sigmoid
loss (and the shape of ``PreferenceLoss``), and its test case is ours (tests/train/test_preference.py):

- ``dpo``: summed log-probs of the answer tokens; loss ``-log sigmoid(beta * ((pc - pr) - (rc - rr)))``
  (smoothed: ``(1 - ls) * that + ls * -log sigmoid(-beta * ...)``); rewards ``beta * (p - r)``.
- ``dpo_norm``: the same on the mean log-prob per answer token (open-instruct's default, Tulu 3).
- ``simpo``: no reference; mean log-probs, loss ``-log sigmoid(beta * (pc - pr) - gamma)``, SimPO's
  eq. 6 (Meng et al. 2024, https://arxiv.org/abs/2405.14734; open-instruct takes ``gamma / beta`` as
  ``gamma_beta_ratio``); rewards ``beta * p``.

Log-probs are taken with log-softmax in fp32 whatever the logits' dtype (TRL #878: fp16 logits gave
NaN rewards).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from data.mixture import IGNORE_INDEX

LOSSES = ("dpo", "dpo_norm", "simpo")
NEEDS_REFERENCE = {"dpo": True, "dpo_norm": True, "simpo": False}
AVERAGED = {"dpo": False, "dpo_norm": True, "simpo": True}  # mean over answer tokens, else the sum


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, average: bool) -> torch.Tensor:
    """Per row: the sum (or the mean) of the labels' log-probs over the labels that are not
    IGNORE_INDEX (the answer tokens), with log-softmax in fp32. logits [R, L, V], labels [R, L]
    (already shifted: label t is the token after input t)."""
    kept = labels != IGNORE_INDEX
    logps = torch.log_softmax(logits.float(), dim=-1)
    token = torch.gather(logps, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    total = (token * kept).sum(-1)
    return total / kept.sum(-1) if average else total


class PreferenceLoss:
    """A preference objective with its parameters, in torchtune's ``DPOLoss`` shape: built once from the
    recipe's ``[preference]``, called on per-sequence log-probs (sums for ``dpo``, means for ``dpo_norm``
    and ``simpo``: ``average``) by the trainer on each micro batch and on the held-out pairs
    (train.callbacks.eval). ``gamma`` is SimPO's margin."""

    def __init__(self, kind: str, beta: float, label_smoothing: float, gamma: float):
        if kind not in LOSSES:
            raise ValueError(f"unknown preference loss {kind!r}; known: {LOSSES}")
        self.kind, self.beta, self.label_smoothing, self.gamma = kind, beta, label_smoothing, gamma
        self.needs_reference = NEEDS_REFERENCE[kind]
        self.average = AVERAGED[kind]

    def __call__(self, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                 ref_chosen: torch.Tensor | None = None, ref_rejected: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair losses, chosen rewards, rejected rewards); the reference's log-probs for ``dpo`` and
        ``dpo_norm`` only."""
        beta = self.beta
        if self.needs_reference:
            assert ref_chosen is not None and ref_rejected is not None, f"{self.kind} needs the reference's log-probs"
            logits = beta * ((policy_chosen - policy_rejected) - (ref_chosen - ref_rejected))
            chosen_rewards = beta * (policy_chosen - ref_chosen)
            rejected_rewards = beta * (policy_rejected - ref_rejected)
        else:
            logits = beta * (policy_chosen - policy_rejected) - self.gamma
            chosen_rewards, rejected_rewards = beta * policy_chosen, beta * policy_rejected
        ls = self.label_smoothing
        losses = -F.logsigmoid(logits) * (1 - ls) - F.logsigmoid(-logits) * ls
        return losses, chosen_rewards.detach(), rejected_rewards.detach()


def pair_sums(losses: torch.Tensor, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
              chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """The sums over a batch's pairs of what ``train.preference.metrics.STEP_METRICS`` average, in their order (fp64): divided
    by the pairs' count after summing over micro batches and ranks, they are the metrics."""
    margin = chosen_rewards - rejected_rewards
    columns = (losses.detach(), chosen_logps.detach(), rejected_logps.detach(), chosen_rewards, rejected_rewards,
               (margin > 0).to(margin.dtype), margin)
    return torch.stack([c.double().sum() for c in columns])
