"""Muon for Laneformer's lane weights: each lane's matrix orthogonalised on its own.

A lane weight is a batch-first stack ``[lanes, out, in]``, one matrix per lane (``models.laneformer.model.
LaneLinear``; the attention projections are lane weights too). ``torch.optim.Muon`` (torch 2.14) takes 2-D
parameters only, and flattening a lane weight to ``[lanes * out, in]`` would orthogonalise the lanes together
and change the update's scale. ``LaneMuon`` runs torch's Muon step on every matrix of the stack at once: the
momentum and Nesterov lerps, torchtitan's batched Newton–Schulz (``torchtitan.distributed.flex_shard.
dist_muon``, one ``baddbmm`` chain over the leading dim, bf16 as torch's), decoupled weight decay and
torch's learning-rate adjustment (``adjust_lr_fn``, by the matrix's own ``[out, in]``). On one lane's slice
it is ``torch.optim.Muon`` (tests/train/test_muon.py holds it to that, lane by lane).

Under FSDP2 the parameters are DTensors. ``models.laneformer.parallelize`` shards a lane weight on dim 0
(its lanes) while the shard degree is at most the lane count, so each rank holds whole lanes: Newton–Schulz
runs on the local lanes with no communication. Beyond that it shards dim 1 (rows of every lane), and a 2-D
matrix sharded on dim 0 is split too: for those the step all-gathers the bf16 update (the precision
Newton–Schulz starts from, so nothing is lost), orthogonalises the whole stack on every rank, and keeps its
own slice. ``orthogonalised_locally`` says which case a parameter is; the planner counts both.

Why not torchtitan's ``DistMuon`` (the same batched kernel, with owner-balanced redistribution): it
refuses anything but one CUDA device per process (so no CPU/gloo test could run it) and needs a
``ComputeLayout`` per parameter name and bucket plans; the README's Muon section says more.

A skipped step (the spike guard's ``found_inf``, ``train.titan.GuardedOptimizers``) leaves the weights and
the momentum untouched, decided on the device as fused AdamW does: no host sync.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr
from torchtitan.distributed.flex_shard.dist_muon import _zeropower_via_newtonschulz

ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")  # torch.optim.Muon's names (None: "original")


def newton_schulz(update: torch.Tensor, ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C),
                  ns_steps: int = DEFAULT_NS_STEPS, eps: float = EPS) -> torch.Tensor:
    """The approximate polar factor of each matrix of ``update`` (2-D, or batch-first 3-D), in bf16:
    torchtitan's batched Newton–Schulz, torch.optim.Muon's iteration on each matrix."""
    return _zeropower_via_newtonschulz(update, ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, eps=eps)


def newton_schulz_flops(shape: Sequence[int], ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """FLOPs of ``newton_schulz`` on a ``[..., R, C]`` stack: per matrix (n = min(R, C), m = max) and step,
    ``X X^T`` (2 n^2 m), ``b G + c G G`` (2 n^3) and ``a X + (b G + c G G) X`` (2 n^2 m)."""
    *batch, r, c = shape
    n, m = min(r, c), max(r, c)
    return math.prod(batch) * ns_steps * (4 * n * n * m + 2 * n ** 3)


def orthogonalised_locally(param: torch.Tensor) -> bool:
    """Whether this rank's shard of ``param`` holds whole matrices (every sharded mesh dim splits a
    leading batch dim only: a lane weight on dim 0, its lanes), so Newton–Schulz needs nothing from
    the other ranks. A plain tensor is whole."""
    if not isinstance(param, DTensor):
        return True
    return all(size == 1 or isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % param.ndim < param.ndim - 2)
               for size, p in zip(param.device_mesh.shape, param.placements))


def muon_names(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The parameter names ``patterns`` (regexes, ``re.search``) pick for Muon."""
    found = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
    return [n for n in names if found is not None and found.search(n)]


class LaneMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for 2-D matrices and batch-first stacks of them (``[lanes, R, C]``: each
    ``[R, C]`` its own matrix), plain or FSDP2 (DTensor) parameters. Its arguments are torch's."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None, **ignored):
        # ``ignored``: the fused/foreach switches torchtitan's container gives every group (Muon has neither)
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr, momentum and weight_decay must be >= 0 (got {lr}, {momentum}, {weight_decay})")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn: one of {ADJUST_LR_FNS} or None, got {adjust_lr_fn!r}")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"ns_steps: must be in [0, 100) (got {ns_steps})")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.ndim not in (2, 3):
                    names = group.get("param_names")
                    raise ValueError(f"Muon takes 2-D matrices and batch-first 3-D stacks of them; "
                                     f"{names[i] if names else f'parameter {i}'} has shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = getattr(self, "found_inf", None)  # a 0/1 tensor (GuardedOptimizers): 1 leaves everything as it was
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, skip)
        return loss

    def _update(self, p: torch.Tensor, group: dict, skip: torch.Tensor | None) -> None:
        assert p.grad is not None
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t
        param, grad, buf = local(p), local(p.grad), local(state["momentum_buffer"])
        # torch.optim._muon._single_tensor_muon, op for op (so one lane's slice is bitwise torch's)
        new_buf = buf.lerp(grad, 1 - group["momentum"])
        update = grad.lerp(new_buf, group["momentum"]) if group["nesterov"] else new_buf
        direction = self._direction(p, update, group)
        lr = group["lr"]
        adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:])  # the matrix's own [R, C]
        new_param = param.mul(1 - lr * group["weight_decay"])
        new_param.add_(direction, alpha=-adjusted_lr)
        if skip is not None:  # on the device, as fused AdamW's found_inf: a skipped step changes nothing
            new_buf, new_param = torch.where(skip.bool(), buf, new_buf), torch.where(skip.bool(), param, new_param)
        buf.copy_(new_buf)
        param.copy_(new_param)

    def _direction(self, p: torch.Tensor, update: torch.Tensor, group: dict) -> torch.Tensor:
        """Newton–Schulz of this rank's ``update`` (a local tensor): on the local matrices when they are
        whole, else on the all-gathered stack, of which this rank keeps its slice."""
        ns = lambda x: newton_schulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if orthogonalised_locally(p):
            return ns(update)
        assert isinstance(p, DTensor)
        mesh, placements = p.device_mesh, p.placements
        # bf16 before the gather: Newton–Schulz's first step casts to bf16 anyway (the same bits, half the bytes)
        whole = DTensor.from_local(update.bfloat16(), mesh, placements, shape=p.shape, stride=p.stride()).full_tensor()
        mine = DTensor.from_local(ns(whole), mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)
        return mine.to_local()
