"""What the planner prints: ``train.py --dry-run`` and ``train.py --plan [--sweep --ops --compiled --json]``.

    python train.py --recipe R --dry-run [--run DIR]
    python train.py --recipe R --plan [--gpus N] [--gpu h100|h200|a100|mi300x] [--sweep] [--ops [--compiled]] [--json]

``make_plan`` computes a ``Plan`` (memory, rooflines, the compiled estimate,
the sweep); ``Plan.lines`` writes it as text, one section per function, and
``Plan.to_json`` as numbers for tools (``bench.gpu_check``). A new estimate
adds a field to ``Plan``, a section to ``Plan.lines`` and a key to ``to_json``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rundir.progress import progress
from rundir.table import text_table
from train import recipe as R

from .comm import Cluster, Communication, Layout, candidate_layouts, cluster_for, communication
from .data import data_report, realized_mix
from .gpus import GIB, GPUS, Gpu
from .interval import Interval, checkpoint_interval
from .length import GB, LONG, LengthTable, cp_traffic, dry_run_lines, length_table
from .memory import FIT_FRACTION, Memory, memory_plan, memory_plans
from .replica import plan_lines
from .roofline import ROOFLINE_NOTE, Speed, ops_table, roofline
from .step import AC_MODES, STAND_IN_NOTE, Shape

if TYPE_CHECKING:  # imported where a plan is compiled: it needs torch's Inductor
    from .compiled import CompiledEstimate

MICRO_BATCHES = (1, 2, 4, 8, 16)
TIE = 0.01  # settings within 1% of the fastest (with communication) count as equally fast
TOP = 12  # layout rows the sweep prints


# ---- dry run -----------------------------------------------------------------------------


def run_report(recipe: R.Recipe, *, gpus: int, mfu: float, peak_tflops: float) -> str:
    """Parameters, steps, tokens, FLOPs per token and the wall time at ``mfu``."""
    from train.recipe import model_config

    config = model_config(recipe)
    with torch.device("meta"):
        model = config.build()
    t = recipe.training
    nparams, flops = config.get_nparams_and_flops(model, t.seq_len)
    if gpus:
        seconds = t.total_tokens * flops / (mfu * peak_tflops * 1e12 * gpus)
        wall = (f"expected wall time: {seconds / 86400:.1f} days on {gpus} GPUs at {mfu:.0%} MFU "
                f"of {peak_tflops:g} TFLOP/s ({t.total_tokens / seconds / gpus:,.0f} tokens/s/GPU)")
    else:  # an MFU of a GPU's peak says nothing about a 2M-parameter model on a CPU
        wall = "expected wall time: a CPU recipe ([parallel] gpus = 0): no GPU estimate; --gpus N makes one for N GPUs"
    from train.preference.plan import reference_lines  # a preference run's forward over every pair before step 1

    wall = "\n".join([wall, *reference_lines(recipe, flops, gpus and mfu * peak_tflops * 1e12 * gpus)])
    return "\n".join([
        f"recipe: {recipe.path}",
        f"model: {recipe.model.flavor}, parameters: {nparams:,}",
        f"objective: {recipe.objective} (train/objectives/{recipe.objective}.py)",
        f"tokens per step: {recipe.tokens_per_step:,} ({t.global_batch} x {t.seq_len})",
        f"steps: {t.steps:,}  total tokens: {t.total_tokens:,}",
        f"FLOPs per token: {flops:,} ({flops / 1e9:.2f} GFLOP)",
        wall,
        f"run dir: {recipe.output_dir}",
    ])


def dry_run(recipe: R.Recipe, *, gpus: int, mfu: float, peak_tflops: float, run_dir: Path | None = None) -> str:
    """``train.py --dry-run``: the run report, whether a long-context recipe needs context parallelism, the
    data plan and the realized mix."""
    weights = {s.name: s.weight or 0.0 for s in recipe.data.sources}
    return "\n".join([run_report(recipe, gpus=gpus, mfu=mfu, peak_tflops=peak_tflops), *dry_run_lines(recipe, gpus),
                      data_report(recipe), realized_mix(run_dir or recipe.output_dir, weights)])


# ---- the sweep ---------------------------------------------------------------------------


def _accumulation(recipe: R.Recipe, micro_batch: int, gpus: int) -> int | None:
    """Micro batches per step that keep the recipe's global batch (None if it does not divide)."""
    per_step = micro_batch * gpus
    return recipe.training.global_batch // per_step if recipe.training.global_batch % per_step == 0 else None


