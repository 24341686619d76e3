"""The recipe's tables: one dataclass a TOML table, each checking its own values in ``__post_init__``
(as torchtitan's configs do) and deriving what it alone decides (``[training]``'s sizes in steps).

A check raises ``TableError`` with the table-relative message; ``train.recipe.loading`` adds the file
(or the ``--set`` that gave the key) and the table. What holds across tables is ``train.recipe.checks``'.
"""

from __future__ import annotations

import math
import os
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from data.held_out import held_out_problem
from data.mixture import SourceSpec
from eval.spec import EvalSpec
from rundir import EXPORT_DIR, REPO, RUNS_DIR
from train.recipe.objective import objective_of


# [optimizer] muon_params' default: the matrices inside the layers, the lane weights of attention (wq, wk, wv,
# wo) and the MLP (w1, w2, w3). The embeddings, the output head and every norm stay on AdamW, as in Moonlight
# (arXiv 2502.16982, Sec. 2.2).
MUON_PARAMS = (r"\.attention\.w[qkvo]\.weight$", r"\.feed_forward\.w[123]\.weight$")


class RecipeError(ValueError):
    """A recipe problem, with the file, table and key it is about."""


class TableError(ValueError):
    """A table's own check failed: ``why`` after ``[table] ``, once the loader adds the file. ``key``:
    the key at fault where the error names the ``--set`` that gave it instead of the file; ``table``:
    the label when it is not the table's (``data.sources[1]``)."""

    def __init__(self, why: str, key: str = "", table: str = ""):
        super().__init__(why)
        self.key, self.table = key, table


def absolute(path: str | Path) -> Path:
    """``path``, relative to the repo unless absolute."""
    return Path(os.path.abspath(REPO / path))


def at_least(table, low: int, *names: str, says: str = "") -> None:
    """Each of ``names`` is >= ``low`` (a table's counts, intervals and timeouts); ``says``: the bound
    as the message gives it (``> 0``), else ``>= low``."""
    for name in names:
        if getattr(table, name) < low:
            raise TableError(f"{name}: must be {says or f'>= {low}'} (got {getattr(table, name)})")


@dataclass(kw_only=True)
class Run:
    name: str
    output_dir: str | None = None  # default: runs/<name> in the repo
    seed: int = 0
    deterministic: bool = False  # bitwise-reproducible kernels (slower)
    # Where torch.compile keeps its Inductor FX-graph and AOTAutograd caches (TORCHINDUCTOR_CACHE_DIR), so every
    # rank and every restart of the run finds the kernels compiled before. None: <run>/compile_cache
    # (torch's default, /tmp/torchinductor_$USER, is per host: a restart on other nodes compiles again).
    compile_cache: str | None = None


@dataclass(kw_only=True)
class Model:
    flavor: str
    # Any Laneformer.Config field may be overridden here (checked against the model by train.build).
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Data:
    tokenizer: str  # the SentencePiece .model the shards were made with
    tokenizer_sha256: str | None = None  # its expected sha256: the preflight refuses another file
    # Where relative source paths live (relative: to the repo). $LANEFORMER_DATA_ROOT overrides it,
    # and --set data.root=... overrides both: moving the data is one edit. Unset: the repo.
    root: str | None = None
    # Chat template (data.chat): a name, a .jinja file, or an HF folder / tokenizer_config.json.
    # Unset: the initial checkpoint's own, else data.chat.DEFAULT; the load records which.
    chat_template: str | None = None
    # Every source's held-out documents (data.held_out): a fraction or a document count, 0 for none;
    # a source's own `held_out` overrides it. The run validates on each held-out set ([eval]).
    held_out: int | float | None = None
    sources: list[SourceSpec] = field(default_factory=list)  # [[data.sources]]

    def __post_init__(self):
        if self.held_out is not None and (why := held_out_problem(self.held_out)):
            raise TableError(f"held_out: {why}", key="held_out")
        if self.tokenizer_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.tokenizer_sha256):
            raise TableError(f"tokenizer_sha256: expected 64 lowercase hex digits, got {self.tokenizer_sha256!r}")
        # Pair sources are drawn uniformly together (data.pairs_loader), each in proportion to its pairs: a
        # token budget or unequal weights would be ignored, so they are refused, naming the source.
        pairs = [(i, s) for i, s in enumerate(self.sources) if s.pairs]
        for i, s in pairs:
            where = {"key": f"sources[{i}]", "table": f"data.sources[{i}]"}
            if s.tokens is not None:
                raise TableError(f"tokens: source {s.name!r} is a pair source, drawn uniformly with the run's other "
                                 "pairs: a token budget would be ignored. Give it weight = 1.0 instead", **where)
            first = pairs[0][1]
            if s.weight != first.weight:
                raise TableError(f"weight: {s.weight} for source {s.name!r}, {first.weight} for {first.name!r}: a "
                                 "preference run draws its pairs uniformly from all its pair sources together (each "
                                 "in proportion to its pairs), so unequal weights would be ignored. Give every pair "
                                 "source the same weight", **where)


