"""Kog's released configs: which code revision a ``config.json`` is written for, and
the native ``Laneformer.Config`` that computes exactly what that code computes.

The same key means different things in Kog's two revisions, and absent keys
take each revision's own defaults, so an import reads the revision first:

- ``model_type "laneformer_tp"``: the older code (``LaneformerTPConfig``). Every
  layer sends its partial outputs forward, the early ones too (with
  ``use_early_comm`` the other lanes' early outputs count twice); the last
  ``broadcast_delay`` layers' sends never arrive. ``use_comm=false``: layers
  from ``broadcast_delay`` on add sqrt(L) times their own output, nothing
  else. Windowed layers: ``i < sliding_window_n_layers`` (``N < 0``: the last
  ``-N``), except ``unclamped_layers``, which attend fully. Absent keys take
  that class's defaults (``num_lanes`` 1, ``broadcast_delay`` 1, ...). Keys
  the code does not read have no effect and are listed as ignored.
- ``model_type "laneformer"`` without this project's keys: the newer code, as
  far as public descriptions of it go. The first and the last
  ``broadcast_delay`` layers send nothing forward; ``use_attention_comm`` /
  ``use_mlp_comm`` false scale a sub-block's own output instead of exchanging;
  ``swa_layers`` lists the windowed layers. Its defaults are not public, so
  the shape keys must be present, and keys it is not known to read are
  refused unless the caller names them as ignorable.
- ``model_type "laneformer"`` with this project's keys (``early_mode``,
  ``early_send_forward``, ``late_mode``, ``final_agg``): a project export,
  read by the remote code's ``LaneformerConfig``.

A config these rules cannot reproduce exactly raises ``ReleaseConfigError``
naming the key. ``laneformer_tp_keys`` goes the other way: the older
revision's keys for a native config, when that code can compute the same
function.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..model import Laneformer
from .config_map import native_from_hf

# LaneformerTPConfig's defaults: what the older code uses for an absent key.
KOG_TP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "intermediate_size": 4 * 4096,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "num_lanes": 1,
    "broadcast_delay": 1,
    "use_comm": True,
    "use_early_comm": True,
    "lm_head_type": "replicate",
    "pre_norm_lane_agg": False,
    "replicated_rmsn_scale": True,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "sliding_window_n_layers": 0,
    "unclamped_layers": [],
}
# Keys of the newer code whose values set the shapes or the numbers: no public defaults.
NEWER_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size", "num_lanes", "broadcast_delay", "rope_theta", "norm_eps")
# Optional keys of the newer code, with the older code's defaults (the same config class, extended).
NEWER_OPTIONAL = {
    "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 4096,
    "use_early_comm": True, "use_attention_comm": True, "use_mlp_comm": True,
    "lm_head_type": "replicate", "pre_norm_lane_agg": False, "replicated_rmsn_scale": True,
    "tie_word_embeddings": False, "sliding_window": None, "swa_layers": None,
    "scaling_args": None, "rope_scaling": None,
}
# Older keys a newer config may carry only at the value that does nothing.
NEWER_INERT = {"use_comm": True, "sliding_window_n_layers": 0, "unclamped_layers": []}
# Keys that only shape initialisation, kernels, caching or generation in both revisions.
NO_EFFECT = {
    "multiple_of", "depth_init", "use_flex_attn", "attn_mask_type", "use_cache", "layer_types",
    "model_type", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
}
PROJECT_KEYS = ("early_mode", "early_send_forward", "late_mode", "final_agg")


class ReleaseConfigError(ValueError):
    """A config.json key whose meaning the import cannot reproduce exactly."""

    def __init__(self, key: str, why: str):
        self.key = key
        super().__init__(f"{key}: {why}")


@dataclass
class ReleaseMapping:
    """How a config.json became native fields: for the import's printout and checks."""

    revision: str
    fields: dict  # native field -> value
    sources: dict = field(default_factory=dict)  # native field -> where the value came from
    ignored: list[str] = field(default_factory=list)  # keys with no effect on the logits
    tie_embeddings: bool = False  # lm_head is tok_embeddings

    def lines(self, overrides: dict | None = None) -> list[str]:
        """The printout: every native field and its source; ``overrides`` (``--set``) replace fields."""
        overrides = overrides or {}
        out = [f"read as: {self.revision}"]
        for name, value in self.fields.items():
            source = self.sources.get(name, "")
            if name in overrides:
                value, source = overrides[name], f"--set (the config gave {value!r} <- {source})"
            out.append(f"  {name} = {value!r}  <- {source}")
        out += [f"  {name} = {value!r}  <- --set" for name, value in overrides.items() if name not in self.fields]
        if self.tie_embeddings:
            out.append("  lm_head <- tok_embeddings (tie_word_embeddings=true; untied from here on)")
        if self.ignored:
            out.append(f"keys ignored (no effect on the logits): {', '.join(self.ignored)}")
        return out


