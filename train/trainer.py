"""torchtitan's Trainer, with one step that reads top to bottom and callbacks at its named points.

torchtitan's ``Trainer.train`` runs the loop: load, then per step ``should_continue_training``,
``train_step``, the checkpoint save. This class fills in that loop; a step, in order:

1. ``pre_step`` callbacks (the heartbeat enters ``data``);
2. forward and backward over the step's micro batches (``forward_backward``);
3. torchtitan clips; the pre-clip norm and the step's global loss go to the ``pre_optim_step``
   callbacks (the spike guard decides, on the device, whether the update applies);
4. the optimizer update (``GuardedOptimizers``), then ``post_train_batch`` callbacks;
5. torchtitan's checkpoint save when due, bracketed by ``pre_checkpoint`` and
   ``post_checkpoint_saved`` (``checkpoint``);
6. ``post_step`` callbacks, with the step safe on disk (asked by torchtitan's loop as
   ``should_continue_training``, before the next step).

``pre_train`` runs once after the checkpoint load, ``post_train`` after the loop, ``on_error``
when training stops on an exception. What runs at each point, in which phase and with which
priority: the README's "One step, in order" table, built from ``train.callbacks``. What this
changes of torchtitan itself is ``train.titan``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist
import tyro

from torchtitan.components.checkpointer.base import TRAIN_STATE
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from train.callbacks.callback import Callbacks
from train.callbacks.spike_guard import SpikeGuard
from train.health.heartbeat import Heartbeat
from train.health.phases import Phase
from train.titan import GuardedOptimizers, grad_norm_to, sleep_as_barrier


CALLBACKS_KEY = "callbacks"  # the callbacks' state in the trainer's checkpoint state (train.callbacks.callback)
LEGACY_GUARD_KEY = "guard"  # the spike guard's, in checkpoints written before callbacks


class LaneformerTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        # Configs of train.callbacks' callbacks; set from the recipe (train.build), not the CLI.
        callbacks: Annotated[list, tyro.conf.Suppress] = field(default_factory=list)
        reduce_grads: str = "every_micro_batch"  # train.recipe.REDUCE_GRADS
        compile_cache: str = ""  # TORCHINDUCTOR_CACHE_DIR for this process (train.build.compile_cache)

    def __init__(self, config: Config):
        self.heartbeat = Heartbeat(Path(config.dump_folder))  # first: a stall while building is seen too
        if config.compile_cache:  # read by Inductor at its first compile (torch._inductor.runtime.cache_dir_utils)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.compile_cache
        super().__init__(config)
        self.heartbeat.mark("built")
        assert isinstance(self.optimizers, GuardedOptimizers), "use GuardedOptimizers.Config"
        self._loss_sum = torch.zeros((), device=self.device)  # this rank's loss of the step, over its micro batches
        self.step_loss: torch.Tensor | None = None  # the step's global loss, at pre_optim_step (on the device)
        self.grad_norm: torch.Tensor | None = None  # the step's pre-clip norm, from torchtitan's clipping
        self.data_wait_s = 0.0  # seconds this rank waited for batches (train.callbacks.straggler)
        self._micro_batch = 0  # of the step in progress
        self._started = False  # whether pre_train has run (see should_continue_training)
        self.callbacks = Callbacks([c.build(trainer=self) for c in config.callbacks], self.enter)
        self.checkpointer.before_save = self._before_save
        self.checkpointer.after_save = lambda path: self.callbacks.call("post_checkpoint_saved", self, path,
                                                                        then=Phase.CHECKPOINT)

    def enter(self, phase: Phase) -> None:
        """This rank enters ``phase`` of the current step: its heartbeat says so."""
        self.heartbeat.beat(phase, self.step)

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        self.heartbeat.mark("rendezvous")
        return parallel_dims

    # -- the loop (torchtitan's Trainer.train calls these) --------------------------------------------

    def train(self):
        """torchtitan's loop (its checkpoint load and final save included; its closing sleep a barrier),
        then ``post_train``."""
        self.enter(Phase.LOAD)
        try:
            with sleep_as_barrier():
                super().train()
            self.callbacks.call("post_train", self)
        except Exception as e:
            self.callbacks.call_on_error(self, e)
            raise

    def should_continue_training(self) -> bool:
        """torchtitan asks this before every step, that is after the checkpoint load (the first time)
        or the previous step's save: ``pre_train`` or ``post_step`` runs here."""
        if self._started:  # until the next step: torchtitan's garbage collection
            self.callbacks.call("post_step", self, then=Phase.METRICS)
        else:
            self._started = True
            self.callbacks.call("pre_train", self)
        return super().should_continue_training()

    def train_step(self, data_iterator):
        self.callbacks.call("pre_step", self)
        self._micro_batch = 0
        with grad_norm_to(self._pre_optim_step):
            self._torchtitan_step(data_iterator)
        self.callbacks.call("post_train_batch", self)

    def _torchtitan_step(self, data_iterator):
        """torchtitan's step: data, forward/backward, clipping, the update. It stops on a non-finite
        logged loss; a step the spike guard skipped is not a stop (the guard counts it)."""
        try:
            super().train_step(data_iterator)
        except RuntimeError as e:
            if not ("not finite" in str(e) and self.optimizers.skipped):
                raise

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        if self._micro_batch == 0:
            self.enter(Phase.FORWARD_BACKWARD)
        self._reduce_grads_now(last=self._micro_batch == self.gradient_accumulation_steps - 1)
        self._micro_batch += 1
        loss = super().forward_backward_step(**kwargs)
        self._loss_sum += loss.detach()
        return loss

    def _pre_optim_step(self, grad_norm: torch.Tensor) -> None:
        """Called with torchtitan's pre-clip gradient norm, before the optimizer update."""
        self.enter(Phase.OPTIMIZER)
        loss = self._loss_sum.clone()
        self._loss_sum.zero_()
        if self.parallel_dims.dp_enabled:  # the step's global loss, on the device
            loss = dist_utils.dist_sum_tensor(loss, self.parallel_dims.get_mesh("batch"))
        self.step_loss, self.grad_norm = loss, grad_norm
        self.callbacks.call("pre_optim_step", self)

    def _before_save(self, step: int) -> None:
        self.enter(Phase.CHECKPOINT)
        self.callbacks.call("pre_checkpoint", self, then=Phase.CHECKPOINT)

    # -- the step's parts -------------------------------------------------------------------------

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

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), CALLBACKS_KEY: self.callbacks.state_json()}
        held = self.checkpointer.loading  # during a load, the keys its checkpoint holds
        if held is not None and f"{TRAIN_STATE}.{CALLBACKS_KEY}" not in held:
            # written before callbacks (round 4): the spike guard's state had a key of its own
            del state[CALLBACKS_KEY]
            guard = self.callbacks.get(SpikeGuard.name).guard.state_dict()
            if guard := {k: v for k, v in guard.items() if f"{TRAIN_STATE}.{LEGACY_GUARD_KEY}.{k}" in held}:
                state[LEGACY_GUARD_KEY] = guard
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if CALLBACKS_KEY in state_dict:
            self.callbacks.load_state_json(state_dict[CALLBACKS_KEY])
        elif LEGACY_GUARD_KEY in state_dict:
            self.callbacks.get(SpikeGuard.name).load_state_dict({**state_dict[LEGACY_GUARD_KEY], "step": self.step})

    @property
    def rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0
