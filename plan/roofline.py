"""Eager roofline: each aten op of one micro batch charged its compute or memory time.

A ``TorchDispatchMode`` charges each aten op of one micro batch of the
unsharded model (forward, loss, backward, AC recomputation) the larger of
torch's own compute and memory-transfer estimates
(``torch.utils._runtime_estimation``, rescaled to the GPU's datasheet peak
FLOP/s and bandwidth, ``gpus.GPUS``), plus the recipe's optimizer step on one
GPU's FSDP shard (fused AdamW; with Muon, LaneMuon's Newton–Schulz on the lanes
the GPU holds whole, or on every lane after an all-gather: ``train.muon``). An
estimate of eager kernels: no communication, no overlap, no compile fusion
(``compiled.py`` estimates the fused kernels).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from rundir.table import text_table

from .gpus import Gpu
from .step import Shape, _ac_config, _batch, _build, _loss, _windows, step_optimizers, use_cuda_kernels

ROOFLINE_NOTE = "estimate: eager ops, compute and memory traffic only, no communication, no compile fusion"


def compute_scale(gpu: Gpu) -> float:
    """Factor on torch's compute time for the datasheet peak. ``get_compute_time`` halves
    FLOPs into MACs and then divides by 75% of its table's peak *FLOP* rate, i.e. it runs at
    1.5x the datasheet; a roofline takes the datasheet peak itself."""
    from torch.utils._runtime_estimation import flops_to_ns

    flops = 1e12
    return flops / gpu.peak_flops("bfloat16") * 1e9 / flops_to_ns(flops, torch.bfloat16, gpu.datasheet)


def bandwidth_scale(gpu: Gpu) -> float:
    """Factor on torch's transfer time (its table's bandwidth) for the GPU's own."""
    from torch._inductor.analysis.device_info import datasheet_dram_bw_gbs

    return datasheet_dram_bw_gbs(gpu.datasheet) / gpu.dram_gbs


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
        self.compute_scale, self.bandwidth_scale = compute_scale(gpu), bandwidth_scale(gpu)

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
        transfer = get_transfer_time(ins, outs, gpu_type=self.gpu.datasheet) * self.bandwidth_scale
        phase, where = self.where.now() if self.where else (self.phase, "")
        self.ops.append(Op(where, name, phase, sum(get_num_bytes(t) for t in ins + outs),
                           compute * 1e-9, transfer * 1e-9))
        return out


@dataclass
class Speed:
    """Roofline time of one optimizer step on one GPU."""

    micro_batch_s: float  # forward + loss + backward of one micro batch
    optimizer_s: float  # clipping + the optimizer step on one GPU's shard
    accumulation: int
    tokens_per_step: int  # per GPU
    flops_per_token: int
    peak_flops: float
    ops: list[Op] = field(repr=False)
    muon: MuonWork | None = None  # with [optimizer] name = "muon": its Newton–Schulz on this GPU

    @property
    def step_s(self) -> float:
        return self.accumulation * self.micro_batch_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.flops_per_token * self.tokens_per_s / self.peak_flops

    def line(self, label: str = "roofline", note: str = ROOFLINE_NOTE) -> str:
        return f"{label}: {self.tokens_per_s:,.0f} tokens/s/GPU, MFU {self.mfu:.1%} ({note})"


