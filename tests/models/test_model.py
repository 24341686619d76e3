"""The Laneformer model against the spec and an independent dense reference."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from models.laneformer import laneformer_configs, model_registry
from models.laneformer.flops import nparams_and_flops_per_token


def build(flavor="tiny", seed=0, **overrides):
    config = model_registry(flavor, attn_backend="dense", **overrides).model
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    # Non-trivial norm weights, so a wrong norm sharing would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def test_2b_parameter_count_names_and_shapes():
    config = laneformer_configs["2B"]()
    with torch.device("meta"):
        model = config.build()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert sum(math.prod(s) for s in shapes.values()) == 2_320_069_632
    expected_layer = {
        "attention.wq.weight": (8, 384, 3072),
        "attention.wk.weight": (8, 192, 3072),
        "attention.wv.weight": (8, 192, 3072),
        "attention.wo.weight": (8, 3072, 384),
        "feed_forward.w1.weight": (8, 1536, 3072),
        "feed_forward.w3.weight": (8, 1536, 3072),
        "feed_forward.w2.weight": (8, 3072, 1536),
        "attention_norm.weight": (3072,),
        "ffn_norm.weight": (3072,),
    }
    expected = {
        "tok_embeddings.weight": (32000, 3072),
        "norm.weight": (3072,),
        "lm_head.weight": (32000, 3072),
        **{f"layers.{i}.{k}": v for i in range(15) for k, v in expected_layer.items()},
    }
    assert shapes == expected
    assert [config.window_of(i) for i in range(15)] == [2048] * 10 + [None] * 5


def test_small_flavors_sizes():
    for flavor, low, high in [("100M", 80e6, 120e6), ("tiny", 1e6, 6e6), ("tiny-4lane", 1e6, 6e6)]:
        config = laneformer_configs[flavor]()
        with torch.device("meta"):
            n = sum(p.numel() for p in config.build().parameters())
        assert low < n < high, (flavor, n)
    assert laneformer_configs["tiny"]().n_lanes == 8
    assert laneformer_configs["tiny-4lane"]().n_lanes == 4


def test_flops_per_token_2b_hand_computed():
    config = laneformer_configs["2B"]()
    with torch.device("meta"):
        model = config.build()
    n, flops = nparams_and_flops_per_token(config, model, 4096)
    dense_matmul = 6 * (2_320_069_632 - 32000 * 3072)
    # QK^T and AV: 6 * heads * (2 * head_dim) * context; window layers see 2048 tokens.
    attention = 6 * 32 * 2 * 96 * (10 * 2048 + 5 * 4096)
    assert flops == dense_matmul + attention == 14_840_543_232


def test_bad_shapes_name_the_field():
    with pytest.raises(ValueError, match="model.n_kv_heads"):
        dataclasses.replace(laneformer_configs["tiny"](), n_kv_heads=6)


# ---- an independent dense reference, plain torch ---------------------------------


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def theta_freqs(theta, hd):
    """RoPE's frequencies theta^(-2i/hd), i < hd/2 (RoFormer, arXiv 2104.09864, eq. 15), float64."""
    return 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)


