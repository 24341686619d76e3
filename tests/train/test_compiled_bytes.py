"""The compiled estimate's kernel bytes (plan/compiled.py) against a count by hand.

The 1.33 lanes/dense step ratio of ``train.py --plan --compiled`` is a sum of the bytes Inductor's
fused kernels move; ``tests/train/test_plan.py`` checks it only against the planner itself. Here two
toy blocks go through the same compile (``_compile_layer``) and every kernel's bytes are counted
by hand from what it must read and write once:

- an RMSNorm of ``x: [N, D]`` alone. Forward, one kernel: reads ``x`` and the weight, writes ``y``
  and ``1/rms`` (``[N, 1]`` in fp32, saved for the backward: the norm's kernel computes it in fp32).
  Backward, two kernels: the weight's gradient (a reduction over rows: reads ``g``, ``x``, ``1/rms``,
  writes ``[D]``) and the input's (reads ``g``, ``x``, the weight, ``1/rms``, writes ``dx``).
- the exchange step of a layer that receives and sends (``_add_partial``, reduce "own"): forward,
  one kernel (reads ``x``, ``o``, the arrival, writes the new residual and the send: 5 lane-wide
  passes, the lane sum fused in: ``lane_sum``); backward, one kernel (reads ``g`` and the send's
  gradient, writes ``o``'s: 3 passes; the residual's and arrival's gradients are ``g`` itself).
  With 8 lanes, as the flavors have: there a ``torch.sum`` over lanes under compile becomes a
  kernel of its own (checked by breaking ``lane_sum``), which is what ``lane_sum`` avoids.
"""

from __future__ import annotations

import pytest
import torch

from models.laneformer.exchange import _add_partial, from_lanes
from models.laneformer.model import LaneRMSNorm
from plan.compiled import _compile_layer


def by_phase(kernels):
    return {phase: sorted((k.kind, k.bytes) for k in kernels if k.phase == phase)
            for phase in ("forward", "backward")}


class _Norm(torch.nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.norm = LaneRMSNorm.Config(normalized_shape=dim, eps=1e-5).build().to(dtype)

    def forward(self, x):
        return self.norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_compiled_norm_moves_what_a_hand_count_says(dtype):
    N, D, s = 64, 32, dtype.itemsize
    x, w, rstd = N * D * s, D * s, N * 4  # bytes of x (and of y, g, dx), the weight, 1/rms in fp32
    kernels = _compile_layer(_Norm(D, dtype), (torch.empty(N, D, dtype=dtype, requires_grad=True),), 0)
    assert by_phase(kernels) == {
        "forward": [("fused", x + w + x + rstd)],
        "backward": sorted([("fused", x + x + rstd + w),  # dw: g, x, 1/rms -> [D]
                            ("fused", x + x + w + rstd + x)]),  # dx: g, x, w, 1/rms -> dx
    }


class _Exchange(torch.nn.Module):
    def forward(self, x, o, arrival):
        return _add_partial(x, o, "own", arrival, True)


def test_a_compiled_exchange_moves_five_lane_wide_passes_forward_and_three_backward():
    B, S, L, D, dtype = 2, 8, 8, 32, torch.bfloat16  # 8 lanes, as the flavors but tiny-4lane
    lane_wide = B * S * L * D * dtype.itemsize

    def stored_lanes_first():  # as the layer gets them in training (models.laneformer.exchange.to_lanes)
        return from_lanes(torch.empty(L, B, S, D, dtype=dtype)).requires_grad_()

    kernels = _compile_layer(_Exchange(), tuple(stored_lanes_first() for _ in range(3)), 0)
    assert by_phase(kernels) == {"forward": [("fused", 5 * lane_wide)], "backward": [("fused", 3 * lane_wide)]}
