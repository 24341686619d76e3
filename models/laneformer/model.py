"""Laneformer: a Llama-style decoder whose hidden state has a lane axis.

Every lane carries its own full residual stream (``x: [B, S, L, D]``, stored
lane by lane: the sub-blocks work on ``to_lanes(x)``, ``[L, B, S, D]``, the
layout of the lane matmuls, so a compiled block fuses its elementwise work
into few kernels). The projections are lane-batched: lane ``l`` only uses its slice of each weight
(row linears ``wq, wk, wv, w1, w3``: ``[L, out/L, D]``; column linears ``wo,
w2``: ``[L, D, in/L]``), so inside a block nothing crosses lanes and lane ``l``
owns query heads ``l*H/L ...`` and the KV heads of its own GQA groups.
Attention folds lanes into heads and runs as ordinary causal GQA.

Lanes meet only in how the partial outputs ``o_m`` of a sub-block (attention
or MLP, separately) reach the residual streams: Delayed Tensor Parallelism.
For layer ``i`` and lane ``l``::

    layers i < delay ("early"):
        present: x_l += sum_m o_m(i)          (a normal all-reduce)
        scaled:  x_l += sqrt(L) * o_l(i)      (no exchange at all)
    other layers:
        x_l += o_l(i) + sum_{m != l} o_m(i - delay)   (if layer i-delay sent)
      or, with delayed_exchange=False:
        x_l += sqrt(L) * o_l(i)                       (Kog's use_comm=false)
    final:
        mean_of_norms: h = mean_l RMSNorm(x_l)
        norm_of_sum:   h = RMSNorm(sum_l x_l)
    logits = lm_head(h)

Defaults, and why (all are ``Config`` fields so an exported model carries them):

- ``delay=2``, ``n_lanes=8``: the published Laneformer 2B.
- ``early_mode="present"``: the first ``delay`` layers have nothing to receive
  yet; an all-reduce there keeps the lanes a single model from the start.
- ``early_send_forward=False``: with a present all-reduce the early outputs of
  the other lanes are already counted; sending them again (Kog's older code)
  would count them twice. This is Kog's newer revision.
- ``late_mode="drop"``: the newer revision sends nothing forward from the last
  ``delay`` layers, whose outputs would arrive after the network ends; each
  lane keeps its own share and the final lane aggregation merges the lanes.
  ``"flush"`` adds the pending outputs before the final norm, ``"present"``
  all-reduces those layers at once. A layer sends only what some later layer
  (or the flush) receives, so with fewer layers than ``2 * delay`` an early
  layer whose output would land past the end sends nothing under ``"drop"``.
- ``final_agg="mean_of_norms"``: every lane is normalised on its own GPU at
  inference, so only the normalised ``[D]`` vectors need to be averaged.

With ``delay=0`` every layer is an all-reduce, all lanes stay identical and
the model equals a dense GQA/SwiGLU transformer whose weights are the lane
slices concatenated (the tests check this).

Per-layer attention windows: layers in ``window_layers`` attend within
``window_size`` tokens (2B: layers 0-9, 2048), the rest full causal. When
``positions`` restart at 0 (packed documents), attention stays inside each
document.

RoPE per layer type (``rope_of``): window layers rotate with ``rope_theta``;
full layers with ``rope_theta_global`` (None: ``rope_theta``, today's model) and
``rope_scaling`` ("llama": Llama 3.1's, "yarn": YaRN's, by ``rope_scaling_factor``
over ``rope_original_seq_len``). Why only the full layers: a window layer never
sees a distance past ``window_size``, so a longer context asks nothing new of
it; Gemma 3 (arXiv 2503.19786, section 2) likewise raises the base of its global
layers only and keeps its local ones at 10k. Every layer's rotation is torchtitan's
own ``ComplexRoPE`` (``torchtitan/models/common/rope.py``); YaRN's sharper attention,
which that RoPE leaves to the model, is the layer's softmax scale (``softmax_scale_of``).
"""

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import (
    FlexAttention,
    create_attention_mask,
    get_causal_mask_mod,
    get_document_mask_mod,
    get_sliding_window_mask_mod,
)
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.module import Module, ModuleDict

from .attention import DenseMaskFlexAttention, carrier_block_mask
from .exchange import Reduce, _add_partial, from_lanes, to_lanes