def read_release(raw: dict, ignorable: tuple[str, ...] = ()) -> ReleaseMapping:
    """The native fields that compute what the code ``raw`` (a config.json dict) was written for."""
    model_type = raw.get("model_type")
    if model_type == "laneformer_tp":
        return _from_laneformer_tp(raw)
    if model_type == "laneformer":
        if any(k in raw for k in PROJECT_KEYS):
            return _from_project(raw)
        return _from_newer(raw, ignorable)
    raise ReleaseConfigError("model_type", f"{model_type!r}; expected 'laneformer_tp' (Kog's older code) "
                                          "or 'laneformer' (Kog's newer code, or a project export)")


class _Reader:
    """Reads keys with a revision's defaults and records where each native field came from."""

    def __init__(self, raw: dict, defaults: dict, revision: str):
        self.raw, self.defaults = raw, defaults
        self.mapping = ReleaseMapping(revision, {})

    def get(self, key: str):
        return self.raw[key] if key in self.raw else self.defaults[key]

    def src(self, key: str) -> str:
        return f"{key}={self.raw[key]!r}" if key in self.raw else f"{key} absent: default {self.defaults[key]!r}"

    def set(self, name: str, value, source: str) -> None:
        self.mapping.fields[name] = value
        self.mapping.sources[name] = source


