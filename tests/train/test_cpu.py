"""train.cpu: the CPU-only adjustments that let torchtitan's Trainer run here.

The dense-mask attention fallback is checked against real flex_attention; the
trainer itself runs on CPU in tests/train/test_train.py.
"""

import sys

import pytest
import torch

from train.cpu import (
    DenseMaskFlexAttention,
    adapt_config,
    dense_mask_from_block_mask,
    has_gpu,
    use_cpu_if_no_gpu,
)

cpu_only = pytest.mark.skipif(has_gpu(), reason="tests the CPU-only path")


@cpu_only
def test_use_cpu_patches_already_imported_modules():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils
    import torchtitan.trainer  # noqa: F401

    assert use_cpu_if_no_gpu() is True
    assert use_cpu_if_no_gpu() is True  # idempotent
    for module in (tt_utils, metrics, dist_utils):
        assert module.device_type == "cpu"
        assert module.device_module is tt_utils.device_module
    leftover = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("torchtitan")
        and module is not None
        and vars(module).get("device_type") == "cuda"
    ]
    assert leftover == []


@cpu_only
def test_tiny_recipe_gets_cpu_settings():
    from train import recipe as R
    from train.build import trainer_config

    config = trainer_config(R.load("tiny.toml"))
    assert type(config.model_spec.model.inner_attention) is DenseMaskFlexAttention.Config
    assert config.training.mixed_precision_param == "float32"
    assert config.training.disable_cuda_graphs
    assert config.comm.train_timeout_seconds >= 600
    fn = config.model_spec.parallelize_fn
    assert adapt_config(config).model_spec.parallelize_fn is fn  # idempotent


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