def rope(x, positions, freqs):
    """Meta-Llama complex RoPE: rotate interleaved pairs (x[2i], x[2i+1]) by positions * freqs[i]."""
    angles = positions[..., None].double() * freqs  # [B, S, hd/2]
    cos, sin = angles.cos()[:, :, None].float(), angles.sin()[:, :, None].float()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def dense_forward(sd, cfg, tokens, rope_of=None):
    """A dense GQA/SwiGLU transformer with weights = lane slices concatenated. ``rope_of(layer)``: the
    layer's RoPE frequencies and attention scale (None: 1/sqrt(head_dim)); default: ``cfg.rope_theta``'s."""
    B, S = tokens.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rope_of = rope_of or (lambda layer: (theta_freqs(cfg.rope_theta, hd), None))
    row = lambda w: w.reshape(-1, w.shape[-1])  # [L, out/L, D] -> [out, D]
    col = lambda w: w.permute(1, 0, 2).reshape(w.shape[1], -1)  # [L, D, in/L] -> [D, in]
    positions = torch.arange(S).expand(B, S)
    x = sd["tok_embeddings.weight"][tokens]
    idx = torch.arange(S)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = rms_norm(x, sd[p + "attention_norm.weight"], cfg.norm_eps)
        q = (h @ row(sd[p + "attention.wq.weight"]).T).view(B, S, H, hd)
        k = (h @ row(sd[p + "attention.wk.weight"]).T).view(B, S, Hkv, hd)
        v = (h @ row(sd[p + "attention.wv.weight"]).T).view(B, S, Hkv, hd)
        freqs, scale = rope_of(i)
        q, k = rope(q, positions, freqs), rope(k, positions, freqs)
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
        scores = scores * scale if scale is not None else scores / math.sqrt(hd)
        allowed = idx[:, None] >= idx[None, :]
        if cfg.window_of(i):
            allowed &= idx[:, None] - idx[None, :] < cfg.window_of(i)
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, S, H * hd)
        x = x + attn @ col(sd[p + "attention.wo.weight"]).T
        h = rms_norm(x, sd[p + "ffn_norm.weight"], cfg.norm_eps)
        gate = F.silu(h @ row(sd[p + "feed_forward.w1.weight"]).T) * (h @ row(sd[p + "feed_forward.w3.weight"]).T)
        x = x + gate @ col(sd[p + "feed_forward.w2.weight"]).T
    return rms_norm(x, sd["norm.weight"], cfg.norm_eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("flavor", ["tiny", "tiny-4lane"])
def test_no_delay_equals_dense_transformer(flavor):
    model = build(flavor, delay=0)
    lanes = []
    model.layers["1"].register_forward_hook(lambda m, args, out: lanes.append(out[0]))
    tokens = torch.randint(0, model.config.vocab_size, (2, 48))
    with torch.no_grad():
        logits = model(tokens)
        reference = dense_forward(model.state_dict(), model.config, tokens)
    # All lanes carry the same residual stream.
    assert (lanes[0] - lanes[0][:, :, :1]).abs().max() < 1e-5
    assert (logits - reference).abs().max() <= 1e-5


# ---- the delayed exchange ----------------------------------------------------------


def residual_trace(model, tokens, perturb=None):
    """Residual streams after every sub-block: [(layer, 'attn'|'mlp', x[B,S,L,D])] (the sub-blocks
    take and return lanes first: ``to_lanes``)."""
    from models.laneformer.exchange import from_lanes

    trace, hooks = [], []
    for i, layer in model.layers.items():
        hooks.append(layer.feed_forward.register_forward_pre_hook(
            lambda m, args, i=i: trace.append((int(i), "attn", from_lanes(args[0]).clone()))))
        hooks.append(layer.register_forward_hook(
            lambda m, args, out, i=i: trace.append((int(i), "mlp", out[0].clone()))))
    if perturb:
        layer, sub, lane = perturb
        module = getattr(model.layers[str(layer)], "attention" if sub == "attn" else "feed_forward")

        def add_noise(m, args, out):
            out = out.clone()
            out[lane] += torch.randn_like(out[lane])
            return out

        hooks.append(module.register_forward_hook(add_noise))
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return trace


@pytest.mark.parametrize("sub", ["attn", "mlp"])
def test_a_lane_output_reaches_other_lanes_after_delay(sub):
    model = build("tiny", n_layers=7, window_layers=[])
    delay, layer, lane = model.config.delay, 2, 3
    tokens = torch.randint(0, model.config.vocab_size, (1, 16))
    clean = residual_trace(model, tokens)
    torch.manual_seed(1)
    dirty = residual_trace(model, tokens, perturb=(layer, sub, lane))
    others = [m for m in range(model.config.n_lanes) if m != lane]
    first_change = None
    for (i, s, x0), (_, _, x1) in zip(clean, dirty):
        if not torch.equal(x0[:, :, others], x1[:, :, others]):
            first_change = (i, s)
            break
    assert first_change == (layer + delay, sub)
    # The perturbed lane itself changes at once.
    at = [k for k, (i, s, _) in enumerate(clean) if (i, s) == (layer, sub)][0]
    assert not torch.equal(clean[at][2][:, :, lane], dirty[at][2][:, :, lane])


def test_early_present_layers_reach_all_lanes_at_once():
    model = build("tiny", n_layers=6, window_layers=[])
    tokens = torch.randint(0, model.config.vocab_size, (1, 8))
    clean = residual_trace(model, tokens)
    dirty = residual_trace(model, tokens, perturb=(0, "attn", 5))
    assert not torch.equal(clean[0][2][:, :, 0], dirty[0][2][:, :, 0])


# ---- masks: sliding window, causality, documents ------------------------------------


def attention_output(model, layer, x, positions=None):
    """The attention sub-block of ``x: [B, S, L, D]`` (it works lanes first: ``to_lanes``)."""
    from models.laneformer.exchange import from_lanes, to_lanes

    tokens = torch.zeros(x.shape[:2], dtype=torch.long)
    block = model.layers[str(layer)]
    mask = model.attention_masks(tokens, positions)[block.window]
    with torch.no_grad():
        return from_lanes(block.attention(to_lanes(x), block.attention_norm, mask, positions))


def test_window_layer_ignores_tokens_beyond_the_window():
    model = build("tiny")  # layers 0, 1: window 32; layers 2, 3: full
    S, w = 64, model.config.window_size
    x = torch.randn(1, S, model.config.n_lanes, model.config.dim)
    x2 = x.clone()
    x2[:, 0] += 1.0  # change token 0 only
    for layer, sees_far in [(0, False), (3, True)]:
        a, b = attention_output(model, layer, x), attention_output(model, layer, x2)
        changed = (a - b).abs().amax(dim=(0, 2, 3)) > 1e-6
        assert changed[:w].all()  # within the window: token 0 is visible
        assert bool(changed[w:].any()) == sees_far
        if sees_far:
            assert changed[w:].all()


def test_causal_no_future_token_influences_earlier_logits():
    model = build("tiny")
    tokens = torch.randint(0, model.config.vocab_size, (1, 40))
    changed = tokens.clone()
    changed[0, 25:] = (changed[0, 25:] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :25], b[:, :25], atol=0, rtol=0)
    assert not torch.allclose(a[:, 25:], b[:, 25:])


