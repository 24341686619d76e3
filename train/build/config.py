"""A checked ``Recipe`` compiled into torchtitan's ``Trainer.Config``: every recipe table maps onto the
torchtitan component that owns it, nothing through command-line strings. The run's objective
(train.objectives, by ``Recipe.objective``) gives its loss and its data loader; the result is adapted for
CPU (fp32, gloo) only when no GPU is present; the attention kernel comes from ``model_registry``.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

import rundir
from data.loader import SentencePieceTokenizer
from train.build.checks import initial_load
from train.callbacks.bitflip import BITFLIP_ENV, BitFlip
from train.callbacks.eval import Eval
from train.callbacks.export import Export
from train.callbacks.heartbeat import HeartbeatMarks
from train.callbacks.metrics_file import MetricsFile
from train.callbacks.preemption import Preemption
from train.callbacks.progress import Progress
from train.callbacks.replica_check import ReplicaCheck
from train.callbacks.report import Report
from train.callbacks.rollback import Rollback
from train.callbacks.source_tokens import SourceTokens
from train.callbacks.spike_guard import SpikeGuard
from train.callbacks.straggler import Straggler
from train.cpu import adapt_config
from train.muon import LaneMuon
from train.objectives import OBJECTIVES
from train.recipe import Recipe, dp_degrees, model_spec
from train.titan import GuardedOptimizers, LaneformerMetrics, MilestoneCheckpointManager
from train.trainer import LaneformerTrainer


def wandb_env(recipe: Recipe) -> dict[str, str]:
    """The WANDB_* variables torchtitan's wandb logger reads (it has no config fields for them)."""
    log = recipe.logging
    return {"WANDB_PROJECT": log.wandb_project or recipe.run.name, "WANDB_RUN_NAME": recipe.run.name,
            "WANDB_MODE": log.wandb_mode}


def compile_cache(recipe: Recipe) -> str:
    """``[run] compile_cache``, else ``<run>/compile_cache``. Not an inherited TORCHINDUCTOR_CACHE_DIR:
    Inductor exports its per-host default itself the first time it looks (cache_dir_utils.cache_dir)."""
    if recipe.run.compile_cache:
        return str(rundir.in_repo(recipe.run.compile_cache))
    return str(recipe.output_dir / rundir.COMPILE_CACHE_DIR)


def callbacks(recipe: Recipe) -> list:
    """The configs of the run's callbacks (train.callbacks), from its recipe; the trainer calls them in
    (-priority, name) order at each point."""
    t, c, d, e, launch = recipe.training, recipe.checkpoint, recipe.data, recipe.eval, recipe.launch
    made = [
        HeartbeatMarks.Config(),
        MetricsFile.Config(),
        SpikeGuard.Config(enabled=t.skip_spikes, sigmas=t.spike_sigmas, window=t.spike_window,
                          max_consecutive_skips=t.max_consecutive_skips, remember=t.spike_rollbacks),
        ReplicaCheck.Config(every=t.consistency_every),
        Progress.Config(),
        SourceTokens.Config(),
        Straggler.Config(threshold=launch.straggler_threshold, windows=launch.straggler_windows),
        Eval.Config(every=e.every, at_end=e.at_end, spec=e.spec(), chat_template=d.chat_template,
                    val_sets=recipe.validation_sets),
        Preemption.Config(),
        Rollback.Config(spikes=t.spike_rollbacks, window=t.spike_window),
    ]
    if c.export_hf:
        made.append(Export.Config(out_dir=str(recipe.export_dir), recipe=Path(recipe.path).name,
                                  tokenizer_dir=str(Path(d.tokenizer).parent), chat_template=d.chat_template))
    if recipe.logging.report:
        made.append(Report.Config(every=e.every))
    if spec := os.environ.get(BITFLIP_ENV):  # tests only (train.callbacks.bitflip)
        made.append(BitFlip.Config(spec=spec))
    return made


def world_size() -> int:
    """This launch's ranks, as torchrun says (1 without it): train.py reads it once and hands it to the
    preflight and the trainer config."""
    return int(os.environ.get("WORLD_SIZE", 1))


def pattern(regexes: list[str]) -> str:
    """One regex matching any of ``regexes`` (none: one that matches nothing)."""
    return "|".join(f"(?:{r})" for r in regexes) or r"(?!)"


