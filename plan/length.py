"""The plan at length: memory per GPU, roofline speed and the context parallelism a long context needs.

``--plan`` of a recipe whose ``seq_len`` is above 4,096 (a long-context phase,
issue 44) adds a table at 4k, 16k, 32k and 64k tokens on H100 and H200: the
FLOPs per token (``models.laneformer.flops``: attention grows with length on
the full layers only, the window layers stay at ``window_size``), the traced
peak memory at CP 1 (plus what the layout holds across micro batches), the
smallest context-parallel (CP) degree whose plan fits,
and the roofline at that degree with its communication; then whether the
recipe, at its own length and micro batch, needs CP on each GPU kind, which
``train.py --dry-run`` prints too (``dry_run_lines``: one trace per degree
tried, seconds).

CP as torchtitan 0.3.0 runs it with flex attention (``plan.step`` traces it):
- each GPU of a CP group holds ``seq_len / cp`` tokens of a sequence
  (``torchtitan.distributed.context_parallel.cp_shard``, head-tail load
  balancing by default), so activations per GPU shrink by ``cp``, except the
  K and V every attention layer all-gathers over the group
  (``apply_cp_to_forward``: ``flex_cp_allgather``), which flex saves at full
  length;
- parameters are sharded over ``dp_shard x cp`` ranks (``ParallelDims``'s
  ``fsdp`` mesh), so on a fixed number of GPUs the data-parallel degree falls
  by ``cp`` and the shard group grows by it;
- the all-gather of K and V (forward, again under AC's recomputation) and the
  reduce-scatter of their gradients (backward) wait inside their own operators
  before flex attention may run: counted exposed, on NVLink (a CP group of at
  most a node's GPUs), at bus bandwidth as in ``plan.comm``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from rundir.table import text_table
from train import recipe as R

from .comm import Cluster, Communication, Layout, communication
from .gpus import GIB, GPUS, Gpu
from .memory import FIT_FRACTION, Memory, memory_plan
from .roofline import roofline
from .step import Shape

LONG = 4096  # the 2B's trained context (spec section 1): a recipe above it is a long-context phase
LENGTHS = (4096, 16384, 32768, 65536)
KINDS = ("h100", "h200")
CP_DEGREES = (1, 2, 4, 8)  # up to one node of 8 GPUs: CP's collectives stay on NVLink
GB = 1e9


def cp_layout(recipe: R.Recipe, gpus: int, cp: int) -> Layout:
    """The recipe's layout on ``gpus`` GPUs at CP ``cp`` in place of its own ``context_parallel``."""
    recipe = copy.copy(recipe)
    recipe.parallel = dataclasses.replace(recipe.parallel, context_parallel=cp)
    return Layout.of(recipe, gpus)


def cp_bytes(config, seq_len: int, cp: int, ac: str, dtype_bytes: int) -> int:
    """Bytes each GPU receives per sequence in CP's collectives: every layer all-gathers the
    sequence's K and V (forward, and again when AC recomputes it) and reduce-scatters their
    gradients (backward); each moves ``(cp - 1) / cp`` of the full-length K and V through a rank,
    in the compute dtype (FSDP's ``param_dtype``: ``dtype_bytes`` an element)."""
    kv = seq_len * 2 * config.n_kv_heads * config.head_dim * dtype_bytes
    passes = 2 + (ac != "none")
    return config.n_layers * passes * (cp - 1) * kv // cp


def cp_traffic(config, shape: Shape, accumulation: int, cluster: Cluster) -> tuple[float, float]:
    """(bytes per GPU per step, exposed seconds) of CP's collectives, on NVLink: ``cp_bytes`` for each
    sequence of each micro batch."""
    dtype_bytes = getattr(torch, shape.param_dtype).itemsize
    moved = accumulation * shape.micro_batch * cp_bytes(config, shape.seq_len, shape.cp, shape.ac, dtype_bytes)
    return moved, moved / (cluster.intra_node_gbs * GB)


