"""At the end of a run, export the final weights as a Hugging Face folder (recipe switch).

Writes ``<run>/hf`` (or ``[checkpoint] export_dir``) with the remote code,
safetensors, tokenizer files and a model card naming the recipe, the tokens
seen and the latest eval numbers of the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from train.trainer import LaneformerTrainer


def latest_evals(run_dir: Path) -> dict[str, float] | None:
    reports = sorted((run_dir / "evals").glob("step-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return json.loads(reports[-1].read_text())["metrics"] if reports else None


class ExportHook(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        out_dir: str
        recipe: str
        tokenizer_dir: str
        dtype: str = "bfloat16"  # the released checkpoints are bf16

    def __init__(self, config: Config):
        self.config = config

    def after_step(self, trainer: LaneformerTrainer) -> None:
        if trainer.step != trainer.config.training.steps:
            return
        from models.laneformer.hf.export import ModelCard, to_hf

        c = self.config
        run_dir = Path(trainer.config.dump_folder)
        t = trainer.config.training
        tokens = trainer.step * t.global_batch_size * t.seq_len
        card = ModelCard(recipe=c.recipe, step=trainer.step, tokens_seen=tokens, evals=latest_evals(run_dir))
        path = to_hf(trainer.model_parts[0], c.out_dir, tokenizer_dir=c.tokenizer_dir, card=card,
                     dtype=getattr(torch, c.dtype), overwrite=True)
        if path is not None:
            logger.info(f"exported the final weights to {path}")