EarlyMode = Literal["present", "scaled"]
LateMode = Literal["drop", "flush", "present"]
FinalAgg = Literal["mean_of_norms", "norm_of_sum"]
RopeScaling = Literal["none", "llama", "yarn"]
# How a sub-block's partial outputs enter the residual streams at once.


def _trunc_normal(std: float):
    return lambda w: nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)


def _normal(std: float):
    return lambda w: nn.init.normal_(w, std=std)


class LaneLinear(Module):
    """A lane-batched linear: lane ``l`` maps ``x[l]`` with ``weight[l]``, lanes first (``to_lanes``).

    Row linears (``wq, wk, wv, w1, w3``) read the full width and produce the
    lane's share; column linears (``wo, w2``) map the share back to a full-width
    partial output. Both are this one op with different shapes.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        n_lanes: int
        in_features: int  # per lane
        out_features: int  # per lane

    def __init__(self, config: Config):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.n_lanes, config.out_features, config.in_features)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [L, ..., in] x [L, out, in] -> [L, ..., out], one batched matmul over lanes.
        rows = x.reshape(x.shape[0], -1, x.shape[-1])
        if torch.is_grad_enabled():
            y = _LaneMatmul.apply(rows, self.weight)
        else:  # evals and generation: nothing to save for a backward (see normed_lane_matmul)
            y = torch.bmm(rows, self.weight.transpose(1, 2))
        return y.reshape(*x.shape[:-1], -1)


class _LaneMatmul(torch.autograd.Function):
    """``y[l] = x[l] @ w[l]^T`` for ``x: [L, N, in]``, ``w: [L, out, in]``.

    Why not plain ``bmm(x, w^T)``: autograd's bmm formula yields the weight
    gradient as ``[L, in, out]``, whose transpose the gradient accumulation then
    copies into the weight's layout, a full pass over every lane weight per
    step (``train.py --plan --ops``). Here ``dw = g^T x`` comes out in ``[L, out, in]``.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.bmm(x, w.transpose(1, 2))

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = torch.bmm(g, w) if ctx.needs_input_grad[0] else None
        dw = torch.bmm(g.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        return dx, dw


class LaneRMSNorm(RMSNorm):
    """torchtitan's RMSNorm (same parameter, same values) that can also return 1/rms."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def with_rstd(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``self(x)``, 1/rms(x) in fp32): ``F.rms_norm``'s own kernel, which computes both."""
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], self.weight, eps)


def normed_lane_matmul(x: torch.Tensor, norm: LaneRMSNorm, *linears: LaneLinear) -> tuple[torch.Tensor, ...]:
    """``tuple(lin(norm(x)) for lin in linears)``: the row lane linears that read one norm, as one step.

    ``x: [L, ..., D]``, lanes first (``to_lanes``); the weights ``[L, out_i, D]`` are concatenated
    on ``out`` for the matmul only, so parameters, checkpoints and exports keep one tensor per
    linear. The outputs are separate tensors (not one to be split), so that a compiled backward
    can form the scaled gradient ``_NormedLaneMatmul`` needs in the kernels that make theirs.
    """
    rows = x.reshape(x.shape[0], -1, x.shape[-1])  # [L, N, D]
    weights: list[torch.Tensor] = [lin.weight for lin in linears]
    with torch.no_grad():  # the norm's gradients come from _NormedLaneMatmul's backward
        xn, rstd = norm.with_rstd(rows)
    if torch.is_grad_enabled():
        ys = _NormedLaneMatmul.apply(rows, xn, rstd, norm.weight, *weights)
    else:  # evals and generation: the same forward, without a backward to save for (which a compiled
        ys = _lane_matmul(xn, weights)  # model cannot trace under no_grad: ctx.save_for_backward)
    return tuple(y.reshape(*x.shape[:-1], -1) for y in ys)


