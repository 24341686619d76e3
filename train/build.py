"""Check a ``Recipe`` against the model, the files and this machine, and compile it
into torchtitan's ``Trainer.Config`` objects.

``preflight`` runs every check a launch makes before anything is written (and
``--dry-run`` runs the same). Every recipe table maps onto the torchtitan
component that owns it; nothing goes through command-line strings. The result
is adapted for CPU (fp32, gloo) only when no GPU is present; the attention
kernel comes from ``model_registry``.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec

import rundir
from rundir import writable
from data.chat import resolve_template, template_sha256
from data.loader import MixtureDataLoader, SentencePieceTokenizer, build_mixture
from data.mixture import Mixture
from data.holdout import held_out_dir, recorded_holdout
from data.pairs import MANIFEST_KEY as PAIRS
from data.shards import MANIFEST, load_manifest, open_source
from data.tokenizer import Tokenizer, check_sha256, how_to_get
from eval.suite import check_inputs
from models.laneformer import NATIVE_FIELDS, Laneformer, laneformer_configs, model_registry
from models.laneformer.checkpoint import open_checkpoint
from train.cpu import adapt_config
from train.callbacks.bitflip import BITFLIP_ENV, BitFlip
from train.callbacks.eval import Eval
from train.callbacks.export import Export
from train.callbacks.heartbeat import Heartbeat
from train.callbacks.metrics_file import MetricsFile
from train.callbacks.preemption import Preemption
from train.callbacks.pref_eval import PrefEval
from train.callbacks.progress import Progress
from train.callbacks.replica_check import ReplicaCheck
from train.callbacks.report import Report
from train.callbacks.rollback import Rollback
from train.callbacks.source_tokens import SourceTokens
from train.callbacks.spike_guard import SpikeGuard
from train.callbacks.straggler import Straggler
from train.recipe import (Recipe, RecipeError, check_keys, check_needs, check_value, check_world, dp_degrees,
                          validation_sets)
from train.health.storage import run_dir_problem
from train.titan import GuardedOptimizers, LaneformerMetrics, MilestoneCheckpointManager
from train.preference.pairs import PairDataLoader, PairSet
from train.preference.trainer import PreferenceTrainer
from train.trainer import LaneformerTrainer


def model_spec(recipe: Recipe) -> ModelSpec:
    """The flavor's ModelSpec with the recipe's ``[model]`` overrides, each checked against
    ``Laneformer.Config``'s type hints by the recipe's own checker."""
    m, path = recipe.model, recipe.path
    if m.flavor not in laneformer_configs:
        raise RecipeError(f"{path}: [model] flavor: unknown {m.flavor!r}; known: {sorted(laneformer_configs)}")
    check_keys(m.overrides, NATIVE_FIELDS, path, "[model]")
    hints = typing.get_type_hints(Laneformer.Config)
    overrides = {k: check_value(v, hints[k], path, "model", k) for k, v in m.overrides.items()}
    try:
        return model_registry(m.flavor, **overrides)
    except (ValueError, TypeError) as e:
        raise RecipeError(f"{path}: [model] {e}") from e


def model_config(recipe: Recipe) -> Laneformer.Config:
    return model_spec(recipe).model


def initial_load(recipe: Recipe) -> tuple[str | None, bool]:
    """(checkpoint step dir or HF folder to start from, whether it is an HF export)."""
    src = recipe.checkpoint.init_from
    if src is None:
        return None, False
    path = Path(src)
    why = f"{recipe.path}: [checkpoint] init_from: {path}"
    if not path.exists():
        raise RecipeError(f"{why} does not exist")
    try:
        checkpoint = open_checkpoint(path)
    except FileNotFoundError:
        raise RecipeError(
            f"{why} holds no complete checkpoint "
            "(a run dir with checkpoints/step-N, a step dir with .metadata, or an HF export)"
        ) from None
    return str(checkpoint.folder), checkpoint.kind == "hf"


@dataclass
class Preflight:
    """What the checks found: the model config and mixture when they could be built, and
    every problem as ``file: [table] key: why``. A launch starts only with no problems."""

    config: Laneformer.Config | None = None
    mixture: Mixture | None = None
    problems: list[str] = field(default_factory=list)
    no_space: bool = False  # the run dir cannot hold its checkpoints (Exit.NO_SPACE when the only problem)


def preflight(recipe: Recipe, world_size: int) -> Preflight:
    """Every check a launch makes before anything is written (``--dry-run`` runs the same)."""
    out, p = Preflight(), recipe.path
    d, t, c = recipe.data, recipe.training, recipe.checkpoint

    def check(fn):
        try:
            return fn()
        except RecipeError as e:
            out.problems.append(str(e))

    check(lambda: check_world(recipe, world_size))
    out.config = check(lambda: model_config(recipe))
    if out.config is not None and t.seq_len > out.config.max_seq_len:
        out.problems.append(f"{p}: [training] seq_len: {t.seq_len} exceeds the model's max_seq_len "
                            f"{out.config.max_seq_len}")
    check(lambda: initial_load(recipe))
    tokenizer = None
    if not Path(d.tokenizer).is_file():
        out.problems.append(f"{p}: [data] tokenizer: {d.tokenizer} not found{how_to_get(d.tokenizer)}")
    else:
        try:
            tokenizer = Tokenizer(d.tokenizer)
        except (ValueError, OSError, RuntimeError) as e:
            out.problems.append(f"{p}: [data] tokenizer: {e}")
        if d.tokenizer_sha256 and (wrong := check_sha256(d.tokenizer, d.tokenizer_sha256)):
            out.problems.append(f"{p}: [data] tokenizer_sha256: {wrong}{how_to_get(d.tokenizer)}")
            tokenizer = None
    out.problems += check_needs(recipe)
    if not d.sources:
        out.problems.append(f"{p}: [data] sources: needs at least one [[data.sources]]")
    missing = [(i, s) for i, s in enumerate(d.sources) if not Path(s.path).is_dir()]
    for i, s in missing:
        out.problems.append(f"{p}: [data.sources[{i}]] path: {s.path} not found (source {s.name!r}; make it with "
                            f"{make_source_command(recipe, s)})")
    if out.config is not None and tokenizer is not None and d.sources and not missing:
        try:
            if recipe.preference.loss:
                check_pairs(recipe, out.config, tokenizer)
            elif paired := [s.name for s in d.sources if s.pairs]:
                out.problems.append(f"{p}: [preference] loss: source(s) {paired} are preference pairs: a run on "
                                    "them needs a preference loss (dpo, dpo_norm or simpo), else it would train "
                                    "on the rejected answers too")
            else:
                out.mixture = check_data(recipe, out.config, tokenizer)
        except (ValueError, OSError) as e:
            out.problems.append(f"{p}: [data] sources: {e}")
        else:
            out.problems += check_chat_templates(recipe)
    if tokenizer is not None:
        out.problems += check_held_out(recipe, tokenizer)
    if not writable(recipe.output_dir):
        out.problems.append(f"{p}: [run] output_dir: {recipe.output_dir} is not writable")
    elif out.config is not None:
        with torch.device("meta"):
            nparams = sum(q.numel() for q in out.config.build().parameters())
        if space := run_dir_problem(recipe.output_dir, nparams, c.keep_last, c.milestones):
            out.problems.append(f"{p}: [run] output_dir: {space}")
            out.no_space = True
    out.problems += [f"{p}: [eval] {problem}" for problem in check_inputs(recipe.eval.spec())]
    if c.export_hf and not writable(Path(c.export_dir)):
        out.problems.append(f"{p}: [checkpoint] export_dir: {c.export_dir} is not writable")
    return out


def make_source_command(recipe: Recipe, source) -> str:
    """The command that makes a missing source's shards: from its Hub dataset or ``input`` where it
    names one (train.data reads the recipe), else from the user's own files (data.tokenize)."""
    if source.hub_id or source.input:
        return f"python -m train.data tokenize --recipe {recipe.path} --source {source.name}"
    key = f"--chat-key {source.chat_key}" if source.chat_key else f"--text-key {source.text_key or 'text'}"
    if source.pairs:
        key = f"--pairs --seq-len {recipe.training.seq_len}"
    return (f"python -m data.tokenize --input <your jsonl/parquet files> {key} "
            f"--tokenizer {recipe.data.tokenizer} --out {source.path}")


