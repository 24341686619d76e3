"""The delayed exchange between lanes (Delayed Tensor Parallelism), and the lane-major layout it runs in.

A sub-block's partial outputs are added to the lanes' residual streams, and what each lane sends
to the others arrives ``delay`` layers later (``models.laneformer.model.LaneBlock`` holds the rule
of each layer: ``Laneformer.Config.exchange_of``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Reduce = Literal["present", "scaled", "own"]


def _add_partial(x, o, reduce: Reduce, arrival, sends: bool):
    """Add a sub-block's partial outputs ``o`` to the lanes; return (x, what to send).

    ``arrival`` is the other lanes' output of the same sub-block ``delay``
    layers back (or None); what this layer sends is the sum over the other
    lanes of its own outputs, to be added ``delay`` layers later.
    """
    return _Exchange.apply(x, o, arrival, reduce, sends)


class _Exchange(torch.autograd.Function):
    """``_add_partial`` as one autograd step that saves nothing.

    Why not plain autograd: its backward negates the send's gradient, expands the lane sum
    and adds three gradients into ``o`` one at a time (a pass over a lane-wide tensor each);
    here ``g_o = g_x - g_send + sum_l g_send`` is one expression (one kernel when compiled), and the
    residual's and arrival's gradients are ``g_x`` itself.
    """

    @staticmethod
    def forward(ctx, x, o, arrival, reduce: Reduce, sends: bool):
        ctx.set_materialize_grads(False)
        ctx.reduce, ctx.lanes, ctx.has_arrival = reduce, o.shape[2], arrival is not None
        x, o = to_lanes(x), to_lanes(o)
        total = lane_sum(o) if reduce == "present" or sends else None
        if reduce == "present":
            new = x + total
        elif reduce == "scaled":
            new = torch.add(x, o, alpha=math.sqrt(o.shape[0]))
        else:
            new = x + o
        if arrival is not None:
            new = new + to_lanes(arrival)
        return from_lanes(new), (from_lanes(total - o) if sends else None)

    @staticmethod
    def backward(ctx, g, g_send):
        g_lanes = to_lanes(g)
        g_send = None if g_send is None else to_lanes(g_send)
        if ctx.reduce == "present":
            g_total = lane_sum(g_lanes)
            g_o = g_total.expand_as(g_lanes) if g_send is None else (g_total + lane_sum(g_send)) - g_send
        else:
            g_o = g_lanes * math.sqrt(ctx.lanes) if ctx.reduce == "scaled" else g_lanes
            if g_send is not None:
                g_o = g_o - g_send + lane_sum(g_send)
        return g, from_lanes(g_o), (g if ctx.has_arrival else None), None, None


def to_lanes(t: torch.Tensor) -> torch.Tensor:
    """``[B, S, L, D]`` as ``[L, B, S, D]`` (a view): the order the residual stream is stored in.

    Why lane-major: the lane matmuls read and write ``[L, B*S, D]`` blocks, so a residual stream
    stored lane by lane is their operand as is; and the exchange's elementwise kernels, written
    in this order, iterate it in memory order (Inductor fuses kernels only when their loops match).
    """
    return t.permute(2, 0, 1, 3)


def from_lanes(t: torch.Tensor) -> torch.Tensor:
    """``to_lanes``'s inverse (a view)."""
    return t.permute(1, 2, 0, 3)


def lane_sum(t: torch.Tensor) -> torch.Tensor:
    """``t.sum(dim=0, keepdim=True)`` for lanes first (``to_lanes``); compiled, as ``L - 1`` adds of lanes.

    Why: Inductor makes a reduction over lanes its own kernel, which its consumers then read
    besides the lanes; a sum of lanes is elementwise, so it fuses into the kernels that read the
    lanes anyway (the exchange: one kernel, not three). Eager keeps ``torch.sum``.
    """
    if not torch.compiler.is_compiling():
        return t.sum(dim=0, keepdim=True)
    acc = t[:1].to(torch.promote_types(t.dtype, torch.float32))  # bf16 lanes summed in fp32, as torch.sum
    for lane in range(1, t.shape[0]):
        acc = acc + t[lane:lane + 1]
    return acc.to(t.dtype)
