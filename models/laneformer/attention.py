"""The attention kernels a Laneformer runs with, chosen in one place.

``model_registry(flavor, attn_backend=...)`` puts the kernel into the model
config, as torchtitan's llama3 ``model_registry`` does. The backends:

- ``"flex"`` / ``"flex_flash"``: torchtitan's FlexAttention (the GPU kernels);
- ``"dense"``: ``DenseMaskFlexAttention``, FlexAttention's interface computed
  with SDPA and a dense boolean mask, because flex_attention has no backward on
  CPU. Its mask is the BlockMask's own ``mask_mod``, so masks are defined once
  for both kernels;
- ``"auto"``: ``backend_for(device)`` of the device the model will run on.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.config_utils import get_attention_config
from torchtitan.protocols.module import Module

BACKENDS = ("auto", "flex", "flex_flash", "dense")


def backend_for(device: str | torch.device | None = None) -> str:
    """The kernel for a device (default: CUDA when present): flex on CUDA, dense elsewhere."""
    if device is None:
        return "flex" if torch.cuda.is_available() else "dense"
    return "flex" if torch.device(device).type == "cuda" else "dense"


def attention_config(backend: str = "auto") -> Module.Config:
    """The ``inner_attention`` config of a backend name (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; known: {list(BACKENDS)}")
    if backend == "auto":
        backend = backend_for()
    if backend == "dense":
        return DenseMaskFlexAttention.Config()
    return get_attention_config(backend)


def dense_mask_from_block_mask(block_mask: BlockMask) -> torch.Tensor:
    """Evaluate ``block_mask.mask_mod`` on every (b, h, q, kv): a boolean
    tensor [B_mask, H_mask, Q, KV] (B_mask/H_mask as the BlockMask was built,
    usually [B, 1, S, S]) that broadcasts against SDPA's [B, H, Q, KV]."""
    q_len, kv_len = block_mask.seq_lengths
    n_b, n_h = block_mask.kv_num_blocks.shape[:2]
    device = block_mask.kv_num_blocks.device
    b = torch.arange(n_b, device=device).view(-1, 1, 1, 1)
    h = torch.arange(n_h, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    mask = block_mask.mask_mod(b, h, q, kv)
    return mask.to(torch.bool).expand(n_b, n_h, q_len, kv_len)


def carrier_block_mask(mask_mod, B: int, H: int | None, Q_LEN: int, KV_LEN: int, device) -> BlockMask:
    """``create_block_mask``'s signature, for DenseMaskFlexAttention: one partial block the size of the
    whole (Q_LEN, KV_LEN), so the BlockMask only carries ``mask_mod`` and the lengths, all that SDPA's
    dense mask is made from. ``create_block_mask`` evaluates ``mask_mod`` at every (q, kv) under vmap
    to find the empty blocks, a sparsity SDPA cannot use: ~4 ms a mask at 4 x 64 tokens on one core
    (0.2 ms here), two masks a micro batch of the tiny model."""
    shape = (B, H or 1, 1)
    return BlockMask.from_kv_blocks(torch.ones(shape, dtype=torch.int32, device=device),
                                    torch.zeros((*shape, 1), dtype=torch.int32, device=device),
                                    BLOCK_SIZE=(Q_LEN, KV_LEN), mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))


class DenseMaskFlexAttention(FlexAttention):
    """FlexAttention's interface computed with SDPA and a dense boolean mask.

    O(S^2) memory: for tests and small CPU runs only. (A query whose mask row
    is empty gets 0 from SDPA, as from flex.)
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        score_mod=None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform=None,
        **kwargs,
    ) -> torch.Tensor:
        assert isinstance(
            attention_masks, BlockMask
        ), f"attention_masks must be a BlockMask, got {type(attention_masks)}"
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError(
                "DenseMaskFlexAttention supports mask_mod only (no score_mod, "
                "no lse/out_transform)"
            )
        mask = dense_mask_from_block_mask(attention_masks)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)