def check_data(recipe: Recipe, config: Laneformer.Config, tokenizer: Tokenizer | None = None) -> Mixture:
    """Open and validate every source against the tokenizer and model, as training will."""
    t = recipe.training
    return build_mixture(recipe.data.sources, tokenizer or Tokenizer(recipe.data.tokenizer), t.seq_len,
                         recipe.run.seed, config.vocab_size, t.steps * t.global_batch)


def check_pairs(recipe: Recipe, config: Laneformer.Config, tokenizer: Tokenizer | None = None) -> str:
    """A preference run's sources: every training and held-out source opens as pairs that fit seq_len,
    and the run's pairs (steps x global batch / 2) fit in each source's ``max_epochs``. Returns what
    was found, for the dry run."""
    t = recipe.training
    tokenizer = tokenizer or Tokenizer(recipe.data.tokenizer)
    if plain := [s.name for s in recipe.data.sources if not s.pairs]:
        raise RecipeError(f"source(s) {plain}: a preference run trains on pairs only (set pairs = true on a "
                          "pair source)")
    heldout = (PairSet(recipe.preference.heldout, t.seq_len, tokenizer.fingerprint, config.vocab_size)
               if recipe.preference.heldout else [])
    pairs = PairSet([s.path for s in recipe.data.sources], t.seq_len, tokenizer.fingerprint, config.vocab_size)
    epochs = t.steps * t.global_batch / 2 / len(pairs)
    for s in recipe.data.sources:
        if s.max_epochs is not None and epochs > s.max_epochs:
            raise RecipeError(f"source {s.name!r}: the run reads {t.steps * t.global_batch // 2:,} pairs, "
                              f"{epochs:.2f} epochs of the {len(pairs):,} pairs, over its max_epochs {s.max_epochs}")
    return (f"pairs on this machine: {len(pairs):,} ({epochs:.2f} epochs), held out: {len(heldout):,}")


