"""Parameter and FLOP accounting for MFU.

FLOPs per token = 6 * (parameters in matmuls) + attention. The lane-batched
projections do exactly the FLOPs of the dense model (each lane multiplies its
own slice), so the 6N rule holds with N excluding the embedding lookup. Each
attention layer adds 6 * n_heads * 2 * head_dim * context per token (QK^T and
AV, forward and backward, no causal discount, as torchtitan counts), where a
sliding-window layer's context is ``min(window, seq_len)``.
"""

import torch
from torch import nn


def attention_flops_per_token(config, seq_len: int) -> int:
    per_context = 6 * config.n_heads * 2 * config.head_dim
    return sum(
        per_context * min(config.window_of(i) or seq_len, seq_len) for i in range(config.n_layers)
    )


def nparams_and_flops_per_token(config, model: nn.Module, seq_len: int) -> tuple[int, int]:
    nparams = sum(p.numel() for p in model.parameters())
    n_embedding = config.vocab_size * config.dim
    return nparams, 6 * (nparams - n_embedding) + attention_flops_per_token(config, seq_len)


def flops_per_token(config, seq_len: int) -> int:
    """FLOPs per token at ``seq_len``, the parameters counted on the meta device (no memory): the
    planner's figure at lengths the recipe does not train at."""
    with torch.device("meta"):
        model = config.build()
    return nparams_and_flops_per_token(config, model, seq_len)[1]
