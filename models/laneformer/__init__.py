"""Laneformer as a torchtitan model: flavors and the ``model_registry``.

``model_registry(flavor)`` returns the ``ModelSpec`` torchtitan's Trainer
builds from; ``config_registry`` holds runnable ``Trainer.Config`` functions
(``--module models.laneformer --config laneformer_tiny``).
"""

from collections.abc import Callable

from torchtitan.protocols.model_spec import ModelSpec

from .model import Laneformer
from .parallelize import parallelize_laneformer
from .state_dict_adapter import LaneformerStateDictAdapter

__all__ = ["Laneformer", "laneformer_configs", "model_registry", "parallelize_laneformer"]


def _2b() -> Laneformer.Config:
    """The published Laneformer 2B: exactly 2,320,069,632 parameters."""
    return Laneformer.Config(
        dim=3072, n_layers=15, n_heads=32, n_kv_heads=16, head_dim=96,
        ffn_hidden_dim=12288, vocab_size=32000, max_seq_len=4096, n_lanes=8, delay=2,
        window_size=2048, window_layers=list(range(10)),
    )


def _100m() -> Laneformer.Config:
    """~96M parameters with the 2B's lane and window structure, for GPU smoke runs."""
    return Laneformer.Config(
        dim=512, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=32,
        ffn_hidden_dim=2048, vocab_size=32000, max_seq_len=4096, n_lanes=8, delay=2,
        window_size=1024, window_layers=list(range(11)),
    )


def _tiny(n_lanes: int) -> Callable[[], Laneformer.Config]:
    def tiny() -> Laneformer.Config:
        """~2M parameters for CPU tests; window layers shorter than test sequences."""
        return Laneformer.Config(
            dim=128, n_layers=4, n_heads=8, n_kv_heads=n_lanes, head_dim=16,
            ffn_hidden_dim=512, vocab_size=4096, max_seq_len=1024, n_lanes=n_lanes, delay=2,
            window_size=32, window_layers=[0, 1],
        )

    return tiny


laneformer_configs: dict[str, Callable[[], Laneformer.Config]] = {
    "2B": _2b,
    "100M": _100m,
    "tiny": _tiny(8),
    "tiny-4lane": _tiny(4),
}


def model_registry(flavor: str, **overrides) -> ModelSpec:
    """The ModelSpec of a flavor, with optional ``Laneformer.Config`` field overrides."""
    if flavor not in laneformer_configs:
        raise ValueError(f"unknown Laneformer flavor {flavor!r}; known: {sorted(laneformer_configs)}")
    config = laneformer_configs[flavor]()
    if overrides:
        import dataclasses

        config = dataclasses.replace(config, **overrides)
    return ModelSpec(
        name="laneformer",
        flavor=flavor,
        model=config,
        parallelize_fn=parallelize_laneformer,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=LaneformerStateDictAdapter,
    )