def check_held_out(recipe: Recipe, tokenizer: Tokenizer) -> list[str]:
    """Problems of the held-out sets the run validates on: a source with a ``holdout`` whose documents
    were not split off (the command that splits them, without re-tokenizing), or split with another
    setting, or whose held-out set cannot be read with the run's tokenizer."""
    p, problems = recipe.path, []
    try:
        validation_sets(recipe)
    except RecipeError as e:
        problems.append(str(e))
    for i, s in enumerate(recipe.data.sources):
        if not s.holdout or not Path(s.path).is_dir():
            continue  # a missing source is reported with the command that makes it (and holds out)
        where, held = f"{p}: [data.sources[{i}]] holdout: source {s.name!r}", held_out_dir(s.path)
        try:
            entry = recorded_holdout(s.path)
            if entry is None:
                problems.append(f"{where} has no held-out set ({held}); split it off without re-tokenizing: "
                                f"python -m train.data holdout --recipe {p} --source {s.name}")
            elif entry["holdout"] != s.holdout:
                problems.append(f"{where} is {s.holdout!r}, but {held / MANIFEST} records holdout {entry['holdout']!r}: "
                                "give that, or tokenize the source again")
            else:
                open_source(held, tokenizer.fingerprint, tokenizer.vocab_size)
        except ValueError as e:  # ShardError: an unreadable held-out set
            problems.append(f"{where}: {e}")
    return problems


def check_chat_templates(recipe: Recipe) -> list[str]:
    """Problems of chat and pair sources (training and held-out) against the run's template: a manifest
    that records another template (trained on one, exported with another), a ``chat_key`` source
    tokenized as plain text, or a ``pairs`` source not tokenized as pairs (and the reverse)."""
    p, d = recipe.path, recipe.data
    name, jinja = resolve_template(d.chat_template)
    sha = template_sha256(jinja)
    where = [(f"[data.sources[{i}]]", s.name, s.path, s.chat_key, s.pairs) for i, s in enumerate(d.sources)]
    where += [(f"[eval] val_sources[{i}]", Path(v).name, v, None, None) for i, v in enumerate(recipe.eval.val_sources)]
    where += [(f"[preference] heldout[{i}]", Path(v).name, v, None, True) for i, v in enumerate(recipe.preference.heldout)]
    where += [(f"[data.sources[{i}]] holdout", s.name, str(held_out_dir(s.path)), None, None)
              for i, s in enumerate(d.sources) if s.holdout]
    problems = []
    for table, source, path, chat_key, pairs in where:
        manifest = Path(path) / MANIFEST
        try:
            entries = load_manifest(path)
        except ValueError:
            continue  # a missing or unreadable manifest is reported by the checks that open the source
        key = PAIRS if PAIRS in entries else "chat"  # pair sources record their template as chat ones do
        chat = entries.get(key)
        retokenize = f"retokenize it with python -m train.data tokenize --recipe {p} --source {source}"
        if chat_key and chat is None:
            problems.append(f"{p}: {table} chat_key: source {source!r} is conversations, but {manifest} has no "
                            f"'chat' entry (tokenized as plain text?); {retokenize}")
        elif pairs is not None and pairs != (key == PAIRS):
            problems.append(f"{p}: {table} pairs: source {source!r} is {'' if pairs else 'not '}preference pairs, "
                            f"but {manifest} has {'no' if pairs else 'a'} 'pairs' entry; "
                            + (retokenize if pairs else "set pairs = true"))
        elif chat is not None and chat.get("template_sha256") != sha:
            problems.append(
                f"{p}: [data] chat_template: the run's template {name} (sha256 {sha[:12]}…) is not the one "
                f"source {source!r} was tokenized with: {manifest} records {key}.template "
                f"{chat.get('template')!r} (sha256 {str(chat.get('template_sha256'))[:12]}…). Set "
                "[data] chat_template to that template, or retokenize the source with this one")
    return problems


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
        Heartbeat.Config(),
        MetricsFile.Config(),
        SpikeGuard.Config(enabled=t.skip_spikes, sigmas=t.spike_sigmas, window=t.spike_window,
                          max_consecutive_skips=t.max_consecutive_skips, remember=t.spike_rollbacks),
        ReplicaCheck.Config(every=t.consistency_every),
        Progress.Config(),
        SourceTokens.Config(),
        Straggler.Config(threshold=launch.straggler_threshold, windows=launch.straggler_windows),
        Eval.Config(every=e.every, at_end=e.at_end, spec=e.spec(), chat_template=d.chat_template,
                    val_sets=validation_sets(recipe)),
        Preemption.Config(),
        Rollback.Config(spikes=t.spike_rollbacks, window=t.spike_window),
    ]
    if recipe.preference.loss and recipe.preference.heldout:
        made.append(PrefEval.Config(every=e.every, at_end=e.at_end))
    if c.export_hf:
        made.append(Export.Config(out_dir=c.export_dir, recipe=Path(recipe.path).name,
                                  tokenizer_dir=str(Path(d.tokenizer).parent), chat_template=d.chat_template))
    if recipe.logging.report:
        made.append(Report.Config(every=e.every))
    if spec := os.environ.get(BITFLIP_ENV):  # tests only (train.callbacks.bitflip)
        made.append(BitFlip.Config(spec=spec))
    return made


