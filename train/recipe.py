"""The recipe: one TOML file per run, typed, validated before anything starts.

A recipe has the tables below. Every key is checked against its declared
type; unknown keys, wrong types and impossible values raise ``RecipeError``
naming the file, the table and the key (and the closest valid key on a typo).
``--set table.key=value`` overrides (``rundir.parse_set``'s grammar) go
through the same checks.

Sizes may be given in steps or in tokens (``total_tokens`` / ``steps``,
``global_batch`` / ``global_batch_tokens``, ``warmup_steps`` /
``warmup_tokens``): exactly one of each pair, resolved by ``resolve()``, which
also makes every path absolute (relative paths are relative to the repo).
``[[data.sources]]`` parse straight into ``data.mixture.SourceSpec``.
``[data] chat_template`` is resolved to the one template the run uses (see
data.chat for the order) and checked to exist, so the resolved recipe says which.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from data.chat import TEMPLATES, check_template, checkpoint_template, resolve_template
from data.holdout import held_out_dir, holdout_problem
from data.mixture import MixtureError, SourceSpec, check_distinct, needs
from eval.spec import EvalSpec, EvalSpecError
from rundir import EXPORT_DIR, REPO, RUNS_DIR, parse_set

RECIPES = REPO / "recipes"


class RecipeError(ValueError):
    """A recipe problem, with the file, table and key it is about."""


class RecipeFile(str):
    """A recipe's path, as every error prints it, that knows which keys ``--set`` gave: an error about
    such a key names the command line's ``--set table.key=value`` instead of the file."""

    sets: dict[tuple[str, str], str]

    def __new__(cls, path: Path | str, sets: dict[tuple[str, str], str] | None = None):
        self = super().__new__(cls, str(path))
        self.sets = sets or {}
        return self

    def of(self, where: str, key: str) -> str:
        """Who gave ``[where] key``: ``--set ...`` (on the command line, over the file) or the file."""
        item = self.sets.get((where.strip("[]"), key.split("[")[0].split(".")[0]))
        return f"--set {item} (over {self})" if item else str(self)


def _collect(errors: list[str], fn):
    """``fn()``, or None with its RecipeError's lines added to ``errors``: every problem is reported at once."""
    try:
        return fn()
    except RecipeError as e:
        errors.append(str(e))
        return None


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
    # Any Laneformer.Config field may be overridden here (checked against the model).
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Data:
    tokenizer: str  # the SentencePiece .model the shards were made with
    tokenizer_sha256: str | None = None  # its expected sha256: the preflight refuses another file
    # Where relative source paths live (relative: to the repo). $LANEFORMER_DATA_ROOT overrides it,
    # and --set data.root=... overrides both: moving the data is one edit. Unset: the repo.
    root: str | None = None
    # Chat template (data.chat): a name, a .jinja file, or an HF folder / tokenizer_config.json.
    # Unset: the initial checkpoint's own, else data.chat.DEFAULT; resolve() records which.
    chat_template: str | None = None
    # Every source's held-out documents (data.holdout): a fraction or a document count, 0 for none;
    # a source's own `holdout` overrides it. The run validates on each held-out set ([eval]).
    holdout: int | float | None = None
    sources: list[SourceSpec] = field(default_factory=list)  # [[data.sources]]


@dataclass(kw_only=True)
class Optimizer:
    lr: float
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # No decay for norms and embeddings (regex over parameter names).
    no_decay: list[str] = field(default_factory=lambda: [r"norm\.weight$", r"tok_embeddings\."])


@dataclass(kw_only=True)
class Schedule:
    warmup_steps: int | None = None
    warmup_tokens: int | None = None
    decay_fraction: float = 0.2  # WSD: the last fraction of steps decays
    decay_shape: Literal["linear", "sqrt", "cosine"] = "linear"
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio


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
    # Roll back (train/health/rollback.py) when this many steps are skipped within spike_window steps: to the
    # checkpoint before the first of them, skipping the data seen since (PaLM's remedy). 0: never.
    spike_rollbacks: int = 0
    # With [parallel] replicate > 1: steps between comparisons of the replicas' parameters and optimizer
    # state (train/health/consistency.py); always also before a checkpoint save. 0: before saves only.
    consistency_every: int = 100


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