@dataclass
class MuonWork:
    """Muon's share of one GPU's optimizer step (train.muon.LaneMuon)."""

    matrices: int  # Muon's parameters (lane weights: stacks of matrices)
    numel: int  # their elements, whole model
    local: int  # of them, the parameters whose lanes this GPU holds whole (no communication)
    flops: int  # Newton–Schulz on this GPU per step
    seconds: float  # its roofline time
    gathered_bytes: int  # bf16 updates all-gathered per GPU per step (the parameters FSDP splits inside a matrix)

    def line(self, optimizer_s: float) -> str:
        where = (f"all {self.matrices} on whole lanes held by this GPU: no communication" if self.local == self.matrices
                 else f"{self.matrices - self.local} of {self.matrices} sharded inside their matrices (more GPUs than "
                      f"lanes): their bf16 updates all-gathered ({self.gathered_bytes / 1e9:.3g} GB per GPU per step, "
                      "not in the communication plan) and every lane orthogonalised on every GPU")
        return (f"Muon per GPU per step: Newton–Schulz {self.flops / 1e9:,.1f} GFLOP, {self.seconds * 1e3:.2f} ms roofline "
                f"of the optimizer's {optimizer_s * 1e3:.2f} ms ({self.numel:,} parameters in {self.matrices} Muon "
                f"tensors; {where})")


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
    if dense_twin:  # the twin compares the models: AdamW for it (Muon would orthogonalise its matrices whole)
        shape = dataclasses.replace(shape, optimizer="adamw")
    with FakeTensorMode():
        model = _build(llama3_twin(config) if dense_twin else config, dtype, "cpu")
        use_cuda_kernels(model, _windows(config), shape.cp)
        if (ac := _ac_config(shape.ac)) is not None:
            ac.build().apply(model)
        tokens, labels = _batch(config.vocab_size, shape, "cpu")
        with _Where(model) as where, _Costs(gpu, where) as costs:
            _loss(model(tokens), labels).backward()
        # The optimizer runs once per step on this GPU's FSDP shard (fp32), split on the dim
        # parallelize.lane_placement gives each parameter (lane weights: dim 1 beyond n_lanes GPUs).
        # AdamW's shards are flat; Muon's keep their matrix shape (train.muon.LaneMuon orthogonalises them).
        placement = lane_placement(config.n_lanes, shape.gpus)
        named = list(model.named_parameters())
        muon = shape.muon(n for n, _ in named)
        shards = [_shard(p, _shard_dim(placement, p), shape.gpus, flat=n not in muon) for n, p in named]
        for s in shards:
            s.grad = torch.empty_like(s)
        planned = _planned_muon(gpu, {id(s): p.shape for (n, p), s in zip(named, shards) if n in muon
                                      and shape.gpus > 1 and _shard_dim(placement, p) >= p.ndim - 2})
        optimizer = step_optimizers([(n, s) for (n, _), s in zip(named, shards)], shape, planned)
        optimizer.step()  # creates the state
        with _Costs(gpu, phase="optimizer") as opt_costs:
            torch.nn.utils.clip_grad_norm_(shards, shape.grad_clip, foreach=True)
            planned.ns_costs.clear()
            optimizer.step()
        muon_work = None
        if muon:
            gathered = {n for (n, p), s in zip(named, shards) if id(s) in planned.gathered}
            muon_work = MuonWork(
                matrices=len(muon), numel=sum(p.numel() for n, p in named if n in muon),
                local=len(muon) - len(gathered), flops=planned.flops, seconds=sum(op.seconds for op in planned.ns_costs),
                gathered_bytes=sum(2 * p.numel() * (shape.gpus - 1) // shape.gpus for n, p in named if n in gathered))
    from models.laneformer.flops import nparams_and_flops_per_token

    # the twin: equal parameters; under CP each token still attends over the whole sequence
    _, flops = nparams_and_flops_per_token(config, model, shape.seq_len)
    return Speed(
        micro_batch_s=sum(op.seconds for op in costs.ops),
        optimizer_s=sum(op.seconds for op in opt_costs.ops),
        accumulation=accumulation,
        tokens_per_step=accumulation * shape.micro_batch * shape.tokens,
        flops_per_token=flops,
        peak_flops=gpu.peak_flops(shape.param_dtype),
        ops=costs.ops + opt_costs.ops,
        muon=muon_work,
    )


def _shard(param: torch.Tensor, dim: int, gpus: int, flat: bool) -> torch.Tensor:
    """One GPU's fp32 FSDP shard of ``param`` split on ``dim`` (the padded, largest one): flat, or in its shape."""
    if flat:
        return torch.empty(_shard_numel(param, dim, gpus), requires_grad=True)
    size = list(param.shape)
    size[dim] = -(-size[dim] // gpus)
    return torch.empty(size, requires_grad=True)


def _planned_muon(gpu: Gpu, gathered: dict[int, torch.Size]):
    """A ``train.muon.LaneMuon`` for the roofline's plain shards: the step as the run takes it, with each
    parameter in ``gathered`` (id -> its whole shape: FSDP splits it inside its matrices) orthogonalised
    whole, as the run does after its all-gather; Newton–Schulz's operators and FLOPs counted apart."""
    from train.muon import LaneMuon, newton_schulz, newton_schulz_flops

    class PlannedMuon(LaneMuon):
        def _direction(self, p, update, group):
            whole = update.new_empty(gathered[id(p)], dtype=torch.bfloat16) if id(p) in gathered else update
            PlannedMuon.flops += newton_schulz_flops(whole.shape, group["ns_steps"])
            with _Costs(gpu, phase="optimizer") as costs:
                direction = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
            PlannedMuon.ns_costs += costs.ops
            return direction[tuple(slice(0, n) for n in update.shape)]

        def step(self, closure=None):
            PlannedMuon.flops = 0
            return super().step(closure)

    PlannedMuon.gathered, PlannedMuon.flops, PlannedMuon.ns_costs = set(gathered), 0, []
    return PlannedMuon


# ---- the per-op table --------------------------------------------------------------------


_CATEGORIES = {"mm": "matmul", "bmm": "matmul", "addmm": "matmul", "attention": "attention",
               "attention_backward": "attention", "rms_norm": "rms_norm", "rms_norm_backward": "rms_norm",
               "clone": "copies (layout, dtype)", "copy_": "copies (layout, dtype)",
               "_to_copy": "copies (layout, dtype)"}


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
    lines += text_table(["kind", "lanes ms", "dense ms", "lanes/dense"], rows, numbers=True)
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
        lines += text_table(["module", "op", "phase", "calls", "GB", "bound", "ms", "share"], rows, numbers=True)
    return lines

