"""Plan a run before it starts: its size, its data, its memory per GPU, its speed.

    python train.py --recipe R --dry-run [--run DIR]
    python train.py --recipe R --plan [--gpus N] [--gpu h100|h200|a100|mi300x] [--sweep] [--ops]

Every fact about a GPU run that a CPU can give comes from this one module, so a
recipe is checked before a job waits in a queue for 24 nodes:

- ``dry_run``: parameters, steps, tokens, FLOPs per token, wall time at an
  assumed MFU; planned vs available tokens per source (a plan beyond a
  source's ``max_epochs`` is refused, as it is before training) and, from a
  run's ``metrics.jsonl``, the mix it has consumed so far.
- ``memory_plan``: peak memory per GPU of one training step. The recipe's
  model is built on fake tensors (``FakeTensorMode``: shapes, no storage),
  with the recipe's activation checkpointing and FSDP2 applied by
  torchtitan's own parallelize path over a fake process group of N ranks;
  forward, loss, backward, clipping and fused AdamW run under
  ``FSDPMemTracker``, as torchtitan's former ``scripts/estimate/estimation.py``
  did. Two steps run: the first creates the optimizer state. Without a GPU the
  tensors are fake *CPU* tensors (autograd refuses fake CUDA tensors then);
  the sizes are the same. Eager: ``torch.compile`` may save fewer tensors.
- ``roofline``: a ``TorchDispatchMode`` charges each aten op of one micro
  batch of the unsharded model (forward, loss, backward, AC recomputation)
  the larger of torch's own compute and memory-transfer estimates
  (``torch.utils._runtime_estimation``, rescaled to the named GPU's datasheet
  peak FLOP/s; bandwidth: the datasheet's),
  plus the fused AdamW step on one GPU's FSDP shard. An estimate of eager
  kernels: no communication, no overlap, no compile fusion.

Two CUDA kernels cannot be traced on CPU as they run on a GPU: flex attention
(no CPU backward) and RMSNorm (one fused kernel on CUDA, ~10 ops on CPU).
Both are replaced by stand-in operators with the kernel's inputs, outputs and
saved tensors (attention: q, k, v, output, logsumexp; RMSNorm: input and
1/rms), defined for fake tensors only.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common import RMSNorm
from torchtitan.models.common.attention import FlexAttention

from train import recipe as R

GIB = 2**30
FIT_FRACTION = 0.9  # a plan fits with >= 10% of the GPU left for the allocator and NCCL buffers
MICRO_BATCHES = (1, 2, 4, 8, 16)
AC_MODES = ("none", "selective", "full")
ROOFLINE_NOTE = "estimate: eager ops, compute and memory traffic only, no communication, no compile fusion"
STAND_IN_NOTE = ("attention: a stand-in that saves what flex attention saves (q, k, v, output, logsumexp); "
                 "RMSNorm: one fused kernel (saves input and 1/rms)")


# ---- GPUs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """A GPU kind: torch's datasheet entry for peak FLOPs and bandwidth, and its memory."""

    label: str
    datasheet: str  # a torch._inductor.analysis.device_info name
    memory_gib: float  # total memory as the driver reports it
    dram_gbs: float | None = None  # bandwidth, where it differs from the datasheet entry's

    @property
    def bandwidth_scale(self) -> float:
        """Factor on torch's transfer time for the datasheet entry's bandwidth."""
        from torch._inductor.analysis.device_info import datasheet_dram_bw_gbs

        return 1.0 if self.dram_gbs is None else datasheet_dram_bw_gbs(self.datasheet) / self.dram_gbs

    def peak_flops(self, dtype: torch.dtype) -> float:
        from torch._inductor.analysis.device_info import datasheet_tops

        return datasheet_tops(dtype, device_name=self.datasheet) * 1e12

    @property
    def compute_scale(self) -> float:
        """Factor on torch's compute time for the datasheet peak. ``get_compute_time`` halves
        FLOPs into MACs and then divides by 75% of the peak *FLOP* rate, i.e. it runs at
        1.5x the datasheet; a roofline takes the datasheet peak itself."""
        from torch.utils._runtime_estimation import flops_to_ns

        flops = 1e12
        return flops / self.peak_flops(torch.bfloat16) * 1e9 / flops_to_ns(flops, torch.bfloat16, self.datasheet)