def accumulation(recipe: R.Recipe, seq_len: int, gpus: int, cp: int, micro_batch: int = 1) -> int:
    """Micro batches (``micro_batch`` sequences each per CP group) that keep the recipe's tokens per
    step; 1 if they do not divide."""
    per_step, rows = (gpus // cp) * micro_batch, recipe.tokens_per_step // seq_len
    whole = recipe.tokens_per_step % seq_len == 0 and rows >= per_step and rows % per_step == 0
    return rows // per_step if whole else 1


@dataclass
class Row:
    """One length on one GPU kind: the peak at CP 1 and the plan at the smallest CP degree that fits
    (cp None: none up to ``CP_DEGREES[-1]`` does)."""

    seq_len: int
    gpu: Gpu
    flops_per_token: int
    micro_batch: int = 1
    peak_cp1: int = 0  # at CP 1: traced peak plus what the layout holds beyond it
    cp: int | None = None
    memory: Memory | None = None
    comm: Communication | None = None
    cp_s: float = 0.0  # CP's exposed seconds per step
    cp_gb: float = 0.0  # CP's bytes per GPU per step, GB

    @property
    def usable(self) -> float:
        """Bytes a plan may peak at on this GPU."""
        return FIT_FRACTION * self.gpu.memory_gib * GIB

    @property
    def peak(self) -> int:
        assert self.memory is not None and self.comm is not None
        return self.memory.peak + self.comm.extra_memory

    @property
    def tokens_per_s(self) -> float:
        assert self.comm is not None
        return self.comm.speed.tokens_per_step / (self.comm.step_s + self.cp_s)

    @property
    def mfu(self) -> float:
        assert self.comm is not None
        return self.flops_per_token * self.tokens_per_s / self.comm.speed.peak_flops

    def cells(self) -> list:
        head = [f"{self.seq_len:,}", self.gpu.label, f"{self.flops_per_token / 1e9:.2f}",
                f"{self.peak_cp1 / GIB:.2f}"]
        if self.cp is None:
            return head + [f"> {CP_DEGREES[-1]}", "-", "-", "-", "-", "-"]
        assert self.comm is not None
        return head + [self.cp, f"{self.peak / GIB:.2f}", self.comm.accumulation, f"{self.cp_gb:.2f}",
                       f"{self.tokens_per_s:,.0f}", f"{self.mfu:.1%}"]

    def verdict(self) -> str:
        """Whether this length needs CP on this GPU, and at what degree."""
        cp1 = f"{self.peak_cp1 / GIB:.2f} GiB of {self.usable / GIB:.1f} GiB usable"
        if self.cp == 1:
            return f"{self.gpu.label}: CP 1 fits ({cp1})"
        if self.cp is None:
            return f"{self.gpu.label}: CP 1 does not fit ({cp1}), nor does any degree up to {CP_DEGREES[-1]}"
        return f"{self.gpu.label}: CP 1 does not fit ({cp1}); CP {self.cp} does ({self.peak / GIB:.2f} GiB)"

    def to_json(self) -> dict:
        out = {"seq_len": self.seq_len, "gpu": self.gpu.label, "flops_per_token": self.flops_per_token,
               "micro_batch": self.micro_batch, "peak_gib_cp1": self.peak_cp1 / GIB, "cp": self.cp}
        if self.cp is not None:
            assert self.comm is not None
            out |= {"peak_gib": self.peak / GIB, "accumulation": self.comm.accumulation, "cp_gb": self.cp_gb,
                    "cp_exposed_s": self.cp_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}
        return out


def _at_length(config, seq_len: int):
    """The model config with positions up to ``seq_len``."""
    return dataclasses.replace(config, max_seq_len=max(config.max_seq_len, seq_len))


def _fit(recipe: R.Recipe, config, row: Row, gpus: int, cluster: Cluster, traced: dict) -> Row:
    """``row`` at the smallest CP degree whose peak (traced, plus what the layout holds) fits; the peak at
    CP 1 whether it fits or not. Memory is traced once per length, CP degree and micro batch (``traced``:
    it does not depend on the GPU kind)."""
    for cp in CP_DEGREES:
        if gpus % cp or row.seq_len % (2 * cp):  # head-tail balancing cuts a sequence in 2 x cp chunks
            continue
        try:
            layout = cp_layout(recipe, gpus, cp)
        except R.RecipeError:  # the layout does not divide gpus / cp
            continue
        shape = Shape.of(recipe, layout.shard, micro_batch=row.micro_batch, seq_len=row.seq_len, cp=cp)
        key = (row.seq_len, cp, row.micro_batch)
        if key not in traced:
            traced[key] = memory_plan(config, shape, row.gpu)
        memory = traced[key]
        if memory.peak > row.usable and cp > 1:
            continue
        acc = accumulation(recipe, row.seq_len, gpus, cp, row.micro_batch)
        speed = roofline(config, shape, row.gpu, accumulation=acc)
        comm = communication(config, layout, speed, cluster, gpus=gpus, accumulation=acc,
                             param_dtype=shape.param_dtype, reduce_dtype=shape.reduce_dtype)
        if cp == 1:
            row.peak_cp1 = memory.peak + comm.extra_memory
        if memory.peak + comm.extra_memory > row.usable:
            continue
        moved, seconds = cp_traffic(config, shape, acc, cluster)
        return dataclasses.replace(row, cp=cp, memory=memory, comm=comm, cp_gb=moved / GB, cp_s=seconds)
    return row


def _kinds(kinds: tuple[Gpu, ...] | None) -> tuple[Gpu, ...]:
    return kinds or tuple(GPUS[k] for k in KINDS)


@dataclass
class RecipeNeed:
    """Whether the recipe, at its own length and micro batch, needs CP on each GPU kind."""

    recipe: R.Recipe
    gpus: int
    rows: list[Row]

    def lines(self) -> list[str]:
        t, p = self.recipe.training, self.recipe.parallel
        have = p.context_parallel
        needed = [r for r in self.rows if r.cp != 1]
        head = (f"context parallelism at the recipe's {t.seq_len:,} tokens (micro batch {t.micro_batch}, activation "
                f"checkpointing {p.activation_checkpoint}, {self.gpus} GPUs; fits: peak at most {FIT_FRACTION:.0%} "
                "of the GPU): ")
        if not needed:
            head += f"not needed on {' or '.join(r.gpu.label for r in self.rows)}"
        else:
            head += "needed on " + ", ".join(
                f"{r.gpu.label} (CP {r.cp})" if r.cp else f"{r.gpu.label} (more than CP {CP_DEGREES[-1]})"
                for r in needed)
        short = [r for r in self.rows if r.cp is None or r.cp > have]
        enough = (f"  [parallel] context_parallel = {have}: enough on "
                  f"{' and '.join(r.gpu.label for r in self.rows)}" if not short else
                  f"  [parallel] context_parallel = {have}: too small on " + ", ".join(
                      f"{r.gpu.label} (set it to {r.cp})" if r.cp else
                      f"{r.gpu.label} (no degree up to {CP_DEGREES[-1]} fits: activation checkpointing "
                      "or a smaller micro batch)" for r in short))
        return [head, *(f"  {r.verdict()}" for r in self.rows), enough]

    def to_json(self) -> list[dict]:
        return [r.to_json() for r in self.rows]


def recipe_need(recipe: R.Recipe, config, gpus: int, cluster: Cluster, kinds: tuple[Gpu, ...] | None = None,
                traced: dict | None = None) -> RecipeNeed:
    """The CP the recipe needs at its own ``seq_len`` and ``micro_batch`` (``train.py --dry-run`` of a
    long-context recipe, and the verdict under ``--plan``'s table)."""
    from models.laneformer.flops import flops_per_token

    t = recipe.training
    config = _at_length(config, t.seq_len)
    flops = flops_per_token(config, t.seq_len)
    traced = {} if traced is None else traced
    return RecipeNeed(recipe, gpus, [_fit(recipe, config, Row(t.seq_len, gpu, flops, t.micro_batch), gpus, cluster,
                                          traced) for gpu in _kinds(kinds)])


@dataclass
class LengthTable:
    recipe: R.Recipe
    gpus: int
    cluster: Cluster
    rows: list[Row]
    need: RecipeNeed
    traced: dict[tuple[int, int, int], Memory]  # (length, CP, micro batch): the traced memory

    def verdicts(self) -> list[str]:
        """Per length: the CP degree each GPU kind needs."""
        lines = []
        for length in dict.fromkeys(r.seq_len for r in self.rows):
            says = [f"{'no CP' if r.cp == 1 else f'CP {r.cp}' if r.cp else f'more than CP {CP_DEGREES[-1]}'} "
                    f"on {r.gpu.label}" for r in self.rows if r.seq_len == length]
            lines.append(f"  {length:,} tokens: {', '.join(says)}")
        return lines

    def lines(self) -> list[str]:
        t, p = self.recipe.training, self.recipe.parallel
        lines = ["", f"plan at length (seq_len {t.seq_len:,} > {LONG:,}): on {self.gpus} GPUs, micro batch 1 "
                 f"(one sequence per CP group), activation checkpointing {p.activation_checkpoint}, the recipe's "
                 f"tokens per step where they divide (else accumulation 1); FLOPs per token grow with length on "
                 f"the full-attention layers only"]
        lines += text_table(["tokens", "GPU", "GFLOP/token", "peak GiB CP 1", "CP", "peak GiB", "accumulation",
                             "CP GB/step", "tokens/s/GPU", "MFU"], [r.cells() for r in self.rows], numbers=True)
        return lines + [
            f"context parallelism needed (smallest degree whose peak fits {FIT_FRACTION:.0%} of the GPU):",
            *self.verdicts(),
            *self.need.lines(),
            "  (CP as torchtitan 0.3.0 runs flex attention: seq_len / CP tokens per GPU, K and V all-gathered "
            "over the group in every layer and saved at full length, parameters sharded over shard x CP; CP's "
            f"all-gathers and reduce-scatters exposed at {self.cluster.intra_node_gbs:g} GB/s inside a node; "
            "peak GiB: traced, plus what the layout holds across micro batches; tokens/s: the eager roofline with "
            "the data-parallel and CP communication; MFU with FLOPs per token as torchtitan counts them, attention "
            "without a causal discount)",
        ]

    def to_json(self) -> dict:
        return {"rows": [r.to_json() for r in self.rows], "recipe": self.need.to_json()}


def length_table(recipe: R.Recipe, config, gpus: int, cluster: Cluster, kinds: tuple[Gpu, ...] | None = None,
                 lengths: tuple[int, ...] | None = None) -> LengthTable:
    """The table at ``LENGTHS`` and the recipe's own length, and the recipe's own need."""
    from models.laneformer.flops import flops_per_token

    kinds = _kinds(kinds)
    lengths = lengths or tuple(sorted({*LENGTHS, recipe.training.seq_len}))
    traced: dict[tuple[int, int, int], Memory] = {}
    rows = []
    for length in lengths:
        at_length = _at_length(config, length)
        flops = flops_per_token(at_length, length)
        rows += [_fit(recipe, at_length, Row(length, gpu, flops), gpus, cluster, traced) for gpu in kinds]
    need = recipe_need(recipe, config, gpus, cluster, kinds, traced)
    return LengthTable(recipe, gpus, cluster, rows, need, traced)


def dry_run_lines(recipe: R.Recipe, gpus: int) -> list[str]:
    """``train.py --dry-run``: whether a long-context recipe needs CP at its own length on H100 and H200
    (one fake-tensor trace per CP degree tried); nothing for a recipe at or below ``LONG`` or for a CPU
    recipe."""
    from train.recipe import model_config

    if recipe.training.seq_len <= LONG or not gpus:
        return []
    from .comm import cluster_for

    need = recipe_need(recipe, model_config(recipe), gpus, cluster_for("h100"))
    return [*need.lines(), "  (train.py --plan prints the memory and speed at 4k..64k tokens and each length's CP)"]
