"""At the end of a run, export the final weights as a Hugging Face folder (recipe switch).

Writes ``<run>/hf`` (or ``[checkpoint] export_dir``) with the remote code,
safetensors, tokenizer files with the run's chat template (the one its chat
data was tokenized with) and a model card naming the recipe, the tokens seen
and the latest eval numbers of the run.

It runs after training, once the final checkpoint is on disk, so a failed
export loses nothing: it raises ``ExportFailed`` on every rank with the
``convert to-hf`` command that redoes it from that checkpoint, and train.py
exits ``Exit.EXPORT_FAILED`` (not requeued: training is complete).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from rundir import latest_evals
from health.exits import Exit, StopRun
from train.callbacks.callback import Callback, TrainerView, bookkeeping_group
from health.phases import Phase


class ExportFailed(StopRun):
    code = Exit.EXPORT_FAILED


class Export(Callback[TrainerView], Configurable):
    name = "export"
    phase = Phase.EXPORT

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        out_dir: str
        recipe: str
        tokenizer_dir: str
        chat_template: str | None = None  # the run's (recipe [data] chat_template, resolved); None: data.chat's default
        dtype: str = "bfloat16"  # the released checkpoints are bf16

    def __init__(self, config: Config, trainer: TrainerView):
        self.config = config

    def command(self, run_dir: Path, tokens: int) -> str:
        """The CLI call that writes the same export from the run's latest complete checkpoint."""
        c = self.config
        args = ["python", "-m", "models.laneformer.convert", "to-hf", str(run_dir), c.out_dir,
                "--tokenizer", c.tokenizer_dir, "--dtype", c.dtype, "--recipe", c.recipe,
                "--tokens-seen", str(tokens), "--overwrite"]
        if c.chat_template is not None:
            args += ["--chat-template", c.chat_template]
        return shlex.join(args)

    def post_train(self, trainer: TrainerView) -> None:
        if trainer.step != trainer.config.training.steps:
            return
        run_dir = Path(trainer.config.dump_folder)
        t = trainer.config.training
        tokens = trainer.step * t.global_batch_size * t.seq_len
        try:
            path = self._export(trainer, run_dir, tokens)
            error = None
        except Exception as e:  # every rank must learn of it: the gather may have passed elsewhere
            error = f"{type(e).__name__}: {e}"
            logger.exception("the end-of-run export failed")
        errors = [error]
        if (group := bookkeeping_group()) is not None:
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error, group=group)
        failed = [e for e in errors if e]
        if failed:
            command = self.command(run_dir, tokens)
            raise ExportFailed(f"training is complete and checkpointed, but the export to {self.config.out_dir} "
                               f"failed ({failed[0]}). Retry with:\n  {command}",
                               step=trainer.step, message=failed[0], command=command)
        if path is not None:
            logger.info(f"exported the final weights to {path}")

    def _export(self, trainer: TrainerView, run_dir: Path, tokens: int) -> Path | None:
        from models.laneformer.hf.export import ModelCard, to_hf

        c = self.config
        card = ModelCard(recipe=c.recipe, step=trainer.step, tokens_seen=tokens, evals=latest_evals(run_dir))
        return to_hf(trainer.model_parts[0], c.out_dir, tokenizer_dir=c.tokenizer_dir, card=card,
                     dtype=getattr(torch, c.dtype), overwrite=True, chat_template=c.chat_template)