def trainer_config(recipe: Recipe) -> LaneformerTrainer.Config:
    t, o, s, p, c, log = (recipe.training, recipe.optimizer, recipe.schedule, recipe.parallel,
                          recipe.checkpoint, recipe.logging)
    spec = model_spec(recipe)
    vocab = spec.model.vocab_size
    adamw = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps}
    no_decay = "|".join(f"(?:{r})" for r in o.no_decay) or r"(?!)"
    init_path, init_hf = initial_load(recipe)
    trainer_class, extra = LaneformerTrainer, {}
    if recipe.preference.loss:  # a preference run: pairs in, the preference loss out (train.preference)
        trainer_class, extra = preference_trainer(recipe)
    config = trainer_class.Config(
        model_spec=spec,
        dump_folder=str(recipe.output_dir),
        # No HF assets folder: the tokenizer is the recipe's, and HF export is ours (models.laneformer.hf).
        # torchtitan's default, ./tests/assets/tokenizer, exists only in its own source tree.
        hf_assets_path="",
        tokenizer=SentencePieceTokenizer.Config(path=recipe.data.tokenizer),
        dataloader=PairDataLoader.Config(
            sources=[s.path for s in recipe.data.sources], vocab_size=vocab, seed=recipe.run.seed,
        ) if recipe.preference.loss else MixtureDataLoader.Config(
            sources=recipe.data.sources,
            vocab_size=vocab,
            seed=recipe.run.seed,
            total_samples=t.steps * t.global_batch,
        ),
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        optimizer=GuardedOptimizers.Config(
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
            max_norm=o.grad_clip,  # torchtitan clips; the guard gets the pre-clip norm it computed
            mixed_precision_param=p.param_dtype,
            mixed_precision_reduce=p.reduce_dtype,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=p.shard,
            # -1 (one replica per shard group) is the recipe's, not torchtitan's: resolved on this world
            data_parallel_replicate_degree=p.replicate if p.replicate != -1 else
            dp_degrees(recipe, int(os.environ.get("WORLD_SIZE", 1)))[0],
            fsdp_reshard_after_forward=p.reshard_after_forward,
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
        **extra,
    )
    return adapt_config(config, fp32=p.cpu_fp32)


def preference_trainer(recipe: Recipe) -> tuple[type, dict]:
    """The trainer class of a preference run and its ``[preference]`` fields."""
    pref = recipe.preference
    _, jinja = resolve_template(recipe.data.chat_template)
    return PreferenceTrainer, {"loss_type": pref.loss, "beta": pref.beta, "label_smoothing": pref.label_smoothing,
                               "gamma": pref.gamma, "heldout": pref.heldout, "template_sha256": template_sha256(jinja)}