def _shape_fields(r: _Reader) -> None:
    hidden, heads = r.get("hidden_size"), r.get("num_attention_heads")
    r.set("dim", hidden, r.src("hidden_size"))
    r.set("n_layers", r.get("num_hidden_layers"), r.src("num_hidden_layers"))
    r.set("n_heads", heads, r.src("num_attention_heads"))
    kv = r.get("num_key_value_heads")
    r.set("n_kv_heads", kv or heads, r.src("num_key_value_heads") + ("" if kv else " -> num_attention_heads"))
    r.set("head_dim", hidden // heads, "hidden_size // num_attention_heads, as Kog's code computes it")
    r.set("ffn_hidden_dim", r.get("intermediate_size"), r.src("intermediate_size"))
    r.set("vocab_size", r.get("vocab_size"), r.src("vocab_size"))
    r.set("max_seq_len", r.get("max_position_embeddings"), r.src("max_position_embeddings"))
    r.set("rope_theta", float(r.get("rope_theta")), r.src("rope_theta"))
    r.set("norm_eps", float(r.get("norm_eps")), r.src("norm_eps"))
    r.set("n_lanes", r.get("num_lanes"), r.src("num_lanes"))


def _head_and_norms(r: _Reader) -> None:
    """lm head, per-lane norm scales, tied embeddings, final aggregation: the same in both revisions."""
    if r.get("lm_head_type") != "replicate":
        raise ReleaseConfigError("lm_head_type", f"{r.get('lm_head_type')!r}: only 'replicate' (one [vocab, hidden] "
                                                 "lm_head on the lane-aggregated state) has a native equivalent")
    if not r.get("replicated_rmsn_scale"):
        raise ReleaseConfigError("replicated_rmsn_scale", "false (one norm scale per lane) has no native equivalent")
    pre = r.get("pre_norm_lane_agg")
    r.set("final_agg", "norm_of_sum" if pre else "mean_of_norms", r.src("pre_norm_lane_agg"))
    r.mapping.tie_embeddings = bool(r.get("tie_word_embeddings"))


def _window(r: _Reader, windowed: list[int], source: str) -> None:
    size = r.get("sliding_window")
    if windowed and not (isinstance(size, int) and size >= 1):
        raise ReleaseConfigError("sliding_window", f"{size!r}, but layers {windowed} are windowed ({source}); "
                                                   "Kog's code needs a window size to build their mask")
    r.set("window_layers", windowed, source)
    if size is not None:
        r.set("window_size", size, r.src("sliding_window"))


def _from_laneformer_tp(raw: dict) -> ReleaseMapping:
    r = _Reader(raw, KOG_TP_DEFAULTS, "laneformer_tp (Kog's older code, LaneformerTPConfig)")
    _shape_fields(r)
    n, d, comm = r.get("num_hidden_layers"), r.get("broadcast_delay"), r.get("use_comm")
    if not isinstance(d, int) or d < 0:
        raise ReleaseConfigError("broadcast_delay", f"{d!r}: expected an integer >= 0")
    if d == 0 and comm:
        raise ReleaseConfigError("broadcast_delay", "0 with use_comm=true: Kog's laneformer_tp code has layer 0 "
                                                    "receive from itself and fails")
    r.set("delay", d, r.src("broadcast_delay"))
    r.set("early_mode", "present" if r.get("use_early_comm") else "scaled", r.src("use_early_comm"))
    r.set("early_send_forward", True, "laneformer_tp sends every layer's outputs forward, the early ones too")
    r.set("late_mode", "drop", "laneformer_tp never adds what the last broadcast_delay layers send")
    r.set("delayed_exchange", bool(comm), r.src("use_comm"))
    _head_and_norms(r)
    k, unclamped = r.get("sliding_window_n_layers"), r.get("unclamped_layers")
    if not isinstance(k, int):
        raise ReleaseConfigError("sliding_window_n_layers", f"{k!r}: expected an integer")
    if not isinstance(unclamped, list) or not all(isinstance(i, int) for i in unclamped):
        raise ReleaseConfigError("unclamped_layers", f"{unclamped!r}: expected a list of layer indices")
    windowed = [i for i in range(n) if (i < k or i >= n + k) and i not in unclamped]
    _window(r, windowed, f"{r.src('sliding_window_n_layers')}, unclamped_layers={unclamped}")
    read = set(KOG_TP_DEFAULTS)
    r.mapping.ignored = sorted(key for key in raw if key not in read)
    return r.mapping


def _from_newer(raw: dict, ignorable: tuple[str, ...]) -> ReleaseMapping:
    for key in NEWER_REQUIRED:
        if key not in raw:
            raise ReleaseConfigError(key, "absent, and the default of Kog's newer code is not public")
    r = _Reader(raw, NEWER_OPTIONAL, "laneformer (Kog's newer code, as publicly described)")
    _shape_fields(r)
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != r.mapping.fields["head_dim"]:
        raise ReleaseConfigError("head_dim", f"{head_dim} differs from hidden_size // num_attention_heads = "
                                             f"{r.mapping.fields['head_dim']}, which Kog's code uses")
    for key in ("scaling_args", "rope_scaling"):
        if r.get(key) is not None:
            raise ReleaseConfigError(key, f"{r.get(key)!r}: scaled RoPE frequencies have no native equivalent")
    for key, inert in NEWER_INERT.items():
        if key in raw and raw[key] != inert:
            raise ReleaseConfigError(key, f"{raw[key]!r}: a laneformer_tp key, which Kog's newer code is not "
                                          f"known to read; only {inert!r} is safe to ignore")
    d = r.get("broadcast_delay")
    if not isinstance(d, int) or d < 0:
        raise ReleaseConfigError("broadcast_delay", f"{d!r}: expected an integer >= 0")
    r.set("delay", d, r.src("broadcast_delay"))
    r.set("early_mode", "present" if r.get("use_early_comm") else "scaled", r.src("use_early_comm"))
    r.set("early_send_forward", False, "the newer code sends nothing forward from the first broadcast_delay layers")
    r.set("late_mode", "drop", "the newer code sends nothing forward from the last broadcast_delay layers")
    attn, mlp = bool(r.get("use_attention_comm")), bool(r.get("use_mlp_comm"))
    if attn != mlp:
        off = "use_attention_comm" if not attn else "use_mlp_comm"
        raise ReleaseConfigError(off, "false while the other sub-block exchanges: per-sub-block exchange has "
                                      "no native equivalent")
    r.set("delayed_exchange", attn, f"{r.src('use_attention_comm')}, {r.src('use_mlp_comm')}")
    _head_and_norms(r)
    windowed = r.get("swa_layers") or []
    n = r.get("num_hidden_layers")
    if not isinstance(windowed, list) or not all(isinstance(i, int) and 0 <= i < n for i in windowed):
        raise ReleaseConfigError("swa_layers", f"{windowed!r}: expected layer indices in [0, {n})")
    _window(r, sorted(windowed), r.src("swa_layers"))
    known = set(NEWER_REQUIRED) | set(NEWER_OPTIONAL) | set(NEWER_INERT) | NO_EFFECT
    unknown = [key for key in raw if key not in known and key not in ignorable]
    if unknown:
        raise ReleaseConfigError(unknown[0], "not known to be read by Kog's newer code, so its effect cannot be "
                                             "reproduced (pass it as ignorable if it has none)")
    r.mapping.ignored = sorted(key for key in raw if key in NO_EFFECT or key in ignorable)
    return r.mapping


def _from_project(raw: dict) -> ReleaseMapping:
    fields, absent, ignored = native_from_hf(raw)
    sources = {name: ("absent: default" if name in absent else "this project's key") for name in fields}
    return ReleaseMapping("laneformer (a project export)", fields, sources, ignored)


def _windows_as_tp(config: Laneformer.Config) -> dict:
    """``sliding_window_n_layers`` (+ ``unclamped_layers``) for the native windowed layers."""
    n, w = config.n_layers, sorted(config.window_layers)
    if not w:
        return {"sliding_window_n_layers": 0, "unclamped_layers": []}
    if w == list(range(len(w))):
        return {"sliding_window_n_layers": len(w), "unclamped_layers": []}
    if w == list(range(n - len(w), n)):
        return {"sliding_window_n_layers": -len(w), "unclamped_layers": []}
    k = w[-1] + 1
    return {"sliding_window_n_layers": k, "unclamped_layers": [i for i in range(k) if i not in w]}


def laneformer_tp_keys(config: Laneformer.Config) -> tuple[dict, list[str]]:
    """(the older code's keys for ``config``, []) when that code computes the same function,
    else ({}, the reasons it cannot)."""
    why = []
    if config.head_dim * config.n_heads != config.dim:
        why.append(f"head_dim={config.head_dim}: laneformer_tp uses hidden_size // num_attention_heads")
    if config.delayed_exchange and config.delay == 0:
        why.append("delay=0 (all-reduce everywhere): laneformer_tp fails on broadcast_delay=0 with use_comm=true")
    if config.delayed_exchange and config.delay < config.n_layers and not config.early_send_forward:
        why.append("early_send_forward=false: laneformer_tp sends the first broadcast_delay layers forward too")
    if config.rope_theta_global not in (None, config.rope_theta) or config.rope_scaling != "none":
        why.append("rope_theta_global/rope_scaling: laneformer_tp rotates every layer with rope_theta alone")
    keys = {
        "use_comm": config.delayed_exchange,
        "use_early_comm": config.early_mode == "present",
        "pre_norm_lane_agg": config.final_agg == "norm_of_sum",
        "lm_head_type": "replicate",
        "replicated_rmsn_scale": True,
        "pad_token_id": None,  # read by LaneformerTPModel; transformers 5 configs no longer define it
        **_windows_as_tp(config),
    }
    if not why:  # what laneformer_tp would read back must behave the same on every layer
        raw = {**_tp_shape_keys(config), **keys, "model_type": "laneformer_tp"}
        back = dataclasses.replace(config, **_from_laneformer_tp(raw).fields)
        for i in range(config.n_layers):
            if (back.exchange_of(i), back.window_of(i)) != (config.exchange_of(i), config.window_of(i)):
                why.append(f"late_mode={config.late_mode!r}: layer {i} would be "
                           f"{back.exchange_of(i)} in laneformer_tp, {config.exchange_of(i)} here")
                break
    return ({}, why) if why else (keys, [])


def _tp_shape_keys(config: Laneformer.Config) -> dict:
    return {"hidden_size": config.dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
            "intermediate_size": config.ffn_hidden_dim, "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_seq_len, "rope_theta": config.rope_theta,
            "norm_eps": config.norm_eps, "num_lanes": config.n_lanes, "broadcast_delay": config.delay,
            "sliding_window": config.window_size}

