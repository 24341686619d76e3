"""Next-token cross-entropy, torchtitan's own loss (``CrossEntropyLoss``): the sum over the micro batch's
valid tokens over the step's valid tokens on all ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig

from models.laneformer import Laneformer
from train.objectives.base import Objective
from train.recipe import Recipe
from train.recipe.objective import CROSS_ENTROPY


class CrossEntropy(Objective):
    name = CROSS_ENTROPY

    @dataclass(kw_only=True, slots=True)
    class Config(Objective.Config):
        global_vocab_size: int | None = None  # torchtitan's CrossEntropyLoss.Config's (its loss-parallel CE)

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        super().__init__(config)
        self.loss = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=config.global_vocab_size),
                                     compile_config=compile_config)

    @classmethod
    def config_of(cls, recipe: Recipe, model: Laneformer.Config) -> Config:
        return cls.Config(global_vocab_size=model.vocab_size)

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.loss(pred, labels, global_valid_tokens)
