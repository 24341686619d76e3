"""Compiled roofline: what ``torch.compile`` (Inductor) moves and computes, kernel by kernel.

The eager roofline (``roofline.py``) charges every aten op its own pass over
memory; a compiled block fuses elementwise chains and reductions into single
kernels, so it over-counts. Here one layer of the model (and one of its dense
twin) is compiled forward and backward by Inductor on the CPU, at the plan's
micro batch and sequence length. A post-fusion scheduler pass
(``torch._inductor.config._post_fusion_custom_pass``) reads each fused
kernel's bytes read and written (``get_read_write_buffers_sizes``) and FLOPs
(``estimate_flops``), then stops code generation: nothing is compiled to C++
and nothing runs (the compiled graphs return empty tensors of the right shapes,
and the backward is lowered at once, ``force_non_lazy_backward_lowering``).
Each kernel costs max(FLOPs / peak, bytes / bandwidth) on the GPU.

Attention is the stand-in operator of ``step.py`` (Inductor keeps it as an
extern kernel) costed as the flex kernel: q, k, v, output and logsumexp
moved once, FLOPs of the visible pairs of each layer's window. Every layer is
costed as the middle layer (its exchange: what most layers do); the embedding,
final norm, head and loss keep their eager roofline, as does the optimizer.

What the estimate ignores: communication, launch overheads and overlap,
Triton's own fusion choices (the CPU scheduler's are close, not equal), cache
reuse between kernels, matmuls below peak, and FSDP's casts.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from rundir.table import text_table

from .gpus import Gpu
from .roofline import Speed
from .step import Shape, _build, _visible_pairs

COMPILED_NOTE = ("estimate: Inductor's fused kernels of one layer (CPU scheduler) at max(FLOPs/peak, "
                 "bytes/bandwidth), attention as the flex kernel, head, loss and optimizer from the eager roofline; "
                 "ignores communication, launch overheads, overlap, cache reuse and matmuls below peak")


@dataclass(frozen=True)
class Kernel:
    """One post-fusion kernel of the compiled layer."""

    phase: str  # forward | backward
    name: str  # the aten ops it fuses (Inductor's origins), or the extern kernel
    kind: str  # fused | extern | attention
    bytes: int  # read + written
    flops: int

    def seconds(self, gpu: Gpu, dtype: str) -> float:
        return max(self.flops / gpu.peak_flops(dtype), self.bytes / (gpu.dram_gbs * 1e9))


class _Stop(Exception):
    """Raised by the post-fusion pass: the kernels are read, no code is generated."""


def _origins(node) -> str:
    names = sorted({str(o.target).removeprefix("aten.").split(".")[0] for o in node.get_nodes()[0].node.origins
                    if o.op == "call_function"} if node.node is not None else set())
    for snode in node.get_nodes()[1:]:
        if snode.node is not None:
            names = sorted(set(names) | {str(o.target).removeprefix("aten.").split(".")[0]
                                         for o in snode.node.origins if o.op == "call_function"})
    return "+".join(names[:6]) + ("+..." if len(names) > 6 else "") or "?"


def _kernels(nodes, phase: str, window: int) -> list[Kernel]:
    from torch._inductor import ir
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    out = []
    for node in nodes:
        if isinstance(node, NopKernelSchedulerNode) or isinstance(node.node, ir.MultiOutput):
            continue
        kernel = getattr(node.node, "op_overload", None)
        if kernel is not None and kernel._schema.name.startswith("laneplan::attention"):
            out.append(_attention(node, kernel, phase, window))
            continue
        kind = "extern" if isinstance(node, ExternKernelSchedulerNode) else "fused"
        out.append(Kernel(phase, _origins(node), kind, int(node.get_read_write_buffers_sizes()),
                          int(node.estimate_flops() or 0)))
    return out


def _attention(node, kernel, phase: str, window: int) -> Kernel:
    """The flex kernel: reads q, k, v (backward: also out, lse, grad), writes out and lse (backward: dq, dk, dv)."""
    from torch.utils.flop_counter import flop_registry

    inputs = [t for t in node.node.inputs if hasattr(t, "get_size")]
    sizes = [[int(s) for s in t.get_size()] for t in inputs]
    itemsize = lambda t: t.get_dtype().itemsize
    nbytes = lambda t, s: itemsize(t) * int(torch.Size(s).numel())
    read = sum(nbytes(t, s) for t, s in zip(inputs, sizes))
    if phase == "forward":
        q = sizes[0]
        written = nbytes(inputs[0], q) + 4 * q[0] * q[1] * q[2]  # out like q, lse fp32 [B, heads, S]
        flops = flop_registry[torch.ops.laneplan.attention](*sizes, window)
    else:
        written = sum(nbytes(t, s) for t, s in zip(inputs[1:4], sizes[1:4]))  # dq, dk, dv
        flops = flop_registry[torch.ops.laneplan.attention_backward](*sizes, window)
    return Kernel(phase, "attention (flex)", "attention", read + written, int(flops))


def _compile_layer(block: torch.nn.Module, args: tuple, window: int) -> list[Kernel]:
    """Inductor's post-fusion kernels of ``block(*args)`` forward and backward (nothing runs)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.exc import InductorError
    from torch._inductor.output_code import OutputCode

    phases, kernels = iter(("forward", "backward")), []

    def collect(nodes):
        kernels.extend(_kernels(nodes, next(phases), window))
        raise _Stop

    class Uncompiled(OutputCode):
        """Stands for the graph whose kernels were read: calling it ends the trace (nothing runs)."""

        def __call__(self, *inputs):
            raise _Stop

        def post_compile(self, *args, **kwargs):
            pass

        def prepare_for_serialization(self):
            pass

        def set_triton_bundle(self, bundle):
            pass

    def inner(gm, example_inputs, **kwargs):
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except InductorError as e:
            if not isinstance(e.inner_exception, _Stop):
                raise
        return Uncompiled()

    backend = functools.partial(compile_fx, inner_compile=inner)
    with (inductor_config.patch(_post_fusion_custom_pass=collect, fx_graph_cache=False),
          functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False)):
        torch._dynamo.reset()
        try:
            torch.compile(block, backend=backend, fullgraph=True)(*args)
        except _Stop:  # both graphs lowered (the backward at once); the forward was called
            pass
        finally:
            torch._dynamo.reset()
    return kernels


