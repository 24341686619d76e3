"""Cross-entropy with a weight per token (``[[data.sources]] loss_weight``: the batch's ``loss_weights``,
data.mixture): sum(w x ce) over the step's summed weights on all ranks, Megatron's float loss mask;
torchtitan's token mean is its case w = 1 (tests/train/test_loss_weights.py). The weights are per token,
so context parallelism cuts them with the tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from torchtitan.components.loss import IGNORE_INDEX

from data.mixture import LOSS_WEIGHTS
from train.objectives.base import Objective
from train.recipe.objective import WEIGHTED_CROSS_ENTROPY


def weighted_cross_entropy(pred: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w x ce) over the tokens, in fp32: torchtitan's ``cross_entropy_loss`` (sum reduction, IGNORE_INDEX
    skipped) with each token's loss weighted."""
    ce = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX)
    return (ce * weights.flatten()).sum()


class WeightedCrossEntropy(Objective):
    name = WEIGHTED_CROSS_ENTROPY
    inputs = per_token = (LOSS_WEIGHTS,)

    @dataclass(kw_only=True, slots=True)
    class Config(Objective.Config):
        pass

    def weight(self, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """The micro batch's summed loss weights."""
        return batch[LOSS_WEIGHTS].sum(dtype=torch.float32)

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert global_valid_tokens is not None
        return weighted_cross_entropy(pred, labels, inputs[LOSS_WEIGHTS]) / global_valid_tokens, {}