GPUS = {
    "h100": Gpu("H100 80GB", "NVIDIA H100", 81559 / 1024),
    # torch's table has no H200: the H100's compute with 4.8 TB/s of HBM3e.
    "h200": Gpu("H200 141GB", "NVIDIA H100", 143771 / 1024, dram_gbs=4800.0),
    "a100": Gpu("A100 80GB", "NVIDIA A100", 81920 / 1024),
    "mi300x": Gpu("MI300X 192GB", "AMD MI300X", 205822885888 / GIB),
}


# ---- dry run: size, steps, wall time, data ------------------------------------------------


def run_report(recipe: R.Recipe, *, gpus: int, mfu: float, peak_tflops: float) -> str:
    """Parameters, steps, tokens, FLOPs per token and the wall time at ``mfu``."""
    from train.build import model_config

    config = model_config(recipe)
    with torch.device("meta"):
        model = config.build()
    t = recipe.training
    nparams, flops = config.get_nparams_and_flops(model, t.seq_len)
    seconds = t.total_tokens * flops / (mfu * peak_tflops * 1e12 * gpus)
    return "\n".join([
        f"recipe: {recipe.path}",
        f"model: {recipe.model.flavor}, parameters: {nparams:,}",
        f"tokens per step: {recipe.tokens_per_step:,} ({t.global_batch} x {t.seq_len})",
        f"steps: {t.steps:,}  total tokens: {t.total_tokens:,}",
        f"FLOPs per token: {flops:,} ({flops / 1e9:.2f} GFLOP)",
        f"expected wall time: {seconds / 86400:.1f} days on {gpus} GPUs at {mfu:.0%} MFU "
        f"of {peak_tflops:g} TFLOP/s ({t.total_tokens / seconds / gpus:,.0f} tokens/s/GPU)",
        f"run dir: {recipe.output_dir}",
    ])


def data_report(recipe: R.Recipe) -> str:
    """Planned vs available tokens per source; raises ValueError beyond a source's max_epochs.

    Sources that are not on this machine are listed with their planned share only.
    """
    from train.build import check_data, model_config

    sources = recipe.data.sources
    missing = [str(s.path) for s in sources if not os.path.exists(s.path)]
    total = recipe.training.total_tokens
    if not missing:
        return check_data(recipe, model_config(recipe)).describe()
    norm = sum(s.weight for s in sources if s.weight is not None) or 1.0
    lines = [f"mixture: {total:,} tokens planned; not on this machine: {', '.join(missing)}"]
    for s in sources:
        share = (s.weight / norm) if s.weight is not None else s.tokens / total
        lines.append(f"  {s.name}: share {share:.4f}, plan {share * total:,.0f} tokens, "
                     f"max_epochs {s.max_epochs} ({s.path})")
    return "\n".join(lines)


def realized_mix(run_dir: Path, weights: dict[str, float]) -> str:
    """Tokens consumed per source so far, from the run's metrics.jsonl."""
    from rundir import read_metrics

    rows = read_metrics(run_dir)
    if not rows:
        return f"realized mix: no metrics yet in {run_dir}"
    consumed, step = {}, 0
    for row in rows:
        tokens = {k.removeprefix("data/tokens/"): v for k, v in row.items() if k.startswith("data/tokens/")}
        if tokens:
            consumed, step = tokens, row["step"]
    total = sum(consumed.values()) or 1
    norm = sum(weights.values()) or 1.0
    lines = [f"realized mix at step {step} ({run_dir}):"]
    lines += [f"  {name}: {n:,} tokens, share {n / total:.4f} (weight {weights.get(name, 0) / norm:.4f})"
              for name, n in consumed.items()]
    return "\n".join(lines)


def dry_run(recipe: R.Recipe, *, gpus: int, mfu: float, peak_tflops: float, run_dir: Path | None = None) -> str:
    """``train.py --dry-run``: the run report, the data plan and the realized mix."""
    weights = {s.name: s.weight or 0.0 for s in recipe.data.sources}
    return "\n".join([run_report(recipe, gpus=gpus, mfu=mfu, peak_tflops=peak_tflops), data_report(recipe),
                      realized_mix(run_dir or recipe.output_dir, weights)])


# ---- stand-ins for the CUDA kernels ------------------------------------------------------