@dataclass(kw_only=True)
class Launch:
    # Crash restarts (each after a new checkpoint) allowed per 24 hours; 0: no limit.
    # Crashes without a new checkpoint in between always stop the run.
    crashes_per_day: int = 8
    # Seconds without a heartbeat from any rank (train/health/heartbeat.py) before a launcher ends the job as
    # stalled, dumps every rank's Python stacks to <run>/stalls/, and restarts it as after a crash; 0: off.
    # Longer allowances: until every rank has finished its first step (rendezvous, build, checkpoint
    # load, compile), and while a rank is in a checkpoint save or load, or in an eval, export or report
    # (train/health/phases.py says which phase gets which).
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
    # A rank whose compute check (train/health/straggler.py) is slower than the other ranks' median by more than this
    # fraction at straggler_windows logging steps in a row is named: stderr, <run>/alerts.jsonl, wandb.alert.
    straggler_threshold: float = 0.2
    straggler_windows: int = 5
    exclude_stragglers: bool = False  # the next restart also excludes the nodes named as stragglers


@dataclass(kw_only=True)
class Logging:
    interval: int = 10
    tensorboard: bool = True
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    report: bool = True  # the run writes report/ (python -m report) after each eval and at the end


@dataclass(kw_only=True)
class Eval(EvalSpec):
    """``[eval]``: what to evaluate (eval.spec.EvalSpec, whose checks it runs), a quicker default
    size for a look during training, and when to run (the trainer's concern, not the eval's)."""
    every: int = 0  # steps between evals; 0: only at the end
    at_end: bool = True
    core_max_per_task: int | None = 50
    evalplus_limit: int | None = 20

    def spec(self) -> EvalSpec:
        """The what, without the when."""
        return EvalSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EvalSpec)})


@dataclass(kw_only=True)
class Preference:
    """``[preference]``: preference optimization after SFT (train.preference). Without ``loss`` the run
    trains on next-token cross-entropy; with it every training source must be a pair source. Defaults:
    beta 0.1 and label_smoothing 0 are TRL's ``DPOConfig`` and open-instruct's ``DPOConfig``; gamma
    unset is open-instruct's ``gamma_beta_ratio`` 0.3 times beta (SimPO's margin, ``simpo`` only)."""
    loss: Literal["dpo", "dpo_norm", "simpo"] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float | None = None
    heldout: list[str] = field(default_factory=list)  # pair sources for eval/pref_loss and eval/pref_accuracy


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
    path: str = ""  # the file it came from

    @property
    def output_dir(self) -> Path:
        """The run dir (absolute once resolved; default ``runs/<name>`` in the repo)."""
        return absolute(self.run.output_dir or f"{RUNS_DIR}/{self.run.name}")

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch * self.training.seq_len


TABLES = {k: v for k, v in typing.get_type_hints(Recipe).items() if k != "path"}


def find(name: str) -> Path:
    """A recipe path; a bare name is looked up in ``recipes/``."""
    path = Path(name)
    if not path.exists() and not path.is_absolute() and len(path.parts) == 1:
        candidate = RECIPES / (name if name.endswith(".toml") else name + ".toml")
        if candidate.exists():
            return candidate
    if not path.exists():
        raise RecipeError(f"{name}: recipe file not found (also looked in {RECIPES})")
    return path


DATA_ROOT_ENV = "LANEFORMER_DATA_ROOT"


def load(name: str, overrides: list[str] = ()) -> Recipe:
    """Read, override (``$LANEFORMER_DATA_ROOT``, then ``table.key=value``), check and resolve a recipe."""
    path = find(name)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from e
    if os.environ.get(DATA_ROOT_ENV) and isinstance(raw.get("data"), dict):
        raw["data"]["root"] = os.environ[DATA_ROOT_ENV]
    sets = {}
    for item in overrides:
        sets[_apply_override(raw, item, path)] = item
    recipe = _parse(raw, RecipeFile(path, sets))
    resolve(recipe)
    return recipe


def _apply_override(raw: dict, item: str, path: Path) -> tuple[str, str]:
    """Set ``table.key=value`` in ``raw``; returns (table, key)."""
    try:
        key, value = parse_set(item)
    except ValueError:
        key, value = "", None
    parts = key.split(".")
    if len(parts) < 2:
        raise RecipeError(f"--set {item!r}: expected table.key=value")
    table = raw
    for part in parts[:-1]:
        table = table.setdefault(part, {})
    table[parts[-1]] = value
    return ".".join(parts[:-1]), parts[-1]


