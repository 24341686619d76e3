"""Every parameter's gradient of the tiny model, with the lane block's custom autograd functions
(``_LaneMatmul`` of wo/w2, ``_NormedLaneMatmul`` of q/k/v and w1/w3, ``_Exchange``), against plain
autograd, in float64.

- delay 0: the model is a dense GQA/SwiGLU transformer whose weights are the lane slices
  concatenated (the spec; ``test_model.dense_forward``, plain torch). Autograd through that
  reference, on the model's own parameter tensors, gives every lane weight's gradient in its
  lane layout.
- the tiny flavor's exchange (delay 2) with 6 layers, so that layers 2 and 3 send to 4 and 5
  (tiny's own 4 layers send nothing under late_mode "drop"), window layers: the same model with
  the three custom functions replaced by the formulas they stand for, differentiated by autograd.

The model tests run forward under ``no_grad``, so a wrong custom backward showed nowhere but in a
loss curve.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import models.laneformer.model as M
from tests.models.test_model import build, dense_forward


def tokens_and_targets(vocab: int, seq: int = 40):  # longer than tiny's window (32)
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (1, seq), generator=g), torch.randint(0, vocab, (1, seq), generator=g)


def gradients(model, logits_of) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    tokens, targets = tokens_and_targets(model.config.vocab_size)
    logits = logits_of(params, tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def assert_same_gradients(got: dict, want: dict, rtol: float) -> None:
    """Every parameter's gradient within ``rtol`` of the reference's largest entry, and not all zero."""
    assert got.keys() == want.keys()
    lane_weights = [n for n in got if n.endswith(("wo.weight", "w2.weight", "wq.weight", "w1.weight"))]
    assert len(lane_weights) == 4 * len([n for n in got if n.endswith("ffn_norm.weight")])
    for name in got:
        scale = want[name].abs().max().item()
        assert scale > 0, name
        err = (got[name] - want[name]).abs().max().item()
        assert err <= rtol * scale, f"{name}: max |error| {err:.3g} vs max |grad| {scale:.3g}"


def test_delay_0_gradients_equal_the_dense_transformers():
    model = build("tiny", delay=0).double()
    got = gradients(model, lambda params, tokens: model(tokens))
    want = gradients(model, lambda params, tokens: dense_forward(params, model.config, tokens))
    # Both compute RoPE's angles in float32 (torchtitan's ComplexRoPE; the reference's cos/sin), the rest in float64.
    assert_same_gradients(got, want, rtol=2e-6)  # measured 2.1e-7


def _plain_lane_matmul(x, w):
    return torch.einsum("lni,loi->lno", x, w)


def _plain_normed_lane_matmul(x, norm, *linears):
    xn = F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
    return tuple(torch.einsum("l...i,loi->l...o", xn, lin.weight) for lin in linears)


def _plain_add_partial(x, o, reduce, arrival, sends):
    """The spec's residual update for ``[B, S, L, D]``: what ``_Exchange`` computes."""
    total = o.sum(dim=2, keepdim=True)
    update = {"own": o, "present": total.expand_as(o), "scaled": math.sqrt(o.shape[2]) * o}[reduce]
    new = x + update + (arrival if arrival is not None else 0)
    return new, (total - o if sends else None)


def test_tiny_gradients_equal_plain_autograd_of_the_same_formulas(monkeypatch):
    model = build("tiny", n_layers=6).double()
    assert [layer.sends for layer in model.layers.values()] == [False, False, True, True, False, False]
    got = gradients(model, lambda params, tokens: model(tokens))
    monkeypatch.setattr(M._LaneMatmul, "apply", _plain_lane_matmul)
    monkeypatch.setattr(M, "normed_lane_matmul", _plain_normed_lane_matmul)
    monkeypatch.setattr(M, "_add_partial", _plain_add_partial)
    want = gradients(model, lambda params, tokens: model(tokens))
    assert_same_gradients(got, want, rtol=1e-10)  # measured 1.1e-15
