"""A preference run's part of ``train.build``: whether a recipe trains on a preference loss
(``[preference] loss``) decides here what the build does about it, before a launch (``check``) and
for its trainer (``configure``, called once by ``train.build.config.trainer_config``). Nothing else in
train/ asks, outside this package and the recipe's ``[preference]`` table (which checks what it asks
of ``[training]``): tests/train/test_one_pass.py holds to it. The rules of pair sources themselves are
the data's (the recipe's ``[data]``, data.pairs, data.pairs_loader).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from torchtitan.components.loss import BaseLoss
from torchtitan.config import CompileConfig

from data.chat import resolve_template, template_sha256
from data.pairs_loader import PairDataLoader, PairSet
from data.tokenizer import Tokenizer
from models.laneformer import Laneformer
from train.callbacks.eval import Eval
from train.preference.trainer import PreferenceTrainer
from train.recipe import Recipe, RecipeError
from train.trainer import LaneformerTrainer


def check(recipe: Recipe, config: Laneformer.Config, tokenizer: Tokenizer) -> list[str]:
    """The preflight's questions of ``[preference]`` against the run's sources: pair sources are read by a
    preference run only (else it would train on the rejected answers too), returned as a problem; a
    preference run's sources open as its pairs (``check_pairs``, which raises what it finds)."""
    if recipe.preference.loss is not None:
        check_pairs(recipe, config, tokenizer)
        return []
    paired = [s.name for s in recipe.data.sources if s.pairs]
    return [f"{recipe.path}: [preference] loss: source(s) {paired} are preference pairs: a run on them needs a "
            "preference loss (dpo, dpo_norm or simpo), else it would train on the rejected answers too"
            ] if paired else []


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


class TrainerLoss(BaseLoss):
    """torchtitan's loss slot in a preference run. torchtitan's Trainer builds ``config.loss`` whatever the
    trainer does with it; the preference trainer computes its loss in its own micro-batch body
    (train.preference.trainer, with train.preference.loss), so the slot holds this, which refuses a
    call, rather than a cross-entropy that, reached by mistake, would train on the rejected answers."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        pass

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a preference run's loss is its trainer's (train.preference.trainer), not torchtitan's "
                           "loss slot")


def configure(recipe: Recipe, config: LaneformerTrainer.Config) -> LaneformerTrainer.Config:
    """The run's trainer config: ``config`` (train.build's, next-token cross-entropy on the mixture) as it
    is, or, with a ``[preference]`` loss, the preference trainer's with the same settings but the data
    (pairs), the loss, the held-out pairs in the eval callback, and ``[preference]``'s values."""
    pref = recipe.preference
    if pref.loss is None:
        return config
    _, jinja = resolve_template(recipe.data.chat_template)
    shared = {f.name: getattr(config, f.name) for f in fields(LaneformerTrainer.Config)}
    return PreferenceTrainer.Config(**{
        **shared,
        "dataloader": PairDataLoader.Config(sources=[str(s.path) for s in recipe.data.sources],
                                            vocab_size=config.model_spec.model.vocab_size, seed=recipe.run.seed),
        "loss": TrainerLoss.Config(),
        "callbacks": [replace(c, pairs=True) if isinstance(c, Eval.Config) and pref.held_out else c
                      for c in config.callbacks],
    }, preference=pref, template_sha256=template_sha256(jinja))
