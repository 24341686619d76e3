"""torchtitan's Trainer with the few things a pretraining run needs on top.

- Bad steps are skipped, not fatal: ``GuardedOptimizers`` asks the trainer's
  ``StepGuard`` before every update (global loss and pre-clip grad norm), and
  clips gradients itself so the guard sees the norm before clipping.
- Permanent milestone checkpoints survive ``keep_last`` purging.
- Side effects of training (skip log, per-source token counts, later eval and
  preemption) are small hooks called after each step, not code in the loop.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist
import tyro

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import LR_SCHEDULER
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from train.guard import StepGuard
from train.hooks import Hook, LogSourceTokens, MetricsJsonl


class GuardedOptimizers(OptimizersContainer):
    """An optimizer step that first clips gradients and asks whether to skip."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        grad_clip: float = 1.0

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.grad_clip = config.grad_clip
        self.should_skip = lambda grad_norm: None  # set by LaneformerTrainer

    def step(self, closure=None):
        params = [p for m in self.model_parts for p in m.parameters()]
        grad_norm = dist_utils.clip_grad_norm_(params, self.grad_clip, foreach=True)
        if self.should_skip(float(grad_norm)):
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


class MilestoneCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointing; ``milestones`` steps are never purged."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        milestones: list[int] = field(default_factory=list)

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.milestones = set(config.milestones)

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return super()._should_save(curr_step, last_step) or (
            self.enable and curr_step in self.milestones
        )

    def _load(self, step: int = -1) -> bool:
        try:
            loaded = super()._load(step)
        except Exception as e:
            which = step if step >= 0 else self._find_load_step()
            where = f"{self.folder}/step-{which}" if which >= 0 else self.initial_load_path
            raise RuntimeError(
                f"checkpoint {where} could not be loaded ({type(e).__name__}: {e}). "
                "If it is damaged, move it aside to resume from the previous checkpoint."
            ) from e
        # torchtitan restores the schedulers' step but the optimizers keep the lr saved in
        # their state, i.e. the old schedule's; a resumed run whose schedule changed (more
        # steps, another decay) would take its first step at that stale lr.
        for scheduler in self.states[LR_SCHEDULER].schedulers:
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        return loaded

    def _purge_stale_checkpoints(self):
        if not self._should_purge():
            return
        steps = sorted(
            (int(m.group(1)), name)
            for name in os.listdir(self.folder)
            if (m := re.fullmatch(r"step-(\d+)", name)) and int(m.group(1)) not in self.milestones
        )
        for _, name in steps[: -self.keep_latest_k]:
            self.purge_queue.put(f"{self.folder}/{name}")


class LaneformerTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        # Configurable configs whose objects have after_step; set from the recipe, not the CLI.
        hooks: Annotated[list, tyro.conf.Suppress] = field(default_factory=list)
        skip_spikes: bool = True
        spike_sigmas: float = 6.0
        spike_window: int = 100

    def __init__(self, config: Config):
        super().__init__(config)
        self.guard = StepGuard(config.spike_sigmas, config.spike_window, config.skip_spikes)
        self.hooks: list[Hook] = [LogSourceTokens(), *(h.build() for h in config.hooks)]
        if dist.get_rank() == 0:
            self.metrics_processor.logger.add_logger(MetricsJsonl(Path(config.dump_folder) / "metrics.jsonl"))
        self._step_loss = torch.zeros((), device=self.device)
        assert isinstance(self.optimizers, GuardedOptimizers), "use GuardedOptimizers.Config"
        self.optimizers.should_skip = self._should_skip
        if utils.device_type == "cpu":
            # MFU against a GPU's peak means nothing on a CPU; torchtitan prints
            # N/A for it only under this flag.
            self.metrics_processor.has_quantization = True

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        self._step_loss += loss.detach()
        return loss

    def _should_skip(self, grad_norm: float) -> str | None:
        loss = self._step_loss.clone()
        self._step_loss.zero_()
        if self.parallel_dims.dp_enabled:
            loss = dist_utils.dist_sum_tensor(loss, self.parallel_dims.get_mesh("batch"))
        reason = self.guard.check(float(loss), grad_norm)
        if reason:
            logger.warning(f"step {self.step}: skipped ({reason}); {self.guard.skipped} skipped so far")
            self.metrics_processor.logger.log({"skipped_steps": self.guard.skipped}, self.step)
        return reason

    def train_step(self, data_iterator):
        try:
            super().train_step(data_iterator)
        except RuntimeError as e:
            # torchtitan stops on a non-finite logged loss; a skipped step is handled.
            if not (self.guard.last_reason and "not finite" in str(e)):
                raise
        for hook in self.hooks:
            hook.after_step(self)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "guard": self.guard.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "guard" in state_dict:
            self.guard.load_state_dict(state_dict["guard"])