@dataclass
class Setting:
    """One layout x micro batch x AC point of the sweep (memory and speed None: not traced)."""

    ac: str
    micro_batch: int
    accumulation: int | None
    memory: Memory | None = None
    speed: Speed | None = None
    comm: Communication | None = None  # the layout's communication at this point
    shard: int | None = None  # the shard degree memory and roofline were traced at

    @property
    def peak(self) -> int:
        """The traced peak and what the layout holds beyond it (deferred gradients, gathered parameters)."""
        return self.memory.peak + (self.comm.extra_memory if self.comm else 0)

    @property
    def usable(self) -> bool:
        return (self.memory is not None and self.accumulation is not None and self.comm is not None
                and self.peak <= FIT_FRACTION * self.memory.gpu.memory_gib * GIB)


@dataclass
class Sweep:
    gpus: int
    gpu: Gpu
    cluster: Cluster
    settings: list[Setting]

    @property
    def ranked(self) -> list[Setting]:
        """Usable settings, fastest first by roofline tokens/s/GPU with communication."""
        return sorted((s for s in self.settings if s.usable), key=lambda s: -s.comm.tokens_per_s)

    @property
    def best(self) -> Setting | None:
        """Among settings within ``TIE`` of the fastest, the one with the fewest network bytes, then
        the least memory, then the fewest intra-node bytes: the estimates cannot tell such speeds
        apart, and a quieter network and memory headroom are worth having."""
        ranked = self.ranked
        if not ranked:
            return None
        near = [s for s in ranked if s.comm.tokens_per_s >= (1 - TIE) * ranked[0].comm.tokens_per_s]
        return min(near, key=lambda s: (s.comm.network_bytes, s.peak, s.comm.intra_bytes))


def sweep(recipe: R.Recipe, config, gpus: int, gpu: Gpu, cluster: Cluster) -> Sweep:
    """Layouts x micro batch x AC: peak memory, fits, roofline with communication. Memory and
    roofline are traced per shard degree (FSDP over every GPU; HSDP inside a node); each AC mode
    shards its model once for all micro batches; a micro batch larger than one that does not fit is
    not traced. Reshard policies and gradient reductions change only what ``comm`` adds."""
    settings = []
    layouts = candidate_layouts(gpus, cluster.gpus_per_node)
    traces = [(shard, ac) for shard in dict.fromkeys(layout.shard for layout in layouts) for ac in AC_MODES]
    # a trace per shard degree x AC mode, ~20 s each for the 2B: minutes in all, so say how far it is
    for shard, ac in progress(traces, desc="plan --sweep: shard degree x AC traced", unit="trace", every=1):
        shape = Shape.of(recipe, shard, ac=ac)
        memory = memory_plans(config, shape, gpu, MICRO_BATCHES, stop_when_full=True)
        for mb in MICRO_BATCHES:
            acc = _accumulation(recipe, mb, gpus)
            if mb not in memory:
                settings.append(Setting(ac, mb, acc, shard=shard))
                continue
            speed = roofline(config, dataclasses.replace(shape, micro_batch=mb), gpu, accumulation=acc or 1)
            for layout in (layout for layout in layouts if layout.shard == shard):
                comm = acc and communication(config, layout, speed, cluster, gpus=gpus, accumulation=acc,
                                             param_dtype=shape.param_dtype, reduce_dtype=shape.reduce_dtype)
                settings.append(Setting(ac, mb, acc, memory[mb], speed, comm or None, shard))
    return Sweep(gpus, gpu, cluster, settings)


