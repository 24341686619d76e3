"""Kog's Laneformer forward passes, written from their description for the import tests.

Plain torch, independent of ``models/``: the older ``laneformer_tp`` revision
(``LaneformerTPConfig`` keys and defaults, every layer sending its partial
outputs forward) and the newer one as publicly described (the first and last
``broadcast_delay`` layers send nothing; ``use_attention_comm`` /
``use_mlp_comm``; ``swa_layers``). Folders are written and read in the
released layout: ``config.json`` + ``model.safetensors`` with TorchTitan names
under ``model.`` and lane weights ``[L, out, in]``.
"""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TP_DEFAULTS = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "intermediate_size": 16384, "max_position_embeddings": 131072, "vocab_size": 128256,
    "rope_theta": 10000.0, "norm_eps": 1e-5, "num_lanes": 1, "broadcast_delay": 1, "use_comm": True,
    "use_early_comm": True, "lm_head_type": "replicate", "pre_norm_lane_agg": False,
    "replicated_rmsn_scale": True, "tie_word_embeddings": False, "sliding_window": None,
    "sliding_window_n_layers": 0,
}


def _get(cfg, key):
    return cfg.get(key, TP_DEFAULTS.get(key))


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights in the released layout, large enough that lanes, norms and the exchange move the logits."""
    g = torch.Generator().manual_seed(seed)
    D, H, L = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads"), _get(cfg, "num_lanes")
    KV, F, V = _get(cfg, "num_key_value_heads") or H, _get(cfg, "intermediate_size"), _get(cfg, "vocab_size")
    hd = D // H

    def lin(*shape):
        return torch.randn(shape, generator=g) * 0.08

    def norm():
        return 1 + 0.2 * torch.randn(D, generator=g)

    tied = _get(cfg, "tie_word_embeddings")  # the embeddings are the lm head too: keep logits ~5
    w = {"model.tok_embeddings.weight": torch.randn(V, D, generator=g) * (0.25 if tied else 1.0),
         "model.norm.weight": norm()}
    for i in range(_get(cfg, "num_hidden_layers")):
        p = f"model.layers.{i}."
        w[p + "attention.wq.weight"] = lin(L, H * hd // L, D)
        w[p + "attention.wk.weight"] = lin(L, KV * hd // L, D)
        w[p + "attention.wv.weight"] = lin(L, KV * hd // L, D)
        w[p + "attention.wo.weight"] = lin(L, D, H * hd // L)
        w[p + "feed_forward.w1.weight"] = lin(L, F // L, D)
        w[p + "feed_forward.w3.weight"] = lin(L, F // L, D)
        w[p + "feed_forward.w2.weight"] = lin(L, D, F // L)
        w[p + "attention_norm.weight"] = norm()
        w[p + "ffn_norm.weight"] = norm()
    if not tied:
        w["lm_head.weight"] = lin(V, D) * 3
    return w


def save_release(folder: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def load_release(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    weights = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(f))
    return json.loads((Path(folder) / "config.json").read_text()), weights


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _lanes(x, weight):
    return torch.einsum("bsli,loi->bslo", x, weight)


def _rope(x, cis):
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * cis).flatten(3)


def _windowed_layers(cfg, newer):
    n = _get(cfg, "num_hidden_layers")
    if newer:
        return set(cfg.get("swa_layers") or [])
    k, unclamped = _get(cfg, "sliding_window_n_layers"), cfg.get("unclamped_layers", [])
    return {i for i in range(n) if (i < k or i >= n + k) and i not in unclamped}


def forward(cfg: dict, w: dict[str, torch.Tensor], tokens: torch.Tensor, newer: bool = False) -> torch.Tensor:
    """Logits [B, S, V] of Kog's code for config ``cfg`` (older revision unless ``newer``)."""
    D, H, L = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads"), _get(cfg, "num_lanes")
    KV, n, d = _get(cfg, "num_key_value_heads") or H, _get(cfg, "num_hidden_layers"), _get(cfg, "broadcast_delay")
    hd, eps = D // H, _get(cfg, "norm_eps")
    assert _get(cfg, "lm_head_type") == "replicate" and _get(cfg, "replicated_rmsn_scale")
    B, S = tokens.shape

    freqs = 1.0 / (_get(cfg, "rope_theta") ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    angles = torch.outer(torch.arange(S).float(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    q_idx, k_idx = torch.arange(S)[:, None], torch.arange(S)[None, :]
    causal = k_idx <= q_idx
    windowed = _windowed_layers(cfg, newer)
    window = cfg.get("sliding_window")

    # Per layer and sub-block: how the partial outputs are added, and whether they are sent forward.
    modes, sends = [], []
    for i in range(n):
        if i < d:
            mode = ["present" if _get(cfg, "use_early_comm") else "no_reduce"] * 2
            send = not newer
        elif newer:
            mode = ["past" if cfg.get(k, True) else "no_reduce" for k in ("use_attention_comm", "use_mlp_comm")]
            send = n - d > i
        else:
            mode = ["past" if _get(cfg, "use_comm") else "no_reduce"] * 2
            send = True
        modes.append(mode)
        sends.append(send)

    def reduce(o, mode, past):
        if mode == "no_reduce":
            return o * math.sqrt(L)
        if mode == "present":
            return o.sum(dim=2, keepdim=True)
        if past is None:  # the newer code: nothing was sent to this layer
            return o
        return o + past.sum(dim=2, keepdim=True) - past

    x = w["model.tok_embeddings.weight"][tokens][:, :, None, :].expand(B, S, L, D)
    sent_attn, sent_mlp = [], []
    for i in range(n):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "attention_norm.weight"], eps)
        q = _rope(_lanes(h, w[p + "attention.wq.weight"]).reshape(B, S, H, hd), cis).transpose(1, 2)
        k = _rope(_lanes(h, w[p + "attention.wk.weight"]).reshape(B, S, KV, hd), cis).transpose(1, 2)
        v = _lanes(h, w[p + "attention.wv.weight"]).reshape(B, S, KV, hd).transpose(1, 2)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        allowed = causal & (k_idx > q_idx - window) if i in windowed else causal
        scores = (q @ k.transpose(2, 3)) * hd**-0.5
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32)
        out = (probs @ v).transpose(1, 2).reshape(B, S, L, H * hd // L)
        o = _lanes(out, w[p + "attention.wo.weight"])
        past = sent_attn[i - d] if i >= d else None
        x = x + reduce(o, modes[i][0], past)
        sent_attn.append(o if sends[i] else None)

        h = _rms(x, w[p + "ffn_norm.weight"], eps)
        o = _lanes(torch.nn.functional.silu(_lanes(h, w[p + "feed_forward.w1.weight"]))
                   * _lanes(h, w[p + "feed_forward.w3.weight"]), w[p + "feed_forward.w2.weight"])
        past = sent_mlp[i - d] if i >= d else None
        x = x + reduce(o, modes[i][1], past)
        sent_mlp.append(o if sends[i] else None)

    if _get(cfg, "pre_norm_lane_agg"):
        h = _rms(x.sum(dim=2), w["model.norm.weight"], eps)
    else:
        h = _rms(x, w["model.norm.weight"], eps).mean(dim=2)
    head = w["model.tok_embeddings.weight"] if _get(cfg, "tie_word_embeddings") else w["lm_head.weight"]
    return h @ head.T
