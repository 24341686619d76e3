"""Hugging Face config of a Laneformer (remote code: imports transformers only).

Key names follow Kog's releases where they have the field (hidden_size,
num_lanes, broadcast_delay, use_comm, sliding_window, swa_layers, ...); fields
they lack get new keys: ``head_dim``, ``early_mode``, ``early_send_forward``,
``late_mode``, ``final_agg``, and the RoPE of the full-attention layers:
``rope_theta_global`` (null: ``rope_theta``), ``rope_scaling_type`` ("none",
"llama", "yarn"), ``rope_scaling_factor``, ``rope_original_max_position_embeddings``
(not ``rope_scaling``: transformers reads that key itself, as a dict for every
layer); absent, they are one RoPE of ``rope_theta`` on every layer, as before
they existed. A project export writes every key, so this class reads only its
own keys. Kog's releases say less and mean different
things in their two revisions; ``convert from-hf`` works out what they
compute (``hf/kog_releases.py``) and imports them, rather than this class
guessing.

An export also writes the keys of Kog's older ``laneformer_tp`` code
(``use_early_comm``, ``pre_norm_lane_agg``, ``sliding_window_n_layers``,
``unclamped_layers``) where that code can compute the same function; they
are carried through untouched here. Options this model cannot express
(per-lane norm scales, lane or vocab-parallel lm heads, tied embeddings)
raise ValueError instead of loading as a different model.
"""

from transformers import PretrainedConfig

EARLY_MODES = ("present", "scaled")
LATE_MODES = ("drop", "flush", "present")
FINAL_AGGS = ("mean_of_norms", "norm_of_sum")
ROPE_SCALINGS = ("none", "llama", "yarn")


class LaneformerConfig(PretrainedConfig):
    model_type = "laneformer"

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=3072,
        num_hidden_layers=15,
        num_attention_heads=32,
        num_key_value_heads=None,
        head_dim=None,
        intermediate_size=12288,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_theta_global=None,
        rope_scaling_type="none",
        rope_scaling_factor=1.0,
        rope_original_max_position_embeddings=4096,
        norm_eps=1e-5,
        num_lanes=8,
        broadcast_delay=2,
        early_mode="present",
        early_send_forward=False,
        late_mode="drop",
        use_comm=True,
        final_agg="mean_of_norms",
        sliding_window=None,
        swa_layers=None,
        tie_word_embeddings=False,
        use_cache=True,
        bos_token_id=1,
        eos_token_id=2,
        lm_head_type="replicate",
        replicated_rmsn_scale=True,
        **kwargs,
    ):
        if lm_head_type != "replicate":
            raise ValueError(f"lm_head_type={lm_head_type!r} is not supported (only 'replicate')")
        if not replicated_rmsn_scale:
            raise ValueError("replicated_rmsn_scale=False (per-lane norm scales) is not supported")
        if tie_word_embeddings:
            raise ValueError("tie_word_embeddings=True is not supported: Laneformer has its own lm_head")
        for name, value, allowed in (
            ("early_mode", early_mode, EARLY_MODES),
            ("late_mode", late_mode, LATE_MODES),
            ("final_agg", final_agg, FINAL_AGGS),
            ("rope_scaling_type", rope_scaling_type, ROPE_SCALINGS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}; expected one of {allowed}")
        swa_layers = swa_layers or []
        if swa_layers and sliding_window is None:
            raise ValueError("swa_layers is set but sliding_window is null")

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_theta_global = rope_theta_global
        self.rope_scaling_type = rope_scaling_type
        self.rope_scaling_factor = rope_scaling_factor
        self.rope_original_max_position_embeddings = rope_original_max_position_embeddings
        self.norm_eps = norm_eps
        self.num_lanes = num_lanes
        self.broadcast_delay = broadcast_delay
        self.early_mode = early_mode
        self.early_send_forward = early_send_forward
        self.late_mode = late_mode
        self.use_comm = use_comm
        self.final_agg = final_agg
        self.sliding_window = sliding_window
        self.swa_layers = sorted(swa_layers)
        self.lm_head_type = lm_head_type
        self.replicated_rmsn_scale = replicated_rmsn_scale
        # Derived, never read back: transformers' DynamicCache keeps only the
        # last window of keys for "sliding_attention" layers.
        kwargs.pop("layer_types", None)
        self.layer_types = [
            "sliding_attention" if i in self.swa_layers else "full_attention" for i in range(num_hidden_layers)
        ]
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