def sweep_lines(sw: Sweep, recipe: R.Recipe) -> list[str]:
    lines = [f"sweep on {sw.gpus} x {sw.gpu.label} (roofline: {ROOFLINE_NOTE}):"]
    for shard in dict.fromkeys(s.shard for s in sw.settings):
        rows, seen = [], set()
        for s in sw.settings:
            if s.shard != shard or (s.ac, s.micro_batch) in seen:
                continue
            seen.add((s.ac, s.micro_batch))
            if s.memory is None:
                rows.append([s.ac, s.micro_batch, "not traced", "no (a smaller micro batch does not fit)", "-", "-",
                             "-"])
            else:
                rows.append([s.ac, s.micro_batch, f"{s.memory.peak / GIB:.2f}", "yes" if s.memory.fits else "no",
                             s.accumulation or "does not divide", f"{s.speed.tokens_per_s:,.0f}", f"{s.speed.mfu:.1%}"])
        lines += [f"parameters sharded over {shard} GPUs (traced peak; reduce every micro batch, default resharding):"]
        lines += text_table(["AC", "micro batch", "peak GiB", "fits", "accumulation", "roofline tokens/s/GPU", "MFU"],
                            rows, numbers=True)
    best, ranked = sw.best, sw.ranked
    if best is None:
        return lines + [f"recommended: nothing fits on {sw.gpu.label} at this global batch"]
    lines += [f"layouts ranked by roofline with communication ({sw.cluster.describe()}), "
              f"the {min(TOP, len(ranked))} fastest of {len(ranked)} that fit; peak includes what the layout holds "
              f"beyond the trace:"]
    rows = [["*" if s is best else "", s.comm.layout.name, s.comm.layout.reshard_after_forward,
             s.comm.layout.reduce_grads, s.ac, s.micro_batch, f"{s.peak / GIB:.2f}",
             f"{s.comm.network_bytes / 1e9:.1f}", f"{s.comm.intra_bytes / 1e9:.1f}",
             f"{s.comm.exposed_s / s.comm.step_s:.1%}", f"{s.comm.tokens_per_s:,.0f}", f"{s.comm.mfu:.1%}"]
            for s in ranked[:TOP] + ([best] if best not in ranked[:TOP] else [])]
    lines += text_table(["", "layout", "reshard", "reduce_grads", "AC", "micro batch", "peak GiB", "network GB",
                         "intra-node GB", "exposed", "tokens/s/GPU", "MFU"], rows, numbers=True)
    c = best.comm
    return lines + [
        f"recommended: micro batch {best.micro_batch}, activation checkpointing {best.ac} (within {TIE:.0%} of the "
        f"fastest that fits with communication, then the fewest network bytes and the least memory): "
        f"{c.tokens_per_s:,.0f} tokens/s/GPU, MFU {c.mfu:.1%}, peak {best.peak / GIB:.2f} GiB; gradient "
        f"accumulation {best.accumulation} keeps {recipe.training.global_batch} sequences per step on {sw.gpus} GPUs",
        f"recommended layout: {c.layout.describe()}: [parallel] {', '.join(c.layout.recipe_lines())}",
        *(f"  {line}" for line in c.figures()),
    ]


# ---- the plan ----------------------------------------------------------------------------


