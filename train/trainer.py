"""torchtitan's Trainer with the loop written out: every point of a step, in order, in ``train``.

``LaneformerTrainer.train`` is torchtitan 0.3.0's ``Trainer.train`` and ``train_step`` in one loop
(as torchtitan's own torchft trainer overrides ``train``), calling torchtitan's parts: the
checkpointer, the batches, ``forward_backward_step``, clipping, the optimizers and schedulers, the
metrics. A step, in order:

1. ``pre_step`` callbacks (the heartbeat enters ``data``), then the step's batches;
2. forward and backward over its micro batches (``forward_backward``);
3. clipping; the pre-clip norm and the step's global loss go to the ``pre_optim_step`` callbacks
   (the spike guard decides, on the device, whether the update applies);
4. the update (``GuardedOptimizers``), the lr step, torchtitan's metrics at logging steps, then
   ``post_train_batch`` callbacks;
5. the checkpoint save when due, between ``pre_checkpoint`` and ``post_checkpoint_saved``
   (``checkpoint``);
6. ``post_step`` callbacks, with the step safe on disk.

Before the first step: the checkpoint load, a preference run's reference pass
(``train.preference.trainer``), then ``pre_train``; after the last: every rank meets at a barrier
(torchtitan sleeps 2 s on rank 0), then ``post_train``; ``on_error`` when training stops on an
exception. What runs at each point, in which phase and with which priority: the README's "One step,
in order" table, built from ``train.callbacks``. What this changes of torchtitan itself is
``train.titan``.

Where sources weigh their tokens (``[[data.sources]] loss_weight``: the batch's ``loss_weights``), the loss
is sum(w x ce) / sum(w) over the step's tokens on all ranks (``weighted_cross_entropy``), Megatron's float
loss mask; otherwise torchtitan's token mean, of which it is the case w = 1.

Under context parallelism (``[parallel] context_parallel``) torchtitan slices each micro batch over the CP
ranks (``post_dataloading_process``, after the model's masks of the whole sequence are added), each CP
rank's loss is its slice's share, and the step's global loss and the largest data-parallel rank's loss are
summed over the CP ranks first.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from torch.distributed.elastic.multiprocessing.errors import record

from torchtitan.components.checkpointer.base import TRAIN_STATE
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from data.mixture import LOSS_WEIGHTS
from rundir import checkpoint_of
from train.callbacks.callback import Callbacks
from train.callbacks.spike_guard import SpikeGuard
from health.heartbeat import Heartbeat
from health.phases import Phase
from models.laneformer import Laneformer
from train.titan import GuardedOptimizers

CALLBACKS_KEY = "callbacks"  # the callbacks' state in the trainer's checkpoint state (train.callbacks.callback)
LEGACY_GUARD_KEY = "guard"  # the spike guard's, in checkpoints written before callbacks

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]  # torchtitan's (input_dict, labels)


def weighted_cross_entropy(pred: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w x ce) over the tokens, in fp32: torchtitan's ``cross_entropy_loss`` (sum reduction, IGNORE_INDEX
    skipped) with each token's loss weighted."""
    ce = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX)
    return (ce * weights.flatten()).sum()


