"""Native ``Laneformer.Config`` <-> this project's Hugging Face ``config.json`` keys.

An export must carry every architecture field, or the Hub model would be a
different network than the one trained. A project export is read back by
the remote code's ``LaneformerConfig``, so transformers and the importer
read it the same way; Kog's own releases are read by ``kog_releases.py``.
"""

import dataclasses
import inspect

from torchtitan.protocols.model import BaseModel
from transformers import PretrainedConfig

from ..model import Laneformer
from .configuration_laneformer import LaneformerConfig

# native field -> HF key (released names where the release has one with the same meaning).
NATIVE_TO_HF = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_hidden_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rope_theta_global": "rope_theta_global",
    "rope_scaling": "rope_scaling_type",  # transformers owns "rope_scaling" (configuration_laneformer.py)
    "rope_scaling_factor": "rope_scaling_factor",
    "rope_original_seq_len": "rope_original_max_position_embeddings",
    "norm_eps": "norm_eps",
    "n_lanes": "num_lanes",
    "delay": "broadcast_delay",
    "early_mode": "early_mode",
    "early_send_forward": "early_send_forward",
    "late_mode": "late_mode",
    "delayed_exchange": "use_comm",
    "final_agg": "final_agg",
    "window_size": "sliding_window",
    "window_layers": "swa_layers",
}
# Training-only fields: no effect on the function the weights compute.
NOT_ARCHITECTURE = {f.name for f in dataclasses.fields(BaseModel.Config)} | {"init_std", "inner_attention"}


def _architecture_fields(config: Laneformer.Config) -> list[str]:
    names = [f.name for f in dataclasses.fields(config) if f.name not in NOT_ARCHITECTURE]
    unmapped = [n for n in names if n not in NATIVE_TO_HF]
    if unmapped:
        raise ValueError(f"Laneformer.Config fields {unmapped} have no Hugging Face key; add them to NATIVE_TO_HF")
    return names


def hf_config(config: Laneformer.Config) -> LaneformerConfig:
    """The HF config of a native model config (every architecture field, untied embeddings)."""
    fields = {NATIVE_TO_HF[n]: getattr(config, n) for n in _architecture_fields(config)}
    return LaneformerConfig(**fields, tie_word_embeddings=False)


def config_json(config: LaneformerConfig) -> dict:
    """What config.json holds: every architecture key, plus the generic keys that differ from defaults."""
    keys = [*NATIVE_TO_HF.values(), "tie_word_embeddings", "bos_token_id", "eos_token_id"]
    return {**config.to_diff_dict(), **{k: getattr(config, k) for k in keys}}


def native_from_hf(raw: dict) -> tuple[dict, list[str], list[str]]:
    """(native fields, fields whose key was absent, keys with no native field) of a project config.json."""
    hf = LaneformerConfig.from_dict(raw)
    fields = {native: getattr(hf, key) for native, key in NATIVE_TO_HF.items()}
    absent = [native for native, key in NATIVE_TO_HF.items() if key not in raw]
    if hf.sliding_window is None:  # no windowed layer: the window size is unused
        fields.pop("window_size")
    known = set(inspect.signature(LaneformerConfig.__init__).parameters) | set(PretrainedConfig().to_dict()) | {
        "auto_map", "layer_types", "pad_token_id", "torch_dtype",
    }
    return fields, absent, sorted(k for k in raw if k not in known)
