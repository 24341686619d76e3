"""Everything this framework changes of torchtitan 0.3.0, in one place.

torchtitan's ``Trainer`` runs the loop; a few of its parts need more than their configs
give. Each change below names the torchtitan code it replaces or hooks, and
``TORCHTITAN_API`` lists the signatures they rely on: ``tests/train/test_titan.py``
fails when torchtitan's side of any of them changes, before a run silently loses one.

- ``grad_norm_to``: ``Trainer.train_step`` computes the pre-clip gradient norm with
  ``dist_utils.clip_grad_norm_`` and drops it; the spike guard needs it before the update.
  The module attribute is swapped for one step.
- ``sleep_as_barrier``: ``Trainer.train`` ends with rank 0 sleeping 2 s "for other ranks to
  complete"; the trainer has every rank meet at a barrier instead (``torchtitan.trainer``'s ``time``
  swapped for the loop). The two in-place changes: each undone on the way out.
- ``GuardedOptimizers``: fused Adam(W) that applies or skips a step on the device.
- ``MilestoneCheckpointManager``: torchtitan's DCP checkpointing, with milestones that are never
  purged, damaged checkpoints moved aside, a full disk named, and the points around every save
  (``train.callbacks``' ``pre_checkpoint``/``post_checkpoint_saved``).
- ``LaneformerMetrics``: torchtitan's metrics, also at the last step, with MFU "N/A" on a CPU.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from rundir import is_complete, step_number
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import LR_SCHEDULER, MODEL
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from train.health.consistency import is_verified
from train.health.storage import NoSpace, checkpoint_bytes, free_bytes, is_out_of_space

# What the changes below rely on: (owner, attribute) -> its signature in torchtitan 0.3.0.
TORCHTITAN_API = {
    (dist_utils, "clip_grad_norm_"): "(parameters: 'torch.Tensor | Iterable[torch.Tensor]', max_norm: 'float', "
    "norm_type: 'float' = 2.0, error_if_nonfinite: 'bool' = False, foreach: 'bool | None' = None, "
    "pp_mesh: 'DeviceMesh | None' = None, ep_enabled: 'bool' = False) -> 'torch.Tensor'",
    (MetricsProcessor, "should_log"): "(self, step: int) -> bool",
    (CheckpointManager, "_should_save"): "(self, curr_step: 'int', last_step: 'bool' = False) -> 'bool'",
    (CheckpointManager, "_save"): "(self, curr_step: 'int', last_step: 'bool' = False) -> 'bool'",
    (CheckpointManager, "_load"): "(self, step: 'int' = -1) -> 'bool'",
    (CheckpointManager, "_find_load_step"): "(self, folder: 'str' = '') -> 'int'",
    (CheckpointManager, "_purge_stale_checkpoints"): "(self)",
    (CheckpointManager, "_should_purge"): "(self) -> 'bool'",
    (CheckpointManager, "dcp_load"): "(self, state_dict: 'dict[str, Any]', checkpoint_id: 'str', from_hf: 'bool', "
    "from_quantized: 'bool') -> 'None'",
    (Trainer, "train_step"): "(self, data_iterator: collections.abc.Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]])",
    (Trainer, "forward_backward_step"): None,  # only overridden and called through: any signature
    (Trainer, "batch_generator"): None,
    (Trainer, "should_continue_training"): "(self) -> bool",
    # train.preference.trainer: one micro batch's forward, loss and backward, with the preference loss
    (Trainer, "_forward_backward_body"): "(self, inputs: torch.Tensor, labels: torch.Tensor, global_valid_tokens: "
    "torch.Tensor, extra_kwargs: dict[str, typing.Any]) -> torch.Tensor",
}


@contextmanager
def grad_norm_to(receiver: Callable[[torch.Tensor], None]):
    """Hand the pre-clip gradient norm that torchtitan's ``Trainer.train_step`` computes with
    ``dist_utils.clip_grad_norm_`` (and then drops) to ``receiver`` before the optimizer step,
    instead of computing it a second time. Replaces ``torchtitan.distributed.utils.clip_grad_norm_``
    for the one step, so other Trainers in the process are untouched."""
    clip = dist_utils.clip_grad_norm_

    def clip_and_hand_over(*args, **kwargs):
        norm = clip(*args, **kwargs)
        receiver(norm)
        return norm

    dist_utils.clip_grad_norm_ = clip_and_hand_over
    try:
        yield
    finally:
        dist_utils.clip_grad_norm_ = clip


class _TimeWithoutSleep:
    """The ``time`` module with a ``sleep`` that returns at once."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


