"""Hugging Face config of a Laneformer (remote code: imports torch/transformers only).

Key names follow Kog's released ``laneformer-2b-it`` config where it has them
(hidden_size, num_lanes, broadcast_delay, sliding_window, swa_layers, ...).
Fields it lacks get new keys: ``head_dim``, ``early_mode``,
``early_send_forward``, ``late_mode``, ``final_agg``. A released config that
only has the older keys still loads; they are read as follows:

- ``head_dim`` absent: ``hidden_size // num_attention_heads`` (Kog's code).
- ``early_mode`` absent: ``"present"`` if ``use_early_comm`` (default True)
  else ``"scaled"``.
- ``final_agg`` absent: ``"norm_of_sum"`` if ``pre_norm_lane_agg`` else
  ``"mean_of_norms"``.
- ``swa_layers`` absent: ``sliding_window_n_layers = N`` means layers
  ``0..N-1`` (``N < 0``: the last ``-N`` layers); no window when
  ``sliding_window`` is null.
- ``use_comm = false`` (no exchange at all) is ``broadcast_delay =
  num_hidden_layers`` with ``early_mode = "scaled"``.
- ``early_send_forward`` / ``late_mode`` absent: ``false`` / ``"drop"``, Kog's
  newer revision (the older ``laneformer_tp`` code sent every layer forward).

Options the model cannot express (per-lane norm scales, lane or
vocab-parallel lm heads, tied embeddings, early all-reduce without later
exchange) raise ValueError instead of loading as a different model.
"""

from transformers import PretrainedConfig

EARLY_MODES = ("present", "scaled")
LATE_MODES = ("drop", "flush", "present")
FINAL_AGGS = ("mean_of_norms", "norm_of_sum")


def window_layers_from_released(n_layers, sliding_window, sliding_window_n_layers):
    """The windowed layers of a config that has ``sliding_window_n_layers`` instead of ``swa_layers``."""
    if sliding_window is None or not sliding_window_n_layers:
        return []
    n = sliding_window_n_layers
    return list(range(n)) if n > 0 else list(range(n_layers + n, n_layers))


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
        norm_eps=1e-5,
        num_lanes=8,
        broadcast_delay=2,
        early_mode=None,
        early_send_forward=False,
        late_mode="drop",
        final_agg=None,
        sliding_window=None,
        swa_layers=None,
        tie_word_embeddings=False,
        use_cache=True,
        bos_token_id=1,
        eos_token_id=2,
        # Released keys, read only when the new ones above are absent:
        use_comm=True,
        use_early_comm=True,
        pre_norm_lane_agg=False,
        sliding_window_n_layers=0,
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
        if early_mode is None:
            early_mode = "present" if use_early_comm else "scaled"
        if not use_comm:
            if early_mode != "scaled":
                raise ValueError("use_comm=False with an early all-reduce cannot be expressed")
            broadcast_delay = num_hidden_layers
        if final_agg is None:
            final_agg = "norm_of_sum" if pre_norm_lane_agg else "mean_of_norms"
        if swa_layers is None:
            swa_layers = window_layers_from_released(num_hidden_layers, sliding_window, sliding_window_n_layers)
        for name, value, allowed in (
            ("early_mode", early_mode, EARLY_MODES),
            ("late_mode", late_mode, LATE_MODES),
            ("final_agg", final_agg, FINAL_AGGS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}; expected one of {allowed}")
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
        self.norm_eps = norm_eps
        self.num_lanes = num_lanes
        self.broadcast_delay = broadcast_delay
        self.early_mode = early_mode
        self.early_send_forward = early_send_forward
        self.late_mode = late_mode
        self.final_agg = final_agg
        self.sliding_window = sliding_window
        self.swa_layers = sorted(swa_layers)
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
