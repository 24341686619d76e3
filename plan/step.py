"""The training step both plans trace: its shape, and stand-ins for the CUDA kernels.

Two CUDA kernels cannot be traced on CPU as they run on a GPU: flex attention
(no CPU backward) and RMSNorm (one fused kernel on CUDA, ~10 ops on CPU).
Both are replaced by stand-in operators with the kernel's inputs, outputs and
saved tensors (attention: q, k, v, output, logsumexp; RMSNorm: input and
1/rms), defined for fake tensors only.

Context parallelism (``Shape.cp``) is traced as torchtitan 0.3.0 runs it with
flex attention (``torchtitan.distributed.context_parallel.apply_cp_to_forward``):
each GPU holds ``seq_len / cp`` tokens of a sequence, and every attention layer
all-gathers K and V over the CP group (torch's ``cplib::flex_cp_allgather``;
its backward reduce-scatters their gradients), so the gathered full-length K
and V are what flex attention saves. A stand-in of that all-gather gives the
trace the same shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common import RMSNorm
from torchtitan.models.common.attention import FlexAttention

from train import recipe as R

AC_MODES = ("none", "selective", "full")
STAND_IN_NOTE = ("attention: a stand-in that saves what flex attention saves (q, k, v, output, logsumexp); "
                 "RMSNorm: one fused kernel (saves input and 1/rms)")

def _visible_pairs(seq_len: int, window: int) -> int:
    """(query, key) pairs a causal mask with this window (0: none) lets through."""
    w = min(window or seq_len, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def _local_pairs(q_shape, k_shape, window: int) -> int:
    """Visible (query, key) pairs x batch x heads x head_dim of one GPU's queries. Under CP the
    GPU holds 1/cp of the queries against all keys; load balancing (torchtitan's head-tail
    default) gives each GPU 1/cp of the pairs."""
    B, S_q, H, D = q_shape
    return B * H * D * _visible_pairs(k_shape[1], window) * S_q // k_shape[1]


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
    torch.library.define(lib + "cp_all_gather", "(Tensor k, Tensor v, int cp) -> (Tensor, Tensor)")
    torch.library.define(lib + "cp_reduce_scatter", "(Tensor dk, Tensor dv, int cp) -> (Tensor, Tensor)")
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
        return 2 * 2 * _local_pairs(q_shape, k_shape, window)  # Q K^T and P V

    @register_flop_formula(torch.ops.laneplan.attention_backward)
    def _(grad_shape, q_shape, k_shape, *args, out_shape=None, **kwargs):
        return 5 * 2 * _local_pairs(q_shape, k_shape, args[-1])  # recompute Q K^T, dV, dP, dQ, dK

    @torch.library.register_fake(lib + "cp_all_gather")
    def _(k, v, cp):  # [B, S / cp, kv_heads, head_dim] -> [B, S, kv_heads, head_dim]
        return k.new_empty((k.shape[0], k.shape[1] * cp, *k.shape[2:])), v.new_empty(
            (v.shape[0], v.shape[1] * cp, *v.shape[2:]))

    @torch.library.register_fake(lib + "cp_reduce_scatter")
    def _(dk, dv, cp):
        return dk.new_empty((dk.shape[0], dk.shape[1] // cp, *dk.shape[2:])), dv.new_empty(
            (dv.shape[0], dv.shape[1] // cp, *dv.shape[2:]))

    def gather_setup(ctx, inputs, output):
        ctx.cp = inputs[2]

    def gather_backward(ctx, dk, dv):
        return (*torch.ops.laneplan.cp_reduce_scatter(dk, dv, ctx.cp), None)

    torch.library.register_autograd(lib + "cp_all_gather", gather_backward, setup_context=gather_setup)

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

    def with_rstd(self, x):
        """``models.laneformer.model.LaneRMSNorm.with_rstd``: the same kernel's two outputs."""
        return torch.ops.laneplan.rms_norm(x, self.weight, self.eps or 0.0)


