"""What every objective is: torchtitan's loss slot (``BaseLoss``), owning everything about a run's loss.

The trainer (train.trainer) builds the recipe's objective as torchtitan builds any loss
(``Trainer.Config.loss``; ``trainer.objective``) and calls it at one place, one micro batch at a time,
never asking which it is. An objective owns:

- ``inputs``: the keys of the batch that are its, not the model's (loss weights, pair ids), carried with the
  batch and handed to ``__call__`` as keyword arguments, as torchtitan's own RL losses take theirs
  (``torchtitan/experiments/rl/losses/``); of those, ``per_token`` are [batch, seq] and context
  parallelism cuts them with the tokens (``LaneformerTrainer.post_dataloading_process``, the one place);
- ``weight``: what a micro batch adds to the loss's denominator (its valid tokens, their loss weights,
  its pairs); the trainer sums it over the step's micro batches and ranks, so every objective
  normalises over the step's global tokens or pairs, whatever the micro batches and world size;
- ``__call__``: the micro batch's loss over that global denominator;
- ``prepare``: anything before the first step (the preference reference pass);
- ``make_batches``: the step's micro batches as the loader gave them made into what the forward takes (an
  RL run samples its completions and scores them here); identity for the others;
- ``step_metrics``: its metrics beyond the loss, summed over the data-parallel ranks and logged at
  logging steps through the trainer's one point (``LaneformerTrainer.log_step``);
- ``evaluates``/``evaluate``: its own held-out score, run by the eval callback (train.callbacks.eval);
- from a recipe: its config (``config_of``), its data (``dataloader_of``) and its preflight (``check``).

A new objective is one file here and its line in ``train.objectives.OBJECTIVES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

import torch

from torchtitan.components.loss import IGNORE_INDEX, BaseLoss
from torchtitan.config import CompileConfig, Configurable

from data.loader import MixtureDataLoader
from data.tokenizer import Tokenizer
from health.phases import Phase
from models.laneformer import Laneformer
from train.recipe import Recipe


class TrainerParts(Protocol):
    """What an objective reads of the trainer, before step 1 and in its evaluation (the trainer stands above
    this room: named by this contract, never imported)."""

    @property
    def step(self) -> int: ...

    @property
    def config(self) -> Any: ...  # LaneformerTrainer.Config

    @property
    def rank0(self) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def model_parts(self) -> list[torch.nn.Module]: ...

    @property
    def dataloader(self) -> Any: ...  # the objective's own loader (``dataloader_of``)

    @property
    def tokenizer(self) -> Any: ...  # data.loader.SentencePieceTokenizer

    def enter(self, phase: Phase) -> None: ...


class Objective(BaseLoss):
    name: ClassVar[str]  # as train.recipe.objective names it
    inputs: ClassVar[tuple[str, ...]] = ()
    per_token: ClassVar[tuple[str, ...]] = ()
    evaluates: bool = False  # whether ``evaluate`` has anything to score in this run
    eval_name: ClassVar[str] = ""  # its part's name in the eval callback's errors
    reads_sources: ClassVar[bool] = True  # trains on [[data.sources]] (an RL run reads its [rl] tasks instead)

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        pass  # each objective declares its own (torchtitan builds a Config's owner class)

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        self.config = config

    @classmethod
    def config_of(cls, recipe: Recipe, model: Laneformer.Config) -> Config:
        """The run's objective config, from its recipe (train.build)."""
        return cls.Config()

    @classmethod
    def dataloader_of(cls, recipe: Recipe, model: Laneformer.Config) -> Configurable.Config:
        """The loader of the objective's batches: the mixture of the recipe's sources."""
        return MixtureDataLoader.Config(sources=recipe.data.sources, vocab_size=model.vocab_size,
                                        seed=recipe.run.seed, total_samples=recipe.training.samples)

    @classmethod
    def check(cls, recipe: Recipe, model: Laneformer.Config, tokenizer: Tokenizer) -> list[str]:
        """The preflight's questions of the objective against the run's sources, as ``file: [table] key: why``:
        pair sources are a preference run's only (else it would train on the rejected answers too)."""
        paired = [s.name for s in recipe.data.sources if s.pairs]
        return [f"{recipe.path}: [preference] loss: source(s) {paired} are preference pairs: a run on them needs a "
                "preference loss (dpo, dpo_norm or simpo), else it would train on the rejected answers too"
                ] if paired else []

    def weight(self, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """What the micro batch adds to the denominator: its valid tokens."""
        return (labels != IGNORE_INDEX).sum()

    def prepare(self, trainer: TrainerParts) -> None:
        """Before the first step, after the checkpoint load."""

    def make_batches(self, trainer: TrainerParts, batches: list) -> list:
        """The step's micro batches, ``(input_dict, labels)`` as the loader gave them, made into the ones the
        forward takes, before their denominator is summed (``weight``): the loader's batches themselves."""
        return batches

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> dict[str, float]:
        """After every step: at a logging step (``reduce`` given: the sum over the data-parallel ranks) the
        objective's own metrics over the step; either way they start again for the next."""
        return {}

    def evaluate(self, trainer: TrainerParts) -> dict[str, float]:
        """Its held-out score (only called where ``evaluates``)."""
        raise NotImplementedError(f"{self.name} has no evaluation of its own")
