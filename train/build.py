"""Compile a ``Recipe`` into torchtitan's ``Trainer.Config`` objects.

Every recipe table maps onto the torchtitan component that owns it; nothing
goes through command-line strings. The result is adapted for CPU (fp32,
dense-mask attention, gloo) only when no GPU is present.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from data.loader import MixtureDataLoader, SentencePieceTokenizer, build_mixture
from data.mixture import Mixture
from models.laneformer import Laneformer, model_registry
from train.cpu import adapt_config
from train.eval_hook import EvalHook
from train.export_hook import ExportHook
from train.preemption import PreemptionHook
from train.recipe import REPO, Recipe, RecipeError, check_keys
from train.trainer import GuardedOptimizers, LaneformerTrainer, MilestoneCheckpointManager


def model_config(recipe: Recipe) -> Laneformer.Config:
    """The flavor with the recipe's field overrides, checked against the model."""
    fields = sorted({f.name for f in dataclasses.fields(Laneformer.Config)} - {"inner_attention"})
    check_keys(recipe.model.overrides, fields, recipe.path, "[model]")
    try:
        return model_registry(recipe.model.flavor, **recipe.model.overrides).model
    except (ValueError, TypeError) as e:
        raise RecipeError(f"{recipe.path}: [model] {e}") from e


def repo_path(path: str) -> str:
    return str(path if Path(path).is_absolute() else REPO / path)


def initial_load(recipe: Recipe) -> tuple[str | None, bool]:
    """(checkpoint step dir or HF folder to start from, whether it is an HF export)."""
    src = recipe.checkpoint.init_from
    if src is None:
        return None, False
    path = Path(repo_path(src))
    if (path / "config.json").exists() and list(path.glob("*.safetensors")):
        return str(path), True
    if (path / ".metadata").exists():
        return str(path), False
    steps = sorted(
        (int(p.name.split("-")[1]), p) for p in (path / "checkpoints").glob("step-*")
        if p.name.split("-")[1].isdigit() and (p / ".metadata").exists()
    )
    if not steps:
        raise RecipeError(
            f"{recipe.path}: [checkpoint] init_from: {path} holds no complete checkpoint "
            "(a run dir with checkpoints/step-N, a step dir, or an HF export)"
        )
    return str(steps[-1][1]), False


def source_specs(recipe: Recipe) -> list[dict]:
    """The recipe's sources as data.mixture.SourceSpec fields, paths resolved."""
    keys = ("name", "weight", "tokens", "max_epochs")
    return [{k: getattr(s, k) for k in keys} | {"path": repo_path(s.path)} for s in recipe.data.sources]


def check_data(recipe: Recipe, config: Laneformer.Config) -> Mixture:
    """Open and validate every source against the tokenizer and model, as training will."""
    t = recipe.training
    return build_mixture(source_specs(recipe), repo_path(recipe.data.tokenizer), t.seq_len,
                         recipe.run.seed, config.vocab_size, t.steps * t.global_batch)


def export_hooks(recipe: Recipe) -> list:
    """The end-of-run Hugging Face export, when the recipe asks for it."""
    if not recipe.checkpoint.export_hf:
        return []
    out = recipe.checkpoint.export_dir
    return [ExportHook.Config(
        out_dir=repo_path(out) if out else str(recipe.output_dir / "hf"),
        recipe=Path(recipe.path).name,
        tokenizer_dir=str(Path(repo_path(recipe.data.tokenizer)).parent),
    )]


def trainer_config(recipe: Recipe) -> LaneformerTrainer.Config:
    t, o, s, p, c, log = (recipe.training, recipe.optimizer, recipe.schedule, recipe.parallel,
                          recipe.checkpoint, recipe.logging)
    spec = model_registry(recipe.model.flavor, **recipe.model.overrides)
    vocab = spec.model.vocab_size
    adamw = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps}
    no_decay = "|".join(f"(?:{r})" for r in o.no_decay) or r"(?!)"
    init_path, init_hf = initial_load(recipe)
    os.environ.setdefault("WANDB_PROJECT", log.wandb_project or recipe.run.name)
    os.environ.setdefault("WANDB_RUN_NAME", recipe.run.name)
    os.environ.setdefault("WANDB_MODE", log.wandb_mode)
    config = LaneformerTrainer.Config(
        model_spec=spec,
        dump_folder=str(recipe.output_dir),
        tokenizer=SentencePieceTokenizer.Config(path=repo_path(recipe.data.tokenizer)),
        dataloader=MixtureDataLoader.Config(
            sources=source_specs(recipe),
            tokenizer_path=repo_path(recipe.data.tokenizer),
            vocab_size=vocab,
            seed=recipe.run.seed,
            total_samples=t.steps * t.global_batch,
        ),
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        optimizer=GuardedOptimizers.Config(
            grad_clip=o.grad_clip,
            param_groups=[
                ParamGroupConfig(pattern=no_decay, optimizer_name="AdamW",
                                 optimizer_kwargs={**adamw, "weight_decay": 0.0}),
                ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                 optimizer_kwargs={**adamw, "weight_decay": o.weight_decay}),
            ],
        ),
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
            max_norm=math.inf,  # GuardedOptimizers clips, after looking at the norm
            mixed_precision_param=p.param_dtype,
            mixed_precision_reduce=p.reduce_dtype,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=p.shard,
            data_parallel_replicate_degree=p.replicate,
            spmd_backend="partial_dtensor",
        ),
        compile=CompileConfig(enable=p.compile, components=["model"]),
        activation_checkpoint={"none": None, "selective": SelectiveAC.Config(),
                               "full": FullAC.Config()}[p.activation_checkpoint],
        checkpoint=MilestoneCheckpointManager.Config(
            enable=True,
            folder="checkpoints",
            interval=c.interval,
            keep_latest_k=c.keep_last,
            async_mode="async" if c.async_save else "disabled",
            milestones=c.milestones,
            last_save_model_only=False,
            initial_load_path=init_path,
            initial_load_in_hf=init_hf,
            initial_load_model_only=c.init_weights_only if init_path else True,
        ),
        metrics=MetricsProcessor.Config(
            log_freq=log.interval,
            enable_tensorboard=log.tensorboard,
            save_tb_folder="tensorboard",
            enable_wandb=log.wandb_mode != "disabled",
        ),
        comm=CommConfig(),
        debug=DebugConfig(seed=recipe.run.seed, deterministic=recipe.run.deterministic),
        hooks=[EvalHook.Config(
            **{k: v for k, v in dataclasses.asdict(recipe.eval).items()
               if k not in ("val_sources", "core_bundle", "lm_eval_tasks")},
            val_sources=[repo_path(p) for p in recipe.eval.val_sources],
            core_bundle=recipe.eval.core_bundle and repo_path(recipe.eval.core_bundle),
            lm_eval_tasks=recipe.eval.lm_eval_tasks and repo_path(recipe.eval.lm_eval_tasks),
        ), *export_hooks(recipe), PreemptionHook.Config()],  # last: an eval due at the preempted step runs first
        skip_spikes=t.skip_spikes,
        spike_sigmas=t.spike_sigmas,
        spike_window=t.spike_window,
    )
    return adapt_config(config)
