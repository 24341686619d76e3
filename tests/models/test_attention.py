"""The attention kernels: the CPU dense-mask kernel against real flex_attention,
and model_registry's one choice of kernel."""

import pytest
import torch
from torchtitan.models.common.attention import FlexAttention

from models.laneformer import model_registry
from models.laneformer.attention import DenseMaskFlexAttention, backend_for, dense_mask_from_block_mask


def test_model_registry_chooses_the_kernel_by_backend_name():
    assert type(model_registry("tiny", attn_backend="dense").model.inner_attention) is DenseMaskFlexAttention.Config
    assert type(model_registry("tiny", attn_backend="flex").model.inner_attention) is FlexAttention.Config
    auto = model_registry("tiny", delay=1).model
    assert type(auto.inner_attention) is type(model_registry("tiny", attn_backend=backend_for()).model.inner_attention)
    assert auto.delay == 1
    assert backend_for("cpu") == "dense" and backend_for("cuda:1") == "flex"
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        model_registry("tiny", attn_backend="sdpa")


@pytest.mark.parametrize("batch", [1, 2])
def test_dense_mask_attention_matches_flex(batch):
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
    from torchtitan.models.common.attention import (
        get_causal_mask_mod,
        get_document_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
        get_sliding_window_mask_mod,
    )

    torch.manual_seed(0)
    S, H, KV, D = 96, 4, 2, 16
    positions = torch.stack(
        [
            torch.cat([torch.arange(30), torch.arange(50), torch.arange(16)]),
            torch.cat([torch.arange(7), torch.arange(89)]),
        ]
    )[:batch]
    causal, window = get_causal_mask_mod(), get_sliding_window_mask_mod(20)
    document = get_document_mask_mod(positions)
    masks = {
        "causal": [causal],
        "causal+document": [causal, document],
        "causal+packed_document": [
            causal,
            get_efficient_causal_mask_mod_for_packed_document(positions),
        ],
        "causal+document+sliding_window": [causal, document, window],
    }
    q = torch.randn(batch, S, H, D)
    k, v = torch.randn(batch, S, KV, D), torch.randn(batch, S, KV, D)
    attention = DenseMaskFlexAttention.Config().build()
    for name, mods in masks.items():
        block_mask = create_block_mask(and_masks(*mods), batch, None, S, S, device="cpu")
        ref = flex_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            block_mask=block_mask, enable_gqa=True,
        ).transpose(1, 2)
        out = attention(q, k, v, attention_masks=block_mask, enable_gqa=True)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5, msg=name)


def test_torchtitan_compiled_create_block_mask_works_on_cpu():
    from torch.nn.attention.flex_attention import and_masks, create_block_mask
    from torchtitan.models.common.attention import (
        create_attention_mask,
        get_causal_mask_mod,
        get_document_mask_mod,
        get_sliding_window_mask_mod,
    )

    positions = torch.cat([torch.arange(40), torch.arange(24)]).repeat(2, 1)
    mod = and_masks(
        get_causal_mask_mod(), get_document_mask_mod(positions), get_sliding_window_mask_mod(16)
    )
    compiled = create_attention_mask(mod, 2, None, 64, 64, device="cpu")
    eager = create_block_mask(mod, 2, None, 64, 64, device="cpu")
    assert torch.equal(compiled.to_dense(), eager.to_dense())
    assert torch.equal(dense_mask_from_block_mask(compiled), dense_mask_from_block_mask(eager))
