"""What the model tests share: lane-parallel decoding's configs and a model on given weights
(also used by tests/e2e/test_lane_parallel_decode.py)."""

from __future__ import annotations

import torch


# --- lane-parallel decoding (tests/models/test_generate.py, tests/e2e/test_lane_parallel_decode.py) ---

# Every exchange variant Laneformer.Config supports, and its RoPE per layer type, as overrides of the tiny
# shape with 6 layers (with delay 2 the middle layers 2 and 3 send to 4 and 5) and a window of 3 that binds.
DECODE_BASE = {"n_layers": 6, "window_size": 3, "window_layers": [0, 1, 2]}
DECODE_VARIANTS = {
    "default": {},
    "delay 0": {"delay": 0},
    "delay 1": {"delay": 1},
    "early scaled": {"early_mode": "scaled"},
    "early sends forward": {"early_send_forward": True},
    "late flush": {"late_mode": "flush"},
    "late present": {"late_mode": "present"},
    "norm of sum": {"final_agg": "norm_of_sum"},
    "no delayed exchange": {"delayed_exchange": False},
    "delay 1, scaled+send, flush, norm of sum": {"delay": 1, "early_mode": "scaled", "early_send_forward": True,
                                                 "late_mode": "flush", "final_agg": "norm_of_sum"},
    "delay 4 > layers/2, flush": {"delay": 4, "early_send_forward": True, "late_mode": "flush"},
    # not an exchange: RoPE per layer type (layers 3-5 rotate differently and scale their logits), past 4 tokens
    "rope: global theta, yarn": {"rope_theta_global": 5e5, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                                 "rope_original_seq_len": 4},
}
DECODE_PROMPT = [1, 5, 9, 200, 31, 7]


def decode_config(**overrides):
    """The tiny flavor with DECODE_BASE and ``overrides``, dense attention (CPU)."""
    import dataclasses

    from models.laneformer import laneformer_configs
    from models.laneformer.attention import attention_config

    return dataclasses.replace(laneformer_configs["tiny"](), **{**DECODE_BASE, **overrides},
                               inner_attention=attention_config("dense"))


def model_from_weights(config, weights):
    """A Laneformer that uses ``weights`` (native names) in place, in eval mode, on CPU."""
    from models.laneformer.model import Laneformer

    with torch.device("meta"):
        model = Laneformer(config)
    model.load_state_dict(weights, assign=True)
    for module in model.modules():  # RoPE caches are not in the state dict
        if hasattr(module, "_init_self_buffers"):
            module._init_self_buffers(buffer_device=torch.device("cpu"))
    return model.eval()