def _parse(raw: dict, path: RecipeFile) -> Recipe:
    errors: list[str] = []
    _collect(errors, lambda: check_keys(raw, TABLES, path, "recipe"))
    values = {}
    for name, cls in TABLES.items():
        if name not in raw:
            if not _has_default(Recipe, name):
                errors.append(f"{path}: missing table [{name}]")
        elif not isinstance(raw[name], dict):
            errors.append(f"{path.of(name, '')}: [{name}] must be a table")
        else:
            values[name] = _collect(errors, lambda: _parse_table(cls, raw[name], path, name))
    if errors:
        raise RecipeError("\n".join(errors))
    return Recipe(**values, path=path)  # a RecipeFile: later checks name a --set key by its --set too


def _parse_table(cls, table: dict, path: Path, where: str):
    if cls is Model:  # flavor plus free-form overrides, checked against the model later
        if "flavor" not in table:
            raise RecipeError(f"{path}: [model] missing key 'flavor'")
        flavor = check_value(table["flavor"], str, path, where, "flavor")
        return Model(flavor=flavor, overrides={k: v for k, v in table.items() if k != "flavor"})
    hints = typing.get_type_hints(cls)
    errors: list[str] = []
    _collect(errors, lambda: check_keys(table, hints, path, f"[{where}]"))
    values = {}
    for name, tp in hints.items():
        if name not in table:
            if not _has_default(cls, name):
                errors.append(f"{path}: [{where}] missing key '{name}'")
            continue
        values[name] = _collect(errors, lambda: check_value(table[name], tp, path, where, name))
    if errors:
        raise RecipeError("\n".join(errors))
    try:
        return cls(**values)
    except (MixtureError, EvalSpecError) as e:  # SourceSpec and EvalSpec check their own values
        raise RecipeError(f"{path}: [{where}] {e}") from e


