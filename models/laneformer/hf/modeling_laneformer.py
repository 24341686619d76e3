"""Laneformer for Hugging Face transformers, in plain torch (remote code).

Copied into every exported folder, so it imports only torch and transformers
and re-implements the training model (``models/laneformer/model.py``) from
its definition rather than importing it:

- the hidden state is ``[B, S, L, D]``: one full residual stream per lane;
- lane-batched projections ``einsum("bsli,loi->bslo")`` with weights
  ``[L, out/L, D]`` (wq, wk, wv, w1, w3) and ``[L, D, in/L]`` (wo, w2);
- attention folds lanes into heads (lane-major: lane ``l`` owns query heads
  ``l*H/L ...`` and the KV heads of their GQA groups), complex interleaved
  RoPE at the token positions, a causal mask with a per-layer window
  (``swa_layers`` attend to the last ``sliding_window`` tokens);
- RoPE per layer type: window layers rotate with ``rope_theta``; full layers
  with ``rope_theta_global`` (null: ``rope_theta``) and ``rope_scaling_type``
  ("llama": Llama 3.1's, "yarn": YaRN's, whose layers also scale their
  attention logits), by ``rope_scaling_factor`` over
  ``rope_original_max_position_embeddings``;
- the delayed exchange of partial outputs between lanes, per sub-block:
  early layers (``i < broadcast_delay``) all-reduce ("present") or scale their
  own output by sqrt(L) ("scaled"); the others add their own output plus what
  the other lanes produced ``broadcast_delay`` layers earlier (with
  ``use_comm`` false: their own output scaled by sqrt(L), no exchange); the
  last ``broadcast_delay`` layers drop, flush (add before the final norm) or
  all-reduce what would never arrive; ``early_send_forward`` makes early
  layers send as well; a layer sends only what a later layer or the flush
  receives;
- the final lane aggregation: mean over lanes of the normed streams, or the
  norm of their sum.

The exchange runs along layers, never along time, so a KV cache is all that
generation needs: transformers' cache (``layer_types`` in the config makes it
keep only a window of keys for window layers); masks are built from the token
indices of whatever keys the cache returns, so both full and windowed caches
are honoured. Rotations are computed from the positions at each call, with no
table, so generation runs past ``max_position_embeddings`` (transformers then
warns; without ``max_new_tokens`` its ``generate`` stops at that length, or
refuses a longer prompt).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_laneformer import LaneformerConfig

# transformers renamed the cache argument and output from ``past_key_values`` to
# ``cache`` during 5.x: the forward accepts either and returns the current name.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class LaneLinear(nn.Module):
    """Lane ``l`` maps ``x[..., l, :]`` with ``weight[l]`` (shape ``[L, out, in]``, per lane)."""

    def __init__(self, n_lanes, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_lanes, out_features, in_features))

    def forward(self, x):
        return torch.einsum("bsli,loi->bslo", x, self.weight)


def rope_frequencies(config, full, device=None):
    """The rotation frequencies ``[head_dim/2]`` of a window layer (``full`` false) or a full-attention layer."""
    hd = config.head_dim
    theta = config.rope_theta_global if full and config.rope_theta_global is not None else config.rope_theta
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2, device=device)[: hd // 2].float() / hd))
    kind = config.rope_scaling_type if full else "none"
    s, n = config.rope_scaling_factor, config.rope_original_max_position_embeddings
    if kind == "llama":
        # Llama 3.1 (low_freq_factor 1, high_freq_factor 4): wavelengths over n tokens turn s times slower,
        # those under n/4 keep their speed, those between are blended.
        wavelen = 2 * math.pi / freqs
        smooth = ((n / wavelen - 1) / (4 - 1)).clamp(0, 1)
        freqs = (1 - smooth) * freqs / s + smooth * freqs
    elif kind == "yarn":
        # YaRN's NTK-by-parts (beta_fast 32, beta_slow 1): dimensions turning under once in n tokens turn
        # s times slower, those turning over 32 times keep their speed, a linear ramp over the dimensions between.
        def dim_turning(turns):
            return hd * math.log(n / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(math.floor(dim_turning(32)), 0), min(math.ceil(dim_turning(1)), hd - 1)
        ramp = ((torch.arange(hd // 2, device=device).float() - low) / max(high - low, 0.001)).clamp(0, 1)
        freqs = freqs / s * ramp + freqs * (1 - ramp)
    return freqs


def attention_scale(config, full):
    """The attention logits' scale: None (1/sqrt(head_dim)) but on YaRN's full layers,
    (0.1 ln s + 1)^2 / sqrt(head_dim) (YaRN, arXiv 2309.00071, section 3.4)."""
    if not full or config.rope_scaling_type != "yarn":
        return None
    return (0.1 * math.log(config.rope_scaling_factor) + 1) ** 2 / math.sqrt(config.head_dim)


def rope_rotation(positions, freqs):
    """Complex rotations ``[B, S, 1, head_dim/2]`` for integer ``positions`` ``[B, S]`` (fp32, Meta-Llama form)."""
    angles = positions[..., None].float() * freqs
    return torch.polar(torch.ones_like(angles), angles)[:, :, None, :]


def apply_rope(x, rotation):
    """Rotate adjacent pairs of ``x`` ``[B, S, heads, head_dim]``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotation).flatten(3).type_as(x)


def exchange_rule(config, layer):
    """(how layer ``layer`` adds its own partial outputs, whether it sends them to layer + delay).

    A send happens only where it is received: by layer + delay when that exists
    and exchanges, or by the final flush (``late_mode`` "flush").
    """
    n, d = config.num_hidden_layers, config.broadcast_delay
    if layer < d:
        reduce, sends = config.early_mode, config.early_send_forward
    elif not config.use_comm:
        return "scaled", False
    elif d == 0:
        return "present", False
    elif layer >= n - d and config.late_mode == "present":
        return "present", False
    else:
        reduce, sends = "own", True
    received = config.use_comm and (layer + d < n or config.late_mode == "flush")
    return reduce, sends and received


class LaneformerAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        L, hd = config.num_lanes, config.head_dim
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.window = config.sliding_window if layer_idx in config.swa_layers else None
        self.scale = attention_scale(config, full=self.window is None)
        self.wq = LaneLinear(L, config.hidden_size, self.n_heads * hd // L)
        self.wk = LaneLinear(L, config.hidden_size, self.n_kv_heads * hd // L)
        self.wv = LaneLinear(L, config.hidden_size, self.n_kv_heads * hd // L)
        self.wo = LaneLinear(L, self.n_heads * hd // L, config.hidden_size)

    def forward(self, x, rotations, token_index, key_is_real, cache):
        B, S, L, _ = x.shape
        rotation = rotations[self.window is None]
        q = apply_rope(self.wq(x).reshape(B, S, self.n_heads, self.head_dim), rotation).transpose(1, 2)
        k = apply_rope(self.wk(x).reshape(B, S, self.n_kv_heads, self.head_dim), rotation).transpose(1, 2)
        v = self.wv(x).reshape(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # The cache returns the most recent keys: their token indices end at the last query's.
        T = k.shape[2]
        q_idx = token_index[:, None]
        kv_idx = token_index[-1] - T + 1 + torch.arange(T, device=x.device)[None, :]
        allowed = kv_idx <= q_idx
        if self.window is not None:
            allowed = allowed & (q_idx - kv_idx < self.window)
        # Padding keys are hidden; a padding query still sees itself, so no row is empty.
        allowed = allowed[None, None] & (key_is_real[:, None, None, -T:] | (kv_idx == q_idx)[None, None])
        group = self.n_heads // self.n_kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=allowed, scale=self.scale
        )
        return self.wo(out.transpose(1, 2).reshape(B, S, L, -1))


class LaneformerMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        L, h = config.num_lanes, config.intermediate_size // config.num_lanes
        self.w1 = LaneLinear(L, config.hidden_size, h)
        self.w3 = LaneLinear(L, config.hidden_size, h)
        self.w2 = LaneLinear(L, h, config.hidden_size)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LaneformerDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention = LaneformerAttention(config, layer_idx)
        self.feed_forward = LaneformerMLP(config)
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.reduce, self.sends = exchange_rule(config, layer_idx)
        self.lane_scale = math.sqrt(config.num_lanes)

    def _add(self, x, o, arrival):
        """Add partial outputs ``o`` ``[B, S, L, D]``; return (x, what the other lanes send forward)."""
        if self.reduce == "present":
            x = x + o.sum(dim=2, keepdim=True)
        elif self.reduce == "scaled":
            x = x + self.lane_scale * o
        else:
            x = x + o
        if arrival is not None:
            x = x + arrival
        return x, (o.sum(dim=2, keepdim=True) - o if self.sends else None)

    def forward(self, x, arrivals, rotations, token_index, key_is_real, cache):
        o = self.attention(self.attention_norm(x), rotations, token_index, key_is_real, cache)
        x, attn_sent = self._add(x, o, arrivals[0])
        x, mlp_sent = self._add(x, self.feed_forward(self.ffn_norm(x)), arrivals[1])
        return x, (attn_sent, mlp_sent)


class LaneformerPreTrainedModel(PreTrainedModel):
    config_class = LaneformerConfig
    base_model_prefix = "model"
    _no_split_modules = ["LaneformerDecoderLayer"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LaneLinear):
            init.normal_(module.weight, mean=0.0, std=0.02)


class LaneformerModel(LaneformerPreTrainedModel):
    """Embeddings copied to every lane, the lane blocks with their exchange, the final lane aggregation."""

    def __init__(self, config):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LaneformerDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.tok_embeddings

    def set_input_embeddings(self, value):
        self.tok_embeddings = value

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        cfg = self.config
        B, S = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        token_index = torch.arange(past, past + S, device=input_ids.device)
        if attention_mask is None:
            attention_mask = torch.ones(B, past + S, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            # Left padding: positions count real tokens only.
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -S:]
        # by layer type: {False: window layers, True: full-attention layers}
        rotations = {full: rope_rotation(position_ids, rope_frequencies(cfg, full, input_ids.device))
                     for full in (False, True)}
        key_is_real = attention_mask.bool()

        x = self.tok_embeddings(input_ids)[:, :, None, :].expand(-1, -1, cfg.num_lanes, -1)
        in_flight = {}  # layer -> (attention, mlp) outputs of the other lanes, due at layer + delay
        for i, layer in enumerate(self.layers):
            arrivals = in_flight.pop(i - cfg.broadcast_delay, (None, None))
            x, sent = layer(x, arrivals, rotations, token_index, key_is_real, cache)
            if sent[0] is not None:
                in_flight[i] = sent
        for attn_sent, mlp_sent in in_flight.values():  # sent past the last layer: late_mode "flush" only
            x = x + attn_sent + mlp_sent
        if cfg.final_agg == "mean_of_norms":
            return self.norm(x).mean(dim=2)
        return self.norm(x.sum(dim=2))


class LaneformerForCausalLM(LaneformerPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = LaneformerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def set_input_embeddings(self, value):
        self.model.tok_embeddings = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("Laneformer takes a 2D padding attention_mask [batch, past + new tokens]")
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        hidden = self.model(input_ids, attention_mask, position_ids, cache if use_cache else None)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
