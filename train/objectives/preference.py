"""A preference run's objective (``[preference] loss``: DPO, dpo_norm, SimPO; train.preference.loss).

A micro batch is k pairs as ``[chosen..., rejected...]`` rows (data.pairs_loader), so chosen and rejected
go through one forward; its pair ids come with it (``PAIR_IDS``) to look up the reference log-probs. The
loss is the micro batch's sum of pair losses over the step's pairs on all ranks (its ``weight`` is its
pairs), so the loop's sum over micro batches and ranks, which it logs as the loss, is the mean pair loss,
as torchtitan's cross-entropy is the mean token loss.

Before step 1 (``prepare``, after the checkpoint load) the reference log-probs are computed or read
(train.preference.reference). At each logging step the ``pref/*`` metrics
(train.preference.metrics.STEP_METRICS) are the means over the step's pairs on all ranks. With
``[preference] held_out`` the eval callback scores those pairs (``evaluate``), with this same loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from torchtitan.config import CompileConfig
from torchtitan.tools.logging import logger

from data.chat import resolve_template, template_sha256
from data.pairs_loader import PAIR_IDS, PairDataLoader, PairSet
from data.tokenizer import Tokenizer
from health.phases import Phase
from models.laneformer import Laneformer
from train.objectives.base import Objective, TrainerParts
from train.preference import reference
from train.preference.loss import PreferenceLoss, pair_sums, sequence_logps
from train.preference.metrics import EVAL_ACCURACY, EVAL_LOSS, STEP_METRICS
from train.recipe import Preference as PreferenceTable
from train.recipe import Recipe, RecipeError
from train.recipe.objective import PREFERENCE


class Preference(Objective):
    name = PREFERENCE
    inputs = (PAIR_IDS,)  # one a pair, not a token: context parallelism leaves them whole
    eval_name = "held-out pairs"

    @dataclass(kw_only=True, slots=True)
    class Config(Objective.Config):
        # The recipe's [preference] as it is (train.recipe.Preference: its defaults are the only ones).
        preference: PreferenceTable = field(default_factory=PreferenceTable)
        template_sha256: str = ""  # the run's chat template: part of the reference key

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        super().__init__(config)
        p = config.preference
        assert p.loss is not None and p.gamma is not None  # a preference run's (Recipe.objective)
        self.loss = PreferenceLoss(p.loss, p.beta, p.label_smoothing, p.gamma)
        self.evaluates = bool(p.held_out)
        self.reference: dict[str, torch.Tensor] = {}  # role ("train", "held_out") -> [pairs, 2] on the device
        self.held_out_pairs: PairSet | None = None
        self.local_pairs = 0  # pairs per micro batch on this rank (its reference pass and evaluation go by it)
        self._pairs_per_step = 0  # on all ranks: the step metrics' means are over them
        self._sums: torch.Tensor | None = None  # STEP_METRICS' sums over the step's micro batches

    # -- from the recipe -------------------------------------------------------------------------------

    @classmethod
    def config_of(cls, recipe: Recipe, model: Laneformer.Config) -> Config:
        _, jinja = resolve_template(recipe.data.chat_template)
        return cls.Config(preference=recipe.preference, template_sha256=template_sha256(jinja))

    @classmethod
    def dataloader_of(cls, recipe: Recipe, model: Laneformer.Config) -> PairDataLoader.Config:
        return PairDataLoader.Config(sources=[str(s.path) for s in recipe.data.sources], vocab_size=model.vocab_size,
                                     seed=recipe.run.seed)

    @classmethod
    def check(cls, recipe: Recipe, model: Laneformer.Config, tokenizer: Tokenizer) -> list[str]:
        """A preference run's sources open as its pairs (``check_pairs``, which raises what it finds)."""
        check_pairs(recipe, model, tokenizer)
        return []

    # -- before step 1: the reference log-probs ---------------------------------------------------------

    def prepare(self, trainer: TrainerParts) -> None:
        c = trainer.config
        self.local_pairs = c.training.local_batch_size // 2
        self._pairs_per_step = c.training.global_batch_size // 2
        self._sums = torch.zeros(len(STEP_METRICS), dtype=torch.float64, device=trainer.device)
        p = self.config.preference
        # whatever the loss type: the eval scores them, against a reference or not (simpo)
        self.held_out_pairs = PairSet(p.held_out, c.training.seq_len, trainer.tokenizer.tokenizer.fingerprint,
                                      trainer.tokenizer.get_vocab_size()) if p.held_out else None
        if self.loss.needs_reference:
            trainer.enter(Phase.EVAL)  # a pass over every pair: the eval's stall allowance and goodput bucket
            self.reference = self._references(trainer)

    def _references(self, trainer: TrainerParts) -> dict[str, torch.Tensor]:
        """Each role's reference log-probs (train.preference.reference): at step 0 the init checkpoint is
        read and what the keys hold is recorded; a resumed run keys by the record."""
        c, p = trainer.config, self.config.preference
        sets = {"train": trainer.dataloader.loader.pairs}
        if self.held_out_pairs is not None:
            sets["held_out"] = self.held_out_pairs
        if trainer.step == 0:
            if not c.checkpoint.initial_load_path:
                raise reference.ReferenceError(f"[preference] loss {p.loss!r} needs a reference: set "
                                               "[checkpoint] init_from (the SFT checkpoint)")
            record = {"init": reference.checkpoint_identity(c.checkpoint.initial_load_path,
                                                            beat=lambda: trainer.enter(Phase.EVAL))}
        else:
            record = reference.read_inputs(c.dump_folder, trainer.step)
        out = {}
        for role, pairs in sets.items():
            inputs = reference.key_inputs(record["init"], pairs.paths, p.loss, c.training.seq_len,
                                          self.config.template_sha256, c.training.mixed_precision_param,
                                          c.compile.enable)
            out[role] = self._reference(trainer, role, pairs, inputs, record)
            record[role] = {"sources": pairs.paths, "inputs": inputs}
        if trainer.step == 0 and trainer.rank0:
            reference.write_inputs(c.dump_folder, record)
        return out

    def _reference(self, trainer: TrainerParts, role: str, pairs: PairSet, inputs: dict, record: dict
                   ) -> torch.Tensor:
        run_dir = trainer.config.dump_folder
        key = reference.cache_key(inputs)
        path = reference.cache_file(run_dir, role, key)
        if path.is_file():
            logps = reference.load(path, pairs)
            if trainer.rank0:
                logger.info(f"reference log-probs of the {role} pairs: reusing {path} (key {key}; not recomputed)")
        elif trainer.step > 0:
            raise reference.missing_at_resume(run_dir, role, trainer.step, record, pairs.paths, inputs)
        else:
            if trainer.rank0:
                logger.info(f"reference log-probs of the {role} pairs: computing {len(pairs):,} pairs with "
                            f"the init checkpoint {record['init']['path']} (key {key})")
            logps = reference.pair_logps(trainer.model_parts[0], pairs, self.local_pairs, self.loss.average,
                                         trainer.device, beat=lambda: trainer.enter(Phase.EVAL))
            if trainer.rank0:
                reference.save(path, logps)
                logger.info(f"reference log-probs of the {role} pairs: written to {path}")
        return torch.from_numpy(np.ascontiguousarray(logps)).to(trainer.device)

    # -- one micro batch ---------------------------------------------------------------------------------

    def weight(self, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """The micro batch's pairs."""
        return torch.tensor(labels.shape[0] // 2)

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert global_valid_tokens is not None and self._sums is not None  # the step's pairs; prepared
        k = pred.shape[0] // 2
        logps = sequence_logps(pred, labels, self.loss.average)
        chosen, rejected = logps[:k], logps[k:]
        ref = self.reference["train"][inputs[PAIR_IDS]].unbind(1) if self.loss.needs_reference else ()
        losses, chosen_rewards, rejected_rewards = self.loss(chosen, rejected, *ref)
        self._sums += pair_sums(losses, chosen, rejected, chosen_rewards, rejected_rewards)
        return losses.sum() / global_valid_tokens, {}

    # -- the step's metrics, and the held-out pairs ------------------------------------------------------

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> dict[str, float]:
        assert self._sums is not None
        out = {}
        if reduce is not None:
            out = dict(zip(STEP_METRICS, (reduce(self._sums) / self._pairs_per_step).tolist()))
        self._sums.zero_()
        return out

    def evaluate(self, trainer: TrainerParts) -> dict[str, float]:
        """The preference loss and accuracy on the held-out pairs, with autograd on, as the reference pass
        (train.preference.reference.pair_logps says why)."""
        assert self.held_out_pairs is not None  # evaluates: with [preference] held_out only
        policy = torch.from_numpy(reference.pair_logps(trainer.model_parts[0], self.held_out_pairs, self.local_pairs,
                                                       self.loss.average, trainer.device)).double()
        ref = self.reference["held_out"].double().cpu().unbind(1) if self.loss.needs_reference else ()
        losses, chosen, rejected = self.loss(policy[:, 0], policy[:, 1], *ref)
        return {EVAL_LOSS: float(losses.mean()), EVAL_ACCURACY: float((chosen > rejected).double().mean())}


def check_pairs(recipe: Recipe, config: Laneformer.Config, tokenizer: Tokenizer | None = None) -> str:
    """A preference run's sources: every training and held-out source opens as pairs that fit seq_len,
    and the run's pairs (steps x global batch / 2) fit in each source's ``max_epochs``. Returns what
    was found, for the dry run."""
    t = recipe.training
    tokenizer = tokenizer or Tokenizer(recipe.data.tokenizer)
    if plain := [s.name for s in recipe.data.sources if not s.pairs]:
        raise RecipeError(f"source(s) {plain}: a preference run trains on pairs only (set pairs = true on a "
                          "pair source)")
    held_out = len(PairSet(recipe.preference.held_out, t.seq_len, tokenizer.fingerprint, config.vocab_size)
                  if recipe.preference.held_out else [])
    pairs = PairSet([s.path for s in recipe.data.sources], t.seq_len, tokenizer.fingerprint, config.vocab_size)
    epochs = t.samples / 2 / len(pairs)
    for s in recipe.data.sources:
        if s.max_epochs is not None and epochs > s.max_epochs:
            raise RecipeError(f"source {s.name!r}: the run reads {t.samples // 2:,} pairs, "
                              f"{epochs:.2f} epochs of the {len(pairs):,} pairs, over its max_epochs {s.max_epochs}")
    return f"pairs on this machine: {len(pairs):,} ({epochs:.2f} epochs), held out: {held_out:,}"