def check_keys(table: dict, valid, path, where: str) -> None:
    """Refuse keys not in ``valid``, every one of them (a line each), suggesting the closest one."""
    unknown = []
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(key, list(valid), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
            unknown.append(f"{_source(path, where, key)}: {where} has unknown key '{key}'{hint}")
    if unknown:
        raise RecipeError("\n".join(unknown))


def _source(path, where: str, key: str) -> str:
    """Where ``[where] key`` came from: the ``--set`` that gave it, else the file."""
    return path.of(where, key) if isinstance(path, RecipeFile) else str(path)


def check_value(value, tp, path: Path, where: str, key: str):
    """``value`` checked (and lightly converted: int -> float) against type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = RecipeError(f"{_source(path, where, key)}: [{where}] {key}: expected {_type_name(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_value(value, arg, path, where, key)
            except RecipeError:
                pass
        raise bad
    if origin is Literal:
        if value not in args:
            raise RecipeError(f"{_source(path, where, key)}: [{where}] {key}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [check_value(v, args[0], path, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return {check_value(k, args[0], path, where, key): check_value(v, args[1], path, where, f"{key}.{k}")
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return _parse_table(tp, value, path, f"{where}.{key}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return int(value)  # 4e12 tokens written as a float
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise bad
    return value


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _has_default(cls, name: str) -> bool:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def absolute(path: str | Path) -> Path:
    """``path``, relative to the repo unless absolute."""
    return Path(os.path.abspath(REPO / path))


def in_data_root(recipe: Recipe, path: str | Path) -> Path:
    """A data path: relative to ``[data] root`` when set, else to the repo."""
    root = recipe.data.root
    return Path(os.path.abspath(Path(root) / path)) if root else absolute(path)


def resolve(recipe: Recipe) -> None:
    """Make paths absolute, turn token-denominated sizes into steps and check values
    that must hold together."""
    p = recipe.path
    d, e, c = recipe.data, recipe.eval, recipe.checkpoint
    recipe.run.output_dir = str(recipe.output_dir)
    d.tokenizer = str(absolute(d.tokenizer))
    d.root = d.root and str(absolute(d.root))
    if d.holdout is not None and (why := holdout_problem(d.holdout)):
        raise RecipeError(f"{p.of('data', 'holdout')}: [data] holdout: {why}")
    d.sources = [dataclasses.replace(s, path=str(in_data_root(recipe, s.path)),
                                     input=s.input and str(absolute(s.input)),
                                     holdout=d.holdout if s.holdout is None and not s.pairs else s.holdout)
                 for s in d.sources]  # pairs: held out in a file of their own (data.holdout splits documents)
    e.val_sources = [str(in_data_root(recipe, v)) for v in e.val_sources]
    recipe.preference.heldout = [str(in_data_root(recipe, v)) for v in recipe.preference.heldout]
    e.core_bundle = e.core_bundle and str(absolute(e.core_bundle))
    e.lm_eval_tasks = e.lm_eval_tasks and str(absolute(e.lm_eval_tasks))
    e.evalplus_data = e.evalplus_data and ",".join(str(absolute(f)) for f in e.evalplus_data.split(","))
    c.init_from = c.init_from and str(absolute(c.init_from))
    c.export_dir = str(absolute(c.export_dir or recipe.output_dir / EXPORT_DIR))
    d.chat_template = chat_template(recipe)

    t, s, o = recipe.training, recipe.schedule, recipe.optimizer

    def fail(where: str, why: str):
        raise RecipeError(f"{p}: [{where}] {why}")

    if d.tokenizer_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", d.tokenizer_sha256):
        fail("data", f"tokenizer_sha256: expected 64 lowercase hex digits, got {d.tokenizer_sha256!r}")
    try:
        check_distinct(d.sources)
    except MixtureError as err:
        fail("data", f"sources: {err}")

    def one_of(table: str, a: str, b: str, obj) -> None:
        if (getattr(obj, a) is None) == (getattr(obj, b) is None):
            fail(table, f"give exactly one of '{a}' and '{b}'")

    one_of("training", "global_batch", "global_batch_tokens", t)
    one_of("training", "steps", "total_tokens", t)
    for name in ("seq_len", "micro_batch"):
        if getattr(t, name) <= 0:
            fail("training", f"{name}: must be > 0 (got {getattr(t, name)})")
    if t.global_batch is None:
        if t.global_batch_tokens % t.seq_len:
            fail("training", f"global_batch_tokens: {t.global_batch_tokens} is not a multiple of seq_len {t.seq_len}")
        t.global_batch = t.global_batch_tokens // t.seq_len
    t.global_batch_tokens = t.global_batch * t.seq_len
    if t.global_batch <= 0:
        fail("training", f"global_batch: must be > 0 (got {t.global_batch})")
    if t.global_batch % t.micro_batch:
        fail("training", f"global_batch: {t.global_batch} is not divisible by micro_batch {t.micro_batch}")
    if t.steps is None:
        t.steps = math.ceil(t.total_tokens / t.global_batch_tokens)
    t.total_tokens = t.steps * t.global_batch_tokens
    if t.steps <= 0:
        fail("training", f"steps: must be > 0 (got {t.steps})")
    if t.spike_sigmas <= 0 or t.spike_window < 2:
        fail("training", "spike_sigmas must be > 0 and spike_window >= 2")
    if t.consistency_every < 0:
        fail("training", f"consistency_every: must be >= 0 (got {t.consistency_every})")
    if t.spike_rollbacks < 0:
        fail("training", f"spike_rollbacks: must be >= 0 (got {t.spike_rollbacks})")
    if t.max_consecutive_skips < 1:
        fail("training", f"max_consecutive_skips: must be >= 1 (got {t.max_consecutive_skips})")

    if o.lr <= 0:
        fail("optimizer", f"lr: must be > 0 (got {o.lr})")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail("optimizer", f"betas: must be two numbers in [0, 1) (got {o.betas})")
    if o.eps <= 0 or o.weight_decay < 0 or o.grad_clip <= 0:
        fail("optimizer", "eps and grad_clip must be > 0, weight_decay >= 0")

    if s.warmup_steps is None and s.warmup_tokens is None:
        s.warmup_steps = 0
    elif s.warmup_steps is not None and s.warmup_tokens is not None:
        fail("schedule", "give at most one of 'warmup_steps' and 'warmup_tokens'")
    elif s.warmup_steps is None:
        s.warmup_steps = math.ceil(s.warmup_tokens / t.global_batch_tokens)
    if s.warmup_steps < 0:
        fail("schedule", f"warmup_steps: must be >= 0 (got {s.warmup_steps})")
    if not 0 <= s.decay_fraction <= 1:
        fail("schedule", f"decay_fraction: must be in [0, 1] (got {s.decay_fraction})")
    if s.warmup_steps + round(s.decay_fraction * t.steps) > t.steps:
        fail("schedule", f"warmup ({s.warmup_steps}) and decay ({s.decay_fraction} of {t.steps}) exceed the run")
    if not 0 <= s.min_lr_ratio <= 1:
        fail("schedule", f"min_lr_ratio: must be in [0, 1] (got {s.min_lr_ratio})")

    if c.interval <= 0 or c.keep_last < 0:
        fail("checkpoint", "interval must be > 0 and keep_last >= 0")
    if recipe.launch.crashes_per_day < 0:
        fail("launch", f"crashes_per_day: must be >= 0 (got {recipe.launch.crashes_per_day})")
    for key in ("stall_timeout", "stall_timeout_first_step", "stall_timeout_checkpoint", "stall_timeout_eval"):
        if getattr(recipe.launch, key) < 0:
            fail("launch", f"{key}: must be >= 0 seconds, 0 for off (got {getattr(recipe.launch, key)})")
    if not (math.isfinite(recipe.launch.straggler_threshold) and recipe.launch.straggler_threshold > 0):
        fail("launch", "straggler_threshold: must be a finite number > 0, the fraction by which a rank's compute "
                       "check exceeds the other ranks' median (nan or inf would never name a straggler; "
                       f"got {recipe.launch.straggler_threshold})")
    if recipe.launch.straggler_windows < 1:
        fail("launch", f"straggler_windows: must be >= 1 (got {recipe.launch.straggler_windows})")
    if recipe.launch.node_mtbf_hours <= 0 or recipe.launch.restart_s < 0:
        fail("launch", "node_mtbf_hours must be > 0 and restart_s >= 0")
    if c.stall_s is not None and c.stall_s <= 0:
        fail("checkpoint", f"stall_s: must be > 0 seconds (got {c.stall_s})")
    for key in ("comm_init_timeout", "comm_train_timeout"):
        if getattr(recipe.parallel, key) <= 0:
            fail("parallel", f"{key}: must be > 0 seconds (got {getattr(recipe.parallel, key)})")
    if e.every < 0:  # the rest of [eval] is checked by EvalSpec
        fail("eval", f"every: must be >= 0 (got {e.every})")
    if recipe.logging.interval <= 0:
        fail("logging", f"interval: must be > 0 (got {recipe.logging.interval})")
    pref = recipe.preference
    if pref.gamma is None:
        pref.gamma = 0.3 * pref.beta
    if pref.beta <= 0 or not 0 <= pref.label_smoothing < 0.5:
        fail("preference", f"beta must be > 0 and label_smoothing in [0, 0.5) (got {pref.beta}, {pref.label_smoothing})")
    if pref.loss and t.spike_rollbacks:  # train.callbacks.rollback counts skipped data in mixture tokens
        fail("training", "spike_rollbacks: not available in a preference run (the spike guard's skips are)")
    if pref.loss and t.micro_batch % 2:
        fail("training", f"micro_batch: {t.micro_batch} is odd; a preference run's micro batch holds whole pairs")
    if pref.loss:
        pair_weights(recipe)
    par = recipe.parallel
    for key in ("shard", "replicate"):
        if getattr(par, key) == 0 or getattr(par, key) < -1:
            fail("parallel", f"{key}: must be >= 1, or -1 for the ranks the other leaves (got {getattr(par, key)})")
    if par.shard == par.replicate == -1:
        fail("parallel", "shard, replicate: at most one of them may be -1")


def pair_weights(recipe: Recipe) -> None:
    """A preference run draws its pairs uniformly from all its pair sources together (train.preference.pairs),
    each source in proportion to its pairs: a token budget or unequal weights would be ignored, so they
    are refused, naming the source."""
    pairs = [(i, s) for i, s in enumerate(recipe.data.sources) if s.pairs]
    for i, s in pairs:
        where = f"{recipe.path.of('data', f'sources[{i}]')}: [data.sources[{i}]]"
        if s.tokens is not None:
            raise RecipeError(f"{where} tokens: source {s.name!r} is a pair source, drawn uniformly with the run's "
                              "other pairs: a token budget would be ignored. Give it weight = 1.0 instead")
        if s.weight != pairs[0][1].weight:
            raise RecipeError(f"{where} weight: {s.weight} for source {s.name!r}, {pairs[0][1].weight} for "
                              f"{pairs[0][1].name!r}: a preference run draws its pairs uniformly from all its pair "
                              "sources together (each in proportion to its pairs), so unequal weights would be "
                              "ignored. Give every pair source the same weight")


def validation_sets(recipe: Recipe) -> dict[str, str]:
    """The held-out sets the run validates on, by the name its metrics carry: every source's with a
    holdout (``<path>/heldout``, named as the source), then each ``[eval] val_sources`` dir (named as
    its folder)."""
    sets = {s.name: str(held_out_dir(s.path)) for s in recipe.data.sources if s.holdout}
    for i, v in enumerate(recipe.eval.val_sources):
        if Path(v).name in sets:
            raise RecipeError(f"{recipe.path}: [eval] val_sources[{i}]: {v} would be named {Path(v).name!r}, as "
                              f"another held-out set is: rename its folder")
        sets[Path(v).name] = v
    return sets


def check_needs(recipe: Recipe) -> list[str]:
    """Sources whose expected size (``expected_tokens``, by the dataset card) cannot give the planned
    tokens within ``max_epochs``: known before anything is downloaded or tokenized."""
    t, p = recipe.training, recipe.path
    if recipe.preference.loss:  # sized in pairs, not tokens
        from train.preference.plan import size_lines

        return size_lines(recipe)[1]
    try:
        rows = needs(recipe.data.sources, t.seq_len, t.steps * t.global_batch)
    except MixtureError as e:
        return [f"{p}: [data] sources: {e}"]
    return [f"{p}: [data.sources[{i}]] expected_tokens: source {n.name!r} holds ~{n.expected_tokens:,} tokens by "
            f"its card but the plan reads {n.planned_tokens:,} (needs >= {n.needs:,} at max_epochs "
            f"{n.max_epochs:g}): lower its weight, raise max_epochs or add data"
            for i, n in enumerate(rows) if n.fits is False]


def chat_template(recipe: Recipe) -> str:
    """The run's chat template as a data.chat spec: ``[data] chat_template`` (a name, or a path made
    absolute), else the template ``[checkpoint] init_from`` carries, else data.chat.DEFAULT; it must resolve,
    and a file's must render. A bundled one is not rendered here: its tests render it, and rendering
    imports transformers (0.5 s at every rank's start, in a run that may never use a template)."""
    spec, init = recipe.data.chat_template, recipe.checkpoint.init_from
    where = f"{recipe.path}: [data] chat_template"
    if spec is None and init:
        where += f" (unset, so the template of [checkpoint] init_from {init})"
    try:
        if spec is None:
            spec = (init and checkpoint_template(init)) or resolve_template()[0]
        elif spec not in TEMPLATES:
            spec = str(absolute(spec))
        if spec not in TEMPLATES:
            check_template(spec)
    except FileNotFoundError:
        raise RecipeError(f"{where}: {recipe.data.chat_template or spec!r} is neither a template name ({', '.join(TEMPLATES)}) "
                          f"nor an existing .jinja file, HF folder or tokenizer_config.json") from None
    except (OSError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None
    return spec


def dp_degrees(recipe: Recipe, world_size: int) -> tuple[int, int]:
    """(replicate, shard) on ``world_size`` ranks; a layout that does not divide them is an error naming the key."""
    par = recipe.parallel
    for key in ("replicate", "shard"):
        degree = getattr(par, key)
        if degree != -1 and world_size % degree:
            raise RecipeError(f"{recipe.path}: [parallel] {key}: {degree} does not divide the {world_size} ranks")
    replicate = par.replicate if par.replicate != -1 else world_size // par.shard
    shard = par.shard if par.shard != -1 else world_size // replicate
    if shard * replicate != world_size:
        raise RecipeError(f"{recipe.path}: [parallel] shard, replicate: {shard} x {replicate} is not the "
                          f"{world_size} ranks")
    return replicate, shard


def check_world(recipe: Recipe, world_size: int) -> int:
    """The data-parallel degree on ``world_size`` ranks; checks the layout and that the batch divides."""
    t = recipe.training
    replicate, shard = dp_degrees(recipe, world_size)
    dp = shard * replicate
    if t.global_batch % (t.micro_batch * dp):
        raise RecipeError(
            f"{recipe.path}: [training] global_batch ({t.global_batch}) is not divisible by "
            f"micro_batch ({t.micro_batch}) x data-parallel size ({dp})"
        )
    return dp


DERIVED = {("training", "global_batch_tokens"), ("training", "total_tokens"), ("schedule", "warmup_tokens")}


def to_toml(recipe: Recipe) -> str:
    """The resolved recipe as TOML (what ``--print-config`` shows and the run dir keeps)."""
    lines = [f"# resolved from {recipe.path}"]
    for name in TABLES:
        table = getattr(recipe, name)
        values = dataclasses.asdict(table)
        if name == "model":
            values = {"flavor": table.flavor, **table.overrides}
        sources = values.pop("sources", None)
        lines.append(f"\n[{name}]")
        for k, v in values.items():
            if v is not None:  # sizes derived by resolve() are kept as comments
                lines.append(("# " if (name, k) in DERIVED else "") + f"{k} = {_toml_value(v)}")
        for src in sources or []:
            lines.append(f"\n[[{name}.sources]]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in src.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)