SLEEP_LOG = "Sleeping 2 seconds for other ranks to complete"  # torchtitan's line before its sleep


@contextmanager
def sleep_as_barrier():
    """torchtitan's ``Trainer.train`` ends with rank 0 logging ``SLEEP_LOG`` and sleeping 2 s (its only
    ``time.sleep``): every run, restart and test launch paid it. Here the loop runs without the sleep or
    its line, and on the way out, after the last step and save, every rank waits at a barrier for all
    the others: what the sleep stood for, for as long as it takes and no longer."""
    import torchtitan.trainer as titan_trainer

    def not_the_sleep_line(record) -> bool:
        return record.getMessage() != SLEEP_LOG

    titan_trainer.time = _TimeWithoutSleep()
    logger.addFilter(not_the_sleep_line)
    try:
        yield
    finally:
        titan_trainer.time = time
        logger.removeFilter(not_the_sleep_line)
    if dist.is_initialized():  # not on an exception (an error or a preemption ends the run's ranks alike)
        dist.barrier()


class GuardedOptimizers(OptimizersContainer):
    """Fused Adam(W) steps that apply or skip on the device: ``skip`` (the spike guard's 0/1 tensor,
    set before every step) is passed as ``found_inf``, the switch torch's fused kernels already
    have for AMP. Clipping is torchtitan's (``training.max_norm``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass  # its own Config, so that build() makes a GuardedOptimizers

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        for optimizer in self.optimizers:
            if not (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
                    and all(g.get("fused") for g in optimizer.param_groups)):
                raise ValueError(f"GuardedOptimizers skips steps through fused Adam/AdamW only, got "
                                 f"{type(optimizer).__name__} (implementation={config.implementation!r})")
        self.skip: torch.Tensor | None = None  # set by the spike guard (train.callbacks.spike_guard) before each step
        self._last_skip: torch.Tensor | None = None

    def step(self, closure=None):
        if self.skip is None:
            raise RuntimeError("GuardedOptimizers.step without a skip decision for this step")
        for optimizer in self.optimizers:
            optimizer.found_inf = self.skip
        try:
            return super().step(closure)
        finally:
            for optimizer in self.optimizers:
                del optimizer.found_inf
            self._last_skip, self.skip = self.skip, None

    @property
    def skipped(self) -> bool:
        """Whether the latest step was skipped (a host sync: for error paths only)."""
        return self._last_skip is not None and bool(self._last_skip)


class MilestoneCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointing; ``milestones`` steps are never purged, a damaged
    latest checkpoint is moved aside (``step-N.damaged``) instead of failing every restart,
    a save that runs out of disk space stops the run with ``NoSpace``, and every save is
    bracketed by ``before_save``/``after_save`` (the trainer's callback points)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        milestones: list[int] = field(default_factory=list)

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.milestones = set(config.milestones)
        self.prefer_verified = False  # with HSDP replicas: resume from a checkpoint whose copies were compared
        self.before_save: Callable[[int], None] = lambda step: None
        self.after_save: Callable[[Path], None] = lambda path: None
        self.last_saved_step = -1  # the step of this process's latest save
        self.loading: set[str] | None = None  # during a load: the keys its checkpoint holds

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        # replaces CheckpointManager._should_save: also at every milestone
        return super()._should_save(curr_step, last_step) or (self.enable and curr_step in self.milestones)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # wraps CheckpointManager._save (torchtitan's save() calls it): the points around a save,
        # the purge its last-step save skips, and a full disk named
        if not self._should_save(curr_step, last_step):
            return False
        self.before_save(curr_step)  # a replica mismatch raises here: nothing is saved
        try:
            saved = super()._save(curr_step, last_step)  # an async save's failure surfaces at the next
        except (Exception, CheckpointException) as e:
            self._no_space(e, curr_step)
            raise
        if saved:
            if last_step:  # torchtitan's last-step save skips its purge: keep_last + 1 would stay
                self._purge_stale_checkpoints()
            self.last_saved_step = curr_step
            self.after_save(Path(self.folder) / f"step-{curr_step}")
        return saved

    def _no_space(self, error: BaseException, step: int) -> None:
        """Raise ``NoSpace`` when ``error`` is the disk running full (else return: the caller re-raises)."""
        nparams = sum(p.numel() for part in self.states[MODEL].model for p in part.parameters())
        needed = checkpoint_bytes(nparams)  # numel of a sharded parameter is the whole one's
        if not (is_out_of_space(error) or free_bytes(Path(self.folder)) < needed):
            return
        # The half-written step (no .metadata) would never load; its space goes back.
        if not dist.is_initialized() or dist.get_rank() == 0:
            for partial in Path(self.folder).glob("step-*"):
                if step_number(partial) is not None and not is_complete(partial):
                    shutil.rmtree(partial, ignore_errors=True)
        raise NoSpace.at(Path(self.folder), needed, error, step) from error

    def _find_load_step(self, folder: str = "") -> int:
        # replaces CheckpointManager._find_load_step: exactly ``step-N`` with DCP's .metadata (rundir's
        # rule; torchtitan's own search would also pick ``step-N.damaged``), verified ones first with replicas
        path = Path(folder or self.folder)
        steps = [n for p in path.iterdir() if (n := step_number(p)) is not None and is_complete(p)] \
            if path.is_dir() else []
        if self.prefer_verified:
            steps = [n for n in steps if is_verified(path / f"step-{n}")] or steps
        return max(steps, default=-1)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        # wraps CheckpointManager.dcp_load: the checkpoint's keys are known while it loads, so a state
        # whose layout changed (the trainer's) asks for what that checkpoint holds
        if not from_hf:
            self.loading = set(dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
        try:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        finally:
            self.loading = None

    def _load(self, step: int = -1) -> bool:
        # wraps CheckpointManager._load: a damaged latest checkpoint is moved aside and the previous one loaded
        damaged = sorted(p.name for p in Path(self.folder).glob("step-*.damaged*")) if Path(self.folder).is_dir() else []
        if step < 0 and damaged and self._find_load_step() < 0:
            raise RuntimeError(f"{self.folder} holds only damaged checkpoints ({', '.join(damaged)}): not starting "
                               "from scratch beside them; rename one back to step-N to resume from it, or move "
                               "them away to start afresh")
        while True:
            which = step if step >= 0 else self._find_load_step()
            try:
                loaded = super()._load(step)
                failure = None
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                failure = e
            if not self._anyone_failed(failure is not None):
                break
            where = f"{self.folder}/step-{which}" if which >= 0 else self.initial_load_path
            if step >= 0 or which < 0:  # an explicit step or the initial load: nothing to fall back to
                raise RuntimeError(f"checkpoint {where} could not be loaded ({failure})") from failure
            self._move_aside(which, failure)
            if self._find_load_step() < 0:
                raise RuntimeError(
                    f"checkpoint {where} could not be loaded and no complete checkpoint is left in "
                    f"{self.folder} (damaged ones are kept as step-N.damaged); not starting from scratch"
                ) from failure
        # torchtitan restores the schedulers' step but the optimizers keep the lr saved in
        # their state, i.e. the old schedule's; a resumed run whose schedule changed (more
        # steps, another decay) would take its first step at that stale lr.
        for scheduler in self.states[LR_SCHEDULER].schedulers:
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        return loaded

    @staticmethod
    def _anyone_failed(failed: bool) -> bool:
        """Every rank learns whether any rank's load failed (DCP mostly fails on all at once)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return failed
        everyone: list[bool | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, failed)
        return any(everyone)

    def _move_aside(self, which: int, failure: Exception | None) -> None:
        src = Path(self.folder) / f"step-{which}"
        dst = src.with_name(f"{src.name}.damaged")
        n = 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{src.name}.damaged-{n}")
        if not dist.is_initialized() or dist.get_rank() == 0:
            why = f"{type(failure).__name__}: {failure}" if failure else "failed on another rank"
            logger.error(f"DAMAGED CHECKPOINT {src} could not be loaded ({why}); moved to {dst.name}, "
                         "resuming from the previous complete checkpoint")
            src.rename(dst)
        if dist.is_initialized():
            dist.barrier()

    def _purge_stale_checkpoints(self):
        # replaces CheckpointManager._purge_stale_checkpoints: milestones are never purged
        if not self._should_purge():
            return
        steps = sorted(n for name in os.listdir(self.folder)
                       if (n := step_number(Path(name))) is not None and n not in self.milestones)
        for n in steps[: -self.keep_latest_k]:
            self.purge_queue.put(f"{self.folder}/step-{n}")


class LaneformerMetrics(MetricsProcessor):
    """torchtitan's metrics processor, logging the last step too (a run's final loss is its last
    step's, whatever the interval), with MFU "N/A" on a CPU."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        last_step: int = 0  # [training] steps

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        if utils.device_type == "cpu":
            # MFU against a GPU's peak means nothing on a CPU; torchtitan prints N/A for it only under this flag
            self.has_quantization = True

    def should_log(self, step: int) -> bool:
        # replaces MetricsProcessor.should_log (step 1 and every log_freq steps): also the last step
        return super().should_log(step) or step == self.config.last_step