def test_attention_stays_within_documents_when_positions_restart():
    model = build("tiny")
    doc_a, doc_b = torch.randint(0, 4096, (1, 20)), torch.randint(0, 4096, (1, 12))
    packed = torch.cat([doc_a, doc_b], dim=1)
    positions = torch.cat([torch.arange(20), torch.arange(12)])[None]
    with torch.no_grad():
        together = model(packed, positions)
        alone = model(doc_b)
    assert (together[:, 20:] - alone).abs().max() < 1e-5


def spec_update(cfg, outputs, i):
    """The spec's residual update of one sub-block at layer i, from all layers' partial outputs."""
    L, d, n = cfg.n_lanes, cfg.delay, cfg.n_layers
    o = outputs[i]
    others = lambda t: t.sum(dim=2, keepdim=True) - t
    sends = lambda j: (j >= d or cfg.early_send_forward) and (j < n - d or cfg.late_mode == "flush")
    if i < d:
        update = o.sum(dim=2, keepdim=True).expand_as(o) if cfg.early_mode == "present" else math.sqrt(L) * o
    elif i >= n - d and cfg.late_mode == "present":
        update = o.sum(dim=2, keepdim=True).expand_as(o)
    else:
        update = o
    if i >= d and sends(i - d):
        update = update + others(outputs[i - d])
    return update


@pytest.mark.parametrize("variant", [
    {},
    {"early_mode": "scaled"},
    {"early_send_forward": True},
    {"late_mode": "present"},
    {"late_mode": "flush", "delay": 1},
])
def test_residual_updates_follow_the_spec_formula(variant):
    from models.laneformer.exchange import from_lanes

    model = build("tiny", n_layers=6, window_layers=[], **variant)
    cfg = model.config
    outs = {"attn": {}, "mlp": {}}  # [B, S, L, D] (the sub-blocks work lanes first)
    states = {}  # (layer, point) -> residual
    for i, layer in model.layers.items():
        i = int(i)
        layer.attention.register_forward_hook(lambda m, a, out, i=i: outs["attn"].__setitem__(i, from_lanes(out)))
        layer.feed_forward.register_forward_hook(lambda m, a, out, i=i: outs["mlp"].__setitem__(i, from_lanes(out)))
        layer.register_forward_pre_hook(lambda m, a, i=i: states.__setitem__((i, "in"), a[0]))
        layer.feed_forward.register_forward_pre_hook(lambda m, a, i=i: states.__setitem__((i, "attn"), from_lanes(a[0])))
        layer.register_forward_hook(lambda m, a, out, i=i: states.__setitem__((i, "mlp"), out[0]))
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, 12)))
    for i in range(cfg.n_layers):
        got_attn = states[(i, "attn")] - states[(i, "in")]
        got_mlp = states[(i, "mlp")] - states[(i, "attn")]
        assert (got_attn - spec_update(cfg, outs["attn"], i)).abs().max() < 1e-5, (i, "attn")
        assert (got_mlp - spec_update(cfg, outs["mlp"], i)).abs().max() < 1e-5, (i, "mlp")