@dataclass(kw_only=True)
class Optimizer:
    # "adamw": AdamW on every parameter. "muon": Muon (train.muon.LaneMuon, torch.optim.Muon on each lane's
    # matrix) on the matrices `muon_params` picks, AdamW (lr, betas, eps, no_decay) on the rest.
    name: Literal["adamw", "muon"] = "adamw"
    lr: float
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # No decay for norms and embeddings (regex over parameter names).
    no_decay: list[str] = field(default_factory=lambda: [r"norm\.weight$", r"tok_embeddings\."])
    # Muon only (name = "muon"). The parameters it trains (regexes over names, torchtitan's ParamGroupConfig
    # patterns; 2-D matrices or [lanes, R, C] stacks): the attention and MLP lane weights. torch.optim.Muon's
    # momentum, nesterov, ns_steps and adjust_lr_fn (its None is "original"). "match_rms_adamw" scales each
    # matrix's update to AdamW's RMS (0.2 sqrt(max(R, C)), Moonlight, arXiv 2502.16982), so that lr and
    # weight_decay tuned for AdamW carry over to Muon's matrices unchanged.
    muon_params: list[str] = field(default_factory=lambda: list(MUON_PARAMS))
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: Literal["original", "match_rms_adamw", "spectral_unclamped"] = "match_rms_adamw"

    def __post_init__(self):
        if self.lr <= 0:
            raise TableError(f"lr: must be > 0 (got {self.lr})")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise TableError(f"betas: must be two numbers in [0, 1) (got {self.betas})")
        if self.eps <= 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise TableError("eps and grad_clip must be > 0, weight_decay >= 0")
        if not 0 <= self.momentum < 1:
            raise TableError(f"momentum: must be in [0, 1) (got {self.momentum})")
        if not 1 <= self.ns_steps < 100:
            raise TableError(f"ns_steps: must be in [1, 100) (got {self.ns_steps})")
        for key in ("no_decay", "muon_params"):
            for i, pattern in enumerate(getattr(self, key)):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise TableError(f"{key}[{i}]: {pattern!r} is not a regular expression ({e})", key=key) from None
        if self.name == "muon" and not self.muon_params:
            raise TableError("muon_params: name = \"muon\" needs at least one pattern (the matrices Muon trains)")