@dataclass
class Plan:
    """Everything ``--plan`` computed for one recipe on ``gpus`` GPUs of kind ``gpu``."""

    recipe: R.Recipe
    config: object
    gpus: int
    gpu: Gpu
    shape: Shape
    accumulation: int | None
    nparams: int
    memory: Memory
    lanes: Speed
    dense: Speed | None
    dense_error: str | None = None
    comm: Communication | None = None
    compiled: CompiledEstimate | None = None
    sweep: Sweep | None = None
    interval: Interval | None = None  # the Young/Daly checkpoint interval
    lengths: LengthTable | None = None  # a long-context recipe's plan at 4k..64k tokens
    cp_bytes: float = 0.0  # CP's K/V all-gathers and reduce-scatters per GPU per step ([parallel] context_parallel)
    cp_s: float = 0.0  # their exposed seconds
    ops: bool = False  # print one layer's per-op table
    kernels: bool = False  # print the compiled estimate's per-kernel table

    def header_lines(self) -> list[str]:
        t, s = self.recipe.training, self.shape
        return [
            f"plan: {self.recipe.path}: {self.recipe.model.flavor} ({self.nparams:,} parameters) on {self.gpus} x "
            f"{self.gpu.label}, {self.comm.layout.name} (parameters sharded over {s.gpus} ranks), {s.param_dtype} "
            f"params, {s.reduce_dtype} reductions",
            f"micro batch {s.micro_batch} x {t.seq_len} tokens"
            + (f" in context-parallel groups of {s.cp} ({s.tokens:,} tokens per GPU)" if s.cp > 1 else "")
            + f", activation checkpointing {s.ac}, gradient accumulation {self.accumulation} ({t.global_batch} "
            f"sequences per step)",
            f"eager, one step traced on fake tensors; {STAND_IN_NOTE}",
        ]

    def roofline_lines(self) -> list[str]:
        lines = [self.lanes.line()]
        if self.dense is None:
            return lines + [f"dense twin roofline: none ({self.dense_error})"]
        return lines + [self.dense.line("dense twin roofline"),
                        f"lanes/dense roofline step ratio: {self.lanes.step_s / self.dense.step_s:.2f} "
                        f"(the twin: torchtitan llama3 with equal parameters and the same attention windows"
                        + ("; its optimizer AdamW" if self.recipe.optimizer.name != "adamw" else "") + ")"]

    def optimizer_lines(self) -> list[str]:
        """The optimizer's state (from the memory trace) and its step time (the roofline), Muon's Newton–Schulz apart."""
        o = self.recipe.optimizer
        what = ("fused AdamW, two fp32 moments per parameter" if o.name == "adamw" else
                "one fp32 momentum per muon_params parameter, fused AdamW's two fp32 moments for the rest")
        lines = [f"optimizer: {o.name} ({what}): state per GPU {self.memory.optimizer_state / GIB:.2f} GiB, "
                 f"step {self.lanes.optimizer_s * 1e3:.2f} ms roofline (clipping included)"]
        if self.lanes.muon is not None:
            lines.append(self.lanes.muon.line(self.lanes.optimizer_s))
        return lines

    def comm_lines(self) -> list[str]:
        return [] if self.comm is None else self.comm.lines() + self.cp_lines() + self.replica_check_lines()

    def cp_lines(self) -> list[str]:
        """CP's own collectives, on top of FSDP's: exposed, as the length table counts them (plan.length)."""
        if self.shape.cp == 1 or self.comm is None:
            return []
        return [f"context parallel {self.shape.cp}: K and V all-gathered, their gradients reduce-scattered: "
                f"{self.cp_bytes / GB:.3g} GB intra-node per GPU per step, {self.cp_s:.3g} s exposed",
                f"roofline with communication and CP: {self.cp_tokens_per_s:,.0f} tokens/s/GPU"]

    @property
    def cp_tokens_per_s(self) -> float:
        """The roofline with communication, less CP's exposed seconds."""
        return self.comm.speed.tokens_per_step / (self.comm.step_s + self.cp_s)

    def replica_check_lines(self) -> list[str]:
        layout, t = self.comm.layout, self.recipe.training
        return plan_lines(self.nparams, layout.replicate, layout.shard, t.consistency_every,
                          self.recipe.checkpoint.interval, self.gpu.dram_gbs, self.comm.step_s)

    @property
    def fits(self) -> bool:
        """The traced peak plus what the layout holds beyond it fits the GPU."""
        extra = self.comm.extra_memory if self.comm else 0
        return self.memory.peak + extra <= FIT_FRACTION * self.gpu.memory_gib * GIB

    def compiled_lines(self) -> list[str]:
        return [] if self.compiled is None else self.compiled.lines()

    def ops_lines(self) -> list[str]:
        lines = []
        if self.ops and self.dense is not None:
            lines += ["", *ops_table(self.lanes, self.dense, layer=self.config.n_layers // 2)]
        if self.kernels and self.compiled is not None:
            lines += ["", *self.compiled.kernel_table()]
        return lines

    def sweep_lines(self) -> list[str]:
        return [] if self.sweep is None else ["", *sweep_lines(self.sweep, self.recipe)]

    def lines(self) -> list[str]:
        """The text, section by section (a new estimate adds its section here)."""
        return [*self.header_lines(), *self.memory.lines(), *self.optimizer_lines(), *self.roofline_lines(),
                *self.comm_lines(),
                *self.compiled_lines(), *(self.interval.lines() if self.interval else []),
                *(self.lengths.lines() if self.lengths else []), *self.ops_lines(), *self.sweep_lines()]

    def to_json(self) -> dict:
        """The plan's numbers, for tools (bench.gpu_check): GiB, tokens/s/GPU, MFU as a fraction."""
        speed = lambda s: None if s is None else {"tokens_per_s": s.tokens_per_s, "mfu": s.mfu,
                                                  "step_s": s.step_s}
        out = {
            "recipe": str(self.recipe.path), "flavor": self.recipe.model.flavor, "parameters": self.nparams,
            "gpus": self.gpus, "gpu": self.gpu.label, "micro_batch": self.shape.micro_batch,
            "seq_len": self.shape.seq_len, "ac": self.shape.ac, "accumulation": self.accumulation,
            "memory": self.memory.to_json(),
            "optimizer": {"name": self.recipe.optimizer.name, "state_gib": self.memory.optimizer_state / GIB,
                          "step_s": self.lanes.optimizer_s,
                          "newton_schulz": None if self.lanes.muon is None else vars(self.lanes.muon)},
            "roofline": speed(self.lanes), "dense_roofline": speed(self.dense),
            "lanes_dense_ratio": None if self.dense is None else self.lanes.step_s / self.dense.step_s,
            "communication": None if self.comm is None else self.comm.to_json(),
            "context_parallel": self.shape.cp,
            "compiled": None if self.compiled is None else self.compiled.to_json(),
            "recommended": None,
        }
        if self.shape.cp > 1 and self.comm is not None:
            out["cp_traffic"] = {"gb": self.cp_bytes / GB, "exposed_s": self.cp_s, "tokens_per_s": self.cp_tokens_per_s}
        if self.lengths is not None:
            out["lengths"] = self.lengths.to_json()
        if self.sweep is not None:
            out["sweep"] = [{"ac": s.ac, "micro_batch": s.micro_batch, "accumulation": s.accumulation,
                             "peak_gib": s.memory and s.memory.peak / GIB, "fits": s.memory and s.memory.fits,
                             "tokens_per_s": s.speed and s.speed.tokens_per_s, "mfu": s.speed and s.speed.mfu,
                             "communication": s.comm and s.comm.to_json()}
                            for s in self.sweep.settings]
            if (best := self.sweep.best) is not None:
                out["recommended"] = {"micro_batch": best.micro_batch, "ac": best.ac,
                                      "accumulation": best.accumulation, "tokens_per_s": best.speed.tokens_per_s,
                                      "mfu": best.speed.mfu, "peak_gib": best.peak / GIB,
                                      "communication": best.comm.to_json()}
        return out


def make_plan(recipe: R.Recipe, *, gpus: int, gpu: str = "h100", with_sweep: bool = False, with_ops: bool = False,
              with_compiled: bool = True, with_kernels: bool = False, with_dense: bool = True,
              with_lengths: bool = True, cluster: Cluster | None = None) -> Plan:
    """Memory, eager rooflines (lanes and, unless not ``with_dense``, the dense twin: a sweep's table reads
    only the lanes'), the compiled estimate (unless not ``with_compiled``: launch.slurm needs only the
    memory), a long-context recipe's table at 4k..64k tokens (unless not ``with_lengths``: ~20 s of traces
    for the 2B), optionally the sweep and tables."""
    from train.recipe import model_config

    if gpu not in GPUS:
        raise R.RecipeError(f"unknown GPU kind {gpu!r}; known: {', '.join(GPUS)}")
    kind = GPUS[gpu]
    config = model_config(recipe)
    t = recipe.training
    if t.seq_len > config.max_seq_len:
        raise R.RecipeError(f"{recipe.path}: [training] seq_len {t.seq_len} exceeds the model's max_seq_len "
                            f"{config.max_seq_len}")
    R.check_world(recipe, gpus)
    cluster = cluster or cluster_for(gpu)
    if with_sweep and recipe.parallel.context_parallel > 1:
        raise R.RecipeError(f"{recipe.path}: [parallel] context_parallel = {recipe.parallel.context_parallel}: "
                            f"--sweep ranks data-parallel layouts without CP; the plan's table by length "
                            f"gives the CP each length needs")
    layout = Layout.of(recipe, gpus)
    shape = Shape.of(recipe, layout.shard)  # memory and the optimizer's shard follow the shard degree (x CP)
    acc = _accumulation(recipe, shape.micro_batch, gpus // shape.cp)  # the CP ranks of a sequence: one DP rank
    with torch.device("meta"):
        nparams = sum(p.numel() for p in config.build().parameters())
    memory = memory_plan(config, shape, kind)
    lanes = roofline(config, shape, kind, accumulation=acc)
    dense, dense_error = None, "not traced"
    try:
        if with_dense:
            dense, dense_error = roofline(config, shape, kind, accumulation=acc, dense_twin=True), None
    except ValueError as e:  # a shape llama3 cannot take
        dense_error = str(e)
    comm = communication(config, layout, lanes, cluster, gpus=gpus, accumulation=acc,
                         param_dtype=shape.param_dtype, reduce_dtype=shape.reduce_dtype)
    p = Plan(recipe, config, gpus, kind, shape, acc, nparams, memory, lanes, dense, dense_error, comm, ops=with_ops,
             kernels=with_kernels)
    if shape.cp > 1:
        p.cp_bytes, p.cp_s = cp_traffic(config, shape, acc, cluster)
    p.interval = checkpoint_interval(recipe, lanes, gpus, cluster.gpus_per_node, nparams)
    if with_lengths and t.seq_len > LONG:  # a long-context phase: the same plan at 4k..64k, and the CP each length needs
        p.lengths = length_table(recipe, config, gpus, cluster)
    if with_compiled:
        from .compiled import compiled_estimate

        p.compiled = compiled_estimate(config, shape, kind, lanes, dense)
    if with_sweep:
        p.sweep = sweep(recipe, config, gpus, kind, cluster)
    return p


def plan(recipe: R.Recipe, *, gpus: int, gpu: str = "h100", with_compiled: bool = False,
         cluster: Cluster | None = None) -> tuple[str, bool]:
    """The plan's text (memory, eager rooflines, communication; launch.slurm's check before the queue)
    and whether the recipe's setting fits ``gpus`` GPUs of kind ``gpu`` (its own setting only: no table at
    other lengths)."""
    p = make_plan(recipe, gpus=gpus, gpu=gpu, with_compiled=with_compiled, with_lengths=False, cluster=cluster)
    return "\n".join(p.lines()), p.fits
