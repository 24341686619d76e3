"""Native ``Laneformer.Config`` <-> Hugging Face ``config.json`` keys.

An export must carry every architecture field, or the Hub model would be a
different network than the one trained; an import must say which fields a
released config did not have, because they silently take defaults. Released
keys are interpreted in one place, ``LaneformerConfig`` (the remote code),
so transformers and this importer read a config the same way.
"""

import dataclasses
import inspect
import json
from pathlib import Path

from torchtitan.protocols.model import BaseModel
from transformers import PretrainedConfig

from ..model import Laneformer
from .configuration_laneformer import LaneformerConfig

# native field -> HF key (released names where the release has one).
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
    "norm_eps": "norm_eps",
    "n_lanes": "num_lanes",
    "delay": "broadcast_delay",
    "early_mode": "early_mode",
    "early_send_forward": "early_send_forward",
    "late_mode": "late_mode",
    "final_agg": "final_agg",
    "window_size": "sliding_window",
    "window_layers": "swa_layers",
}
# Released keys a native field can also be read from (see LaneformerConfig).
RELEASED_SOURCES = {
    "delay": ("use_comm",),
    "early_mode": ("use_early_comm",),
    "final_agg": ("pre_norm_lane_agg",),
    "window_layers": ("sliding_window_n_layers",),
}
# Training-only fields: no effect on the function the weights compute.
NOT_ARCHITECTURE = {f.name for f in dataclasses.fields(BaseModel.Config)} | {"init_std", "inner_attention"}
CONFIG_FILE = "laneformer_config.json"


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


def native_config(raw: dict, overrides: dict | None = None) -> tuple[Laneformer.Config, list[str], list[str]]:
    """(native config, fields the HF config lacked, HF keys that were ignored) of a config.json dict."""
    hf = LaneformerConfig.from_dict(raw)
    fields, missing = {}, []
    for native, key in NATIVE_TO_HF.items():
        if key not in raw and not any(k in raw for k in RELEASED_SOURCES.get(native, ())):
            missing.append(native)
        fields[native] = getattr(hf, key)
    if hf.sliding_window is None:  # no windowed layer: the window size is unused
        fields.pop("window_size")
        if "window_size" not in missing:
            missing.append("window_size")
    config = Laneformer.Config(**{**fields, **(overrides or {})})
    missing = [f"{n}={getattr(config, n)!r}" for n in missing if n not in (overrides or {})]
    known = set(inspect.signature(LaneformerConfig.__init__).parameters) | set(PretrainedConfig().to_dict()) | {
        "auto_map", "layer_types", "pad_token_id", "torch_dtype",
    }
    ignored = sorted(k for k in raw if k not in known)
    return config, missing, ignored


def native_fields(config: Laneformer.Config) -> dict:
    """The JSON-serialisable fields of a native config (what ``laneformer_config.json`` holds)."""
    return {n: getattr(config, n) for n in _architecture_fields(config) + ["init_std"]}


def write_native_config(config: Laneformer.Config, folder: Path) -> None:
    (folder / CONFIG_FILE).write_text(json.dumps(native_fields(config), indent=2) + "\n")


def read_native_config(path: Path, overrides: dict | None = None) -> Laneformer.Config:
    return Laneformer.Config(**{**json.loads(path.read_text()), **(overrides or {})})