def _visible_pairs(seq_len: int, window: int) -> int:
    """(query, key) pairs a causal mask with this window (0: none) lets through."""
    w = min(window or seq_len, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def _define_stand_ins() -> None:
    """``laneplan::attention`` and ``laneplan::rms_norm``: fake-tensor-only operators with
    the CUDA kernels' inputs, outputs, saved tensors and (attention) FLOPs."""
    if hasattr(torch.ops.laneplan, "attention"):
        return
    from torch.utils.flop_counter import register_flop_formula

    lib = "laneplan::"
    torch.library.define(lib + "attention", "(Tensor q, Tensor k, Tensor v, int window) -> (Tensor, Tensor)")
    torch.library.define(lib + "attention_backward", "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, "
                         "Tensor lse, int window) -> (Tensor, Tensor, Tensor)")
    torch.library.define(lib + "rms_norm", "(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)")
    torch.library.define(lib + "rms_norm_backward",
                         "(Tensor grad, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)")

    @torch.library.register_fake(lib + "attention")
    def _(q, k, v, window):  # q, k, v: [B, S, heads, head_dim]; logsumexp: [B, heads, S] in fp32
        return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)

    @torch.library.register_fake(lib + "attention_backward")
    def _(grad, q, k, v, out, lse, window):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def attention_setup(ctx, inputs, output):
        q, k, v, ctx.window = inputs
        ctx.save_for_backward(q, k, v, *output)

    def attention_backward(ctx, grad, _grad_lse):
        return (*torch.ops.laneplan.attention_backward(grad, *ctx.saved_tensors, ctx.window), None)

    torch.library.register_autograd(lib + "attention", attention_backward, setup_context=attention_setup)

    @register_flop_formula(torch.ops.laneplan.attention)
    def _(q_shape, k_shape, v_shape, window, out_shape=None, **kwargs):
        B, S, H, D = q_shape
        return 2 * 2 * B * H * D * _visible_pairs(S, window)  # Q K^T and P V

    @register_flop_formula(torch.ops.laneplan.attention_backward)
    def _(grad_shape, q_shape, *args, out_shape=None, **kwargs):
        B, S, H, D = q_shape
        return 5 * 2 * B * H * D * _visible_pairs(S, args[-1])  # recompute Q K^T, dV, dP, dQ, dK

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)

    @torch.library.register_fake(lib + "rms_norm_backward")
    def _(grad, x, weight, rstd):
        return torch.empty_like(x), torch.empty_like(weight)

    def norm_setup(ctx, inputs, output):
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight, output[1])

    def norm_backward(ctx, grad, _grad_rstd):
        return (*torch.ops.laneplan.rms_norm_backward(grad, *ctx.saved_tensors), None)

    torch.library.register_autograd(lib + "rms_norm", norm_backward, setup_context=norm_setup)


class FusedRMSNorm(RMSNorm):
    """torchtitan's RMSNorm as CUDA runs it: one kernel (the stand-in operator)."""

    def forward(self, x):
        return torch.ops.laneplan.rms_norm(x, self.weight, self.eps or 0.0)[0]


class AttentionStandIn(FlexAttention):
    """Flex attention's inputs, outputs and saved tensors, on fake tensors (the stand-in operator)."""

    window = 0  # set per layer: a BlockMask's window cannot be read from fake tensors

    def forward(self, q, k, v, **kwargs):
        return torch.ops.laneplan.attention(q, k, v, self.window)[0]


class SelectiveACWithStandIn(SelectiveAC):
    """torchtitan's selective AC, saving the stand-in attention as it saves flex attention."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return super().get_save_ops() | {torch.ops.laneplan.attention.default}


def use_cuda_kernels(model: nn.Module, windows: list[int | None]) -> nn.Module:
    """Swap the model's norms and attention kernels for the stand-ins, in place.

    The stand-ins subclass the modules they replace and change only
    ``forward`` (Laneformer builds its norms' configs inside ``__init__``, so
    swapping classes reaches every norm where a config swap could not). The
    stand-in attention ignores masks, so the model builds none. The stand-in
    operators are defined on first use, not on import (train.py imports this
    module on every launch).
    """
    _define_stand_ins()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.__class__ = FusedRMSNorm
    for layer, window in zip(model.layers.values(), windows, strict=True):
        for module in layer.modules():
            if isinstance(module, FlexAttention):
                module.__class__ = AttentionStandIn
                module.window = window or 0
    if hasattr(model, "attention_masks"):  # Laneformer: one mask per window, unread by the stand-in
        model.attention_masks = lambda tokens, positions: dict.fromkeys(windows)
    return model


def _ac_config(mode: str):
    return {"none": None, "selective": SelectiveACWithStandIn.Config(), "full": FullAC.Config()}[mode]


# ---- the step both plans run -------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What one training step of a plan looks like on one GPU."""

    micro_batch: int
    seq_len: int
    ac: str  # none | selective | full
    gpus: int
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    lr: float = 3e-4
    grad_clip: float = 1.0

    @classmethod
    def of(cls, recipe: R.Recipe, gpus: int, **changes) -> Shape:
        t, p, o = recipe.training, recipe.parallel, recipe.optimizer
        return dataclasses.replace(cls(t.micro_batch, t.seq_len, p.activation_checkpoint, gpus, p.param_dtype,
                                       p.reduce_dtype, o.lr, o.grad_clip), **changes)