@dataclass(kw_only=True)
class Schedule:
    warmup_steps: int | None = None  # or warmup_tokens, made steps by train.recipe.checks (it needs [training])
    warmup_tokens: int | None = None
    decay_fraction: float = 0.2  # WSD: the last fraction of steps decays
    decay_shape: Literal["linear", "sqrt", "cosine"] = "linear"
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio

    def __post_init__(self):
        if self.warmup_steps is not None and self.warmup_tokens is not None:
            raise TableError("give at most one of 'warmup_steps' and 'warmup_tokens'")
        if self.warmup_steps is None and self.warmup_tokens is None:
            self.warmup_steps = 0
        at_least(self, 0, *(k for k in ("warmup_steps", "warmup_tokens") if getattr(self, k) is not None))
        if not 0 <= self.decay_fraction <= 1:
            raise TableError(f"decay_fraction: must be in [0, 1] (got {self.decay_fraction})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TableError(f"min_lr_ratio: must be in [0, 1] (got {self.min_lr_ratio})")


@dataclass(kw_only=True)
class Training:
    seq_len: int
    global_batch: int | None = None  # sequences per optimizer step
    global_batch_tokens: int | None = None
    micro_batch: int = 1  # sequences per rank per forward
    total_tokens: int | None = None
    steps: int | None = None
    skip_spikes: bool = True  # skip the step on a non-finite or spiking loss / grad norm
    spike_sigmas: float = 6.0
    spike_window: int = 100
    max_consecutive_skips: int = 100  # stop (exit 4) after this many skips in a row (a spike window)
    # Roll back (health/rollback.py) when this many steps are skipped within spike_window steps: to the
    # checkpoint before the first of them, skipping the data seen since (PaLM's remedy). 0: never.
    spike_rollbacks: int = 0
    # With [parallel] replicate > 1: steps between comparisons of the replicas' parameters and optimizer
    # state (health/consistency.py); always also before a checkpoint save. 0: before saves only.
    consistency_every: int = 100

    def __post_init__(self):
        """Sizes given in tokens become steps and sequences (exactly one of each pair is given); the
        derived ones are filled in too, so the resolved recipe states both."""
        for a, b in (("global_batch", "global_batch_tokens"), ("steps", "total_tokens")):
            if (getattr(self, a) is None) == (getattr(self, b) is None):
                raise TableError(f"give exactly one of '{a}' and '{b}'")
        at_least(self, 1, "seq_len", "micro_batch", says="> 0")
        if self.global_batch is None:
            if self.global_batch_tokens % self.seq_len:
                raise TableError(f"global_batch_tokens: {self.global_batch_tokens} is not a multiple of seq_len "
                                 f"{self.seq_len}")
            self.global_batch = self.global_batch_tokens // self.seq_len
        self.global_batch_tokens = self.global_batch * self.seq_len
        at_least(self, 1, "global_batch", says="> 0")
        if self.global_batch % self.micro_batch:
            raise TableError(f"global_batch: {self.global_batch} is not divisible by micro_batch {self.micro_batch}")
        if self.steps is None:
            self.steps = math.ceil(self.total_tokens / self.global_batch_tokens)
        self.total_tokens = self.steps * self.global_batch_tokens
        at_least(self, 1, "steps", says="> 0")
        if self.spike_sigmas <= 0 or self.spike_window < 2:
            raise TableError("spike_sigmas must be > 0 and spike_window >= 2")
        at_least(self, 0, "consistency_every", "spike_rollbacks")
        at_least(self, 1, "max_consecutive_skips")

    @property
    def samples(self) -> int:
        """Sequences the run reads: steps x global_batch (both made by ``__post_init__``)."""
        assert self.steps is not None and self.global_batch is not None
        return self.steps * self.global_batch


# How gradients are reduced while micro batches accumulate (FSDP2's switches, set in train/trainer.py).
REDUCE_GRADS = {
    "every_micro_batch": "reduce-scatter (and, under HSDP, all-reduce across replicas) after every micro batch",
    "last_micro_batch": "no reduction before a step's last micro batch: unsharded fp32 gradients are held "
                        "across micro batches, then reduced once",
    "replicas_last_micro_batch": "HSDP: reduce-scatter inside the shard group after every micro batch, all-reduce "
                                 "across replicas once, at the last (holds sharded fp32 partial sums; one replica: "
                                 "as every_micro_batch)",
}


@dataclass(kw_only=True)
class Parallel:
    # The data-parallel layout: ranks = shard x replicate. A parameter is split over `shard` ranks
    # (FSDP2) and that group is copied `replicate` times (HSDP, torchtitan's replicate degree), e.g.
    # shard = 8 (the GPUs of a node), replicate = -1 (one copy per node). -1: the ranks the other leaves.
    shard: int = -1
    replicate: int = 1
    # Context parallelism (torchtitan's context_parallel_degree): every sequence is cut over this many ranks,
    # which attend to each other's keys and values (an all-gather per attention). ranks = context_parallel x
    # shard x replicate; parameters are sharded over shard x context_parallel. Needs [training] seq_len a
    # multiple of 128 x context_parallel and no in-loop evaluation (train.recipe.checks.check_context_parallel).
    context_parallel: int = 1
    # The GPUs this recipe is planned for: what `--dry-run` and `--plan` check and estimate when no
    # --gpus is given (phase 1: 192). 0: a CPU recipe, checked on this launch's ranks, no GPU estimate.
    gpus: int = 0
    # torchtitan's fsdp_reshard_after_forward: "never" keeps parameters gathered from forward to backward.
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    reduce_grads: Literal["every_micro_batch", "last_micro_batch", "replicas_last_micro_batch"] = "every_micro_batch"
    compile: bool = False
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    reduce_dtype: Literal["float32"] = "float32"
    # Without a GPU, train in fp32 whatever param_dtype says (bf16 matmuls are ~20x slower on CPU);
    # false keeps the recipe's precision on CPU too: FSDP2's bf16 compute, fp32 master weights and
    # reductions, as on the cluster (train/cpu.py; tests/train/test_bf16.py).
    cpu_fp32: bool = True
    # Seconds a collective may wait before the NCCL/gloo watchdog ends the job: up to and during the first
    # step (rendezvous, compile), then after it. torchtitan's CommConfig defaults; a CPU run raises both
    # (train/cpu.py). A stall outside a collective is [launch] stall_timeout's.
    comm_init_timeout: int = 300
    comm_train_timeout: int = 100

    def __post_init__(self):
        for key in ("shard", "replicate"):
            if getattr(self, key) == 0 or getattr(self, key) < -1:
                raise TableError(f"{key}: must be >= 1, or -1 for the ranks the other leaves "
                                 f"(got {getattr(self, key)})")
        if self.shard == self.replicate == -1:
            raise TableError("shard, replicate: at most one of them may be -1")
        at_least(self, 1, "context_parallel")
        at_least(self, 1, "comm_init_timeout", "comm_train_timeout", says="> 0 seconds")


@dataclass(kw_only=True)
class Checkpoint:
    interval: int = 1000
    keep_last: int = 3
    async_save: bool = False
    milestones: list[int] = field(default_factory=list)  # steps kept forever
    init_from: str | None = None  # a run dir, checkpoint dir or HF export to start from
    init_weights_only: bool = True  # start fresh optimizer and step counter from init_from
    export_hf: bool = False  # at the end, write a Hugging Face folder of the final weights
    export_dir: str | None = None  # default: <run>/hf (rundir.EXPORT_DIR)
    stall_s: float | None = None  # measured training stall per save (launch.slurm status); None: planned

    def __post_init__(self):
        if self.interval <= 0 or self.keep_last < 0:
            raise TableError("interval must be > 0 and keep_last >= 0")
        if self.stall_s is not None and self.stall_s <= 0:
            raise TableError(f"stall_s: must be > 0 seconds (got {self.stall_s})")


@dataclass(kw_only=True)
class Launch:
    # Crash restarts (each after a new checkpoint) allowed per 24 hours; 0: no limit.
    # Crashes without a new checkpoint in between always stop the run.
    crashes_per_day: int = 8
    # Seconds without a heartbeat from any rank (health/heartbeat.py) before a launcher ends the job as
    # stalled, dumps every rank's Python stacks to <run>/stalls/, and restarts it as after a crash; 0: off.
    # Longer allowances: until every rank has finished its first step (rendezvous, build, checkpoint
    # load, compile), and while a rank is in a checkpoint save or load, or in an eval, export or report
    # (health/phases.py says which phase gets which).
    # Above comm_train_timeout, so that a hang inside a collective is the comm watchdog's to end.
    stall_timeout: int = 600
    stall_timeout_first_step: int = 1800
    stall_timeout_checkpoint: int = 1800
    stall_timeout_eval: int = 3600
    # Inputs of the checkpoint-interval plan (plan/interval.py, printed by train.py --plan): a node's
    # mean time between failures (Llama 3: 419 unexpected interruptions in 54 days on 2,048 8-GPU nodes) and
    # the planned restart, seconds (launch.slurm status measures it).
    node_mtbf_hours: float = 6330.0
    restart_s: float = 600.0
    # A rank whose compute check (health/straggler.py) is slower than the other ranks' median by more than this
    # fraction at straggler_windows logging steps in a row is named: stderr, <run>/alerts.jsonl, wandb.alert.
    straggler_threshold: float = 0.2
    straggler_windows: int = 5
    exclude_stragglers: bool = False  # the next restart also excludes the nodes named as stragglers

    def __post_init__(self):
        at_least(self, 0, "crashes_per_day")
        for key in ("stall_timeout", "stall_timeout_first_step", "stall_timeout_checkpoint", "stall_timeout_eval"):
            if getattr(self, key) < 0:
                raise TableError(f"{key}: must be >= 0 seconds, 0 for off (got {getattr(self, key)})")
        if not (math.isfinite(self.straggler_threshold) and self.straggler_threshold > 0):
            raise TableError("straggler_threshold: must be a finite number > 0, the fraction by which a rank's "
                             "compute check exceeds the other ranks' median (nan or inf would never name a "
                             f"straggler; got {self.straggler_threshold})")
        at_least(self, 1, "straggler_windows")
        if self.node_mtbf_hours <= 0 or self.restart_s < 0:
            raise TableError("node_mtbf_hours must be > 0 and restart_s >= 0")


@dataclass(kw_only=True)
class Logging:
    interval: int = 10
    tensorboard: bool = True
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    report: bool = True  # the run writes report/ (python -m report) after each eval and at the end

    def __post_init__(self):
        at_least(self, 1, "interval", says="> 0")


@dataclass(kw_only=True)
class Eval(EvalSpec):
    """``[eval]``: what to evaluate (eval.spec.EvalSpec, whose checks it runs), a quicker default
    size for a look during training, and when to run (the trainer's concern, not the eval's)."""
    every: int = 0  # steps between evals; 0: only at the end
    at_end: bool = True
    core_max_per_task: int | None = 50
    evalplus_limit: int | None = 20

    def __post_init__(self):
        super().__post_init__()
        at_least(self, 0, "every")

    def spec(self) -> EvalSpec:
        """The what, without the when."""
        return EvalSpec(**{f.name: getattr(self, f.name) for f in fields(EvalSpec)})


@dataclass(kw_only=True)
class Preference:
    """``[preference]``: preference optimization after SFT (train.preference). Without ``loss`` the run
    trains on next-token cross-entropy; with it every training source must be a pair source. These are
    a preference run's only defaults (the preference objective, train.objectives.preference, holds the table as it is): beta 0.1 and
    label_smoothing 0 are TRL's ``DPOConfig`` and open-instruct's ``DPOConfig``; gamma unset is
    open-instruct's ``gamma_beta_ratio`` 0.3 times beta (SimPO's margin, ``simpo`` only)."""
    loss: Literal["dpo", "dpo_norm", "simpo"] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float | None = None
    held_out: list[str] = field(default_factory=list)  # pair sources for eval/pref_loss and eval/pref_accuracy

    def __post_init__(self):
        if self.gamma is None:
            self.gamma = 0.3 * self.beta
        if self.beta <= 0 or not 0 <= self.label_smoothing < 0.5:
            raise TableError(f"beta must be > 0 and label_smoothing in [0, 0.5) (got {self.beta}, "
                             f"{self.label_smoothing})")

    def check(self, training: Training) -> None:
        """What a preference run asks of ``[training]`` (train.recipe.checks calls it with the table)."""
        if self.loss is None:
            return
        if training.spike_rollbacks:  # train.callbacks.rollback counts the skipped data in mixture tokens
            raise TableError("spike_rollbacks: not available in a preference run (the spike guard's skips are)",
                             table="training")
        if training.micro_batch % 2:
            raise TableError(f"micro_batch: {training.micro_batch} is odd; a preference run's micro batch holds "
                             "whole pairs", table="training")


# What [rl] may name as its reward besides "module:function" (eval.rewards).
RL_REWARDS = ("pass_rate", "pass_fail")


@dataclass(kw_only=True)
class Rl:
    """``[rl]``: reinforcement learning with verifiable rewards on code (train.objectives.rl, issue 59). Without
    ``tasks`` the run is not an RL run. Every default cites its source; "unverified" where it could not be
    checked against the source itself."""
    # A JSONL of {"id", "prompt", "tests"} (data.rl_tasks); relative: to the repo.
    tasks: str | None = None
    # Tasks held out for eval/rl_pass@1: data.held_out's rule (blake2b-8 of the prompt's ids under the run's
    # tokenizer, below floor(fraction x 2**64)), as every other source is split.
    held_out: float = 0.2
    prompts_per_step: int = 4  # on all ranks together; [training] global_batch = prompts_per_step x samples_per_prompt
    # G. DeepSeek-R1 and nanochat's chat_rl.py sample 16 a question (issue 59); TRL's num_generations is 8 (unverified)
    samples_per_prompt: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0  # sampling from the policy itself (TRL's GRPOConfig temperature 1.0, unverified)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    # "dapo": token-level over the step's response tokens on all ranks (DAPO, arXiv 2503.14476, its
    # "token-level policy gradient loss"; TRL's GRPOConfig loss_type default "dapo" per issue 59, unverified here);
    # "dr_grpo": over a constant, sequences x max_new_tokens (Dr. GRPO, arXiv 2503.20783, which drops GRPO's
    # 1/|o_i|); "grpo": each sequence's token mean, then the mean over sequences (DeepSeekMath's GRPO).
    loss: Literal["dapo", "dr_grpo", "grpo"] = "dapo"
    # Clip-higher: ratio clamped to [1 - clip_low, 1 + clip_high], DAPO's 0.2 and 0.28 (arXiv 2503.14476 Sec. 3.1;
    # the 0.28 also in Unsloth's GRPO guide: "DAPO recommends 0.28"); torchtitan's DAPOLoss ratio_clip_low/high.
    clip_low: float = 0.2
    clip_high: float = 0.28
    # Divide the advantage by the group's reward std (+1e-6, torchtitan's AdvantageEstimator): GRPO's; off as in
    # Dr. GRPO (arXiv 2503.20783: std scaling biases towards too easy and too hard questions) and torchtitan's default.
    std_scale: bool = False
    # A completion cut at max_new_tokens: "mask" leaves its tokens out of the loss (DAPO's overlong filtering,
    # arXiv 2503.14476 Sec. 3.4); "score" trains on it with its reward.
    truncated: Literal["mask", "score"] = "mask"
    # "pass_rate": the fraction of the task's tests passed (open-instruct's code reward, per issue 59); "pass_fail":
    # 1 when all pass; "module:function": fn(prompt, completion, task) -> float, run in the same sandbox.
    reward: str = "pass_rate"
    reward_timeout_s: float = 2.0  # per completion (open-instruct: 1 s, per issue 59; doubled for 2 shared cores)
    reward_memory_mb: int = 1024
    # KL to the reference: 0, as TRL's GRPOConfig beta=0.0 (Unsloth's GRPO guide lists "beta (float, default 0.0)"),
    # DAPO and OLMo 3's OlmoRL. Only 0 is built.
    beta: float = 0.0

    def __post_init__(self):
        if self.beta != 0:
            raise TableError(f"beta: {self.beta}: a KL to the reference is not built yet (only beta = 0, TRL's and "
                             "DAPO's default: no reference model); issue 59 lists it as left")
        at_least(self, 1, "prompts_per_step", "samples_per_prompt", "max_new_tokens", "reward_memory_mb", says="> 0")
        at_least(self, 0, "top_k")
        if self.samples_per_prompt < 2:
            raise TableError(f"samples_per_prompt: {self.samples_per_prompt}: the advantage is the reward minus its "
                             "group's mean, so a group needs >= 2 samples")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise TableError(f"temperature: must be > 0 (got {self.temperature}); held-out pass@1 is greedy")
        if not 0 < self.top_p <= 1:
            raise TableError(f"top_p: must be in (0, 1] (got {self.top_p})")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise TableError(f"clip_low must be in [0, 1) and clip_high >= 0 (got {self.clip_low}, {self.clip_high})")
        if not isinstance(self.held_out, float) or not 0 < self.held_out < 1:
            raise TableError(f"held_out: a fraction in (0, 1) of the tasks (got {self.held_out!r})")
        if not (math.isfinite(self.reward_timeout_s) and self.reward_timeout_s > 0):
            raise TableError(f"reward_timeout_s: must be > 0 seconds (got {self.reward_timeout_s})")
        if self.reward not in RL_REWARDS and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.reward):
            raise TableError(f"reward: {self.reward!r}: one of {list(RL_REWARDS)} or 'module:function'")
        if self.tasks is not None:
            self.tasks = str(absolute(self.tasks))

    def check(self, training: Training) -> None:
        """What an RL run asks of ``[training]``: a step is prompts_per_step groups of samples_per_prompt
        sequences, and a micro batch holds whole groups (each group's advantage needs all of it)."""
        if self.tasks is None:
            return
        G, n = self.samples_per_prompt, self.prompts_per_step * self.samples_per_prompt
        if training.global_batch != n:
            raise TableError(f"global_batch: {training.global_batch}, but an RL step is prompts_per_step x "
                             f"samples_per_prompt = {n} sequences: set global_batch = {n}", table="training")
        if training.micro_batch % G:
            raise TableError(f"micro_batch: {training.micro_batch} is not a multiple of samples_per_prompt {G}: a "
                             "micro batch holds whole groups", table="training")
        if training.spike_rollbacks:
            raise TableError("spike_rollbacks: not available in an RL run (its batches are sampled)", table="training")


