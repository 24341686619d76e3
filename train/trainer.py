"""torchtitan's Trainer with the few things a pretraining run needs on top.

- Bad steps are skipped, not fatal, and the decision stays on the device: the
  pre-clip gradient norm torchtitan computes (and clips with) is handed to the
  ``StepGuard`` together with the step's global loss, and the guard's 0/1
  answer goes into the fused AdamW as ``found_inf``, which leaves weights,
  moments and step count untouched when it is 1. Nothing in a steady step
  reads a tensor on the host; skip counts and progress are read at logging
  steps only. Too many consecutive skips stop the run (``SkippedOut``).
- Permanent milestone checkpoints survive ``keep_last`` purging; a latest
  checkpoint that fails to load is moved aside and the previous one is used.
- Side effects of training (per-source token counts, eval, report,
  preemption, the straggler check, the end-of-run export) are
  ``train.hooks.Hook``s, called in priority order after each step's
  checkpoint save and once after training.
- Each rank beats a heartbeat (``train.health.heartbeat``) as it enters each phase
  of a step and each hook, for the launchers' stall watchdog and goodput.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Callable

import torch
import torch.distributed as dist
import tyro
from torch.distributed.checkpoint.api import CheckpointException

from rundir import METRICS_FILE, is_complete, latest_complete_checkpoint, step_number
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import LR_SCHEDULER, MODEL, OPTIMIZER
from torchtitan.components.metrics import LoggerContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from train.health.consistency import ReplicaCheck, flip_bit, is_verified
from train.health.guard import StepGuard
from train.health.rollback import due as rollback_due, roll_back
from train.health.heartbeat import Heartbeat
from train.hooks import Hook, LogSourceTokens, MetricsJsonl, in_order
from train.exits import Exit, StopRun
from train.health.storage import NoSpace, checkpoint_bytes, free_bytes, is_out_of_space


class GuardedOptimizers(OptimizersContainer):
    """Fused Adam(W) steps that apply or skip on the device: ``skip`` (the guard's 0/1 tensor,
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
        self.skip: torch.Tensor | None = None  # set by LaneformerTrainer before each step

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
            self.skip = None


@contextmanager
def grad_norm_to(receiver: Callable[[torch.Tensor], None]):
    """Hand the pre-clip gradient norm that torchtitan's ``train_step`` computes (and then
    drops) to ``receiver`` before the optimizer step, instead of computing it a second time.
    Scoped to one step, so other Trainers in the process are untouched."""
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


class MilestoneCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointing; ``milestones`` steps are never purged, a damaged
    latest checkpoint is moved aside (``step-N.damaged``) instead of failing every restart,
    and a save that runs out of disk space stops the run with ``NoSpace``."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        milestones: list[int] = field(default_factory=list)

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.milestones = set(config.milestones)
        # Set by LaneformerTrainer under HSDP: checked before every save, resumed from verified saves only.
        self.replica_check: ReplicaCheck | None = None

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return super()._should_save(curr_step, last_step) or (
            self.enable and curr_step in self.milestones
        )

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        check = self.replica_check
        if check is not None and self._should_save(curr_step, last_step):
            check.run(curr_step, self.states[MODEL].model, self.states[OPTIMIZER])  # a mismatch saves nothing
        try:
            saved = super()._save(curr_step, last_step)  # an async save's failure surfaces at the next
            if saved and last_step:  # torchtitan's last-step save skips its purge: keep_last + 1 would stay
                self._purge_stale_checkpoints()
            if saved and check is not None and (not dist.is_initialized() or dist.get_rank() == 0):
                check.mark_verified(Path(self.folder) / f"step-{curr_step}", curr_step)
            return saved
        except (Exception, CheckpointException) as e:
            nparams = sum(p.numel() for part in self.states[MODEL].model for p in part.parameters())
            needed = checkpoint_bytes(nparams)  # numel of a sharded parameter is the whole one's
            if not (is_out_of_space(e) or free_bytes(Path(self.folder)) < needed):
                raise
            # The half-written step (no .metadata) would never load; its space goes back.
            if not dist.is_initialized() or dist.get_rank() == 0:
                for partial in Path(self.folder).glob("step-*"):
                    if step_number(partial) is not None and not is_complete(partial):
                        shutil.rmtree(partial, ignore_errors=True)
            raise NoSpace.at(Path(self.folder), needed, e, curr_step) from e

    def _find_load_step(self, folder: str = "") -> int:
        # Exactly ``step-N`` with DCP's .metadata (rundir's rule): torchtitan's own search
        # would also pick ``step-N.damaged``.
        path = Path(folder or self.folder)
        steps = [n for p in path.iterdir() if (n := step_number(p)) is not None and is_complete(p)] \
            if path.is_dir() else []
        if self.replica_check is not None:  # with replicas, the latest checkpoint whose copies were compared
            steps = [n for n in steps if is_verified(path / f"step-{n}")] or steps
        return max(steps, default=-1)

    def _load(self, step: int = -1) -> bool:
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
        if not self._should_purge():
            return
        steps = sorted(n for name in os.listdir(self.folder)
                       if (n := step_number(Path(name))) is not None and n not in self.milestones)
        for n in steps[: -self.keep_latest_k]:
            self.purge_queue.put(f"{self.folder}/step-{n}")


class SkippedOut(StopRun):
    code = Exit.SKIPPED_OUT


class LaneformerTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        # Configs of train.hooks.Hook objects; set from the recipe, not the CLI.
        hooks: Annotated[list, tyro.conf.Suppress] = field(default_factory=list)
        skip_spikes: bool = True
        spike_sigmas: float = 6.0
        spike_window: int = 100
        max_consecutive_skips: int = 100
        spike_rollbacks: int = 0  # train.health.rollback: roll back after this many skips within spike_window steps
        consistency_every: int = 100  # train.health.consistency: steps between replica checks (and before every save)
        reduce_grads: str = "every_micro_batch"  # train.recipe.REDUCE_GRADS
        compile_cache: str = ""  # TORCHINDUCTOR_CACHE_DIR for this process (train.build.compile_cache)

    def __init__(self, config: Config):
        self.heartbeat = Heartbeat(Path(config.dump_folder))  # first: a stall while building is seen too
        if config.compile_cache:  # read by Inductor at its first compile (torch._inductor.runtime.cache_dir_utils)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.compile_cache
        super().__init__(config)
        self.heartbeat.mark("built")
        # The last step is logged too: a run's final loss is its last step's, whatever the interval.
        every_interval = self.metrics_processor.should_log
        self.metrics_processor.should_log = lambda step: every_interval(step) or step == config.training.steps
        self.guard = StepGuard(config.spike_sigmas, config.spike_window, config.skip_spikes, self.device,
                               remember=config.spike_rollbacks)
        self._rollback: tuple[int, ...] = ()  # the spikes of a rollback due after this step (train.health.rollback)
        self.replica_check = None  # train.health.consistency, under HSDP only
        if self.parallel_dims.dp_replicate_enabled:
            mesh = self.parallel_dims.get_mesh(["dp_replicate", "fsdp"]).mesh
            self.replica_check = ReplicaCheck(mesh, Path(config.dump_folder), config.consistency_every)
            self.checkpointer.replica_check = self.replica_check
        self.hooks: list[Hook] = in_order([LogSourceTokens(), *(h.build() for h in config.hooks)])
        self._stepped = False  # a step ran whose hooks have not: see should_continue_training
        if dist.get_rank() == 0:
            if not isinstance(self.metrics_processor.logger, LoggerContainer):  # no tensorboard, no wandb
                self.metrics_processor.logger = LoggerContainer()
            self.metrics_processor.logger.add_logger(MetricsJsonl(Path(config.dump_folder) / METRICS_FILE))
        self._step_loss = torch.zeros((), device=self.device)
        self._micro_batch = 0  # of the step in progress (train_step resets it)
        assert isinstance(self.optimizers, GuardedOptimizers), "use GuardedOptimizers.Config"
        self._skipped_logged = 0
        self._last_log: tuple[int, float] | None = None  # (step, time) at the last logging step
        self.data_wait_s = 0.0  # seconds this rank waited for batches (train.health.straggler)
        if utils.device_type == "cpu":
            # MFU against a GPU's peak means nothing on a CPU; torchtitan prints
            # N/A for it only under this flag.
            self.metrics_processor.has_quantization = True

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        self.heartbeat.mark("rendezvous")
        return parallel_dims

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        if self._micro_batch == 0:
            self.heartbeat.beat("forward_backward")
        self._reduce_grads_now(last=self._micro_batch == self.gradient_accumulation_steps - 1)
        self._micro_batch += 1
        loss = super().forward_backward_step(**kwargs)
        self._step_loss += loss.detach()
        return loss

    def _decide(self, grad_norm: torch.Tensor) -> None:
        """Called with torchtitan's pre-clip gradient norm, before the optimizer step."""
        self.heartbeat.beat("optimizer")
        loss = self._step_loss.clone()
        self._step_loss.zero_()
        if self.parallel_dims.dp_enabled:
            loss = dist_utils.dist_sum_tensor(loss, self.parallel_dims.get_mesh("batch"))
        self.optimizers.skip = self.guard.check(loss, grad_norm)

    def _reduce_grads_now(self, last: bool) -> None:
        """``reduce_grads``: FSDP2's own switches defer gradient reduction to the step's last micro batch
        (torchtitan reduces after every one): all of it, or only the all-reduce across HSDP replicas."""
        mode = self.config.reduce_grads
        if mode == "every_micro_batch":
            return
        for model in self.model_parts:
            if mode == "last_micro_batch":
                model.set_requires_gradient_sync(last)
            else:
                model.set_requires_all_reduce(last)

    def batch_generator(self, data_iterable):
        """torchtitan's batches, with this rank's wait for each added to ``data_wait_s``."""
        batches = super().batch_generator(data_iterable)
        while True:
            start = time.perf_counter()
            batch = next(batches)  # torchtitan's generator raises its own error when the data runs out
            self.data_wait_s += time.perf_counter() - start
            yield batch

    def train_step(self, data_iterator):
        self._micro_batch = 0
        self.heartbeat.beat("data", self.step)
        try:
            with grad_norm_to(self._decide):
                super().train_step(data_iterator)
        except RuntimeError as e:
            # torchtitan stops on a non-finite logged loss; a skipped step is handled.
            if not ("not finite" in str(e) and self.guard.read().last_step == self.step):
                raise
        flip_bit(self.model_parts, dist.get_rank(), self.step)  # LANEFORMER_TEST_BITFLIP, tests only
        if self.replica_check is not None and self.replica_check.due(self.step):
            self.replica_check.run(self.step, self.model_parts, self.optimizers)
        if self.metrics_processor.should_log(self.step):
            self._log_progress()
        self._stepped = True
        self.heartbeat.mark("first_step")
        if self.checkpointer._should_save(self.step, last_step=self.step == self.config.training.steps):
            self.heartbeat.beat("checkpoint")

    def should_continue_training(self) -> bool:
        """torchtitan's loop asks this before every step, that is after the previous step's
        checkpoint save: the hooks' ``after_step`` runs here, with that step safe on disk."""
        if self._stepped:
            self._stepped = False
            for hook in self.hooks:
                self.heartbeat.beat(hook.phase)
                hook.after_step(self)
            if self._rollback:
                roll_back(self, self._rollback)
                self._rollback = ()
                self._skipped_logged = self.guard.read().skipped
            self.heartbeat.step_done()
        else:
            self.heartbeat.mark("loaded")  # the first call: after the checkpoint load
        return super().should_continue_training()

    def _log_progress(self) -> None:
        """At logging steps: skips since the last log, progress and ETA; stop a runaway skip streak."""
        g = self.guard.read()
        t = self.config.training
        if g.skipped > self._skipped_logged:
            more = g.skipped - self._skipped_logged
            logger.warning(f"step {g.last_step}: skipped ({g.last_reason}); {g.skipped} skipped so far"
                           + (f", {more} since the last log" if more > 1 else ""))
        self._skipped_logged = g.skipped
        if rollback_due(g.recent, self.config.spike_rollbacks, self.config.spike_window):
            self._rollback = g.recent[-self.config.spike_rollbacks:]  # after this step's save and hooks
        now = time.perf_counter()
        line, metrics = progress(self.step, t.steps, t.global_batch_size * t.seq_len, self._last_log, now)
        self._last_log = (self.step, now)
        logger.info(line)
        self.metrics_processor.logger.log({"skipped_steps": g.skipped, **metrics}, self.step)
        if g.consecutive >= self.config.max_consecutive_skips:
            last = latest_complete_checkpoint(Path(self.config.dump_folder))
            raise SkippedOut(
                f"{g.consecutive} consecutive steps skipped up to step {self.step} (max_consecutive_skips "
                f"{self.config.max_consecutive_skips}; the latest: {g.last_reason}). The last complete "
                f"checkpoint is {last or 'none'}; the weights have not changed since the last applied step. "
                "Look at the data and the learning rate before restarting from it.",
                step=self.step, checkpoint=str(last) if last else None)

    def train(self):
        """torchtitan's loop (its final save included), then the hooks' ``after_train``."""
        self.heartbeat.beat("load")
        super().train()
        for hook in self.hooks:
            self.heartbeat.beat(hook.phase)
            hook.after_train(self)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "guard": self.guard.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "guard" in state_dict:
            self.guard.load_state_dict(state_dict["guard"], self.step)
            self._skipped_logged = int(state_dict["guard"]["skipped"])


def progress(step: int, steps: int, tokens_per_step: int, last: tuple[int, float] | None,
             now: float) -> tuple[str, dict[str, float]]:
    """The progress line of a logging step: step/total, tokens/total, ETA from the step time since
    the previous logging step (none at the first one: it includes start-up and compilation)."""
    line = (f"progress: step {step:,}/{steps:,} ({step / steps:.1%})  "
            f"tokens {_human(step * tokens_per_step)}/{_human(steps * tokens_per_step)}")
    metrics: dict[str, float] = {}
    if last and step > last[0]:
        per_step = (now - last[1]) / (step - last[0])
        eta = per_step * (steps - step)
        metrics = {"progress/step_time_s": per_step, "progress/eta_s": eta}
        line += f"  ETA {_duration(eta)} ({per_step:.3g} s/step)"
    return line, metrics


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:,.0f}"


def _duration(seconds: float) -> str:
    d = timedelta(seconds=round(seconds))
    return f"{d.days}d {d.seconds // 3600}h {d.seconds // 60 % 60:02d}m" if d.days else str(d)