def _build(config, dtype: torch.dtype, device: str) -> nn.Module:
    """``config.build()`` with parameters in ``dtype`` (``module.to`` fails on fake tensors)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return config.build()
    finally:
        torch.set_default_dtype(default)


def _batch(vocab_size: int, shape: Shape, device: str):
    size = (shape.micro_batch, shape.seq_len)
    return torch.randint(0, vocab_size, size, device=device), torch.randint(0, vocab_size, size, device=device)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(logits, labels) / labels.numel()


def _windows(config) -> list[int | None]:
    return [config.window_of(i) for i in range(config.n_layers)]


# ---- memory ------------------------------------------------------------------------------


@dataclass
class Memory:
    """Bytes per GPU: the peak and its parts (FSDPMemTracker's kinds), and the persistent state."""

    peak: int
    parts: dict[str, int]  # at the peak
    state: int  # sharded params + grads + optimizer state, after backward
    gpu: Gpu

    @property
    def fits(self) -> bool:
        return self.peak <= FIT_FRACTION * self.gpu.memory_gib * GIB

    def lines(self) -> list[str]:
        p = self.parts
        return [
            f"peak memory per GPU: {self.peak / GIB:.2f} GiB of {self.gpu.memory_gib:.1f} GiB "
            f"({'fits' if self.fits else 'does not fit'})",
            f"sharded params+grads+optimizer per GPU: {self.state / GIB:.2f} GiB",
            f"activations per GPU: {p['Activation'] / GIB:.2f} GiB",
            f"temporaries per GPU: {p['Temp'] / GIB:.2f} GiB",
            f"all-gather buffers per GPU: {p['All Gather'] / GIB:.2f} GiB",
            f"reduce-scatter buffers per GPU: {p['Reduce Scatter'] / GIB:.2f} GiB",
            f"unsharded params+grads per GPU: {(p['Unsharded Param'] + p['Unsharded Grad']) / GIB:.2f} GiB",
            f"(at the peak: sharded params {p['Sharded Param'] / GIB:.2f}, sharded grads "
            f"{p['Sharded Grad'] / GIB:.2f}, optimizer {p['OptState'] / GIB:.2f}, inputs "
            f"{p['Inputs'] / GIB:.2f}, buffers {p['Buffer'] / GIB:.2f} GiB; fits means at most "
            f"{FIT_FRACTION:.0%} of the GPU)",
        ]


def memory_plans(config, shape: Shape, gpu: Gpu, micro_batches: tuple[int, ...] | None = None,
                 stop_when_full: bool = False) -> dict[int, Memory]:
    """One FSDP2 training step of ``config`` at ``shape`` for each micro batch, traced on
    fake tensors; the sharded model is built once. ``stop_when_full``: no micro batch
    larger than one that does not fit is traced."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.tools import utils as tt_utils

    from models.laneformer import parallelize_laneformer
    from train.cpu import use_cpu_if_no_gpu

    use_cpu_if_no_gpu()  # torchtitan's mesh and our fake tensors on the same device type
    device = tt_utils.device_type
    if dist.is_initialized():
        raise RuntimeError("memory_plans needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", rank=0, world_size=shape.gpus, store=FakeStore())
    plans = {}
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=shape.gpus, cp=1, tp=1, pp=1, ep=1,
                            world_size=shape.gpus, spmd_backend="partial_dtensor")
        dims.build_mesh()  # outside fake mode
        with FakeTensorMode():
            model = use_cuda_kernels(_build(config, torch.float32, device), _windows(config))
            parallelize_laneformer(
                model, parallel_dims=dims,
                training=TrainingConfig(mixed_precision_param=shape.param_dtype,
                                        mixed_precision_reduce=shape.reduce_dtype),
                parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                compile_config=CompileConfig(enable=False), ac_config=_ac_config(shape.ac), dump_folder="",
            )
            optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr, fused=True)
            for p in model.parameters():  # the optimizer state exists from the second step on
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad()
            tracker = FSDPMemTracker(model, optimizer)  # tracks the existing state on entry
            with tracker:
                for mb in micro_batches or (shape.micro_batch,):
                    tracker.reset_mod_stats()  # one step per micro batch, each with its own peak
                    tracker._peak_mem = dict.fromkeys(tracker._peak_mem, 0)  # (no public reset)
                    tokens, labels = _batch(config.vocab_size, dataclasses.replace(shape, micro_batch=mb), device)
                    tracker.track_inputs((tokens, labels))
                    _loss(model(tokens), labels).backward()
                    after_backward = tracker.get_tracker_snapshot()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), shape.grad_clip, foreach=True)
                    optimizer.step()
                    optimizer.zero_grad()
                    del tokens, labels
                    plans[mb] = _memory(tracker.get_tracker_snapshot("peak"), after_backward, gpu)
                    if stop_when_full and not plans[mb].fits:
                        break
    finally:
        dist.destroy_process_group()
    return plans


def _memory(peak: dict, after_backward: dict, gpu: Gpu) -> Memory:
    (at_peak,) = peak.values()  # one device
    (state,) = after_backward.values()
    name = lambda kind: getattr(kind, "value", kind)  # noqa: E731
    parts = {name(k): v for k, v in at_peak.items()}
    persistent = sum(v for k, v in state.items() if name(k) in ("Sharded Param", "Sharded Grad", "OptState"))
    return Memory(peak=parts.pop("Total"), parts=parts, state=persistent, gpu=gpu)


def memory_plan(config, shape: Shape, gpu: Gpu) -> Memory:
    """Peak memory per GPU of one training step at ``shape``."""
    return memory_plans(config, shape, gpu)[shape.micro_batch]


# ---- roofline ----------------------------------------------------------------------------


@dataclass
class Op:
    where: str  # the innermost module running it
    name: str  # the aten (or stand-in) operator
    phase: str  # forward | backward | optimizer
    bytes: int  # read + written
    compute_s: float
    transfer_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.transfer_s)


# Allocations that touch no memory.
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an operator without outputs writes in place (e.g. fused AdamW's)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out += _tensors(args[i] if i < len(args) else kwargs.get(arg.name))
    return out


class _Where:
    """Which module an operator belongs to: in forward the innermost running module; in
    backward the module whose forward created the autograd node being run. Each node is
    labelled when the tensors it produced cross a module boundary (global module hooks)."""

    def __init__(self, model: nn.Module):
        self.names = {id(m): (n.replace("._checkpoint_wrapped_module", "") or "model")
                      for n, m in model.named_modules()}
        self.stack = ["model"]

    @staticmethod
    def _label(tensors, name: str) -> None:
        nodes = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while nodes:
            node = nodes.pop()
            if node is not None and "where" not in node.metadata:
                node.metadata["where"] = name
                nodes += [n for n, _ in node.next_functions]

    def _pre(self, module, args):
        if id(module) in self.names:
            self._label(_tensors(args), self.stack[-1])  # created so far: the caller's
            self.stack.append(self.names[id(module)])

    def _post(self, module, args, output):
        if id(module) in self.names:
            self._label(_tensors(output), self.stack.pop())

    def now(self) -> tuple[str, str]:
        """(phase, module) of the operator running now."""
        node = torch._C._current_autograd_node()
        if node is None:
            return "forward", self.stack[-1]
        if len(self.stack) > 1:  # a module's forward inside backward: activation checkpointing
            return "recompute", self.stack[-1]
        return "backward", node.metadata.get("where", "model")

    def __enter__(self):
        from torch.nn.modules import module

        self.handles = [module.register_module_forward_pre_hook(self._pre),
                        module.register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class _Costs(torch.utils._python_dispatch.TorchDispatchMode):
    """Charges each operator max(compute time, transfer time) on ``gpu`` (torch's cost model)."""

    def __init__(self, gpu: Gpu, where: _Where | None = None, phase: str | None = None):
        super().__init__()
        self.gpu, self.where, self.phase, self.ops = gpu, where, phase, []
        self.compute_scale = gpu.compute_scale

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._runtime_estimation import _VIEW_OPS, get_compute_time, get_num_bytes, get_transfer_time

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.is_view or func._overloadpacket in _VIEW_OPS or name in _FREE:
            return out
        outs = _tensors(out) or _written(func, args, kwargs)
        if not outs:  # e.g. prim.device: no work, but its inputs would be charged
            return out
        ins = _tensors((args, kwargs))
        compute = get_compute_time(func._overloadpacket, args, kwargs, out, {outs[0].dtype},
                                   gpu_type=self.gpu.datasheet) * self.compute_scale
        transfer = get_transfer_time(ins, outs, gpu_type=self.gpu.datasheet) * self.gpu.bandwidth_scale
        phase, where = self.where.now() if self.where else (self.phase, "")
        self.ops.append(Op(where, name, phase, sum(get_num_bytes(t) for t in ins + outs),
                           compute * 1e-9, transfer * 1e-9))
        return out


@dataclass
class Speed:
    """Roofline time of one optimizer step on one GPU."""

    micro_batch_s: float  # forward + loss + backward of one micro batch
    optimizer_s: float  # clipping + fused AdamW on one GPU's shard
    accumulation: int
    tokens_per_step: int  # per GPU
    flops_per_token: int
    peak_flops: float
    ops: list[Op] = field(repr=False)

    @property
    def step_s(self) -> float:
        return self.accumulation * self.micro_batch_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.flops_per_token * self.tokens_per_s / self.peak_flops

    def line(self, label: str = "roofline") -> str:
        return f"{label}: {self.tokens_per_s:,.0f} tokens/s/GPU, MFU {self.mfu:.1%} ({ROOFLINE_NOTE})"


def _shard_dim(placement, param: torch.Tensor) -> int:
    """The dim FSDP splits ``param`` on under ``placement`` (a shard_placement_fn or None: dim 0)."""
    chosen = placement(param) if placement else None
    return chosen.dim if chosen is not None else 0


def _shard_numel(param: torch.Tensor, dim: int, gpus: int) -> int:
    """Elements of one GPU's FSDP shard of ``param`` split on ``dim`` (the padded, largest shard)."""
    return -(-param.shape[dim] // gpus) * param.numel() // param.shape[dim]


def roofline(config, shape: Shape, gpu: Gpu, *, accumulation: int = 1, dense_twin: bool = False) -> Speed:
    """Roofline time of one step on one GPU: ``accumulation`` micro batches of the unsharded
    model (or its equal-parameter dense twin, with the same attention work) and the
    optimizer on the GPU's shard."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from models.laneformer.dense_twin import llama3_twin
    from models.laneformer.parallelize import lane_placement

    dtype = getattr(torch, shape.param_dtype)
    with FakeTensorMode():
        model = _build(llama3_twin(config) if dense_twin else config, dtype, "cpu")
        use_cuda_kernels(model, _windows(config))
        if (ac := _ac_config(shape.ac)) is not None:
            ac.build().apply(model)
        tokens, labels = _batch(config.vocab_size, shape, "cpu")
        with _Where(model) as where, _Costs(gpu, where) as costs:
            _loss(model(tokens), labels).backward()
        # The optimizer runs once per step on this GPU's FSDP shard (fp32), split on the dim
        # parallelize.lane_placement gives each parameter (lane weights: dim 1 beyond n_lanes GPUs).
        placement = lane_placement(config.n_lanes, shape.gpus)
        shards = [torch.empty(_shard_numel(p, _shard_dim(placement, p), shape.gpus), requires_grad=True)
                  for p in model.parameters()]
        for s in shards:
            s.grad = torch.empty_like(s)
        optimizer = torch.optim.AdamW(shards, lr=shape.lr, fused=True)
        optimizer.step()  # creates the state
        with _Costs(gpu, phase="optimizer") as opt_costs:
            torch.nn.utils.clip_grad_norm_(shards, shape.grad_clip, foreach=True)
            optimizer.step()
    from models.laneformer.flops import nparams_and_flops_per_token

    _, flops = nparams_and_flops_per_token(config, model, shape.seq_len)  # the twin: equal parameters
    return Speed(
        micro_batch_s=sum(op.seconds for op in costs.ops),
        optimizer_s=sum(op.seconds for op in opt_costs.ops),
        accumulation=accumulation,
        tokens_per_step=accumulation * shape.micro_batch * shape.seq_len,
        flops_per_token=flops,
        peak_flops=gpu.peak_flops(dtype),
        ops=costs.ops + opt_costs.ops,
    )


# ---- the per-op table --------------------------------------------------------------------


_CATEGORIES = {"mm": "matmul", "bmm": "matmul", "addmm": "matmul", "attention": "attention",
               "attention_backward": "attention", "rms_norm": "rms_norm", "rms_norm_backward": "rms_norm",
               "clone": "copies (layout, dtype)", "copy_": "copies (layout, dtype)",
               "_to_copy": "copies (layout, dtype)"}


def _text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


def _layer_ops(speed: Speed, layer: int) -> list[Op]:
    tag = f"layers.{layer}"
    return [op for op in speed.ops if op.where == tag or op.where.startswith(tag + ".")]


def ops_table(lanes: Speed, dense: Speed, layer: int, top: int = 20) -> list[str]:
    """Where one layer's estimated time goes, lanes vs dense: by kind of operator, then the
    largest (module, operator, phase) rows of each."""
    sides = {"lanes": _layer_ops(lanes, layer), "dense": _layer_ops(dense, layer)}
    totals = {k: sum(op.seconds for op in ops) or 1e-30 for k, ops in sides.items()}
    lines = [f"per-op roofline of layer {layer}, one micro batch (ms; {ROOFLINE_NOTE}):"]
    by_kind = {k: defaultdict(float) for k in sides}
    for k, ops in sides.items():
        for op in ops:
            by_kind[k][_CATEGORIES.get(op.name, "other elementwise and reductions")] += op.seconds
    kinds = sorted(set(by_kind["lanes"]) | set(by_kind["dense"]), key=lambda c: -by_kind["lanes"][c])
    rows = [[c, f"{by_kind['lanes'][c] * 1e3:.3f}", f"{by_kind['dense'][c] * 1e3:.3f}",
             f"{by_kind['lanes'][c] / max(by_kind['dense'][c], 1e-30):.2f}" if by_kind["dense"][c] else "-"]
            for c in kinds]
    rows.append(["layer total", f"{totals['lanes'] * 1e3:.3f}", f"{totals['dense'] * 1e3:.3f}",
                 f"{totals['lanes'] / totals['dense']:.2f}"])
    lines += _text_table(["kind", "lanes ms", "dense ms", "lanes/dense"], rows)
    for k, ops in sides.items():
        groups: dict[tuple, list[Op]] = defaultdict(list)
        for op in ops:
            where = op.where.removeprefix(f"layers.{layer}").lstrip(".") or "(block)"
            groups[(where, op.name, op.phase)].append(op)
        ranked = sorted(groups.items(), key=lambda kv: -sum(op.seconds for op in kv[1]))
        rows = []
        for (where, name, phase), group in ranked[:top]:
            s = sum(op.seconds for op in group)
            bound = "compute" if sum(op.compute_s for op in group) >= sum(op.transfer_s for op in group) else "memory"
            rows.append([where, name, phase, len(group), f"{sum(op.bytes for op in group) / 1e9:.3f}",
                         bound, f"{s * 1e3:.3f}", f"{s / totals[k]:.1%}"])
        rest = sum(op.seconds for _, group in ranked[top:] for op in group)
        rows.append([f"({len(ranked) - top} more rows)" if len(ranked) > top else "", "", "", "", "", "",
                     f"{rest * 1e3:.3f}", f"{rest / totals[k]:.1%}"])
        lines += ["", f"{k}: layer {layer}, largest rows"]
        lines += _text_table(["module", "op", "phase", "calls", "GB", "bound", "ms", "share"], rows)
    return lines


# ---- the plan ----------------------------------------------------------------------------


def _accumulation(recipe: R.Recipe, micro_batch: int, gpus: int) -> int | None:
    """Micro batches per step that keep the recipe's global batch (None if it does not divide)."""
    per_step = micro_batch * gpus
    return recipe.training.global_batch // per_step if recipe.training.global_batch % per_step == 0 else None


def sweep(recipe: R.Recipe, config, gpus: int, gpu: Gpu) -> list[str]:
    """Micro batch x AC: peak memory, fits, roofline; the fastest setting that fits.

    Each AC mode shards its model once for all micro batches; a micro batch
    larger than one that does not fit is not traced (the table says so).
    """
    rows, best = [], None
    for ac in AC_MODES:
        shape = Shape.of(recipe, gpus, ac=ac)
        memory = memory_plans(config, shape, gpu, MICRO_BATCHES, stop_when_full=True)
        for mb in MICRO_BATCHES:
            acc = _accumulation(recipe, mb, gpus)
            if mb not in memory:
                rows.append([ac, mb, "not traced", "no (a smaller micro batch does not fit)", "-", "-", "-"])
                continue
            mem = memory[mb]
            speed = roofline(config, dataclasses.replace(shape, micro_batch=mb), gpu, accumulation=acc or 1)
            rows.append([ac, mb, f"{mem.peak / GIB:.2f}", "yes" if mem.fits else "no",
                         acc or "does not divide", f"{speed.tokens_per_s:,.0f}", f"{speed.mfu:.1%}"])
            if mem.fits and acc and (best is None or speed.tokens_per_s > best[0].tokens_per_s):
                best = (speed, mem, mb, ac, acc)
    lines = [f"sweep on {gpus} x {gpu.label} (roofline: {ROOFLINE_NOTE}):"]
    lines += _text_table(["AC", "micro batch", "peak GiB", "fits", "accumulation", "roofline tokens/s/GPU", "MFU"],
                         [[str(c) for c in r] for r in rows])
    if best is None:
        return lines + [f"recommended: nothing fits on {gpu.label} at this global batch"]
    speed, mem, mb, ac, acc = best
    return lines + [
        f"recommended: micro batch {mb}, activation checkpointing {ac} (the fastest that fits): "
        f"{speed.tokens_per_s:,.0f} tokens/s/GPU, MFU {speed.mfu:.1%}, peak {mem.peak / GIB:.2f} GiB; "
        f"gradient accumulation {acc} keeps {recipe.training.global_batch} sequences per step on {gpus} GPUs"
    ]


def plan(recipe: R.Recipe, *, gpus: int, gpu: str = "h100", with_sweep: bool = False,
         with_ops: bool = False) -> tuple[str, bool]:
    """The plan's text and whether the recipe's setting fits ``gpus`` GPUs of kind ``gpu``."""
    from train.build import model_config

    if gpu not in GPUS:
        raise R.RecipeError(f"unknown GPU kind {gpu!r}; known: {', '.join(GPUS)}")
    kind = GPUS[gpu]
    config = model_config(recipe)
    t = recipe.training
    if t.seq_len > config.max_seq_len:
        raise R.RecipeError(f"{recipe.path}: [training] seq_len {t.seq_len} exceeds the model's max_seq_len "
                            f"{config.max_seq_len}")
    R.check_world(recipe, gpus)
    shape = Shape.of(recipe, gpus)
    acc = _accumulation(recipe, shape.micro_batch, gpus)
    with torch.device("meta"):
        nparams = sum(p.numel() for p in config.build().parameters())
    lines = [
        f"plan: {recipe.path}: {recipe.model.flavor} ({nparams:,} parameters) on {gpus} x {kind.label}, FSDP2 "
        f"over {gpus} ranks, {shape.param_dtype} params, {shape.reduce_dtype} reductions",
        f"micro batch {shape.micro_batch} x {t.seq_len} tokens, activation checkpointing {shape.ac}, "
        f"gradient accumulation {acc} ({t.global_batch} sequences per step)",
        f"eager, one step traced on fake tensors; {STAND_IN_NOTE}",
    ]
    memory = memory_plan(config, shape, kind)
    lines += memory.lines()
    lanes = roofline(config, shape, kind, accumulation=acc)
    lines.append(lanes.line())
    try:
        dense = roofline(config, shape, kind, accumulation=acc, dense_twin=True)
    except ValueError as e:  # a shape llama3 cannot take
        lines.append(f"dense twin roofline: none ({e})")
    else:
        lines += [dense.line("dense twin roofline"),
                  f"lanes/dense roofline step ratio: {lanes.step_s / dense.step_s:.2f} "
                  f"(the twin: torchtitan llama3 with equal parameters and the same attention windows)"]
        if with_ops:
            lines += ["", *ops_table(lanes, dense, layer=config.n_layers // 2)]
    if with_sweep:
        lines += ["", *sweep(recipe, config, gpus, kind)]
    return "\n".join(lines), memory.fits