@dataclass(kw_only=True)
class Recipe:
    run: Run
    model: Model
    data: Data
    optimizer: Optimizer
    training: Training
    schedule: Schedule = field(default_factory=Schedule)
    parallel: Parallel = field(default_factory=Parallel)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    logging: Logging = field(default_factory=Logging)
    eval: Eval = field(default_factory=Eval)
    launch: Launch = field(default_factory=Launch)
    preference: Preference = field(default_factory=Preference)
    rl: Rl = field(default_factory=Rl)
    path: str = ""  # the file it came from (a train.recipe.loading.RecipeFile: it knows the --set keys)
    # Derived at load (train.recipe.checks.validation_sets), not a table: the held-out sets the run
    # validates on, by the name their metrics carry.
    validation_sets: dict[str, str] = field(default_factory=dict)

    @property
    def output_dir(self) -> Path:
        """The run dir (absolute once resolved; default ``runs/<name>`` in the repo)."""
        return absolute(self.run.output_dir or f"{RUNS_DIR}/{self.run.name}")

    @property
    def export_dir(self) -> Path:
        """Where the end-of-run Hugging Face export goes (default ``<run>/hf``, rundir.EXPORT_DIR)."""
        return absolute(self.checkpoint.export_dir or self.output_dir / EXPORT_DIR)

    @property
    def objective(self) -> str:
        """The objective the run trains (train.recipe.objective: the one rule; train.objectives: its code)."""
        return objective_of({"preference": {"loss": self.preference.loss}, "rl": {"tasks": self.rl.tasks},
                             "data": {"sources": [{"loss_weight": s.loss_weight} for s in self.data.sources]}})

    @property
    def tokens_per_step(self) -> int:
        assert self.training.global_batch_tokens is not None  # made by Training.__post_init__
        return self.training.global_batch_tokens


# Keys renamed in 0.2 (one spelling of held-out), by table ("data.sources": every [[data.sources]]): the old
# name is read as the new one, with a message, until the next release (train.recipe.loading.read_renamed).
RENAMED = {"data": {"holdout": "held_out"}, "data.sources": {"holdout": "held_out"},
           "preference": {"heldout": "held_out"}}

TABLES = {k: v for k, v in typing.get_type_hints(Recipe).items() if k not in ("path", "validation_sets")}
