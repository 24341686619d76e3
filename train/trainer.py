"""torchtitan's Trainer with the loop written out: every point of a step, in order, in ``train``.

``LaneformerTrainer.train`` is torchtitan 0.3.0's ``Trainer.train`` and ``train_step`` in one loop
(as torchtitan's own torchft trainer overrides ``train``), calling torchtitan's parts: the
checkpointer, the batches, ``forward_backward_step``, clipping, the optimizers and schedulers, the
metrics. A step, in order:

1. ``pre_step`` callbacks (the heartbeat enters ``data``), then the step's batches, made into what the
   forward takes by the objective (``make_batches``: an RL run samples and scores its completions there);
2. forward and backward over its micro batches (``forward_backward``);
3. clipping; the pre-clip norm and the step's global loss go to the ``pre_optim_step`` callbacks
   (the spike guard decides, on the device, whether the update applies);
4. the update (``GuardedOptimizers``), the lr step, torchtitan's metrics at logging steps, then
   ``post_train_batch`` callbacks;
5. the checkpoint save when due, between ``pre_checkpoint`` and ``post_checkpoint_saved``
   (``checkpoint``);
6. ``post_step`` callbacks, with the step safe on disk.

Before the first step: the checkpoint load, the objective's ``prepare`` (a preference run's reference
pass), then ``pre_train``; after the last: every rank meets at a barrier
(torchtitan sleeps 2 s on rank 0), then ``post_train``; ``on_error`` when training stops on an
exception. What runs at each point, in which phase and with which priority: the README's "One step,
in order" table, built from ``train.callbacks``. What this changes of torchtitan itself is
``train.titan``.

The loss is the run's objective's (``trainer.objective``, train.objectives: cross-entropy, weighted
cross-entropy or a preference loss, chosen by the build from the recipe), built in torchtitan's loss slot
and called at one place (``_forward_backward_body``); its own inputs come with the batch, and it is
normalised by what its ``weight`` sums to over the step's micro batches on all ranks.

Under context parallelism (``[parallel] context_parallel``) torchtitan slices each micro batch over the CP
ranks (``post_dataloading_process``, after the model's masks of the whole sequence are added; the
objective's per-token inputs are cut there too, the same way), each CP rank's loss is its slice's share,
and the step's global loss and the largest data-parallel rank's loss are summed over the CP ranks first.

torchtitan's trace spans (``structured_logger.log_trace_span``: "step", "fetching_batch", "fwd_bwd",
"optim", "collect_dist_metrics") mark the same parts of the step as in its own loop.
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
import spmd_types as spmd
import tyro
from torch.distributed.elastic.multiprocessing.errors import record

from torch.distributed.device_mesh import DeviceMesh

from torchtitan.components.checkpointer.base import TRAIN_STATE
from torchtitan.config import ParallelismConfig
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import cp_shard
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from rundir import checkpoint_of
from train.callbacks.callback import Callbacks
from train.callbacks.spike_guard import SpikeGuard
from health.heartbeat import Heartbeat
from health.phases import Phase
from models.laneformer import Laneformer
from train.objectives import Objective
from train.titan import GuardedOptimizers

CALLBACKS_KEY = "callbacks"  # the callbacks' state in the trainer's checkpoint state (train.callbacks.callback)
LEGACY_GUARD_KEY = "guard"  # the spike guard's, in checkpoints written before callbacks

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]  # torchtitan's (input_dict, labels)
OBJECTIVE_INPUTS = "objective_inputs"  # the objective's inputs among a micro batch's model kwargs, taken out there


def cut_like_tokens(per_token: dict[str, torch.Tensor], masks: Any, mesh: DeviceMesh, parallelism: ParallelismConfig
                    ) -> dict[str, torch.Tensor]:
    """An objective's [batch, seq] inputs cut over the CP ranks as torchtitan's ``prepare_context_parallel_input``
    cuts the tokens: its ``cp_shard``, with the load balancer built as for them (from the sequence length, or
    for "ptrr" from the whole sequence's ``masks``)."""
    if not per_token:
        return {}
    sliced, _ = cp_shard(mesh, tuple(per_token.values()), masks, parallelism.context_parallel_load_balancer,
                         ptrr_mask_key=parallelism.context_parallel_ptrr_mask_key)
    return dict(zip(per_token, sliced))


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
        self.callbacks = Callbacks([c.build(trainer=self) for c in config.callbacks], self.enter)

    @property
    def objective(self) -> Objective:
        """The run's loss (train.objectives), built by torchtitan in its loss slot (``Trainer.Config.loss``)."""
        return cast(Objective, self.loss_fn)

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
        sl.log_trace_instant("training_start")
        self.enter(Phase.LOAD)
        try:
            self.checkpointer.load(step=config.checkpoint.load_step)
            loaded_step = self.step
            logger.info(f"Training starts at step {self.step + 1}")
            self.objective.prepare(self)
            self.callbacks.call("pre_train", self)
            with config.profiler.build(global_step=self.step, base_folder=config.dump_folder) as profiler:
                data_iterator = self.batch_generator(self.dataloader)
                while self.step < config.training.steps:
                    self.step += 1
                    sl.set_step(self.step, relative_step=self.step - loaded_step)
                    with sl.log_trace_span("step"):
                        self.gc_handler.run(self.step)
                        self.callbacks.call("pre_step", self)
                        try:
                            with sl.log_trace_span("fetching_batch"):
                                batches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
                        except DataloaderExhaustedError:
                            logger.warning("Ran out of data; last step was canceled.")
                            break
                        batches = self.objective.make_batches(self, batches)  # an RL run's rollouts

                        self.enter(Phase.FORWARD_BACKWARD)
                        loss, local_weight, global_weight = self.forward_backward(batches)

                        self.enter(Phase.OPTIMIZER)
                        with sl.log_trace_span("optim"):  # torchtitan's span: the clipping, then the update
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
                        with sl.log_trace_span("optim"):
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
        (``prepare_context_parallel_input``, head-tail order), with the objective's inputs taken out of
        the model's (under ``OBJECTIVE_INPUTS``). Under CP, first the model's masks of the whole sequence
        (``Laneformer.attention_masks``: window and document), passed to the model as ``attention_masks``
        and sliced with the tokens, so that a rank's queries keep their windows and documents across the
        slices (a mask built on a slice would restart both at its edge; torchtitan builds masks only for
        its own ``Decoder``); then the objective's per-token inputs (loss weights) cut as the tokens were,
        by torchtitan's ``cp_shard`` with the same load balancer. Without CP the model builds its masks
        in its forward."""
        objective = self.objective
        own = {k: input_dict[k] for k in objective.inputs}
        input_dict = {k: v for k, v in input_dict.items() if k not in own}
        if self.parallel_dims.cp_enabled:
            tokens = input_dict["input"]
            # CP slices positions too (its RoPE and document masks need the whole sequence's)
            positions = input_dict.get("positions")
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            model = cast(Laneformer, self.model_parts[0])
            masks = model.attention_masks(tokens, positions)
            # a dict of BlockMasks among the tensors: torchtitan's hook types every entry as one
            input_dict = {**input_dict, "positions": positions, "attention_masks": cast(torch.Tensor, masks)}
            own |= cut_like_tokens({k: own[k] for k in objective.per_token}, masks, self.parallel_dims.get_mesh("cp"),
                                   self.config.parallelism)
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        return inputs, labels, {**extra_kwargs, OBJECTIVE_INPUTS: own}

    def forward_backward(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """torchtitan's ``forward_backward_step`` on each micro batch, each loss normalised by the step's
        denominator on all ranks (the objective's ``weight`` of each micro batch, summed: valid tokens,
        their loss weights, pairs); returns this rank's loss (the sum over its micro batches) and its and
        all ranks' denominators."""
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        local_weight = sum((self.objective.weight(input_dict, labels) for input_dict, labels in batches),
                           torch.tensor(0))
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

    def _forward_backward_body(self, inputs: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor,
                               extra_kwargs: dict[str, Any]) -> torch.Tensor:
        """torchtitan's forward, loss and backward of one micro batch, the loss the run's objective's, given
        its own inputs (``post_dataloading_process`` took them out of the model's) as keyword arguments."""
        objective_inputs = extra_kwargs.pop(OBJECTIVE_INPUTS)
        with self.train_context():
            pred = self.model_parts[0](inputs, **extra_kwargs)
            loss, _ = self.objective(pred, labels, global_valid_tokens, **objective_inputs)
            del pred
            with spmd.no_typecheck():  # as torchtitan: the types propagate in the forward only
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
        """At logging steps, torchtitan's metrics (the global mean and the largest rank's loss, the pre-clip
        norm, tokens seen, the lr), then the objective's own (``step_metrics``: a preference run's
        ``pref/*``). A non-finite loss stops the run (as torchtitan), unless the spike guard skipped the
        step: it counts it instead, and the step logs no loss."""
        should_log = self.metrics_processor.should_log(self.step)
        own = self.objective.step_metrics(self._sum_over_batch if should_log else None)
        if not should_log:
            return
        if self._log_loss(loss, grad_norm, local_weight, global_weight, lr) and own:
            self.metrics_processor.logger.log(own, self.step)

    def _sum_over_batch(self, sums: torch.Tensor) -> torch.Tensor:
        """``sums`` over the data-parallel ranks (the objective's step metrics)."""
        if self.parallel_dims.dp_enabled:
            return dist_utils.dist_sum_tensor(sums, self.parallel_dims.get_mesh("batch"))
        return sums

    def _log_loss(self, loss: torch.Tensor, grad_norm: torch.Tensor, local_weight: torch.Tensor,
                  global_weight: torch.Tensor, lr: dict[str, float]) -> bool:
        """torchtitan's metrics of the step; False where the spike guard skipped a non-finite step."""
        with sl.log_trace_span("collect_dist_metrics"):
            if self.parallel_dims.dp_cp_enabled:
                mesh = self.parallel_dims.get_optional_mesh("loss")
                rank_loss = loss  # this data-parallel rank's loss over the step's denominator
                if self.parallel_dims.cp_enabled:  # each CP rank holds its slice's share of it (torchtitan's
                    # max is of the shares: a CP rank's loss over its whole sequence's tokens)
                    rank_loss = dist_utils.dist_sum_tensor(loss, self.parallel_dims.get_mesh("cp"))
                global_avg_loss, global_max_loss, global_ntokens_seen = (
                    dist_utils.dist_sum(loss, mesh),
                    # a data-parallel rank's mean loss (local_weight: its share of the denominator, whole sequences)
                    dist_utils.dist_max(rank_loss * global_weight / local_weight, mesh),
                    dist_utils.dist_sum(torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device),
                                        mesh),
                )
            else:
                global_avg_loss = global_max_loss = float(loss.item())
                global_ntokens_seen = self.ntokens_seen
        if not math.isfinite(global_avg_loss):
            if self.optimizers.skipped:
                return False
            raise RuntimeError(f"Loss is not finite (global_avg_loss={global_avg_loss}) at step {self.step}. "
                               "Stopping training.")
        self.metrics_processor.log(self.step, global_avg_loss, global_max_loss, float(grad_norm.item()),
                                   extra_metrics={"n_tokens_seen": global_ntokens_seen, **lr})
        return True

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