def _lane_matmul(xn: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``xn [L, N, D]`` times each ``[L, out_i, D]`` weight, as one matmul on the concatenated weights."""
    y = torch.bmm(xn, torch.cat(weights, dim=1).transpose(1, 2))
    return tuple(y.split([w.shape[1] for w in weights], dim=-1))


class _NormedLaneMatmul(torch.autograd.Function):
    """``ys[i][l] = xn[l] @ ws[i][l]^T`` for ``xn = rmsnorm(x): [L, N, D]``, ``ws[i]: [L, out_i, D]``,
    differentiated with respect to ``x``, the norm weight and ``ws``.

    Why: the row linears that read one norm (q, k, v; w1, w3) are one matmul, so the normed
    tensor is read once and their input gradients are one matmul instead of three (two) plus
    the adds that sum them; and the normed lane-wide tensor is not saved for backward, which
    keeps only ``x`` (the residual stream, held anyway) and ``r = 1/rms(x)`` per lane row.
    The forward is the norm's own kernel and the matmul, so values equal ``norm`` then the
    separate linears bit for bit. The backward needs no normed tensor: with ``W' = W * g``
    (``g`` the norm weight) and ``g_y`` the outputs' gradients side by side, ``dW' = (r g_y)^T x``,
    ``dW = dW' * g``, ``dg = sum(dW' * W)``, and RMSNorm's ``dx = u - x r^2 (x . u) / D`` with
    ``u = (r g_y) @ W'``.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, xn, r, norm_weight, *weights):
        ctx.save_for_backward(x, norm_weight, r, *weights)
        return _lane_matmul(xn, list(weights))

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, *gs):
        x, norm_weight, r, *weights = ctx.saved_tensors
        D = x.shape[-1]
        w = torch.cat(weights, dim=1)
        gz = torch.cat([g * r.to(g.dtype) for g in gs], dim=-1)  # [L, N, out], scaled where each g is made
        dx = None
        if ctx.needs_input_grad[0]:
            u = torch.bmm(gz, w * norm_weight)  # [L, N, D]
            dot = (x * u).sum(dim=-1, keepdim=True, dtype=r.dtype)
            dx = torch.addcmul(u, x, (dot * r.square() / D).to(x.dtype), value=-1)
        dw = torch.bmm(gz.transpose(1, 2), x)  # [L, out, D], the weight scaled by the norm's
        dnorm = (dw * w).sum(dim=(0, 1)) if ctx.needs_input_grad[3] else None
        dws = (dw * norm_weight).split([w.shape[1] for w in weights], dim=1)
        return dx, None, None, dnorm, *dws