def _layer_args(config, layer: int, shape: Shape, dense: bool, dtype: torch.dtype):
    """(block, its forward's arguments) for one layer of the model or of its dense twin."""
    from torchtitan.models.common.attention import FlexAttention

    from models.laneformer.dense_twin import llama3_twin
    from models.laneformer.exchange import from_lanes

    from .step import AttentionStandIn, _define_stand_ins

    _define_stand_ins()
    model_config = llama3_twin(config) if dense else config
    layer_config = model_config.layers[layer] if dense else model_config.layer_config(layer)
    block = _build(layer_config, dtype, "cpu")
    for module in block.modules():
        if isinstance(module, FlexAttention):
            module.__class__ = AttentionStandIn
            module.window = config.window_of(layer) or 0
    B, S = shape.micro_batch, shape.seq_len
    width = (B, S, config.dim) if dense else (B, S, config.n_lanes, config.dim)
    if dense:
        return block, (torch.empty(width, dtype=dtype, requires_grad=True), None, None)

    def lane_wide():  # as the layer gets them in training: stored lane-major (models.laneformer.exchange.to_lanes)
        B, S, L, D = width
        return from_lanes(torch.empty(L, B, S, D, dtype=dtype)).requires_grad_()

    reduce, sends = config.exchange_of(layer)
    receives = layer >= config.delay and config.delay > 0 and config.exchange_of(layer - config.delay)[1]
    x, arrivals = lane_wide(), [lane_wide() if receives else None for _ in range(2)]
    return block, (x, *arrivals, None, None)


@dataclass
class CompiledEstimate:
    """The compiled rooflines of the model and its dense twin, and the layer kernels they come from."""

    layer: int  # the layer compiled
    lanes: Speed
    dense: Speed | None
    lane_kernels: list[Kernel]
    dense_kernels: list[Kernel]
    gpu: Gpu
    dtype: str
    lane_tensor_bytes: int  # one [micro batch, seq, lanes, dim] tensor in the param dtype

    def passes(self, kernels: list[Kernel], kind: str | None = None) -> float:
        """Bytes the kernels move, in passes over one lane-wide tensor (read or written once)."""
        return sum(k.bytes for k in kernels if kind is None or k.kind == kind) / self.lane_tensor_bytes

    def lines(self) -> list[str]:
        lines = [self.lanes.line("compiled roofline", COMPILED_NOTE)]
        if self.dense is not None:
            lines += [self.dense.line("dense twin compiled roofline", "the same estimate"),
                      f"lanes/dense compiled roofline step ratio: {self.lanes.step_s / self.dense.step_s:.2f}"]
        return lines

    def to_json(self) -> dict:
        speed = lambda s: None if s is None else {"tokens_per_s": s.tokens_per_s, "mfu": s.mfu,
                                                  "step_s": s.step_s}
        return {"roofline": speed(self.lanes), "dense_roofline": speed(self.dense),
                "lanes_dense_ratio": None if self.dense is None else self.lanes.step_s / self.dense.step_s,
                "layer": self.layer, "kernels": {"lanes": len(self.lane_kernels), "dense": len(self.dense_kernels)}}

    def kernel_table(self, top: int = 25) -> list[str]:
        """Layer ``layer``'s kernels, lanes vs dense: totals by kind and phase, then the largest of each."""
        sides = {"lanes": self.lane_kernels, "dense": self.dense_kernels}
        ms = lambda k: k.seconds(self.gpu, self.dtype) * 1e3
        lines = [f"compiled kernels of layer {self.layer}, one micro batch ({COMPILED_NOTE}):"]
        rows = []
        for kind in ("fused", "extern", "attention"):
            for phase in ("forward", "backward"):
                got = {s: [k for k in ks if k.kind == kind and k.phase == phase] for s, ks in sides.items()}
                if got["lanes"] or got["dense"]:
                    rows.append([f"{kind} {phase}", *(f"{len(got[s])}" for s in sides),
                                 *(f"{sum(k.bytes for k in got[s]) / 1e9:.3f}" for s in sides),
                                 *(f"{sum(map(ms, got[s])):.3f}" for s in sides)])
        rows.append(["layer total", *(f"{len(ks)}" for ks in sides.values()),
                     *(f"{sum(k.bytes for k in ks) / 1e9:.3f}" for ks in sides.values()),
                     *(f"{sum(map(ms, ks)):.3f}" for ks in sides.values())])
        lines += text_table(["kernels", "lanes n", "dense n", "lanes GB", "dense GB", "lanes ms", "dense ms"], rows,
                            numbers=True)
        lines.append("in passes over one lane-wide tensor (bytes / " f"{self.lane_tensor_bytes / 1e9:.3f} GB): "
                     + "; ".join(f"{side} {self.passes(ks):.1f} (fused kernels {self.passes(ks, 'fused'):.1f}, "
                                 f"matmuls and other extern kernels {self.passes(ks, 'extern'):.1f})"
                                 for side, ks in sides.items()))
        for side, ks in sides.items():
            total = sum(map(ms, ks)) or 1e-30
            ranked = sorted(ks, key=ms, reverse=True)
            rows = [[k.phase, k.kind, k.name, f"{k.bytes / 1e9:.3f}", f"{k.flops / 1e9:.1f}",
                     "compute" if k.flops / self.gpu.peak_flops(self.dtype) >= k.bytes / (self.gpu.dram_gbs * 1e9)
                     else "memory", f"{ms(k):.3f}", f"{ms(k) / total:.1%}"] for k in ranked[:top]]
            rest = sum(map(ms, ranked[top:]))
            rows.append([f"({len(ranked) - top} more)" if len(ranked) > top else "", "", "", "", "", "",
                         f"{rest:.3f}", f"{rest / total:.1%}"])
            lines += ["", f"{side}: layer {self.layer}, largest kernels"]
            lines += text_table(["phase", "kind", "fuses", "GB", "GFLOP", "bound", "ms", "share"], rows, numbers=True)
        return lines