def loss_weight(input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """What a micro batch adds to the loss's denominator: its tokens' loss weights, else its valid tokens."""
    weights = input_dict.get(LOSS_WEIGHTS)
    return weights.sum(dtype=torch.float32) if weights is not None else (labels != IGNORE_INDEX).sum()


class LaneformerTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        # Configs of train.callbacks' callbacks; set from the recipe (train.build), not the CLI.
        callbacks: Annotated[list, tyro.conf.Suppress] = field(default_factory=list)
        reduce_grads: str = "every_micro_batch"  # train.recipe.REDUCE_GRADS
        compile_cache: str = ""  # TORCHINDUCTOR_CACHE_DIR for this process (train.build.compile_cache)

    def __init__(self, config: Config):
        if config.parallelism.pipeline_parallel_degree > 1 or config.validator.enable:
            raise ValueError("the loop (LaneformerTrainer.train) has no pipeline parallelism and no torchtitan "
                             "validator: the in-loop evals are [eval]'s (train.callbacks.eval)")
        self.heartbeat = Heartbeat(Path(config.dump_folder))  # first: a stall while building is seen too
        if config.compile_cache:  # read by Inductor at its first compile (torch._inductor.runtime.cache_dir_utils)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.compile_cache
        super().__init__(config)
        self.heartbeat.mark("built")
        assert isinstance(self.optimizers, GuardedOptimizers), "use GuardedOptimizers.Config"
        self.step_loss: torch.Tensor | None = None  # the step's global loss, at pre_optim_step (on the device)
        self.grad_norm: torch.Tensor | None = None  # the step's pre-clip norm, at pre_optim_step (on the device)
        self.data_wait_s = 0.0  # seconds this rank waited for batches (train.callbacks.straggler)
        self._loss_weights: torch.Tensor | None = None  # the micro batch's, between forward_backward_step and body
        self.callbacks = Callbacks([c.build(trainer=self) for c in config.callbacks], self.enter)

    def enter(self, phase: Phase) -> None:
        """This rank enters ``phase`` of the current step: its heartbeat says so."""
        self.heartbeat.beat(phase, self.step)

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        self.heartbeat.mark("rendezvous")
        return parallel_dims

    # -- the loop -----------------------------------------------------------------------------------

    @record
    def train(self):
        """The run: the load, the reference pass, ``pre_train``, the steps, the closing barrier and
        ``post_train``, every point in the order the module's docstring lists; ``on_error`` when an
        exception stops it."""
        config = self.config
        self.enter(Phase.LOAD)
        try:
            self.checkpointer.load(step=config.checkpoint.load_step)
            loaded_step = self.step
            logger.info(f"Training starts at step {self.step + 1}")
            self.reference_pass()
            self.callbacks.call("pre_train", self)
            with config.profiler.build(global_step=self.step, base_folder=config.dump_folder) as profiler:
                data_iterator = self.batch_generator(self.dataloader)
                while self.step < config.training.steps:
                    self.step += 1
                    sl.set_step(self.step, relative_step=self.step - loaded_step)
                    self.gc_handler.run(self.step)
                    self.callbacks.call("pre_step", self)
                    try:
                        batches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
                    except DataloaderExhaustedError:
                        logger.warning("Ran out of data; last step was canceled.")
                        break

                    self.enter(Phase.FORWARD_BACKWARD)
                    loss, local_weight, global_weight = self.forward_backward(batches)

                    self.enter(Phase.OPTIMIZER)
                    grad_norm = dist_utils.clip_grad_norm_(
                        [p for m in self.model_parts for p in m.parameters()], config.training.max_norm,
                        foreach=True, ep_enabled=self.parallel_dims.ep_enabled)
                    self.grad_norm, self.step_loss = grad_norm, loss
                    if self.parallel_dims.dp_cp_enabled:  # the step's global loss, on the device: the sum
                        # over data-parallel ranks and, under CP, over the slices of each one's sequences
                        self.step_loss = dist_utils.dist_sum_tensor(loss, self.parallel_dims.get_mesh("loss"))
                    self.callbacks.call("pre_optim_step", self)

                    self.enter(Phase.OPTIMIZER)  # the update is optimizer time, whatever phase came before
                    lr = self.lr_schedulers.get_metrics()  # the lr of this update, for its log
                    self.checkpointer.maybe_wait_for_staging()
                    self.optimizers.step()
                    self.lr_schedulers.step()
                    self.log_step(loss, grad_norm, local_weight, global_weight, lr)
                    self.callbacks.call("post_train_batch", self)

                    self.save_checkpoint(last_step=self.step == config.training.steps)
                    profiler.step()
                    if self.step - loaded_step == 1:  # this process has compiled: torchtitan's shorter timeout
                        dist_utils.set_pg_timeouts(timedelta(seconds=config.comm.train_timeout_seconds),
                                                   self.parallel_dims)
                    self.callbacks.call("post_step", self, then=Phase.METRICS)
            logger.info("Training completed")
            if dist.is_initialized():  # every rank done with its last step and save (torchtitan sleeps 2 s)
                dist.barrier()
            self.callbacks.call("post_train", self)
        except Exception as e:
            self.callbacks.call_on_error(self, e)
            raise

    # -- the step's parts, in the loop's order --------------------------------------------------------

    def reference_pass(self) -> None:
        """Before the first step, after the checkpoint load: a preference run's reference log-probs
        (``train.preference.trainer``). Pretraining has none."""

    def batch_generator(self, data_iterable):
        """torchtitan's batches, with this rank's wait for each added to ``data_wait_s``."""
        batches = super().batch_generator(data_iterable)
        while True:
            start = time.perf_counter()
            batch = next(batches)  # torchtitan's generator raises its own error when the data runs out
            self.data_wait_s += time.perf_counter() - start
            yield batch

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """torchtitan's, which under context parallelism slices the batch over the CP ranks
        (``prepare_context_parallel_input``, head-tail order); first, under CP, the model's masks of the
        whole sequence (``Laneformer.attention_masks``: window and document), passed to the model as
        ``attention_masks`` and sliced with the tokens, so that a rank's queries keep their windows and
        documents across the slices (a mask built on a slice would restart both at its edge). torchtitan
        builds masks only for its own ``Decoder``. Without CP the model builds them in its forward."""
        if self.parallel_dims.cp_enabled:
            tokens = input_dict["input"]
            # CP slices positions too (its RoPE and document masks need the whole sequence's)
            positions = input_dict.get("positions")
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            model = cast(Laneformer, self.model_parts[0])
            # a dict of BlockMasks among the tensors: torchtitan's hook types every entry as one
            input_dict = {**input_dict, "positions": positions,
                          "attention_masks": cast(torch.Tensor, model.attention_masks(tokens, positions))}
        return super().post_dataloading_process(input_dict, labels)

    def forward_backward(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """torchtitan's ``forward_backward_step`` on each micro batch, each loss normalised by the step's
        valid tokens on all ranks (their summed loss weights where sources weigh theirs); returns this
        rank's loss (the sum over its micro batches) and its and all ranks' denominators."""
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        local_weight = sum((loss_weight(input_dict, labels) for input_dict, labels in batches), torch.tensor(0))
        # on the device: normalising the loss needs no host sync
        global_weight = local_weight.to(self.device)
        if self.parallel_dims.dp_enabled:
            global_weight = dist_utils.dist_sum_tensor(global_weight, self.parallel_dims.get_mesh("batch"))
        loss = torch.zeros((), device=self.device)
        for i, (input_dict, labels) in enumerate(batches):
            self._reduce_grads_now(last=i == len(batches) - 1)
            input_dict = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            loss += self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                               global_valid_tokens=global_weight).detach()
        return loss, local_weight, global_weight

    def forward_backward_step(self, *, input_dict: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
        self._loss_weights = input_dict.pop(LOSS_WEIGHTS, None)  # not a model input
        return super().forward_backward_step(input_dict=input_dict, **kwargs)

    def _forward_backward_body(self, inputs: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor,
                               extra_kwargs: dict[str, Any]) -> torch.Tensor:
        """torchtitan's forward, loss and backward of one micro batch; with loss weights, the loss is
        ``weighted_cross_entropy`` over the step's summed weights. (Not under CP: its slicing does not cut
        the weights, so train.recipe refuses the two together.)"""
        if self._loss_weights is None:
            return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)
        with self.train_context():
            pred = self.model_parts[0](inputs, **extra_kwargs)
            loss = weighted_cross_entropy(pred, labels, self._loss_weights) / global_valid_tokens
            del pred
            loss.backward()
        return loss

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

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, local_weight: torch.Tensor,
                 global_weight: torch.Tensor, lr: dict[str, float]) -> None:
        """At logging steps, torchtitan's metrics: the global mean and the largest rank's loss, the pre-clip
        norm, tokens seen, the lr. A non-finite loss stops the run (as torchtitan), unless the spike
        guard skipped the step: it counts it instead, and the step logs no loss."""
        if not self.metrics_processor.should_log(self.step):
            return
        if self.parallel_dims.dp_cp_enabled:
            mesh = self.parallel_dims.get_optional_mesh("loss")
            rank_loss = loss  # this data-parallel rank's loss over the step's tokens
            if self.parallel_dims.cp_enabled:  # each CP rank holds its slice's share of it (torchtitan's max
                # is of the shares: a CP rank's loss over its whole sequence's tokens)
                rank_loss = dist_utils.dist_sum_tensor(loss, self.parallel_dims.get_mesh("cp"))
            global_avg_loss, global_max_loss, global_ntokens_seen = (
                dist_utils.dist_sum(loss, mesh),
                # a data-parallel rank's mean token loss (local_weight: its tokens or their weights, whole sequences)
                dist_utils.dist_max(rank_loss * global_weight / local_weight, mesh),
                dist_utils.dist_sum(torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device), mesh),
            )
        else:
            global_avg_loss = global_max_loss = float(loss.item())
            global_ntokens_seen = self.ntokens_seen
        if not math.isfinite(global_avg_loss):
            if self.optimizers.skipped:
                return
            raise RuntimeError(f"Loss is not finite (global_avg_loss={global_avg_loss}) at step {self.step}. "
                               "Stopping training.")
        self.metrics_processor.log(self.step, global_avg_loss, global_max_loss, float(grad_norm.item()),
                                   extra_metrics={"n_tokens_seen": global_ntokens_seen, **lr})

    def save_checkpoint(self, last_step: bool = False) -> None:
        """Save this step when due (torchtitan's interval, a milestone, the last step; ``last_step``
        forces a full synchronous save: the last step's, a preemption's), between ``pre_checkpoint``
        (a callback raising there saves nothing: a replica mismatch) and ``post_checkpoint_saved``."""
        if not self.checkpointer.due(self.step, last_step):
            return
        self.enter(Phase.CHECKPOINT)
        self.callbacks.call("pre_checkpoint", self, then=Phase.CHECKPOINT)
        if self.checkpointer.save(self.step, last_step=last_step):
            self.callbacks.call("post_checkpoint_saved", self, checkpoint_of(Path(self.checkpointer.folder), self.step),
                                then=Phase.CHECKPOINT)

    # -- the trainer's state in a checkpoint ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), CALLBACKS_KEY: self.callbacks.state_json()}
        held = self.checkpointer.loading  # during a load, the keys its checkpoint holds
        if held is not None and f"{TRAIN_STATE}.{CALLBACKS_KEY}" not in held:
            # written before callbacks (round 4): the spike guard's state had a key of its own
            del state[CALLBACKS_KEY]
            guard = cast(SpikeGuard, self.callbacks.get(SpikeGuard.name)).guard.state_dict()
            if guard := {k: v for k, v in guard.items() if f"{TRAIN_STATE}.{LEGACY_GUARD_KEY}.{k}" in held}:
                state[LEGACY_GUARD_KEY] = guard
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if CALLBACKS_KEY in state_dict:
            self.callbacks.load_state_json(state_dict[CALLBACKS_KEY])
        elif LEGACY_GUARD_KEY in state_dict:
            guard_state = {**state_dict[LEGACY_GUARD_KEY], "step": self.step}
            cast(SpikeGuard, self.callbacks.get(SpikeGuard.name)).load_state_dict(guard_state)

    @property
    def rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0