class LaneAttention(Module):
    """GQA attention with heads split evenly over lanes; returns per-lane partial outputs."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        n_lanes: int
        n_heads: int
        n_kv_heads: int
        head_dim: int
        rope: ComplexRoPE.Config
        inner_attention: Module.Config
        softmax_scale: float | None = None  # None: 1/sqrt(head_dim) (Laneformer.Config.softmax_scale_of)
        wqkv_init: dict = field(default_factory=dict)
        wo_init: dict = field(default_factory=dict)

    def __init__(self, config: Config):
        super().__init__()
        L, hd = config.n_lanes, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd

        def lane_linear(n_in, n_out, init):
            return LaneLinear.Config(
                n_lanes=L, in_features=n_in, out_features=n_out, param_init=init
            ).build()

        self.wq = lane_linear(config.dim, config.n_heads * hd // L, config.wqkv_init)
        self.wk = lane_linear(config.dim, config.n_kv_heads * hd // L, config.wqkv_init)
        self.wv = lane_linear(config.dim, config.n_kv_heads * hd // L, config.wqkv_init)
        self.wo = lane_linear(config.n_heads * hd // L, config.dim, config.wo_init)
        self.rope = config.rope.build()
        self.inner_attention = config.inner_attention.build()
        self.softmax_scale = config.softmax_scale

    def forward(self, x, norm: LaneRMSNorm, attention_mask: BlockMask, positions: torch.Tensor | None):
        """Attention of ``norm(x)``, lanes first (``x: [L, B, S, D]``, as the output; the norm is
        applied inside the q/k/v matmul: ``normed_lane_matmul``)."""
        L, B, S, _ = x.shape
        q, k, v = normed_lane_matmul(x, norm, self.wq, self.wk, self.wv)

        def heads(t, n):  # [L, B, S, n/L * hd] -> [B, S, n, hd] in lane-major head order
            return from_lanes(t).reshape(B, S, n, self.head_dim)

        # Lane-major head order: lane l owns heads [l*H/L, (l+1)*H/L), so the
        # GQA group of every query head stays inside its lane.
        q, k, v = heads(q, self.n_heads), heads(k, self.n_kv_heads), heads(v, self.n_kv_heads)
        q, k = self.rope(q, k, positions)
        out = self.inner_attention(
            q, k, v, attention_masks=attention_mask, scale=self.softmax_scale,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )
        return self.wo(to_lanes(out.reshape(B, S, L, -1)))


class LaneFeedForward(Module):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` with the hidden columns split over lanes."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        n_lanes: int
        hidden_dim: int
        w1_init: dict = field(default_factory=dict)
        w2w3_init: dict = field(default_factory=dict)

    def __init__(self, config: Config):
        super().__init__()
        L, h = config.n_lanes, config.hidden_dim // config.n_lanes
        self.w1 = LaneLinear.Config(n_lanes=L, in_features=config.dim, out_features=h, param_init=config.w1_init).build()
        self.w3 = LaneLinear.Config(n_lanes=L, in_features=config.dim, out_features=h, param_init=config.w2w3_init).build()
        self.w2 = LaneLinear.Config(n_lanes=L, in_features=h, out_features=config.dim, param_init=config.w2w3_init).build()

    def forward(self, x: torch.Tensor, norm: LaneRMSNorm) -> torch.Tensor:
        """The MLP of ``norm(x)``, lanes first (``[L, B, S, D]``, as the output); w1 and w3 are one
        matmul that applies the norm (``normed_lane_matmul``)."""
        gate, up = normed_lane_matmul(x, norm, self.w1, self.w3)
        return self.w2(F.silu(gate) * up)


class LaneBlock(Module):
    """Pre-norm attention + SwiGLU on every lane, with this layer's exchange rule."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        attention: LaneAttention.Config
        feed_forward: LaneFeedForward.Config
        attention_norm: LaneRMSNorm.Config
        ffn_norm: LaneRMSNorm.Config
        reduce: Reduce = "own"
        sends: bool = True
        window: int | None = None

    def __init__(self, config: Config):
        super().__init__()
        self.attention = config.attention.build()
        self.feed_forward = config.feed_forward.build()
        self.attention_norm = config.attention_norm.build()
        self.ffn_norm = config.ffn_norm.build()
        self.reduce, self.sends, self.window = config.reduce, config.sends, config.window

    def forward(self, x, attn_arrival, mlp_arrival, attention_mask, positions):
        """``x`` and the arrivals ``[B, S, L, D]``; the sub-blocks work lanes first (``to_lanes``)."""
        o = self.attention(to_lanes(x), self.attention_norm, attention_mask, positions)
        x, attn_send = _add_partial(x, from_lanes(o), self.reduce, attn_arrival, self.sends)
        o = self.feed_forward(to_lanes(x), self.ffn_norm)
        x, mlp_send = _add_partial(x, from_lanes(o), self.reduce, mlp_arrival, self.sends)
        return x, attn_send, mlp_send