def _layer_seconds(kernels: list[Kernel], gpu: Gpu, dtype: str, shape: Shape, window: int, windows) -> float:
    """All layers' time: each layer costs the compiled layer's kernels, its attention at its own window."""
    rest = sum(k.seconds(gpu, dtype) for k in kernels if k.kind != "attention")
    own = _visible_pairs(shape.seq_len, window)
    scaled = [dataclasses.replace(k, flops=k.flops * _visible_pairs(shape.seq_len, w or 0) // own)
              for w in windows for k in kernels if k.kind == "attention"]
    return len(windows) * rest + sum(k.seconds(gpu, dtype) for k in scaled)


def _outside_layers(eager: Speed) -> float:
    """The eager roofline's forward and backward time outside the layers (embedding, final norm, head, loss)."""
    return sum(op.seconds for op in eager.ops if op.phase != "optimizer" and not op.where.startswith("layers."))


_CACHE: dict[tuple, list[Kernel]] = {}  # one compile per (config, layer, shape, side) in a process


def _layer_kernels(config, layer: int, shape: Shape, dense: bool) -> list[Kernel]:
    key = (repr(config), layer, shape.micro_batch, shape.seq_len, shape.param_dtype, dense)
    if key not in _CACHE:
        block, args = _layer_args(config, layer, shape, dense, getattr(torch, shape.param_dtype))
        _CACHE[key] = _compile_layer(block, args, config.window_of(layer) or 0)
    return _CACHE[key]


def compiled_estimate(config, shape: Shape, gpu: Gpu, lanes: Speed, dense: Speed | None) -> CompiledEstimate:
    """The compiled rooflines at ``shape``, from one compiled layer of the model and of ``dense``'s twin.

    Activation checkpointing: "full" adds the layer's forward kernels once more (the recomputation);
    "selective" is costed as "none" (its recomputed ops are a few cheap ones).
    """
    layer = config.n_layers // 2
    windows = [config.window_of(i) for i in range(config.n_layers)]
    window = config.window_of(layer) or 0

    def speed(eager: Speed, kernels: list[Kernel]) -> Speed:
        if shape.ac == "full":
            kernels = kernels + [k for k in kernels if k.phase == "forward"]
        micro = _layer_seconds(kernels, gpu, shape.param_dtype, shape, window, windows) + _outside_layers(eager)
        return dataclasses.replace(eager, micro_batch_s=micro, ops=[])

    lane_kernels = _layer_kernels(config, layer, shape, False)
    dense_kernels = _layer_kernels(config, layer, shape, True) if dense is not None else []
    lane_tensor = shape.micro_batch * shape.seq_len * config.n_lanes * config.dim
    return CompiledEstimate(layer, speed(lanes, lane_kernels), dense and speed(dense, dense_kernels),
                            lane_kernels, dense_kernels, gpu, shape.param_dtype,
                            lane_tensor * getattr(torch, shape.param_dtype).itemsize)