# ---- the fused lane steps against plain autograd ------------------------------------


def test_the_normed_lane_matmul_equals_norm_then_separate_matmuls_forward_and_backward():
    """One matmul for q/k/v with the norm folded in: the values and every gradient of
    ``rmsnorm(x) @ w_i^T`` per lane with separate weights (float64, plain autograd)."""
    from models.laneformer.model import LaneLinear, LaneRMSNorm, normed_lane_matmul

    torch.manual_seed(0)
    L, D, outs = 4, 16, (8, 4, 4)
    norm = LaneRMSNorm.Config(normalized_shape=D, eps=1e-5).build().double()
    linears = [LaneLinear.Config(n_lanes=L, in_features=D, out_features=o).build().double() for o in outs]
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        for lin in linears:
            lin.weight.normal_()
    x = torch.randn(L, 2, 3, D, dtype=torch.float64, requires_grad=True)  # lanes first
    params = [x, norm.weight, *(lin.weight for lin in linears)]
    grads = [torch.randn(L, 2, 3, o, dtype=torch.float64) for o in outs]

    got = normed_lane_matmul(x, norm, *linears)
    got_grads = torch.autograd.grad(got, params, grads)
    xn = F.rms_norm(x, (D,), norm.weight, 1e-5)
    want = [torch.einsum("lbsi,loi->lbso", xn, lin.weight) for lin in linears]
    want_grads = torch.autograd.grad(want, params, grads)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reduce,sends,arrives", [("own", True, True), ("own", False, True), ("own", True, False),
                                                  ("present", False, False), ("present", True, False),
                                                  ("scaled", False, False)])
def test_the_exchange_step_has_the_gradients_of_its_formula(reduce, sends, arrives, compiled=False):
    from models.laneformer.exchange import _add_partial

    if compiled:  # lane_sum is a sum of lane slices there, and the block's layout lanes first
        torch._dynamo.reset()
        _add_partial = torch.compile(_add_partial, fullgraph=True)
    torch.manual_seed(0)
    L = 4
    x, o, arrival = (torch.randn(2, 3, L, 5, dtype=torch.float64, requires_grad=True) for _ in range(3))
    inputs = [x, o] + ([arrival] if arrives else [])
    new, send = _add_partial(x, o, reduce, arrival if arrives else None, sends)
    total = o.sum(dim=2, keepdim=True)
    update = {"own": o, "present": total.expand_as(o), "scaled": math.sqrt(L) * o}[reduce]
    want_new = x + update + (arrival if arrives else 0)
    torch.testing.assert_close(new, want_new, rtol=0, atol=1e-12)
    assert (send is None) == (not sends)
    outputs, want_outputs = [new], [want_new]
    if sends:
        torch.testing.assert_close(send, total - o, rtol=0, atol=1e-12)
        outputs.append(send)
        want_outputs.append(total - o)
    grads = [torch.randn_like(t) for t in outputs]
    got = torch.autograd.grad(outputs, inputs, grads)
    want = torch.autograd.grad(want_outputs, inputs, grads)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reduce,sends,arrives", [("own", True, True), ("present", True, False)])
def test_the_compiled_exchange_step_has_the_same_values_and_gradients(reduce, sends, arrives):
    test_the_exchange_step_has_the_gradients_of_its_formula(reduce, sends, arrives, compiled=True)


def test_a_compiled_model_runs_without_gradients_as_eager():
    """Evals and generation run a compiled model under no_grad (train.callbacks.eval): every block, traced
    whole as torchtitan's apply_compile does (fullgraph), gives the eager values. The lane steps' autograd
    functions save tensors for a backward, which Dynamo cannot trace without gradients: the in-loop
    validation of every compiled run failed with "Unhandled tensor method save_for_backward"."""
    from tests.conftest import tiny_random_model

    model = tiny_random_model(seed=1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.no_grad():
        eager = model(tokens)
        for block in model.layers.children():
            block.compile(backend="eager", fullgraph=True)  # Dynamo's tracing, without Inductor's codegen
        compiled = model(tokens)
    torch._dynamo.reset()
    assert torch.equal(compiled, eager)