class Laneformer(BaseModel):
    """The whole model: embeddings copied to every lane, lane blocks, lane aggregation, lm_head."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        dim: int
        n_layers: int
        n_heads: int
        n_kv_heads: int
        head_dim: int
        ffn_hidden_dim: int
        vocab_size: int = 32000
        max_seq_len: int = 4096
        rope_theta: float = 10000.0  # window layers, and full layers unless rope_theta_global is set
        rope_theta_global: float | None = None  # full layers; None: rope_theta
        rope_scaling: RopeScaling = "none"  # full layers only
        rope_scaling_factor: float = 1.0  # how many times rope_original_seq_len the scaled layers reach
        rope_original_seq_len: int = 4096  # the length trained at before scaling (spec section 1: 4096)
        norm_eps: float = 1e-5
        n_lanes: int = 8
        delay: int = 2
        early_mode: EarlyMode = "present"
        early_send_forward: bool = False
        late_mode: LateMode = "drop"
        delayed_exchange: bool = True
        final_agg: FinalAgg = "mean_of_norms"
        window_size: int = 2048
        window_layers: list[int] = field(default_factory=list)
        init_std: float = 0.02
        inner_attention: Module.Config = field(default_factory=FlexAttention.Config)

        def __post_init__(self):
            self.validate()

        def validate(self) -> None:
            """Raise ValueError naming the field when the shape cannot be built."""
            L = self.n_lanes
            checks = [
                (self.n_heads % L == 0, "n_heads", f"must be divisible by n_lanes={L}"),
                (self.n_kv_heads % L == 0, "n_kv_heads", f"must be divisible by n_lanes={L}"),
                (self.n_heads % self.n_kv_heads == 0, "n_heads", "must be a multiple of n_kv_heads"),
                (self.ffn_hidden_dim % L == 0, "ffn_hidden_dim", f"must be divisible by n_lanes={L}"),
                (self.head_dim % 2 == 0, "head_dim", "must be even (complex RoPE)"),
                (0 <= self.delay, "delay", "must be >= 0"),
                (self.window_size >= 1, "window_size", "must be >= 1"),
                (self.rope_scaling in get_args(RopeScaling), "rope_scaling",
                 f"must be one of {list(get_args(RopeScaling))}"),
                (self.rope_scaling == "none" or self.rope_scaling_factor > 1, "rope_scaling_factor",
                 f"must be > 1 with rope_scaling={self.rope_scaling!r}"),
                (self.rope_original_seq_len >= 1, "rope_original_seq_len", "must be >= 1"),
                (all(0 <= i < self.n_layers for i in self.window_layers), "window_layers",
                 f"must be layer indices in [0, {self.n_layers})"),
            ]
            for ok, name, why in checks:
                if not ok:
                    raise ValueError(f"model.{name} {why}")

        def window_of(self, layer: int) -> int | None:
            return self.window_size if layer in self.window_layers else None

        def rope_of(self, layer: int) -> ComplexRoPE.Config:
            """torchtitan's RoPE of a layer: ``rope_theta`` on window layers; ``rope_theta_global`` and
            ``rope_scaling`` on full layers (the module docstring says why)."""
            shape = {"dim": self.head_dim, "max_seq_len": self.max_seq_len}
            if self.window_of(layer) is not None:
                return ComplexRoPE.Config(**shape, theta=self.rope_theta)
            factor, length = self.rope_scaling_factor, self.rope_original_seq_len
            scaling = {"none": {},  # torchtitan names each method's factor and length its own way
                       "llama": {"scaling_factor": factor, "original_max_position_embeddings": length},
                       "yarn": {"rope_factor": factor, "original_seq_len": length}}[self.rope_scaling]
            theta = self.rope_theta if self.rope_theta_global is None else self.rope_theta_global
            return ComplexRoPE.Config(**shape, theta=theta, scaling=self.rope_scaling, **scaling)

        def softmax_scale_of(self, layer: int) -> float | None:
            """The attention logits' scale of a layer; None: SDPA's and flex's own, 1/sqrt(head_dim).

            YaRN's layers are sharper by ``(0.1 ln s + 1)^2`` (YaRN, arXiv 2309.00071, section 3.4:
            sqrt(1/t) = 0.1 ln(s) + 1 on both q and k), which torchtitan's RoPE leaves to the model
            (rope.py's ``_yarn_inv_freq``); its gpt_oss folds it into the scale the same way.
            """
            if self.rope_scaling != "yarn" or self.window_of(layer) is not None:
                return None
            return (0.1 * math.log(self.rope_scaling_factor) + 1) ** 2 / math.sqrt(self.head_dim)

        def exchange_of(self, layer: int) -> tuple[Reduce, bool]:
            """(how layer ``layer`` adds its own outputs, whether it sends them forward).

            A layer sends only what is received: by layer ``layer + delay`` when
            that exists and exchanges, or by the final flush (``late_mode="flush"``).
            """
            n, d = self.n_layers, self.delay
            reduce: Reduce
            if layer < d:
                reduce, sends = self.early_mode, self.early_send_forward
            elif not self.delayed_exchange:
                return "scaled", False
            elif d == 0:
                return "present", False
            elif layer >= n - d and self.late_mode == "present":
                return "present", False
            else:
                reduce, sends = "own", True
            received = self.delayed_exchange and (layer + d < n or self.late_mode == "flush")
            return reduce, sends and received

        def layer_config(self, layer: int) -> LaneBlock.Config:
            reduce, sends = self.exchange_of(layer)
            linear = {"weight": _trunc_normal(self.init_std)}
            out = {"weight": _trunc_normal(depth_scaled_std(self.init_std, layer))}
            norm = {"weight": nn.init.ones_}
            return LaneBlock.Config(
                attention=LaneAttention.Config(
                    dim=self.dim,
                    n_lanes=self.n_lanes,
                    n_heads=self.n_heads,
                    n_kv_heads=self.n_kv_heads,
                    head_dim=self.head_dim,
                    rope=self.rope_of(layer),
                    inner_attention=self.inner_attention,
                    softmax_scale=self.softmax_scale_of(layer),
                    wqkv_init=linear,
                    wo_init=out,
                ),
                feed_forward=LaneFeedForward.Config(
                    dim=self.dim, n_lanes=self.n_lanes, hidden_dim=self.ffn_hidden_dim,
                    w1_init=linear, w2w3_init=out,
                ),
                attention_norm=LaneRMSNorm.Config(normalized_shape=self.dim, eps=self.norm_eps, param_init=norm),
                ffn_norm=LaneRMSNorm.Config(normalized_shape=self.dim, eps=self.norm_eps, param_init=norm),
                reduce=reduce,
                sends=sends,
                window=self.window_of(layer),
            )

        def update_from_config(self, *, config, **kwargs) -> None:
            """Take the training sequence length from the trainer's config."""
            seq_len = config.training.seq_len
            if seq_len > self.max_seq_len:
                raise ValueError(
                    f"training.seq_len ({seq_len}) exceeds model.max_seq_len ({self.max_seq_len})"
                )
            if config.parallelism.tensor_parallel_degree > 1 or config.parallelism.pipeline_parallel_degree > 1:
                raise ValueError("Laneformer trains with FSDP only: lanes are its tensor axis")

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            from .flops import nparams_and_flops_per_token

            return nparams_and_flops_per_token(self, model, seq_len)

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.enable_weight_tying = False  # read by torchtitan's FSDP wrapper
        self.tok_embeddings = Embedding.Config(
            num_embeddings=config.vocab_size, embedding_dim=config.dim,
            param_init={"weight": _normal(1.0)},
        ).build()
        self.layers = ModuleDict({str(i): config.layer_config(i).build() for i in range(config.n_layers)})
        self.norm = RMSNorm.Config(
            normalized_shape=config.dim, eps=config.norm_eps, param_init={"weight": nn.init.ones_}
        ).build()
        self.lm_head = Linear.Config(
            in_features=config.dim, out_features=config.vocab_size, bias=False,
            param_init={"weight": _trunc_normal(config.dim**-0.5)},
        ).build()

    def attention_masks(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> dict:
        """One mask per distinct window: causal, within documents when positions restart."""
        B, S = tokens.shape
        base = [get_causal_mask_mod()]
        if positions is not None:
            base.append(get_document_mask_mod(positions))
        if isinstance(self.config.inner_attention, DenseMaskFlexAttention.Config):
            build = carrier_block_mask  # SDPA evaluates the mask_mod itself
        else:
            build = create_attention_mask if tokens.is_cuda else create_block_mask
        masks = {}
        for window in {layer.window for layer in self.layers.values()}:
            mods = base + ([get_sliding_window_mask_mod(window)] if window else [])
            masks[window] = build(and_masks(*mods), B, None, S, S, device=tokens.device)
        return masks

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                attention_masks: dict | None = None) -> torch.Tensor:
        """Logits of ``tokens`` (``[B, S]``). ``attention_masks``: what ``attention_masks`` returns (window ->
        mask), given when they were built elsewhere: under context parallelism the trainer builds them on
        the whole sequence and torchtitan slices them with the tokens (``LaneformerTrainer.
        post_dataloading_process``); None: built here from ``tokens`` and ``positions``."""
        cfg = self.config
        masks = self.attention_masks(tokens, positions) if attention_masks is None else attention_masks
        h = self.tok_embeddings(tokens)
        x = h.unsqueeze(2).expand(-1, -1, cfg.n_lanes, -1)
        # in_flight[i] holds what layer i sent: (attention, mlp) sums over the other lanes.
        in_flight: dict[int, tuple] = {}
        for i, layer in enumerate(self.layers.values()):
            arrival = in_flight.pop(i - cfg.delay, (None, None)) if cfg.delay else (None, None)
            x, attn_send, mlp_send = layer(x, arrival[0], arrival[1], masks[layer.window], positions)
            if attn_send is not None:
                in_flight[i] = (attn_send, mlp_send)
        # Still in flight: sends past the last layer, which exchange_of allows only under late_mode="flush".
        for attn_send, mlp_send in in_flight.values():
            x = x + attn_send + mlp_send
        if cfg.final_agg == "mean_of_norms":
            h = self.norm(x).mean(dim=2)
        else:
            h = self.norm(x.sum(dim=2))
        return self.lm_head(h)