def param_groups(recipe: Recipe) -> list[ParamGroupConfig]:
    """torchtitan's parameter groups (first match wins): with ``[optimizer] name = "muon"``, the matrices
    ``muon_params`` picks on Muon (train.muon.LaneMuon, torch.optim.Muon's arguments; decoupled weight decay
    on all of them), then AdamW with no decay for ``no_decay``, then AdamW for the rest."""
    o = recipe.optimizer
    adamw = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps}
    groups = [
        ParamGroupConfig(pattern=pattern(o.no_decay), optimizer_name="AdamW", optimizer_kwargs={**adamw, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={**adamw, "weight_decay": o.weight_decay}),
    ]
    if o.name == "muon":
        muon = {"lr": o.lr, "weight_decay": o.weight_decay, "momentum": o.momentum, "nesterov": o.nesterov,
                "ns_steps": o.ns_steps, "adjust_lr_fn": o.adjust_lr_fn,
                "fused": False, "foreach": False}  # over the container's fused AdamW switches: Muon has neither
        groups.insert(0, ParamGroupConfig(pattern=pattern(o.muon_params), optimizer_name=LaneMuon.__name__,
                                          optimizer_kwargs=muon))
    return groups


def trainer_config(recipe: Recipe, world: int) -> LaneformerTrainer.Config:
    """The Trainer config of ``recipe`` on ``world`` ranks."""
    t, o, s, p, c, log = (recipe.training, recipe.optimizer, recipe.schedule, recipe.parallel,
                          recipe.checkpoint, recipe.logging)
    assert t.steps is not None  # made by Training.__post_init__
    spec = model_spec(recipe)
    objective = OBJECTIVES[recipe.objective]
    init_path, init_hf = initial_load(recipe)
    config = LaneformerTrainer.Config(
        model_spec=spec,
        dump_folder=str(recipe.output_dir),
        # No HF assets folder: the tokenizer is the recipe's, and HF export is ours (models.laneformer.hf).
        # torchtitan's default, ./tests/assets/tokenizer, exists only in its own source tree.
        hf_assets_path="",
        tokenizer=SentencePieceTokenizer.Config(path=recipe.data.tokenizer),
        dataloader=objective.dataloader_of(recipe, spec.model),
        loss=objective.config_of(recipe, spec.model),  # torchtitan's loss slot holds the run's objective
        optimizer=GuardedOptimizers.Config(param_groups=param_groups(recipe)),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=s.warmup_steps,
            decay_ratio=s.decay_fraction,
            decay_type=s.decay_shape,
            min_lr_factor=s.min_lr_ratio,
        ),
        training=TrainingConfig(
            local_batch_size=t.micro_batch,
            global_batch_size=t.global_batch,
            seq_len=t.seq_len,
            steps=t.steps,
            max_norm=o.grad_clip,  # torchtitan clips; the guard gets the pre-clip norm it computed
            mixed_precision_param=p.param_dtype,
            mixed_precision_reduce=p.reduce_dtype,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=p.shard,
            # -1 (one replica per shard group) is the recipe's, not torchtitan's: resolved on this world
            data_parallel_replicate_degree=p.replicate if p.replicate != -1 else
            dp_degrees(recipe, world)[0],
            fsdp_reshard_after_forward=p.reshard_after_forward,
            # torchtitan's CP, head-tail order; the masks are built before it slices the batch
            # (LaneformerTrainer.post_dataloading_process)
            context_parallel_degree=p.context_parallel,
            spmd_backend="partial_dtensor",
        ),
        compile=CompileConfig(enable=p.compile, components=["model"]),
        activation_checkpoint={"none": None, "selective": SelectiveAC.Config(),
                               "full": FullAC.Config()}[p.activation_checkpoint],
        checkpoint=MilestoneCheckpointManager.Config(
            enable=True,
            folder=rundir.CHECKPOINTS_DIR,
            interval=c.interval,
            keep_latest_k=c.keep_last,
            async_mode="async" if c.async_save else "disabled",
            milestones=c.milestones,
            last_save_model_only=False,
            initial_load_path=init_path,
            initial_load_in_hf=init_hf,
            initial_load_model_only=c.init_weights_only if init_path else True,
        ),
        metrics=LaneformerMetrics.Config(
            log_freq=log.interval,
            last_step=t.steps,
            enable_tensorboard=log.tensorboard,
            save_tb_folder=rundir.TENSORBOARD_DIR,
            enable_wandb=log.wandb_mode != "disabled",
        ),
        comm=CommConfig(init_timeout_seconds=p.comm_init_timeout, train_timeout_seconds=p.comm_train_timeout),
        debug=DebugConfig(seed=recipe.run.seed, deterministic=recipe.run.deterministic),
        callbacks=callbacks(recipe),
        reduce_grads=p.reduce_grads,
        compile_cache=compile_cache(recipe),
    )
    return adapt_config(config, fp32=p.cpu_fp32)
