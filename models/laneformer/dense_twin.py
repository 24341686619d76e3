"""The dense twin of a Laneformer: torchtitan's own llama3 with the same parameter count.

Lanes keep the projection FLOPs of a dense model and make the residual stream
L times wider; every "what do lanes cost" figure (``bench.lanes_vs_dense``,
``train.py --plan``'s roofline) is a ratio against this twin, so it is built
in one place.
"""

from __future__ import annotations

import torch


def llama3_twin(lane_config):
    """torchtitan's own llama3 at the Laneformer's depth, width, heads, MLP and vocab.

    Untied embeddings and one norm weight per layer norm, as Laneformer, so the
    parameter counts are equal (checked by the callers). Same RoPE per layer
    (``rope_of``), same inner attention kernel.
    """
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    c = lane_config
    if c.n_heads * c.head_dim != c.dim:
        raise ValueError("the dense twin needs n_heads * head_dim == dim")
    init = {"weight": lambda w: torch.nn.init.trunc_normal_(w, std=0.02)}
    ones = {"weight": torch.nn.init.ones_}
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=c.dim, eps=c.norm_eps, param_init=ones),
            ffn_norm=RMSNorm.Config(normalized_shape=c.dim, eps=c.norm_eps, param_init=ones),
            attention=make_gqa_config(
                dim=c.dim, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, wqkv_param_init=init,
                wo_param_init=init, inner_attention=c.inner_attention, fuse_qkv=True, rope=c.rope_of(i),
            ),
            feed_forward=make_ffn_config(
                dim=c.dim, hidden_dim=c.ffn_hidden_dim, w1_param_init=init, w2w3_param_init=init
            ),
        )
        for i in range(c.n_layers)
    ]
    return Llama3Model.Config(
        dim=c.dim,
        vocab_size=c.vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=c.vocab_size, embedding_dim=c.dim,
            param_init={"weight": lambda w: torch.nn.init.normal_(w, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=c.dim, eps=c.norm_eps, param_init=ones),
        lm_head=Linear.Config(in_features=c.dim, out_features=c.vocab_size, param_init=init),
        layers=layers,
    )