class AttentionStandIn(FlexAttention):
    """Flex attention's inputs, outputs and saved tensors, on fake tensors (the stand-in operator)."""

    window = 0  # set per layer: a BlockMask's window cannot be read from fake tensors
    cp = 1  # the context-parallel degree: K and V all-gathered over it first

    def forward(self, q, k, v, **kwargs):
        if self.cp > 1:
            k, v = torch.ops.laneplan.cp_all_gather(k, v, self.cp)
        return torch.ops.laneplan.attention(q, k, v, self.window)[0]


class SelectiveACWithStandIn(SelectiveAC):
    """torchtitan's selective AC, saving the stand-in attention as it saves flex attention."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return super().get_save_ops() | {torch.ops.laneplan.attention.default}


def use_cuda_kernels(model: nn.Module, windows: list[int | None], cp: int = 1) -> nn.Module:
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
                module.cp = cp
    if hasattr(model, "attention_masks"):  # Laneformer: one mask per window, unread by the stand-in
        model.attention_masks = lambda tokens, positions: dict.fromkeys(windows)
    return model


def _ac_config(mode: str):
    return {"none": None, "selective": SelectiveACWithStandIn.Config(), "full": FullAC.Config()}[mode]


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
    cp: int = 1  # context parallelism: each GPU holds seq_len / cp tokens of a sequence
    optimizer: str = "adamw"  # [optimizer] name; with "muon", muon_params' matrices on train.muon.LaneMuon
    muon_params: tuple[str, ...] = ()
    ns_steps: int = 5

    @property
    def tokens(self) -> int:
        """Tokens of one sequence on one GPU."""
        return self.seq_len // self.cp

    @classmethod
    def of(cls, recipe: R.Recipe, gpus: int, **changes) -> Shape:
        t, p, o = recipe.training, recipe.parallel, recipe.optimizer
        return dataclasses.replace(cls(t.micro_batch, t.seq_len, p.activation_checkpoint, gpus, p.param_dtype,
                                       p.reduce_dtype, o.lr, o.grad_clip, p.context_parallel, o.name,
                                       tuple(o.muon_params), o.ns_steps), **changes)

    def muon(self, names) -> set[str]:
        """The parameter names (of ``names``) this step's Muon trains: none under AdamW."""
        from train.muon import muon_names

        return set(muon_names(names, self.muon_params)) if self.optimizer == "muon" else set()


class Optimizers(torch.optim.Optimizer):
    """The step's optimizers as one (``FSDPMemTracker`` tracks one optimizer): fused AdamW, and with Muon a
    ``train.muon.LaneMuon``, as the run builds them (train.build.config.param_groups: weight decay and
    hyperparameters do not change what is held or computed). ``state`` is theirs together, after each step.
    Each step passes a 0/1 ``found_inf`` as the run's spike guard does (LaneMuon then holds its result
    beside the old values until it picks one)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self._merge()

    def _merge(self) -> None:
        self.state = {p: s for o in self.optimizers for p, s in o.state.items()}  # type: ignore[assignment]

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()
        self._merge()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)


def step_optimizers(named: list[tuple[str, torch.Tensor]], shape: Shape, muon=None) -> Optimizers:
    """The run's optimizers over ``named`` (name, parameter): ``muon`` (a LaneMuon class, the planner's own
    in the roofline) for the Muon parameters, fused AdamW for the rest."""
    from train.muon import LaneMuon

    picked = shape.muon(n for n, _ in named)
    adamw = [p for n, p in named if n not in picked]
    optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(adamw, lr=shape.lr, fused=True)] if adamw else []
    if picked:
        optimizer = (muon or LaneMuon)([p for n, p in named if n in picked], lr=shape.lr, ns_steps=shape.ns_steps)
        optimizer.found_inf = torch.zeros((), device=next(p for _, p in named).device)
        optimizers.append(optimizer)
    return Optimizers(optimizers)


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
    size = (shape.micro_batch, shape.tokens)
    return torch.randint(0, vocab_size, size, device=device), torch.randint(0, vocab_size, size, device=device)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(logits, labels) / labels.numel()


def _windows(config) -> list[int | None]:
    return [config.window_of(i) for i in range(config.n_layers)]
